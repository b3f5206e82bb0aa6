"""Chaos benchmark (issue 41, item 5): replicas killed on a seeded schedule, fault-tolerant diloco (torchft)
against single-launch diloco restarted from its last checkpoint.

    python benchmarks/chaos.py                      # every run, about 17 minutes on 2 cores
    python benchmarks/chaos.py --only ft_free,ft_chaos --syncs 12

Three replicas of one rank each train the GPT of examples/train_gpt.py (benchmarks/chaos_worker.py: the
example's model, data and evaluation, plus per-sync records) until the global model has ``--syncs`` outer
syncs. The same failure schedule (seeded: at the global model's sync k, plus a few seconds, a SIGKILL; the
victim comes back ``--down_s`` later) hits both arms:

* ``ft``: a torchft lighthouse and one ``deepspeed --num_gpus 1`` launch per replica (``--launcher``: or
  the rank alone, or ``acco_ds.cli.warm``, which forks the rank from a parent that imported everything once and
  forks it again after a kill; ``acco.fault_tolerance``, merge "tokens", min_replicas 1). A kill is a SIGKILL
  of the victim launch's process group; the relaunch has the same REPLICA_GROUP_ID and heals from a live one.
* ``plain``: one ``deepspeed --num_gpus 3`` launch, ``"local_sgd": {"replica_group_size": 1}``, a checkpoint
  every ``--save_every`` syncs. A kill is a SIGKILL of the victim rank, then of the whole launch (a rank's
  death ends the launch); this script, the supervisor, relaunches everything, which loads the last checkpoint.

Each arm also runs without failures. Goodput: tokens committed to the global model (the inner steps in
committed syncs, from the workers' records; the plain arm's syncs lost to a restart do not count) per
second of wall time (first launch to last exit), relative to the failure-free run of the same arm. The
straggler rows: A-EDiT (mode edit, sync_time_s) with fault tolerance, replica 0 at half speed
(acco.emulation slow_rank 0, slow_factor 2, in replica 0's config only), merge "tokens" against "mean".

Each replica is held to ``--cores`` CPU cores by a cgroup (harness.CpuCap, weighted ``--shares`` against other
work; the plain launch gets 3x both for its 3 ranks), so a dead replica's CPU is not handed to its survivors,
as on separate machines. Each run has a hard deadline; its processes and cgroups are removed at its end.
Ports: 29800-30399 (run i: 100 i above the first run's). Results: benchmarks/results/chaos.{md,json,png}, written by
chaos_report.py. Relaunch phases: chaos_phases.py.
"""

import argparse
import copy
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import chaos_phases
import harness
from chaos_report import RUNS, markdown, plot

ROOT = harness.ROOT
RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(sys.executable).parent
WORKER = "benchmarks/chaos_worker.py"
LIGHTHOUSE_PORT, FT_PORTS, PLAIN_PORT = 29800, 29810, 29850  # run i, replica r: FT_PORTS + 100 i + 10 r + 0..7


# ------------------------------------------------------------------ configs and the schedule
def configs(args, run):
    """The DeepSpeed config of each launch of ``run`` (one per replica, or one for the plain launch)."""
    base = json.loads((ROOT / "configs" / "diloco_ft_cpu.json").read_text())
    acco = base["acco"]
    acco["local_sgd"] = {"sync_every": args.sync_every}
    acco["fault_tolerance"].update(timeout_s=30, quorum_timeout_s=args.quorum_timeout_s, join=args.join)
    if run.startswith("plain"):
        del acco["fault_tolerance"]
        acco["local_sgd"]["replica_group_size"] = 1
        return [base]
    if run.startswith("edit"):
        acco.update(mode="edit", local_sgd={"sync_time_s": args.sync_time_s})
        acco["fault_tolerance"]["merge"] = run.split("_")[1]
        slow = copy.deepcopy(base)
        slow["acco"]["emulation"] = {"slow_rank": 0, "slow_factor": 2.0}
        return [slow, base, base]
    return [base] * 3


