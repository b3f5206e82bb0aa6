"""Decoupled learners under a kill: three learners, one launch each (``acco-ds syncer`` runs the syncer), a small
GPT on the standard library's source (``decoupled_worker.py``), K = 1, Delayed Nesterov. In the chaos run learner
1 is killed (SIGKILL) at ``--kill-at`` seconds and relaunched ``--relaunch-after`` seconds later with the training
time it had left; the failure-free run is the same without the kill. Measured:

* goodput: inner steps merged into the global model (the syncer's log) per second of the run, against the
  failure-free run;
* the longest exchange of any learner (Δ up, merge, θ_g down), against its mean inner step: no learner waits
  for another, so it stays about one exchange;
* one global model at the end: the syncer's θ_g, which every learner's last merge leaves it on.

Writes ``benchmarks/results/decoupled_chaos.{json,md}``.

    python benchmarks/decoupled_chaos.py [--seconds 40 --kill-at 12 --relaunch-after 4]
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


def run(name, args, work, chaos):
    d = Path(work) / name
    state = d / "syncer"
    d.mkdir(parents=True)
    port = free_port()
    cfg = copy.deepcopy(BASE)
    cfg["acco"] = {"enabled": True, "mode": "decoupled",
                   "local_sgd": {"sync_every": args.sync_every, "min_quorum": 1, "grace_s": "auto",
                                 "staleness": "delayed_nesterov", "nesterov_delay": 3,
                                 "syncer": {"address": f"127.0.0.1:{port}", "state_dir": str(state),
                                            "timeout_s": 60}}}
    cfg_path = d / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    log = open(d / "log.txt", "w")
    syncer = subprocess.Popen([sys.executable, "-m", "acco_ds.cli.report", "syncer", "--config", str(cfg_path),
                               "--shards", "1", "--port", str(port), "--host", "127.0.0.1", "--learners", "3"],
                              env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.perf_counter()
    procs = {i: learner(i, cfg_path, d / f"learner{i}", args.seconds, log) for i in range(3)}
    killed_at = relaunched_at = None
    if chaos:
        time.sleep(args.kill_at)
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        killed_at = time.perf_counter() - t0
        time.sleep(args.relaunch_after)
        relaunched_at = time.perf_counter() - t0
        procs[1] = learner(1, cfg_path, d / "learner1", max(1.0, args.seconds - args.kill_at), log)
    codes = {i: p.wait(timeout=args.seconds * 6 + 120) for i, p in procs.items()}
    wall = time.perf_counter() - t0
    syncer.wait(timeout=60)
    log.close()
    merges = [json.loads(line) for line in (state / "merges.jsonl").read_text().splitlines()]
    ranks = {i: json.loads((d / f"learner{i}" / "rank0.json").read_text()) for i in range(3)}
    merged_steps = sum(c["steps"] for m in merges for c in m["contributions"])
    step_s = {i: r["seconds"] / max(1, r["steps"]) for i, r in ranks.items()}
    return {"name": name, "wall_s": wall, "codes": codes, "killed_at_s": killed_at, "relaunched_at_s": relaunched_at,
            "merges": len(merges), "merged_inner_steps": merged_steps, "goodput_steps_per_s": merged_steps / wall,
            "max_wait_s": {i: r["stats"].get("max_wait_s") for i, r in ranks.items()}, "inner_step_s": step_s,
            "final_versions": {i: r["stats"].get("version") for i, r in ranks.items()},
            "syncer_version": merges[-1]["version"] if merges else 0,
            "final_val_loss": {i: r["trace"][-1]["val_loss"] for i, r in ranks.items()}}


def render(free, chaos, goodput, args, argv) -> str:
    lines = ["# Decoupled learners under a kill\n",
             f"Command: `python benchmarks/decoupled_chaos.py {' '.join(argv or sys.argv[1:])}` "
             f"({getattr(args, 'date', None) or time.strftime('%Y-%m-%d %H:%M')}), {os.cpu_count()} cores, CPU, Python {platform.python_version()}. "
             f"3 learners of one rank, one process each, `acco-ds syncer` of one shard; GPT 2 layers x 64, block 64, "
             f"micro-batch 8 x 2; sync_every {args.sync_every}, K = 1, grace auto, Delayed Nesterov (N = 3); "
             f"{args.seconds:g} s of training per learner. Chaos: learner 1 killed (SIGKILL) at {args.kill_at:g} s, "
             f"relaunched {args.relaunch_after:g} s later with the training time it had left.\n",
             "| run | wall s | merges | inner steps merged | goodput (steps/s) | longest exchange, learners 0/1/2 (s) | "
             "mean inner step 0/1/2 (s) | final versions 0/1/2 (syncer) | exit codes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in (free, chaos):
        waits = "/".join("%.2f" % r["max_wait_s"][i] for i in range(3))
        steps = "/".join("%.3f" % r["inner_step_s"][i] for i in range(3))
        versions = "/".join(str(r["final_versions"][i]) for i in range(3))
        codes = "/".join(str(r["codes"][i]) for i in range(3))
        lines.append(f"| {r['name']} | {r['wall_s']:.1f} | {r['merges']} | {r['merged_inner_steps']} | "
                     f"{r['goodput_steps_per_s']:.2f} | {waits} | {steps} | {versions} ({r['syncer_version']}) | "
                     f"{codes} |")
    worst = max(chaos["max_wait_s"][i] / chaos["inner_step_s"][i] for i in (0, 2))
    lines += ["", f"Goodput of the chaos run against the failure-free one: {goodput:.3f} (goal >= 0.97: "
                  f"{'MET' if goodput >= 0.97 else 'NOT MET'}). The killed learner loses its unfinished period and "
                  f"its {args.relaunch_after:g} s away; nobody else waits for it (K = 1). This machine has "
                  f"{os.cpu_count()} cores for 3 learners and the syncer: a dead learner frees CPU for the others, "
                  f"so their inner steps get faster and the ratio can exceed 1 here; it says that the kill cost "
                  f"nothing measurable, not that it helps. Longest pause of the learners that were not killed (their "
                  f"own exchange: Δ up, merge, θ_g down) against their mean inner step: {worst:.1f} inner steps (goal "
                  f"<= 1: {'MET' if worst <= 1 else 'NOT MET'}: on this oversubscribed machine the exchange of a "
                  f"0.1M-parameter model competes for the CPU with the syncer and the other learners). One global "
                  f"model at the end: the syncer's θ_g (version {chaos['syncer_version']}); each learner ends on the "
                  f"version of its own last merge.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--kill-at", type=float, default=12.0)
    ap.add_argument("--relaunch-after", type=float, default=4.0)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--out", default=str(HERE / "results" / "decoupled_chaos"))
    ap.add_argument("--render", action="store_true", help="only write the page again from the saved JSON")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.out).with_suffix(".json").read_text())
        for r in saved["runs"]:
            for key in ("max_wait_s", "inner_step_s", "final_versions", "codes", "final_val_loss"):
                r[key] = {int(i): v for i, v in r[key].items()}
        args.__dict__.update({k: v for k, v in saved["args"].items() if k not in ("render", "out")})
        md = render(*saved["runs"], saved["goodput"], args, saved.get("argv", []))
        Path(args.out).with_suffix(".md").write_text(md)
        print(md)
        return 0
    work = tempfile.mkdtemp(prefix="acco_decoupled_chaos_")
    free = run("failure-free", args, work, chaos=False)
    chaos = run("chaos", args, work, chaos=True)
    goodput = chaos["goodput_steps_per_s"] / free["goodput_steps_per_s"]
    md = render(free, chaos, goodput, args, argv)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"runs": [free, chaos], "goodput": goodput, "args": vars(args),
                                                    "argv": list(argv or sys.argv[1:]), "date":
                                                    time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    out.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
