"""Do finished runs exit 0? Launch each case N times and count the exit codes and the aborts.

Supervisors judge a replica's liveness by its exit code, so a run that trained to the end and then aborts in
interpreter teardown ("terminate called without an active exception", SIGABRT) looks like a crash, and the
``deepspeed`` launcher SIGKILLs the ranks still finishing. The cause, shown by ``torch alone`` below: a gloo
worker thread (``ProcessGroupGloo::runLoop``) drops a finished collective, and with it the last reference to
a tensor that Python owns; freeing it takes the GIL; once the interpreter is finalizing, taking the GIL ends
the thread (``pthread_exit``), whose unwinding through ``runLoop`` calls ``std::terminate``. acco_ds destroys
its groups in ``engine.destroy()`` and, at interpreter exit, every group left up (``runtime/comm/lifetime.py``).

Cases (``examples/train_gpt.py`` on a 1-layer GPT: ``engine.destroy()`` at the end, no
``destroy_process_group()``, as most DeepSpeed scripts):

* ``acco`` on 2 ranks; ``diloco``, ``co2``, ``sparseloco`` as 2 replicas of 2 on 4 ranks;
* each under the ``deepspeed`` launcher and under ``torchrun``;
* each with acco_ds (the config's ``"acco"`` block on) and stock DeepSpeed beside it (``ACCO_DS_AUTOPATCH=0``:
  stock ZeRO-1 on the same script, config and data);
* ``torch alone``: a 4-rank gloo script with replica, outer and side-thread groups that ends without
  ``destroy_process_group()`` (no DeepSpeed, no acco_ds), and the same script ending with it (``--with-destroy``).

``--load K`` runs K busy processes beside the launches (a machine shared with other jobs: the abort is a race,
and waiting threads that lose their core widen it). Writes a table (stdout and benchmarks/results/exit_codes.md)
and each abort's last lines (benchmarks/results/exit_codes.json).

    python benchmarks/exit_codes.py --launches 10 --load 1 [--only diloco,torch] [--launcher deepspeed]
        [--without-stock] [--merge]
"""

import argparse
import collections
import json
import multiprocessing
import platform
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL = ["--n_layer", "1", "--n_embd", "32", "--eval_batches", "2"]
CASES = {"acco": ("configs/acco_cpu.json", 2), "diloco": ("configs/diloco_cpu.json", 4),
         "co2": ("configs/co2_cpu.json", 4), "sparseloco": ("configs/sparseloco_cpu.json", 4)}
ABORT = "terminate called"

TORCH_ALONE = textwrap.dedent("""
    import sys, threading, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    w, k = dist.get_world_size(), 2
    replica, _ = dist.new_subgroups_by_enumeration([list(range(g * k, (g + 1) * k)) for g in range(w // k)])
    outer, _ = dist.new_subgroups_by_enumeration([list(range(i, w, k)) for i in range(k)])
    side, _ = dist.new_subgroups_by_enumeration([list(range(g * k, (g + 1) * k)) for g in range(w // k)])
    x = torch.randn(1 << 16)
    def side_job():
        with torch.no_grad():
            for _ in range(20):
                dist.all_reduce(x, group=side)
    t = threading.Thread(target=side_job, daemon=True)
    t.start()
    for _ in range(20):
        y = torch.randn(1 << 16)
        dist.all_reduce(y, group=replica)
        dist.all_reduce(y, group=outer)
    t.join()
    dist.all_reduce(torch.ones(1))
    if "--with-destroy" in sys.argv:
        dist.destroy_process_group()
    print("done", flush=True)
""")


