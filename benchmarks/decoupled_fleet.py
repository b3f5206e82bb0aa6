"""A mixed fleet: a learner of 2 ranks and a learner of 1 rank slowed 2x, on one syncer. Does the fast learner
wait for the slow one?

The GPT of ``decoupled_worker.py`` on 3 CPU ranks in all (gloo). The slow rank's micro-batches take 2x as long
(``acco.emulation``: a sleep after each backward, no CPU used). Runs:

* stock ZeRO-1 on the 3 ranks, the slow one included (the ``sync`` mode, plain ZeRO-1): its final validation loss
  is the target;
* barrier: the fleet on ``acco-ds syncer --shards 2`` with K = 2 and ``grace_s`` 0, so every merge waits for both
  learners: DiLoCo with each learner weighed by its tokens (``tests/test_decoupled_sizes.py``);
* decoupled: the same fleet with K = 1 (Delayed Nesterov, N = 2): no learner waits for the other;
* apart: the two learners side by side, each on a syncer of its own (K = 1, ``grace_s`` 0): they share the machine's
  2 cores but no merge, so the fast learner's tokens/s there is its solo rate on this machine. Apart and decoupled
  run in pairs, back to back, for each ``--adopt`` mode and ``--repeats`` times (every other pair decoupled first);
  each decoupled run is compared with the apart run of its pair;
* A-EDiT (``edit`` syncing every ``--sync-time-s`` seconds): replicas must be of one size there, so its fleet is
  3 one-rank replicas, the slow one included: the same ranks and data, grouped otherwise.

Each fleet run starts the syncer (2 shards: the 2-rank learner sends its partitions as they are, the 1-rank
learner moves its pieces into the syncer's 2 parts) and the two learners' ``deepspeed`` launches at once; the
learners train for ``--seconds`` of training time. Each learner declares its tokens per inner step
(``local_sgd.tokens_per_step``: micro-batch x accumulation x block x its ranks). Rank 0 of the 2-rank learner
evaluates the model its users read every few seconds; the time to the target is interpolated on that trace.
Writes ``benchmarks/results/decoupled_fleet.{json,md}``.

    python benchmarks/decoupled_fleet.py [--stock-steps 40] [--seconds 40] [--adopt wait overlap] [--repeats 1]
"""

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from decoupled_race import BASE, BIN, HERE, ROOT, time_to

SLOW_FACTOR = 2.0
MICRO, GAS, BLOCK = BASE["train_micro_batch_size_per_gpu"], BASE["gradient_accumulation_steps"], 64


def acco_config(acco, slow_rank=None):
    cfg = copy.deepcopy(BASE)
    cfg["acco"] = {"enabled": True, **copy.deepcopy(acco)}
    if slow_rank is not None:
        cfg["acco"]["emulation"] = {"slow_rank": slow_rank, "slow_factor": SLOW_FACTOR}
    return cfg


def start(name, cfg, ranks, extra, workdir, env):
    """One ``deepspeed`` launch of ``ranks`` ranks (not waited for): ``(process, folder)``."""
    d = Path(workdir) / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    port = 29500 + (abs(hash(name)) % 150)
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(port),
           str(HERE / "decoupled_worker.py"), "--config", str(d / "config.json"), "--out", str(d)] + extra
    log = open(d / "launch.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), d


def finish(procs, timeout):
    deadline = time.monotonic() + timeout
    for p, d in procs:
        code = p.wait(max(1.0, deadline - time.monotonic()))
        if code != 0:
            raise RuntimeError(f"{d.name}: exit {code}; see {d / 'launch.log'}")
    return [[json.loads(f.read_text()) for f in sorted(d.glob("rank*.json"))] for _, d in procs]


def env_of(**extra):
    # the venv's bin first: its ninja builds DeepSpeed's JIT ops, as make install did (another ninja rebuilds them)
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra)


def syncer(name, cfg, port, learners, workdir):
    state = Path(workdir) / name
    state.mkdir(parents=True, exist_ok=True)
    cfg["acco"]["local_sgd"]["syncer"] = {"address": f"127.0.0.1:{port}", "timeout_s": 120, "state_dir": str(state)}
    (state / "config.json").write_text(json.dumps(cfg))
    return subprocess.Popen([str(BIN / "acco-ds"), "syncer", "--config", str(state / "config.json"), "--shards",
                             "2", "--port", str(port), "--state-dir", str(state), "--learners", str(learners)],
                            env=env_of(), stdout=open(state / "syncer.log", "w"), stderr=subprocess.STDOUT)


def fleet(name, local, args, workdir, apart=False):
    """The 2-rank learner and the slowed 1-rank learner, on one syncer of 2 shards (``apart``: each on its own,
    so that they share the machine but not their merges: the fast learner's solo rate on this machine)."""
    port = 29650 + (abs(hash(name)) % 40) * 8

    def cfg(tokens, slow):
        return acco_config({"mode": "decoupled", "local_sgd": {**local, "tokens_per_step": tokens}}, 0 if slow else None)

    fast, slow = cfg(MICRO * GAS * BLOCK * 2, False), cfg(MICRO * GAS * BLOCK, True)
    ports = [port, port + 4] if apart else [port, port]
    syncers = [syncer(f"{name}/syncer0", fast, ports[0], 1 if apart else 2, workdir)]
    if apart:
        syncers.append(syncer(f"{name}/syncer1", slow, ports[1], 1, workdir))
    else:
        slow["acco"]["local_sgd"]["syncer"] = fast["acco"]["local_sgd"]["syncer"]
    t0 = time.perf_counter()
    seconds = ["--seconds", str(args.seconds)]
    procs = [start(f"{name}/learner0", fast, 2, seconds + ["--agree-eval"], workdir, env_of(ACCO_LEARNER_ID="0")),
             start(f"{name}/learner1", slow, 1, seconds + ["--data-rank-offset", "2"], workdir,
                   env_of(ACCO_LEARNER_ID="1"))]
    try:
        ranks = finish(procs, args.seconds * 4 + 300)
        for p in syncers:
            p.wait(60)
    finally:
        for p in syncers:
            if p.poll() is None:
                p.terminate()
                p.wait(30)
    return {"name": name, "wall_s": time.perf_counter() - t0, "learners": ranks}


