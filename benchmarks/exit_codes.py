"""Do finished runs exit 0? Launch each host's example N times and count the exit codes.

Supervisors judge a replica's liveness by its exit code, so a run that trained to the end and then aborts in
interpreter teardown (gloo threads destroyed out of order: "terminate called without an active exception",
SIGABRT) looks like a crash. This launches, N times each:

* the torch host: ``torchrun --nproc_per_node 2 examples/fsdp2_train_gpt.py`` (plain module, mode sync,
  ``finalize`` then ``optimizer.close()`` and ``destroy_process_group()``, as the example does);
* the DeepSpeed host: ``deepspeed --num_gpus 2 examples/train_gpt.py`` (mode acco, ``engine.destroy()``);

both on a 1-layer GPT for a few steps, and writes a table (stdout and benchmarks/results/exit_codes.md) of
the exit codes seen, with any abort's last lines in benchmarks/results/exit_codes.json.

    python benchmarks/exit_codes.py --launches 30 [--only torch|deepspeed]
"""

import argparse
import collections
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL = ["--n_layer", "1", "--n_embd", "32", "--eval_batches", "2"]


def commands(port: int, workdir: Path) -> dict:
    torch_cfg = workdir / "sync.json"
    torch_cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
                                     "acco": {"enabled": True, "mode": "sync"}}))
    bin_ = Path(sys.executable).parent
    return {
        "torch host (torchrun, sync)": [str(bin_ / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port),
                                        "examples/fsdp2_train_gpt.py", "--config", str(torch_cfg), "--steps", "4",
                                        *MODEL],
        "DeepSpeed host (deepspeed, acco)": [str(bin_ / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
                                             "examples/train_gpt.py", "--deepspeed_config", "configs/acco_cpu.json",
                                             "--steps", "4", *MODEL],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--only", choices=["torch", "deepspeed"], default=None, help="one host's example only")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="acco_exit_codes_"))
    details = {}
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for name, argv in commands(0, workdir).items():
        if args.only and not name.lower().startswith(args.only):
            continue
        codes, aborts = collections.Counter(), []
        t0 = time.monotonic()
        for i in range(args.launches):
            argv[argv.index("--master_port") + 1] = str(harness.free_port())
            with harness.RankSet([(env, argv)], workdir / f"{name.split()[0]}{i}", cwd=ROOT) as run:
                code = run.wait(timeout=args.timeout)[0]
                text = run.log(0)
            codes[code] += 1
            if code != 0:
                aborts.append({"launch": i, "code": code, "tail": text[-1500:]})
            print(f"{name}: launch {i + 1}/{args.launches} exit {code}", flush=True)
        details[name] = {"launches": args.launches, "codes": {str(k): v for k, v in codes.items()},
                         "non_zero": aborts, "seconds": round(time.monotonic() - t0), "date": time.strftime("%Y-%m-%d")}
        harness.kill_everything()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "exit_codes.json"
    if args.only and path.exists():  # keep the other host's last row
        details = {**json.loads(path.read_text()), **details}
    header = (f"Exit codes of finished runs, {platform.node()} ({platform.machine()}, CPU, gloo): "
              f"`python benchmarks/exit_codes.py --launches N [--only torch|deepspeed]`")
    lines = [header, "", "| example | date | launches | exit 0 | other | seconds |", "|---|---|---|---|---|---|"]
    for name, d in details.items():
        ok = d["codes"].get("0", 0)
        lines.append(f"| {name} | {d['date']} | {d['launches']} | {ok} | {d['launches'] - ok} | {d['seconds']} |")
    text = "\n".join(lines)
    print("\n" + text)
    (RESULTS / "exit_codes.md").write_text(text + "\n")
    path.write_text(json.dumps(details, indent=1))


if __name__ == "__main__":
    main()
