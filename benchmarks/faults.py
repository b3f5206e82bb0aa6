"""Fault drill: what a user of acco_ds sees when things break, and whether a
checkpoint gets them back. 2 CPU ranks (gloo, ``DS_ACCELERATOR=cpu``), each
rank a process of ``benchmarks/fault_worker.py`` (tiny MLP, AdamW, ZeRO-1,
``gradient_accumulation_steps`` 2, checkpoints every K steps).

    python benchmarks/faults.py                       # every scenario
    python benchmarks/faults.py --only kill_rank,stop_rank
    python benchmarks/faults.py --list
    python benchmarks/faults.py --cleanup             # namespaces / mounts left by a SIGKILLed drill

Every scenario has a hard time limit: on expiry every process it started is
killed and its row says TIMEOUT. Namespaces and tmpfs mounts are always
removed (errors, Ctrl-C, SIGTERM). Results: a markdown table on stdout and in
benchmarks/results/faults.md, details (full messages, logs' tails) in
benchmarks/results/faults.json.

Ranks, namespaces, deadlines and cleanup come from benchmarks/harness.py.
tests/test_faults.py runs the fast scenarios through this command line. The scenarios themselves are
in fault_scenarios.py.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import forked
import harness
from fault_scenarios import MOUNT_PREFIX, RESULTS, SAVE_EVERY, SCENARIOS, ScenarioTimeout, row, short


def run_scenario(name, workdir=None, opts=None, limit=None):
    """Run one scenario under its hard time limit; always returns rows (TIMEOUT / ERROR rows on failure)."""
    fn, default_limit = SCENARIOS[name]
    deadline = harness.Deadline(limit or default_limit)
    own = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"acco_fault_{name}_"))
    t0 = time.monotonic()
    try:
        rows = fn(workdir, deadline, opts or {})
    except ScenarioTimeout as err:
        rows = [row(name, "TIMEOUT", "n/a", "n.a.", "-", error=str(err))]
    except Exception as err:  # noqa: BLE001 - a drill reports, it does not stop
        rows = [row(name, f"ERROR in the drill: {short(repr(err), 150)}", "n/a", "n.a.", "-", error=str(err)[-6000:])]
    finally:
        harness.kill_everything()
    for r in rows:
        r["scenario"] = name
        r["scenario_seconds"] = round(time.monotonic() - t0, 1)
    if own:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def markdown(rows):
    lines = ["| fault | what the user sees (first relevant line) | s until every rank exited with an error | "
             "last checkpoint intact and resumes exactly | message names problem / fix |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [r["fault"], r["seen"], str(r["seconds"]), r["resumes"], r["clear"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def cleanup():
    """Remove what a SIGKILLed drill left: its network namespaces, its tmpfs mounts."""
    removed = harness.cleanup_leftovers()
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 1 and MOUNT_PREFIX in parts[1]:
            subprocess.run(["umount", "-l", parts[1]], capture_output=True)
            shutil.rmtree(parts[1], ignore_errors=True)
            removed.append(parts[1])
    return removed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--cleanup", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    ap.add_argument("--timeout-s", type=float, default=20, help='"acco": {"timeout_s"} of the hang/link rows')
    ap.add_argument("--out", default=str(RESULTS / "faults"), help="results path without extension")
    ap.add_argument("--opts", default="{}", help="JSON object of scenario options (what the tests vary)")
    ap.add_argument("--limit", type=float, default=None, help="hard limit per scenario, s (default: its own)")
    ap.add_argument("--fresh", action="store_true", help="start every rank as a new interpreter (default: ranks "
                    "fork from this process, which imports torch, DeepSpeed and acco_ds once: benchmarks/forked.py)")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(SCENARIOS))
        return 0
    if args.cleanup:
        print("removed:", ", ".join(cleanup()) or "nothing to remove")
        return 0
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    if not args.fresh:
        forked.preload()
    harness.interrupt_on_signals()
    opts = {"stop_timeout_s": args.timeout_s, "link_timeout_s": args.timeout_s, **json.loads(args.opts)}
    base = Path(tempfile.mkdtemp(prefix="acco_faults_"))
    rows = []
    t0 = time.time()
    try:
        for name in names:
            print(f"== {name} ...", flush=True)
            got = run_scenario(name, base / name, opts, limit=args.limit)
            for r in got:
                print(f"   {r['fault']}: {r['seen']} | {r['seconds']} | {r['resumes']}", flush=True)
            rows += got
    finally:
        harness.kill_everything()  # each scenario removes its own namespaces and mounts in its finally
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    import torch
    import deepspeed
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                       f"{platform.system()} {platform.release()}",
            "cpu": harness.cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "command": "python benchmarks/faults.py" +
            (f" --only {args.only}" if args.only else ""), "seconds": round(time.time() - t0, 1),
            "settings": "2 ranks, gloo on loopback (link row: veth pair between 2 namespaces), DS_ACCELERATOR=cpu, "
                        "OMP_NUM_THREADS=1, MLP 16-64-64-4 (5.6k params), micro-batch 8, "
                        "gradient_accumulation_steps 2, ZeRO-1, AdamW, clip 1.0, acco/fixed, kernels torch "
                        f"(JIT row: native), checkpoint every {SAVE_EVERY} steps"}
    table = markdown(rows)
    print()
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    out.with_suffix(".md").write_text(f"Machine: {meta['cpu']} ({os.cpu_count()} cores), Python {meta['python']}, "
                                      f"torch {meta['torch']}, DeepSpeed {meta['deepspeed']}.\n\nSettings: "
                                      f"{meta['settings']}.\n\nCommand: `{meta['command']}` ({meta['seconds']} s)."
                                      f"\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
