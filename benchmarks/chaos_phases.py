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
``direct`` (a one-rank replica's rank itself, with the environment a launcher would give it).
"""

import sys

LAUNCHERS = ("deepspeed", "direct")

PHASES = ("launcher", "imports", "model, data", "engine", "join", "evaluation", "first step", "total")


def launcher(kind, env, bin_dir, ranks, port):
    """(env, argv prefix) that start ``ranks`` ranks of the worker script that follows the prefix."""
    if kind == "deepspeed":
        return env, [str(bin_dir / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(port)]
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


__all__ = ["LAUNCHERS", "PHASES", "launcher", "markdown", "relaunch_phases"]