def launch(launcher: str, nproc: int, port: int, script: list) -> list:
    bin_ = Path(sys.executable).parent
    if launcher == "deepspeed":
        return [str(bin_ / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port), *script]
    return [str(bin_ / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(port), *script]


def rows(workdir: Path, only, launchers, stock_too=True):
    """(name, env, argv builder) per row."""
    alone = workdir / "torch_alone.py"
    alone.write_text(TORCH_ALONE)
    out = []
    for case, (config, nproc) in CASES.items():
        for launcher in launchers:
            script = ["examples/train_gpt.py", "--deepspeed_config", config, "--steps", "8", *MODEL]
            for stock in (False, True) if stock_too else (False,):
                name = f"{case}, {nproc} ranks, {launcher}, " + ("stock DeepSpeed" if stock else "acco_ds")
                env = {"ACCO_DS_AUTOPATCH": "0"} if stock else {}
                out.append((case, name, env, lambda port, l=launcher, n=nproc, s=script: launch(l, n, port, s)))
    for destroy in (False, True):
        name = "torch alone, 4 ranks, torchrun, " + ("with destroy_process_group()" if destroy else "no destroy")
        argv = [str(alone)] + (["--with-destroy"] if destroy else [])
        out.append(("torch", name, {}, lambda port, a=argv: launch("torchrun", 4, port, a)))
    return [r for r in out if not only or r[0] in only]


def _busy(stop):
    while not stop.is_set():
        sum(i * i for i in range(10000))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--load", type=int, default=0, help="busy processes running beside the launches")
    parser.add_argument("--only", default="", help="comma-separated cases: acco,diloco,co2,sparseloco,torch")
    parser.add_argument("--launcher", choices=["deepspeed", "torchrun"], action="append",
                        help="launchers to use (default both)")
    parser.add_argument("--without-stock", action="store_true", help="leave out the stock DeepSpeed rows")
    parser.add_argument("--merge", action="store_true", help="keep the other rows of the last results file")
    args = parser.parse_args()
    only = {c for c in args.only.split(",") if c}
    workdir = Path(tempfile.mkdtemp(prefix="acco_exit_codes_"))
    env0 = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_busy, args=(stop,), daemon=True) for _ in range(args.load)]
    for h in hogs:
        h.start()
    details = {}
    try:
        for case, name, env, argv_for in rows(workdir, only, args.launcher or ["deepspeed", "torchrun"],
                                                      not args.without_stock):
            codes, aborts, failures = collections.Counter(), 0, []
            t0 = time.monotonic()
            for i in range(args.launches):
                with harness.RankSet([(dict(env0, **env), argv_for(harness.free_port()))],
                                     workdir / f"{len(details)}_{i}", cwd=ROOT) as run:
                    code = run.wait(timeout=args.timeout)[0]
                    text = run.log(0)
                codes[code] += 1
                aborted = ABORT in text
                aborts += aborted
                if code != 0 or aborted:
                    failures.append({"launch": i, "code": code, "tail": text[-1500:]})
                print(f"{name}: launch {i + 1}/{args.launches} exit {code}" + (" (abort)" if aborted else ""),
                      flush=True)
            details[name] = {"launches": args.launches, "codes": {str(k): v for k, v in codes.items()},
                             "aborts": aborts, "failures": failures, "seconds": round(time.monotonic() - t0),
                             "load": args.load, "date": time.strftime("%Y-%m-%d")}
            harness.kill_everything()
    finally:
        stop.set()
        for h in hogs:
            h.join(timeout=5)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "exit_codes.json"
    if args.merge and path.exists():
        details = {**json.loads(path.read_text()), **details}
    import torch
    import deepspeed
    header = (f"Exit codes of finished runs, {harness.cpu_name()}, {platform.machine()}, CPU ranks, gloo, Python "
              f"{platform.python_version()}, torch {torch.__version__}, DeepSpeed {deepspeed.__version__}: "
              f"`python benchmarks/exit_codes.py --launches N --load K` (N and K per row)")
    lines = [header, "", "| case | date | busy processes | launches | exit 0 | aborts | seconds |",
             "|---|---|---|---|---|---|---|"]
    for name, d in details.items():
        lines.append(f"| {name} | {d['date']} | {d['load']} | {d['launches']} | {d['codes'].get('0', 0)} | "
                     f"{d['aborts']} | {d['seconds']} |")
    text = "\n".join(lines)
    print("\n" + text)
    (RESULTS / "exit_codes.md").write_text(text + "\n")
    path.write_text(json.dumps(details, indent=1))


if __name__ == "__main__":
    main()