def barrier_run(name, cfg, extra, args, workdir):
    t0 = time.perf_counter()
    ranks = finish([start(name, cfg, 3, extra, workdir, env_of())], args.seconds * 6 + 600)[0]
    return {"name": name, "wall_s": time.perf_counter() - t0, "learners": [ranks]}


def row(run, target, solo_rate=None):
    fast = run["learners"][0]
    trace = fast[0]["trace"]
    rate = sum(r["tokens"] for r in fast[:2]) / max(r["seconds"] for r in fast[:2])  # ranks 0 and 1: the fast pair
    out = {"run": run["name"], "time_to_target_s": time_to(trace, target), "final_val_loss": trace[-1]["val_loss"],
           "fast_tokens_per_s": rate, "train_s": max(r["seconds"] for r in fast[:2]),
           "merges": fast[0]["stats"].get("merges"), "max_wait_s": fast[0]["stats"].get("max_wait_s")}
    if solo_rate:
        out["vs_solo"] = rate / solo_rate
    return out


def paired_runs(args, workdir, target):
    """For each ``adopt`` and repeat: the fleet apart (the fast learner's solo rate) and on one syncer (K = 1), back
    to back, so that each ratio compares two runs under the same moment's load; every other repeat runs the pair
    the other way round, so that a drift of the machine's speed does not favour one side."""
    H, rows = args.sync_every, []
    for repeat in range(args.repeats):
        for adopt in args.adopt:
            local = {"sync_every": H, "min_quorum": 1, "adopt": adopt}
            tag = f"{adopt}, run {repeat + 1}"

            def apart():
                return fleet(f"apart-{adopt}-{repeat}", {**local, "grace_s": 0}, args, workdir, apart=True)

            def one():
                return fleet(f"decoupled-{adopt}-{repeat}", {**local, "grace_s": "auto", "staleness":
                             "delayed_nesterov", "nesterov_delay": 2}, args, workdir)
            if repeat % 2 == 0:
                alone, shared = apart(), one()
            else:
                shared, alone = one(), apart()
            solo = row(alone, target)["fast_tokens_per_s"]
            rows += [{**row(alone, target, solo), "run": f"apart ({tag})"},
                     {**row(shared, target, solo), "run": f"decoupled ({tag})"}]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stock-steps", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=40.0, help="each learner's training time")
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--sync-time-s", type=float, default=4.0)
    ap.add_argument("--syncs", type=int, default=10, help="A-EDiT's syncs")
    ap.add_argument("--adopt", nargs="+", default=["wait", "overlap"], choices=["wait", "overlap"])
    ap.add_argument("--repeats", type=int, default=1, help="apart/decoupled pairs per adopt mode (every other "
                    "one runs decoupled first)")
    ap.add_argument("--out", default=str(HERE / "results" / "decoupled_fleet"))
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="acco_fleet_")
    H = args.sync_every
    stock = barrier_run("stock", acco_config({"mode": "sync"}, 2), ["--steps", str(args.stock_steps)], args, workdir)
    target = stock["learners"][0][0]["trace"][-1]["val_loss"]
    rows = [row(stock, target)] + paired_runs(args, workdir, target)
    solo_wait = next((r["fast_tokens_per_s"] for r in rows if r["run"].startswith("apart (wait")), None)
    rows.append(row(fleet("barrier", {"sync_every": H, "min_quorum": 2, "grace_s": 0}, args, workdir), target,
                    solo_wait))
    rows.append(row(barrier_run("A-EDiT", acco_config({"mode": "edit", "local_sgd": {
        "sync_time_s": args.sync_time_s, "replica_group_size": 1}}, 2), ["--syncs", str(args.syncs)], args, workdir),
        target, solo_wait))
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "python": platform.python_version(), "command": "python benchmarks/decoupled_fleet.py " + " ".join(
                sys.argv[1:] if argv is None else argv), "target": target, "slow_factor": SLOW_FACTOR,
            "seconds": args.seconds, "sync_every": H, "date": time.strftime("%Y-%m-%d %H:%M")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| run | time to stock's loss (s) | final val loss | fast learner tokens/s | vs apart | merges | "
             "longest pause (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        vs = f"{r['vs_solo']:.3f}" if "vs_solo" in r else "-"
        wait = "-" if r["max_wait_s"] is None else f"{r['max_wait_s']:.2f}"
        lines.append(f"| {r['run']} | {t} | {r['final_val_loss']:.3f} | {r['fast_tokens_per_s']:.0f} | {vs} | "
                     f"{r['merges'] if r['merges'] is not None else '-'} | {wait} |")
    text = "\n".join([f"Target (stock ZeRO-1's final validation loss): {target:.3f}. {meta['machine']}, "
                      f"{meta['date']}, `{meta['command']}`. \"vs apart\": the fast learner's tokens/s over the apart "
                      "run of its pair (barrier and A-EDiT: over the first apart run with adopt wait).", ""]
                     + lines) + "\n"
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
