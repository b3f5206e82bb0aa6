"""Three learners, one slowed 3x: does anyone wait for it? ``"mode": "decoupled"`` against the barrier modes.

Every run is one ``deepspeed`` launch of 3 CPU ranks (gloo), one rank per learner (replica_group_size 1), a
small GPT on the standard library's source (``decoupled_worker.py``); rank 2's micro-batches take 3x as long
(``acco.emulation.slow_rank`` 2, ``slow_factor`` 3: a sleep after each backward, no CPU used), stated in every
row it affects. Runs:

* stock ZeRO-1 (plain DeepSpeed, data-parallel), slow rank included: its final validation loss is the target;
* diloco (barrier at every sync), A-EDiT (``edit`` with ``sync_time_s``: syncs on wall time), decoupled
  (K = 1, ``grace_s`` "auto"), each with the slow rank, trained for the same budget;
* decoupled without the slow rank (all three at full speed): the fast learners' tokens/s should stay within 5%;
* decoupled with ``staleness: "none"``: Nesterov momentum on every single-learner merge.

The decoupled rows use ``staleness: "delayed_nesterov"`` (N = 3 learners) unless said otherwise.

``--case moe`` runs the same fleet on the mixture-of-experts GPT of ``moe_race.py`` (``decoupled_moe.py``: 8
experts, top-2, ep_size 1 inside each learner of one rank): stock ZeRO-1 (the target), diloco, A-EDiT, decoupled
K = 1 with and without the slow rank, shorter budgets (``--moe-*``). Writes ``decoupled_race_moe.{json,md}``.

Rank 0 evaluates the model its users read (no collective) every few seconds of training; the time to the
target is interpolated on that trace. Writes ``benchmarks/results/decoupled_race.{json,md}``.

    python benchmarks/decoupled_race.py [--stock-steps 40] [--seconds 60]
    flock /tmp/acco_heavy.lock python benchmarks/decoupled_race.py --case moe
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent

BASE = {
    "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "steps_per_print": 1000000, "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                              "torch_adam": True}},
}
SLOW = {"slow_rank": 2, "slow_factor": 3.0}


def config(acco=None, slow=True):
    cfg = copy.deepcopy(BASE)
    if acco is None:
        if slow:  # stock DeepSpeed has no emulation hook: the sync mode (plain ZeRO-1, equal to stock) slows it
            cfg["acco"] = {"enabled": True, "mode": "sync", "emulation": dict(SLOW)}
        return cfg
    cfg["acco"] = {"enabled": True, **acco}
    if slow:
        cfg["acco"]["emulation"] = dict(SLOW)
    return cfg


def launch(name, cfg, extra, workdir, timeout, worker=HERE / "decoupled_worker.py"):
    d = Path(workdir) / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    port = 29700 + (abs(hash(name)) % 200)
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "3", "--master_port", str(port), str(worker),
           "--config", str(d / "config.json"), "--out", str(d)] + extra
    t0 = time.perf_counter()
    with open(d / "launch.log", "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    wall = time.perf_counter() - t0
    ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in range(3) if (d / f"rank{r}.json").exists()]
    if code != 0 or len(ranks) != 3:
        raise RuntimeError(f"{name}: exit {code}, {len(ranks)} rank results; see {d / 'launch.log'}")
    return {"name": name, "wall_s": wall, "ranks": ranks}


def time_to(trace, target):
    prev = None
    for p in trace:
        if p["val_loss"] <= target:
            if prev is None:
                return p["time"]
            f = (prev["val_loss"] - target) / (prev["val_loss"] - p["val_loss"])
            return prev["time"] + f * (p["time"] - prev["time"])
        prev = p
    return None


def dense_plan(args, dec):
    """(label, DeepSpeed config, worker flags) of the dense rows."""
    H = args.sync_every
    dec_none = copy.deepcopy(dec)
    dec_none["local_sgd"]["staleness"] = "none"
    return [
        ("stock ZeRO-1 (slow rank 2 x3)", config(None), ["--steps", str(args.stock_steps)]),
        ("diloco (slow rank 2 x3)", config({"mode": "diloco", "local_sgd": {"sync_every": H, "replica_group_size": 1}}),
         ["--steps", str(args.steps)]),
        ("A-EDiT (slow rank 2 x3)", config({"mode": "edit", "local_sgd": {"sync_time_s": args.sync_time_s,
                                                                         "replica_group_size": 1}}),
         ["--syncs", str(args.syncs)]),
        ("decoupled K=1 (slow rank 2 x3)", config(dec), ["--seconds", str(args.seconds)]),
        ("decoupled K=1 (no slow rank)", config(dec, slow=False), ["--seconds", str(args.seconds)]),
        ("decoupled K=1 staleness none (slow rank 2 x3)", config(dec_none), ["--seconds", str(args.seconds)]),
    ]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("dense", "moe"), default="dense")
    ap.add_argument("--stock-steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=80, help="diloco's inner steps")
    ap.add_argument("--syncs", type=int, default=10, help="A-EDiT's syncs")
    ap.add_argument("--seconds", type=float, default=40.0, help="decoupled learners' training time")
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--sync-time-s", type=float, default=4.0)
    ap.add_argument("--moe-stock-steps", type=int, default=20, help="--case moe: stock's steps (the target)")
    ap.add_argument("--moe-steps", type=int, default=40, help="--case moe: diloco's inner steps")
    ap.add_argument("--moe-syncs", type=int, default=5, help="--case moe: A-EDiT's syncs")
    ap.add_argument("--moe-sync-time-s", type=float, default=3.0, help="--case moe: A-EDiT's period (s)")
    ap.add_argument("--moe-seconds", type=float, default=15.0, help="--case moe: decoupled learners' training time")
    ap.add_argument("--out", default=None, help="results path without suffix (default results/decoupled_race[_moe])")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(HERE / "results" / ("decoupled_race" + ("_moe" if args.case == "moe" else "")))
    return args


def rows_of(runs, target):
    rows = []
    for r in runs:
        r0 = r["ranks"][0]
        tps = [x["tokens"] / x["seconds"] for x in r["ranks"]]
        rows.append({"run": r["label"], "wall_s": r["wall_s"], "train_s": [x["seconds"] for x in r["ranks"]],
                     "inner_steps": [x["steps"] for x in r["ranks"]], "tokens_per_s": tps,
                     "final_val_loss": r0["trace"][-1]["val_loss"], "time_to_target_s": time_to(r0["trace"], target),
                     "merges": r0["stats"].get("merges"), "version": r0["stats"].get("version"),
                     "waited_s": r0["stats"].get("outer_wait_s")})
    ref = next(r for r in rows if "decoupled K=1 (no slow" in r["run"])
    for r in rows:  # the fast learners' rate against the run where no learner is slowed
        r["fast_vs_no_slow"] = [r["tokens_per_s"][i] / ref["tokens_per_s"][i] for i in (0, 1)]
    return rows


def table(rows):
    lines = ["| run | train s (rank 0/1/2) | inner steps (0/1/2) | tokens/s per rank (0/1/2) | final val loss (rank 0) "
             "| time to target (s) | rank 0 merges / version | rank 0 waited for outer s | ranks 0/1 tokens/s vs no "
             "slow rank |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttt = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        dec = "-" if r["merges"] is None else f"{r['merges']} / {r['version']}"
        waited = "-" if r["waited_s"] is None else f"{r['waited_s']:.2f}"
        lines.append(f"| {r['run']} | {'/'.join(f'{t:.1f}' for t in r['train_s'])} | "
                     f"{'/'.join(str(s) for s in r['inner_steps'])} | {'/'.join(f'{t:,.0f}' for t in r['tokens_per_s'])} "
                     f"| {r['final_val_loss']:.4f} | {ttt} | {dec} | {waited} | "
                     f"{'/'.join(f'{x:.2f}' for x in r['fast_vs_no_slow'])} |")
    return lines


def main(argv=None) -> int:
    args = parse(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="acco_decoupled_race_")
    dec = {"mode": "decoupled", "local_sgd": {"sync_every": args.sync_every, "replica_group_size": 1, "min_quorum": 1,
                                              "grace_s": "auto", "staleness": "delayed_nesterov"}}
    if args.case == "moe":
        import decoupled_moe
        plan, worker = decoupled_moe.plan(config, dec, args), decoupled_moe.HERE / "decoupled_moe.py"
        model, stock_steps = decoupled_moe.model_words(2, 64, 64), args.moe_stock_steps
    else:
        plan, worker, model, stock_steps = dense_plan(args, dec), HERE / "decoupled_worker.py", "GPT 2 layers x 64", \
            args.stock_steps
    runs, load = [], [os.getloadavg()[0]]
    for name, cfg, extra in plan:
        print(f"running {name} ...", flush=True)
        runs.append(launch(f"run{len(runs)}", cfg, extra, work, 900, worker))
        runs[-1]["label"] = name
    load.append(os.getloadavg()[0])
    target = runs[0]["ranks"][0]["trace"][-1]["val_loss"]
    rows = rows_of(runs, target)
    ratio = next(r for r in rows if "decoupled K=1 (slow" in r["run"])["fast_vs_no_slow"]
    meta = {"command": " ".join(["python benchmarks/decoupled_race.py"] + list(argv or sys.argv[1:])),
            "date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "target": target,
            "cores": os.cpu_count(), "machine": platform.machine(), "model": model, "load_avg_1min": load,
            "args": vars(args)}
    lines = [f"# Three learners, one slowed 3x{' (mixture of experts)' if args.case == 'moe' else ''}\n",
             f"Machine: {os.cpu_count()} cores {platform.machine()}, CPU ranks (gloo, DS_ACCELERATOR=cpu, "
             f"OMP_NUM_THREADS=1), Python {platform.python_version()}. Command: `{meta['command']}` "
             f"({meta['date']}; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end). "
             f"3 ranks, one learner (replica) each; {model}, block 64, micro-batch 8 x 2 accumulation; rank 2 slowed "
             f"3x (acco.emulation slow_rank 2, slow_factor 3) where stated; decoupled: sync_every {args.sync_every}, "
             f"K = 1, grace auto, Delayed Nesterov. Target: stock ZeRO-1's final validation loss after {stock_steps} "
             f"steps = {target:.4f} (rank 0's evaluation of what users read, 4 batches).\n"] + table(rows)
    goal = all(x >= 0.95 for x in ratio)
    lines += ["", f"Fast learners' tokens/s with the slow learner present, against the run without it: rank 0 "
                  f"{ratio[0]:.3f}, rank 1 {ratio[1]:.3f} (goal: within 5%: {'MET' if goal else 'NOT MET'}). Two "
                  f"CPU cores hold three ranks: a slowed rank sleeps and frees its core, so the others may even speed up.",
              ""]
    md = "\n".join(lines)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "fast_ratio": ratio,
                                                    "traces": {r["label"]: r["ranks"][0]["trace"] for r in runs}},
                                                   indent=1))
    out.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
