"""Where a relaunched replica's time goes (issue 45, item 3), from benchmarks/chaos.py's records.

Each relaunch of a fault-tolerant run is cut into phases by the wall-clock stamps ``chaos_worker.py`` writes
into its ``start`` and ``stepped`` lines (``chaos.py`` notes the moment it started the launch):

    launcher     the supervisor starts the launch -> the rank's process starts (the cgroup wrapper, the
                 ``deepspeed`` runner and its launch.py; only the wrapper when the rank is started directly)
    imports      the rank's process starts -> its imports are done (torch, DeepSpeed, acco_ds, the example)
    model, data  -> the engine build starts (the corpus read, the GPT built)
    engine       the engine build without the join (DeepSpeed, ZeRO-1, the outer loop, torchft's Manager)
    join         waiting for the quorum the live replicas form at their next sync, then the heal (a live
                 replica's state sent over torchft's HTTP transport and loaded): torchft's ``start_quorum``
    evaluation   the benchmark's validation of the healed model
    first step   the first inner step (forward, backward, step)

``total`` runs from the launch to the end of that first step: "trains again".

``launcher``: how ``chaos.py --launcher`` starts a replica's ranks: ``deepspeed`` (the runner, which starts
DeepSpeed's launch.py, which starts the ranks: two more processes that each import all of DeepSpeed), or
``direct`` (a one-rank replica's rank itself, with the environment a launcher would give it), or ``warm``
(``acco_ds.cli.warm``: a parent that imported torch, DeepSpeed, acco_ds and torchft once forks the rank, and forks it
again ``--down_s`` after a kill; the kill hits the rank, not the parent. The relaunch's "launch" is then the
moment the kill plus ``--down_s`` falls due, and ``launcher`` is how late the parent's fork came after it).

The floor under a replica's CPU cap: ``python benchmarks/chaos_phases.py --floor [--cores 0.45]`` times a fresh
process that only imports (torch; then torch, DeepSpeed, acco_ds and torchft, as the worker does) inside a cgroup
of that many cores: no relaunch can train again sooner than that after its process starts.
"""

import argparse
import statistics
import subprocess
import sys
import time

LAUNCHERS = ("deepspeed", "direct", "warm")

PHASES = ("launcher", "imports", "model, data", "engine", "join", "evaluation", "first step", "total")


def launcher(kind, env, bin_dir, ranks, port, restart_delay_s=0.0):
    """(env, argv prefix) that start ``ranks`` ranks of the worker script that follows the prefix. ``warm``:
    acco_ds.cli.warm, which restarts a killed rank itself, ``restart_delay_s`` after the kill."""
    if kind == "deepspeed":
        return env, [str(bin_dir / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(port)]
    if kind == "warm":
        return env, [sys.executable, "-m", "acco_ds.cli.warm", "--nproc_per_node", str(ranks), "--master_port", str(port),
                     "--restarts", "100", "--restart_delay_s", f"{restart_delay_s:g}"]
    if ranks != 1:
        raise ValueError(f"--launcher direct starts one rank, not {ranks}")
    return dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port)), [sys.executable]


def relaunch_phases(records, events, t0) -> list:
    """One dict of phase -> seconds per relaunch (a launch after a kill) that reached its first step."""
    out = []
    launches = [e for e in events if e["event"] == "launch"]
    for i, e in enumerate(launches):
        if i < 3 or not any(k["event"] == "kill" and k["replica"] == e["replica"] for k in events):
            continue  # the first three launches start together: no relaunch
        at = t0 + e["t"]
        start = next((d for d in records if d["event"] == "start" and d["replica"] == e["replica"] and d["t"] > at
                      and "proc_start" in d), None)
        stepped = start and next((d for d in records if d["event"] == "stepped" and d["pid"] == start["pid"]), None)
        if stepped is None:
            continue
        join = start.get("quorum_wait_s", 0.0)
        out.append({"replica": e["replica"], "launcher": start["proc_start"] - at,
                    "imports": start["t_imported"] - start["proc_start"],
                    "model, data": start["t_build"] - start["t_imported"],
                    "engine": start["t_engine"] - start["t_build"] - join, "join": join,
                    "evaluation": start["t"] - start["t_engine"], "first step": stepped["t"] - start["t"],
                    "total": stepped["t"] - at})
    return out


def markdown(rows) -> str:
    """The phases of every relaunch, in seconds, one column each ("" without relaunches)."""
    if not rows:
        return ""
    head = "\nWhere each relaunch's time went, s (benchmarks/chaos_phases.py):\n\n| phase | " + " | ".join(f"relaunch {i + 1} (replica {r['replica']})" for i, r in enumerate(rows))
    lines = [head + " | mean |", "|" + "---|" * (len(rows) + 2)]
    for phase in PHASES:
        values = [r[phase] for r in rows]
        lines.append(f"| {phase} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {sum(values) / len(values):.2f} |")
    return "\n".join(lines) + "\n"


FLOOR_IMPORTS = {"torch": "import torch", "torch, deepspeed, acco_ds, torchft":
                 "import torch, deepspeed, acco_ds, torchft"}


def import_floor(cores: float, repeats: int = 3) -> dict:
    """Median wall seconds of a fresh ``python -c <imports>`` inside a ``cores``-core cgroup, per import line."""
    from cpucap import CpuCap
    out = {}
    for name, code in FLOOR_IMPORTS.items():
        times = []
        for _ in range(repeats):
            cap = CpuCap(cores, "floor")
            try:
                t0 = time.perf_counter()
                subprocess.run(cap.wrap([sys.executable, "-c", code]), check=True, capture_output=True, timeout=300)
                times.append(time.perf_counter() - t0)
            finally:
                cap.close()
        out[name] = {"median_s": statistics.median(times), "runs_s": times}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the import floor of a relaunched replica under its CPU cap")
    ap.add_argument("--floor", action="store_true", required=True)
    ap.add_argument("--cores", type=float, default=0.45)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(f"| imports in a fresh process, {a.cores} core cgroup | median s | runs, s |\n|---|---|---|")
    for name, r in import_floor(a.cores, a.repeats).items():
        print(f"| {name} | {r['median_s']:.2f} | " + ", ".join(f"{t:.2f}" for t in r["runs_s"]) + " |")


__all__ = ["LAUNCHERS", "PHASES", "import_floor", "launcher", "markdown", "relaunch_phases"]
