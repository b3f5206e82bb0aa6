"""Decoupled learners under a kill: three learners, one launch each (``acco-ds syncer`` runs the syncer), a small
GPT on the standard library's source (``decoupled_worker.py``), K = 1, Delayed Nesterov. In the chaos run
(``--fault kill-learner``) learner 1 is killed (SIGKILL) ``--kill-at`` seconds after the first merge and relaunched
``--relaunch-after`` seconds later with the training time it had left; ``--fault stop-learner`` stops it (SIGSTOP)
for ``--relaunch-after`` seconds instead, with K = M = 3 and ``grace_s`` 0 (without ``liveness_s`` everyone would
wait for it); ``--fault kill-syncer`` kills the syncer and starts it again on its ``state_dir``. The
failure-free run is the same without the fault. Each ``--variants`` entry (``adopt`` and
the up-link's dtype, e.g. ``wait:fp32 overlap:fp32 overlap:int8``) runs both. Measured:

* goodput: inner steps merged into the global model (the syncer's log) per second, against the failure-free
  run of the same variant: over the whole run (whose end waits for the relaunched learner's last seconds,
  trained alone) and over a window of ``--seconds`` from the first merge (the kill and the relaunch inside);
* the longest pause of a learner between two inner steps (its exchange with the syncer), against its mean
  inner step without the exchange, and where that pause went (sending, waiting for the merge, adopting it), with
  the syncer's side (READY to merge, the grace window);
* the up-link bytes per period (DELTA messages as written by send(), header included);
* one global model at the end: the syncer's θ_g, which every learner's last merge leaves it on.

Writes ``benchmarks/results/decoupled_chaos.{json,md}``.

    python benchmarks/decoupled_chaos.py [--seconds 40 --kill-at 12 --relaunch-after 4 --variants overlap:fp32]
"""

