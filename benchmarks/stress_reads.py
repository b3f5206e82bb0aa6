"""Stress the reads of the round modes: launch each scenario many times beside a CPU hog and count hangs.

A scenario is one engine configuration (host, mode, accumulation, collectives, compression); every launch
runs ``--trials`` trials of ``stress_reads_worker.py`` (eval with a user all-reduce, ``state_dict()``, a user
collective between steps, ``save_checkpoint``, ``acco_finalize``, each at a random point of a round, with a
random communication delay and a random slow rank). A launch that does not finish within ``--timeout``
seconds is a hang: every rank's stacks are dumped into its log (SIGUSR1, faulthandler) and kept in the
results. The CPU hog (``--hogs`` busy processes) makes the ranks' timing irregular, as a loaded machine does.

    python benchmarks/stress_reads.py --launches 50                 # every scenario, 50 launches each
    python benchmarks/stress_reads.py --scenarios ds-acco-adaptive --launches 10 --trials 2

Prints a table and writes ``benchmarks/results/stress_reads.json`` (``--out``).
"""

import argparse
import json
import multiprocessing
import platform
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent
WORKER = HERE / "stress_reads_worker.py"

SCENARIOS = {
    "ds-acco-adaptive": dict(host="deepspeed", mode="acco", accumulation="adaptive"),
    "ds-issue45": dict(host="deepspeed", mode="acco", accumulation="adaptive", pattern="issue45",
                       acco={"emulation": {}, "timeout_s": 60}),
    "ds-slow-rank": dict(host="deepspeed", mode="acco", accumulation="adaptive", acco={
        "max_micro_batches_per_round": 8, "emulation": {"comm_delay_s": 0.05, "slow_rank": 1, "slow_factor": 30.0}}),
    "ds-dpu-adaptive": dict(host="deepspeed", mode="dpu", accumulation="adaptive"),
    "ds-acco-fixed": dict(host="deepspeed", mode="acco", accumulation="fixed"),
    "ds-acco-adaptive-int8": dict(host="deepspeed", mode="acco", accumulation="adaptive", int8=True),
    "ds-acco-adaptive-nodeaware": dict(host="deepspeed", mode="acco", accumulation="adaptive", ranks_per_node=2,
                                       world=4),
    "torch-acco-adaptive": dict(host="torch", mode="acco", accumulation="adaptive"),
    "torch-dpu-adaptive": dict(host="torch", mode="dpu", accumulation="adaptive"),
}


def hog():
    while True:
        pass


def launch(name, scenario, seed, trials, timeout, workdir):
    """One launch; returns {"ok", "seconds", "trials_done", "stacks" (on a hang), "error" (on a crash)}."""
    world = scenario.get("world", 2)
    spec = dict(scenario, seed=seed, trials=trials)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps(spec))
    port = harness.free_port()
    cmds = [(harness.rank_env(r, world, port), [sys.executable, str(WORKER), str(workdir / "spec.json")])
            for r in range(world)]
    start = time.monotonic()
    with harness.RankSet(cmds, workdir, name=f"{name}#{seed}") as ranks:
        codes = ranks.wait(timeout=timeout)
        out = {"seed": seed, "seconds": round(time.monotonic() - start, 1)}
        if any(c is None for c in codes):  # a hang: every thread's stack into the logs, then kill
            for p in ranks.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            texts = ranks.texts()
            out.update(ok=False, hang=True, trials_done=[t.count(" done") for t in texts],
                       stacks={r: t[t.find("Thread 0x"):][-6000:] for r, t in enumerate(texts) if "Thread 0x" in t})
        elif any(codes):
            out.update(ok=False, hang=False, error=ranks.tails(1500))
        else:
            done = [t.count(" done") for t in ranks.texts()]
            complete = min(done) >= trials  # a launch that exits 0 without every trial on every rank showed nothing
            out.update(ok=complete, trials_done=done,
                       **({} if complete else {"error": f"trials done per rank {done} < {trials}"}))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from: " + ", ".join(SCENARIOS))
    p.add_argument("--launches", type=int, default=50)
    p.add_argument("--trials", type=int, default=3, help="engines per launch")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds before a launch counts as a hang")
    p.add_argument("--hogs", type=int, default=1, help="busy processes beside the ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "stress_reads.json"))
    args = p.parse_args()
    names = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}: choose from {', '.join(SCENARIOS)}")
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    results = {"command": shlex.join([sys.executable] + sys.argv), "machine": f"{harness.cpu_name()}, "
               f"{multiprocessing.cpu_count()} cores, {platform.platform()}", "hogs": args.hogs,
               "trials_per_launch": args.trials, "timeout_s": args.timeout, "scenarios": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="acco_stress_") as tmp:
            for name in names:
                runs = []
                for i in range(args.launches):
                    r = launch(name, SCENARIOS[name], args.seed * 100000 + i, args.trials, args.timeout,
                               Path(tmp) / f"{name}-{i}")
                    runs.append(r)
                    status = "ok" if r["ok"] else ("HANG" if r.get("hang") else "CRASH")
                    print(f"{name:<28} launch {i + 1:>3}/{args.launches}: {status} in {r['seconds']} s", flush=True)
                results["scenarios"][name] = {
                    "spec": SCENARIOS[name], "launches": len(runs), "hangs": sum(bool(r.get("hang")) for r in runs),
                    "crashes": sum(not r["ok"] and not r.get("hang") for r in runs),
                    "median_s": sorted(r["seconds"] for r in runs)[len(runs) // 2],
                    "trials_done": sum(min(r.get("trials_done") or [0]) for r in runs),
                    "failed": [r for r in runs if not r["ok"]]}
    finally:
        for h in hogs:
            h.terminate()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{'scenario':<28} {'launches':>8} {'trials':>7} {'hangs':>6} {'crashes':>8} {'median s':>9}")
    for name, s in results["scenarios"].items():
        print(f"{name:<28} {s['launches']:>8} {s['launches'] * args.trials:>7} {s['hangs']:>6} {s['crashes']:>8} "
              f"{s['median_s']:>9}")
    print(f"\n{results['machine']}; {args.hogs} CPU hog(s); results in {args.out}")
    return 1 if any(s["hangs"] or s["crashes"] for s in results["scenarios"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