def kill_schedule(args):
    """Seeded: at the global model's sync k (about one per ``--kill_every``), ``offset_s`` later, SIGKILL of
    ``victim``; none in the last 8 syncs, so that the relaunch joins before the end."""
    rng, out, k = random.Random(args.seed), [], 0
    while True:
        k += rng.randint(args.kill_every - 1, args.kill_every + 1)
        if k > args.syncs - 8:
            return out
        out.append({"sync": k, "offset_s": round(rng.uniform(0.5, 3.0), 2), "victim": rng.randrange(3)})


# ------------------------------------------------------------------------------- one run
class Run:
    """One run's launches (each a harness.RankSet of one launcher), its lighthouse and its CPU caps."""

    def __init__(self, name, args, workdir, deadline):
        self.name, self.args, self.deadline = name, args, deadline
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        self.record = self.dir / "rec"
        self.ft = not name.startswith("plain")
        self.warm = self.ft and args.launcher == "warm"
        self.paths = []
        for i, cfg in enumerate(configs(args, name)):
            self.paths.append(self.dir / f"config{i}.json")
            self.paths[-1].write_text(json.dumps(cfg, indent=1))
        n = 1 if self.ft else 3  # the plain launch's cgroup holds 3 replicas
        self.caps = [harness.CpuCap(args.cores * n, "chaos", shares=args.shares * n) if args.cores else None
                     for _ in range(3 // n)]
        self.launches = {}  # replica (plain: 0) -> its current RankSet
        self.count = 0  # launches so far
        self.events = []  # kills and relaunches, for the results
        self.t0 = time.time()
        self.env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def start(self):
        if self.ft:
            port = LIGHTHOUSE_PORT + RUNS.index(self.name)
            self.env["TORCHFT_LIGHTHOUSE"] = f"http://localhost:{port}"
            argv = [str(BIN / "torchft_lighthouse"), "--min_replicas", "1", "--bind", f"[::]:{port}",
                    "--join_timeout_ms", str(int(self.args.join_timeout_s * 1000)), "--heartbeat_timeout_ms", "2000"]
            self.lighthouse = harness.RankSet([({}, argv)], self.dir / "lighthouse")
        for r in range(3 if self.ft else 1):
            self.launch(r)

    def launch(self, r):
        """Start replica r's launch (plain: the launch of all 3 ranks)."""
        args, n, at = self.args, self.count, time.time() - self.t0  # at: before the launch's processes start
        self.count += 1
        base = 100 * RUNS.index(self.name)  # runs side by side (--together) need ports of their own
        port = base + (FT_PORTS + 10 * r + 2 * (n % 4) if self.ft else PLAIN_PORT + 2 * (n % 8))
        env = dict(self.env, REPLICA_GROUP_ID=str(r), TORCHFT_MANAGER_PORT=str(port + 1)) if self.ft else self.env
        kind = args.launcher if self.ft else "deepspeed"  # --launcher: how a fault-tolerant replica starts
        env, launcher = chaos_phases.launcher(kind, env, BIN, 1 if self.ft else 3, port, args.down_s)
        argv = launcher + [WORKER, "--deepspeed_config", str(self.paths[r]), "--syncs", str(args.syncs_of(self.name)),
                           "--record", str(self.record), "--n_layer", str(args.n_layer), "--n_embd",
                           str(args.n_embd), "--eval_every", "1", "--seed", str(args.seed)]
        if not self.ft:
            argv += ["--save_every_syncs", str(args.save_every), "--ckpt", str(self.dir / "ckpt")]
        if self.caps[r] is not None:
            argv = self.caps[r].wrap(argv)
        self.launches[r] = harness.RankSet([(env, argv)], self.dir / f"launch{n}_r{r}", deadline=self.deadline)
        self.events.append({"event": "launch", "t": at, "replica": r, "launch": n})

    def records(self):
        out = []
        for path in sorted(self.dir.glob("rec.r*.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        return sorted(out, key=lambda d: d["t"])

    def kill(self, victim):
        """SIGKILL: the victim launch's process group (ft), or the victim rank, then its whole launch (plain), or
        the victim rank alone (``--launcher warm``: its acco_ds.cli.warm parent forks it again); returns the launch to
        relaunch."""
        if not self.ft:
            since = self.t0 + max(e["t"] for e in self.events if e["event"] == "launch")
            pids = [d["pid"] for d in self.records() if d["replica"] == victim and d["t"] > since]
            try:
                os.kill(pids[-1], signal.SIGKILL)
            except (IndexError, ProcessLookupError):
                pass
        key = victim if self.ft else 0
        if self.warm:  # the rank dies; its launcher (acco_ds.cli.warm) forks it again --down_s later
            import psutil
            for child in psutil.Process(self.launches[key].procs[0].pid).children():
                try:
                    os.killpg(child.pid, signal.SIGKILL)  # the rank leads a session of its own
                except ProcessLookupError:
                    pass
        else:
            self.launches.pop(key).kill_all()
        self.events.append({"event": "kill", "t": time.time() - self.t0, "replica": victim})
        return key

    def supervise(self, schedule):
        """Run to the end, killing and relaunching on ``schedule``."""
        kills, pending, armed = list(schedule), [], None
        while True:
            self.deadline.check()
            now = time.time()
            for due, r in [p for p in pending if p[0] <= now]:
                pending.remove((due, r))
                if self.warm:  # acco_ds.cli.warm restarts the rank itself: note when it is due
                    self.events.append({"event": "launch", "t": due - self.t0, "replica": r, "launch": None})
                elif not self.ft or any(rs.poll()[0] is None for rs in self.launches.values()):
                    self.launch(r)
                else:  # the others have finished: a relaunch would start over alone from the initial weights
                    self.events.append({"event": "relaunch skipped (run over)", "t": now - self.t0, "replica": r})
            down = {r for _, r in pending} if self.warm else set()  # a warm launcher outlives its killed rank
            live = [r for r in self.launches if self.launches[r].poll()[0] is None and r not in down]
            if kills and live and max([d["sync"] for d in self.records() if d["t"] > self.t0] or [0]) >= kills[0]["sync"]:
                armed = armed or now + kills[0]["offset_s"]
                if now >= armed:
                    k, armed = kills.pop(0), None
                    victim = k["victim"] if k["victim"] in live or not self.ft else live[0]  # down: a live one
                    pending.append((now + self.args.down_s, self.kill(victim)))
                    self.events[-1].update(sync=k["sync"])
            if not live and not pending:
                return
            time.sleep(0.1)

    def close(self):
        for rs in list(self.launches.values()) + ([self.lighthouse] if getattr(self, "lighthouse", None) else []):
            rs.kill_all()  # this run's processes only: another may be running beside it (--together)
        self.t_end = getattr(self, "t_end", time.time())
        self.throttled = [cap.throttled() for cap in self.caps if cap is not None]
        for cap in self.caps:
            if cap is not None:
                cap.close()


def run_one(name, args, workdir, schedule):
    """One run under its hard deadline; returns its summary (with ``error`` if it failed)."""
    deadline = harness.Deadline(args.run_limit_s)
    run = Run(name, args, workdir, deadline)
    error = None
    try:
        run.start()
        run.supervise(schedule if name.endswith("chaos") else [])
        run.t_end = time.time()
    except Exception as err:  # noqa: BLE001 - the table says so
        error = f"{type(err).__name__}: {err}"[-3000:]
    finally:
        run.close()
    out = summarize(run, args)
    out["error"] = error
    out["exit_codes"] = [rs.poll()[0] for rs in run.launches.values()]  # the last launches (kills: -9)
    out["note"] = f"last launches exited with {out['exit_codes']}" if any(out["exit_codes"]) else ""
    out["logs"] = str(run.dir)
    if error:
        out["log_tails"] = {p.parent.name: p.read_text(errors="replace")[-3000:] for p in run.dir.glob("*/rank0.log")}
    return out


# ------------------------------------------------------------------------------ measures
def summarize(run, args):
    """What the records say: committed tokens, goodput, the loss curve, faults, heals, final digests."""
    recs = [d for d in run.records() if d["t"] >= run.t0]
    syncs = [d for d in recs if d["event"] == "sync"]
    last = {}  # (replica, sync) -> the last record of it: a plain restart redoes the syncs after its checkpoint
    for d in syncs:
        last[(d["replica"], d["sync"])] = d
    cfg = configs(args, run.name)[0]
    tokens_per_step = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 128  # block 128
    target = args.syncs_of(run.name)
    steps = sum(d["steps"] for (_, s), d in last.items() if s <= target)
    wall = run.t_end - run.t0
    curve, seen = [], None
    for d in recs:
        if "val" in d and d["sync"] != seen:  # one point per sync reached (a restart goes back)
            curve.append((round(d["t"] - run.t0, 2), d["sync"], round(d["val"], 4)))
            seen = d["sync"]
    first = {}
    for d in syncs:
        first.setdefault(d["sync"], d["t"])
    times = [first[s] for s in sorted(first) if s >= 3]
    gaps = [b - a for a, b in zip(times, times[1:])]
    procs = {}  # pid -> its last record (a killed process's last figures too)
    for d in recs:
        procs[d["pid"]] = d
    ends = [d for d in recs if d["event"] == "end"]
    out = {"run": run.name, "wall_s": round(wall, 1), "syncs": max(first or [0]), "target_syncs": target,
           "committed_tokens": steps * tokens_per_step, "goodput_tokens_per_s": round(steps * tokens_per_step / wall, 1),
           "median_sync_period_s": round(statistics.median(gaps), 3) if gaps else None,
           "final_val": curve[-1][2] if curve else None, "curve": curve, "events": run.events,
           "launches": run.count, "digests": sorted({d["digest"] for d in ends}), "replicas_ended": len(ends),
           "cap_throttled_share": run.throttled, "load_at_end": os.getloadavg()[0]}
    starts = [d for d in recs if d["event"] == "start"]
    back = [[d["t"] - run.t0 - e["t"] for d in starts if d["t"] - run.t0 > e["t"]] for e in run.events
            if e["event"] == "kill"]
    out["recovery_s"] = [round(min(b), 1) if b else None for b in back]
    out["relaunch_phases"] = chaos_phases.relaunch_phases(recs, run.events, run.t0)
    if run.ft:
        per = [procs[p] for p in procs]
        out.update({k: [d.get(k) for d in per] for k in ("syncs_discarded", "heals", "heal_s", "heal_bytes", "early_syncs",
                                                          "quorum_wait_s", "participants_min", "participants_mean",
                                                          "participants_max", "quorums")})
        began = {d["pid"]: d for d in starts}  # after the join: the wait for the first quorum left out
        share = [(d["quorum_wait_s"] - began[d["pid"]]["quorum_wait_s"]) / (d["t"] - began[d["pid"]]["t"])
                 for d in ends if d["pid"] in began]
        out["quorum_wait_fraction"] = round(statistics.mean(share), 4) if share else None
        waits = {}  # pid -> sync -> its quorum_wait_s so far
        for d in syncs:
            waits.setdefault(d["pid"], {})[d["sync"]] = d["quorum_wait_s"]
        last = [min(w[s] - w[s - 1] for w in waits.values() if {s, s - 1} <= w.keys()) for s in sorted(first)
                if s >= 3 and sum({s, s - 1} <= w.keys() for w in waits.values()) == 3]
        # The replica that arrives last at a full quorum waits for no one: its wait is the quorum's own cost.
        out["quorum_last_arriver_s"] = round(statistics.median(last), 4) if last else None
    else:  # a restart loses the syncs after its checkpoint: rank 0 recorded them twice
        out["syncs_discarded"] = [sum(1 for d in syncs if d["replica"] == 0) - len({d["sync"] for d in syncs})]
    return out


def judge(res):
    """The goals of issue 41, item 5, from the runs' measures."""
    g = {}
    for arm in ("ft", "plain"):
        free, chaos = res.get(f"{arm}_free"), res.get(f"{arm}_chaos")
        if free and chaos:
            g[f"{arm}_goodput_ratio"] = round(chaos["goodput_tokens_per_s"] / free["goodput_tokens_per_s"], 3)
    if "ft_goodput_ratio" in g:
        g["goodput_goal_met"] = g["ft_goodput_ratio"] >= 0.90 and g["ft_goodput_ratio"] > g.get("plain_goodput_ratio", 0)
    free, plain = res.get("ft_free"), res.get("plain_free")
    if free and free["quorum_last_arriver_s"] is not None and free["median_sync_period_s"]:
        g["quorum_share_of_period"] = round(free["quorum_last_arriver_s"] / free["median_sync_period_s"], 4)
        g["quorum_goal_met"] = g["quorum_share_of_period"] <= 0.05
        g["quorum_wait_fraction"] = free["quorum_wait_fraction"]
        if plain and plain["median_sync_period_s"]:
            g["period_vs_single_launch"] = round(free["median_sync_period_s"] / plain["median_sync_period_s"] - 1, 4)
    return g


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma-separated runs of {', '.join(RUNS)} (default: all)")
    ap.add_argument("--syncs", type=int, default=38, help="diloco runs: outer syncs of the global model")
    ap.add_argument("--sync_every", type=int, default=24, help="diloco: inner steps per sync")
    ap.add_argument("--kill_every", type=int, default=10, help="mean syncs between kills")
    ap.add_argument("--down_s", type=float, default=5.0, help="seconds between a kill and its relaunch")
    ap.add_argument("--save_every", type=int, default=4, help="restart-all arm: a checkpoint every N syncs")
    ap.add_argument("--edit_syncs", type=int, default=20)
    ap.add_argument("--sync_time_s", type=float, default=3.0, help="A-EDiT's period")
    ap.add_argument("--cores", type=float, default=0.45, help="CPU cores per replica (cgroup; 0: no cap)")
    ap.add_argument("--shares", type=int, default=4096, help="cgroup CPU weight per replica (a process: 1024)")
    ap.add_argument("--n_layer", type=int, default=2)
    ap.add_argument("--n_embd", type=int, default=64)
    ap.add_argument("--quorum_timeout_s", type=float, default=90.0)
    ap.add_argument("--join_timeout_s", type=float, default=10.0,
                    help="the lighthouse's wait for a live replica late to a sync (above the spread of arrivals, or a "
                         "late replica is left out and heals at the next)")
    ap.add_argument("--join", choices=("early", "next_sync"), default="early",
                    help="acco.fault_tolerance.join: end the live replicas' period for a joiner, or not")
    ap.add_argument("--run_limit_s", type=float, default=600.0, help="hard deadline of each run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--launcher", choices=chaos_phases.LAUNCHERS, default="deepspeed", help="of the ft arm")
    ap.add_argument("--together", action="store_true",
                    help="start the selected runs at the same time (their ratio then shares the machine's drift)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, records, checkpoints)")
    ap.add_argument("--out", default=str(RESULTS / "chaos"), help="results path without extension")
    args = ap.parse_args(argv)
    args.syncs_of = lambda run: args.edit_syncs if run.startswith("edit") else args.syncs
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    if set(names) - set(RUNS):
        ap.error(f"unknown runs {sorted(set(names) - set(RUNS))}; known: {', '.join(RUNS)}")
    if args.cores and harness.CpuCap.unavailable():
        ap.error(f"--cores {args.cores}: {harness.CpuCap.unavailable()} (--cores 0 runs without caps)")
    harness.interrupt_on_signals()
    harness.remove_leftover_caps()
    schedule = kill_schedule(args)
    workdir = Path(tempfile.mkdtemp(prefix="acco_chaos_"))
    res, t0 = {}, time.time()
    try:
        if args.together:  # side by side: both see the same load and drift of a shared host
            print(f"== {', '.join(names)} together ...", flush=True)
            threads = [threading.Thread(target=lambda n=n: res.__setitem__(n, run_one(n, args, workdir, schedule)))
                       for n in names]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for name in names:
            if name not in res:  # one after the other
                print(f"== {name} ...", flush=True)
                res[name] = run_one(name, args, workdir, schedule)
            r = res[name]
            print(f"   {r['wall_s']} s, {r['syncs']} syncs, {r['committed_tokens']:,} tokens, goodput "
                  f"{r['goodput_tokens_per_s']:,.0f} tok/s, final val {r['final_val']}, digests {len(r['digests'])}"
                  f"{', ERROR ' + r['error'][:300] if r['error'] else ''}", flush=True)
    finally:
        harness.kill_everything()
        left = harness.processes_naming([str(workdir)] + [f"[::]:{LIGHTHOUSE_PORT + i}" for i in range(len(RUNS))])
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    goals = judge(res)
    import deepspeed
    import torch
    import torchft  # noqa: F401 - its version below
    from importlib.metadata import version
    meta = {"machine": f"{harness.cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; CPU "
                       f"ranks, gloo, DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1; Python {platform.python_version()}, "
                       f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, torchft {version('torchft')}",
            "settings": (f"Settings: 3 replicas x 1 rank; GPT n_layer {args.n_layer}, n_embd {args.n_embd}, block 128, "
                         f"micro-batch 8 x 4 accumulation (4096 tokens per inner step per replica); diloco sync_every "
                         f"{args.sync_every}, {args.syncs} syncs (configs/diloco_ft_cpu.json: AdamW lr 2e-3, outer "
                         f"defaults; fault tolerance min_replicas 1, merge tokens, timeout_s 30; lighthouse "
                         f"join_timeout {args.join_timeout_s:g} s, heartbeat_timeout 2 s); restart-all: a checkpoint every {args.save_every} "
                         f"syncs, relaunch + load_checkpoint; relaunch {args.down_s:g} s after a kill; each replica held "
                         f"to {args.cores or 'uncapped'} CPU cores by a cgroup of cpu.shares {args.shares} (a process: "
                         f"1024; the single launch: 3x both); validation of the committed model (4 batches) at every "
                         f"sync."),
            "code": harness.sh("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD").stdout.strip() + (" + uncommitted changes" if
                    harness.sh("git", "-C", str(ROOT), "status", "--porcelain", "-uno").stdout.strip() else ""),
            "command": "python benchmarks/chaos.py" + (f" --only {args.only}" if args.only else "") +
                       (" --together" if args.together else "") + (f" --cores {args.cores:g}" if args.cores != 0.45 else "") +
                       (f" --launcher {args.launcher}" if args.launcher != "deepspeed" else "") +
                       (f" --join_timeout_s {args.join_timeout_s:g}" if args.join_timeout_s != 10 else "") +
                       (f" --join {args.join}" if args.join != "early" else ""),
            "minutes": round((time.time() - t0) / 60, 1), "date": time.strftime("%Y-%m-%d %H:%M"),
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg()), "seed": args.seed, "schedule": schedule,
            "schedule_words": "; ".join(f"sync {k['sync']} + {k['offset_s']} s: replica {k['victim']}"
                                        for k in schedule) + f" (the restart-all arm: the same syncs and offsets, "
                                                             f"the victim rank's death ends its launch)",
            "sync_time_s": args.sync_time_s, "edit_syncs": args.edit_syncs, "leftover_processes": left}
    table = markdown(res, goals, meta)
    print()
    print(table)
    if left:
        print("LEFTOVER PROCESSES:", *left, sep="\n  ")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "goals": goals, "runs": res}, indent=1, default=str))
    out.with_suffix(".md").write_text(table)
    plot(res, out.with_suffix(".png"))
    return 1 if left or any(r.get("error") for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