import argparse
import copy
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from decoupled_race import BASE  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def learner(i, cfg_path, out, seconds, log):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               ACCO_LEARNER_ID=str(i))
    return subprocess.Popen([sys.executable, str(HERE / "decoupled_worker.py"), "--config", str(cfg_path), "--out",
                             str(out), "--seconds", str(seconds), "--eval-every-s", "1000"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def run(name, args, work, chaos, variant):
    adopt, dtype = variant.split(":")
    d = Path(work) / f"{adopt}-{dtype}-{name}"
    state = d / "syncer"
    d.mkdir(parents=True)
    port = free_port()
    cfg = copy.deepcopy(BASE)
    full = args.fault == "stop-learner"  # K = M: a stopped learner would stall everyone without liveness
    cfg["acco"] = {"enabled": True, "mode": "decoupled",
                   "local_sgd": {"sync_every": args.sync_every, "min_quorum": 3 if full else 1,
                                 "grace_s": 0 if full else "auto",
                                 "staleness": "delayed_nesterov", "nesterov_delay": 3, "adopt": adopt,
                                 "syncer": {"address": f"127.0.0.1:{port}", "state_dir": str(state),
                                            "timeout_s": 60, "liveness_s": args.liveness_s}}}
    if dtype != "fp32":
        cfg["acco"]["compression"] = {"dtype": dtype, "apply_to": ["outer"]}
    cfg_path = d / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    log = open(d / "log.txt", "w")

    def start_syncer():
        return subprocess.Popen([sys.executable, "-m", "acco_ds.cli.report", "syncer", "--config", str(cfg_path),
                                 "--shards", "1", "--port", str(port), "--host", "127.0.0.1", "--learners", "3"],
                                env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    syncer = start_syncer()
    t0, load = time.perf_counter(), os.getloadavg()[0]
    procs = {i: learner(i, cfg_path, d / f"learner{i}", args.seconds, log) for i in range(3)}
    killed_at = relaunched_at = None
    if chaos:  # the fault lands --kill-at seconds after the first merge (start-up times vary on a busy machine)
        while not (state / "merges.jsonl").exists() and time.perf_counter() - t0 < 600:
            time.sleep(0.05)
        time.sleep(args.kill_at)
        victim = syncer if args.fault == "kill-syncer" else procs[1]
        os.killpg(victim.pid, signal.SIGSTOP if args.fault == "stop-learner" else signal.SIGKILL)
        killed_at = time.perf_counter() - t0
        if args.fault != "stop-learner":
            victim.wait()
        time.sleep(args.relaunch_after)
        relaunched_at = time.perf_counter() - t0
        if args.fault == "stop-learner":
            os.killpg(victim.pid, signal.SIGCONT)
        elif args.fault == "kill-syncer":
            syncer = start_syncer()
        else:
            procs[1] = learner(1, cfg_path, d / "learner1", max(1.0, args.seconds - args.kill_at), log)
    codes = {i: p.wait(timeout=args.seconds * 6 + 120) for i, p in procs.items()}
    wall = time.perf_counter() - t0
    syncer.wait(timeout=60)
    log.close()
    merges = [json.loads(line) for line in (state / "merges.jsonl").read_text().splitlines()]
    ranks = {i: json.loads((d / f"learner{i}" / "rank0.json").read_text()) for i in range(3)}
    merged_steps = sum(c["steps"] for m in merges for c in m["contributions"])
    step_s = {i: (r["seconds"] - r["stats"].get("wire_s", 0.0)) / max(1, r["steps"]) for i, r in ranks.items()}
    held = [h for m in merges for h in m.get("held_s", []) if h is not None]
    first = min(m["time"] for m in merges)  # the window: --seconds from the first merge, both runs alike
    inside = [c for m in merges if m["time"] <= first + args.seconds for c in m["contributions"]]
    window = sum(c["steps"] for c in inside)
    others = sum(c["steps"] for c in inside if c["learner"] != 1)  # the learners that were not killed
    return {"name": name, "variant": f"{variant} {args.fault}", "wall_s": wall, "load": [load, os.getloadavg()[0]], "codes": codes, "killed_at_s": killed_at,
            "relaunched_at_s": relaunched_at, "merges": len(merges), "merged_inner_steps": merged_steps,
            "goodput_steps_per_s": merged_steps / wall, "window_steps_per_s": window / args.seconds,
            "window_others_steps_per_s": others / args.seconds,
            "max_wait_s": {i: r["stats"].get("max_wait_s") for i, r in ranks.items()}, "inner_step_s": step_s,
            "longest_phases_s": {i: r["stats"].get("longest_pause_phases_s") for i, r in ranks.items()},
            "phase_s": {i: r["stats"].get("phase_s") for i, r in ranks.items()},
            "uplink_bytes_per_period": {i: r["stats"]["delta_bytes"] / max(1, r["stats"]["merges"])
                                        for i, r in ranks.items()},
            "held_s_mean": sum(held) / max(1, len(held)), "held_s_max": max(held, default=0.0),
            "grace_s_mean": sum(m.get("grace_s", 0.0) for m in merges) / max(1, len(merges)),
            "final_versions": {i: r["stats"].get("version") for i, r in ranks.items()},
            "syncer_version": merges[-1]["version"] if merges else 0,
            "final_val_loss": {i: r["trace"][-1]["val_loss"] for i, r in ranks.items()},
            "delta_files_left": len(list(state.glob("shard*-delta-*.pt")))}


FAULTS = {"kill-learner": "learner 1 killed (SIGKILL) {a.kill_at:g} s after the first merge, relaunched "
                          "{a.relaunch_after:g} s later with the training time it had left.",
          "stop-learner": "learner 1 stopped (SIGSTOP) {a.kill_at:g} s after the first merge for {a.relaunch_after:g} "
                          "s, then SIGCONT; K = M = 3, grace 0, liveness_s {a.liveness_s:g}: the others merge without "
                          "it meanwhile.",
          "kill-syncer": "the syncer killed (SIGKILL) {a.kill_at:g} s after the first merge and started again on "
                         "its state_dir {a.relaunch_after:g} s later."}


def worst_pause(r) -> float:
    """The longest pause of the learners that were not killed (0 and 2), in their mean inner steps."""
    return max(r["max_wait_s"][i] / r["inner_step_s"][i] for i in (0, 2))


def render(pairs, args, argv) -> str:
    lines = ["# Decoupled learners under a kill\n",
             f"Command: `python benchmarks/decoupled_chaos.py {' '.join(argv or sys.argv[1:])}` "
             f"({getattr(args, 'date', None) or time.strftime('%Y-%m-%d %H:%M')}), {os.cpu_count()} cores, CPU, "
             f"Python {platform.python_version()}. 3 learners of one rank, one process each, `acco-ds syncer` of one "
             f"shard; GPT 2 layers x 64, block 64, micro-batch 8 x 2; sync_every {args.sync_every}, "
             f"K = {'3, grace 0' if getattr(args, 'fault', '') == 'stop-learner' else '1, grace auto'}, Delayed "
             f"Nesterov (N = 3); {args.seconds:g} s of training per learner. Chaos (`--fault`): "
             f"{FAULTS[args.fault].format(a=args)} Variant: `adopt` : the up-link's dtype, then the fault.\n",
             "| variant | run | wall s | merges | inner steps merged | goodput (steps/s) | longest pause 0/1/2 (s) | "
             "mean inner step 0/1/2 (s) | up-link bytes per period | final versions 0/1/2 (syncer) | exit codes | "
             "Δ slices left in state_dir | load average before/after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for free, chaos, goodput in pairs:
        for r in (free, chaos):
            waits = "/".join("%.3f" % r["max_wait_s"][i] for i in range(3))
            steps = "/".join("%.3f" % r["inner_step_s"][i] for i in range(3))
            versions = "/".join(str(r["final_versions"][i]) for i in range(3))
            codes = "/".join(str(r["codes"][i]) for i in range(3))
            lines.append(f"| {r['variant']} | {r['name']} | {r['wall_s']:.1f} | {r['merges']} | "
                         f"{r['merged_inner_steps']} | {r['goodput_steps_per_s']:.2f} | {waits} | {steps} | "
                         f"{r['uplink_bytes_per_period'][0]:,.0f} | {versions} ({r['syncer_version']}) | {codes} | "
                         f"{r.get('delta_files_left', '-')} | {r['load'][0]:.1f}/{r['load'][1]:.1f} |")
    lines += ["", "| variant | goodput, chaos / failure-free, whole run; window; window, learners 0 and 2 (goal "
                  ">= 0.97) | longest pause of "
                  "learners 0 and 2, chaos run (inner steps; goal <= 1) | that pause: send / wait for the merge / "
                  "adopt; its CPU time (s) | syncer: READY to merge, mean / max (s); grace mean (s) |",
              "|---|---|---|---|---|"]
    for free, chaos, goodput in pairs:
        worst = worst_pause(chaos)
        win = chaos["window_steps_per_s"] / free["window_steps_per_s"]
        rest = chaos["window_others_steps_per_s"] / free["window_others_steps_per_s"]
        i = max((0, 2), key=lambda j: chaos["max_wait_s"][j] / chaos["inner_step_s"][j])
        ph = chaos["longest_phases_s"][i] or {}
        lines.append(f"| {chaos['variant']} | {goodput:.3f}; {win:.3f}; {rest:.3f} | {worst:.2f} "
                     f"({'met' if worst <= 1 else 'NOT met'}) | {ph.get('send', 0):.3f} / {ph.get('wait', 0):.3f} / "
                     f"{ph.get('adopt', 0):.3f}; {ph.get('cpu', 0):.4f} | {chaos['held_s_mean']:.3f} / "
                     f"{chaos['held_s_max']:.3f}; {chaos['grace_s_mean']:.3f} |")
    lines += ["", "Mean inner step: training seconds less the exchange, per step. A pause's CPU time is this "
                  "process's (process_time) during it; the rest of it the process waited to be scheduled. The killed learner loses its "
                  "unfinished period and its time away; nobody else waits for it (K = 1). This machine has "
                  f"{os.cpu_count()} cores for 3 learners and the syncer: a dead learner frees CPU for the others, so "
                  "the goodput ratio can exceed 1 here; it says that the kill cost nothing measurable, not that it "
                  "helps. One global model at the end: the syncer's θ_g; each learner ends on the version of its own "
                  "last merge.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--kill-at", type=float, default=12.0)
    ap.add_argument("--relaunch-after", type=float, default=4.0)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=["wait:fp32", "overlap:fp32", "overlap:int8"],
                    help="adopt:dtype pairs (adopt wait|overlap, dtype fp32|int8|fp8)")
    ap.add_argument("--fault", choices=sorted(FAULTS), default="kill-learner")
    ap.add_argument("--liveness-s", type=float, default=2.0, help="acco.local_sgd.syncer.liveness_s")
    ap.add_argument("--out", default=str(HERE / "results" / "decoupled_chaos"))
    ap.add_argument("--render", action="store_true", help="only write the page again from the saved JSON")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.out).with_suffix(".json").read_text())
        for pair in saved["pairs"]:
            for r in pair[:2]:
                for key in ("max_wait_s", "inner_step_s", "final_versions", "codes", "final_val_loss",
                            "longest_phases_s", "phase_s", "uplink_bytes_per_period"):
                    r[key] = {int(i): v for i, v in r[key].items()}
        args.__dict__.update({k: v for k, v in saved["args"].items() if k not in ("render", "out")})
        md = render(saved["pairs"], args, saved.get("argv", []))
        Path(args.out).with_suffix(".md").write_text(md)
        print(md)
        return 0
    work = tempfile.mkdtemp(prefix="acco_decoupled_chaos_")
    pairs = []
    for variant in args.variants:
        free = run("failure-free", args, work, False, variant)
        chaos = run("chaos", args, work, True, variant)
        pairs.append((free, chaos, chaos["goodput_steps_per_s"] / free["goodput_steps_per_s"]))
    md = render(pairs, args, argv)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"pairs": pairs, "args": vars(args), "argv": list(argv or sys.argv[1:]),
                                                    "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    out.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
