"""Memory of ACCO vs stock DeepSpeed ZeRO-1, from the same training script.

    python benchmarks/memory.py [--n_layer 8 --n_embd 512]

Runs examples/train_gpt.py for a few steps on 2 CPU ranks, once with stock
ZeRO-1 (no acco block) and once with ACCO, and reports each rank-0 process's
peak resident memory and ACCO's own buffer bytes next to the formula
    8N + bN + 8N/W bytes   (two fp32 accumulators, gathered bit16/fp32
                            parameters, reduced and kept fp32 partitions)
for N parameters, b bytes per model parameter and W ranks.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode, args, out):
    cmd = ["deepspeed", "--num_gpus", "2", str(ROOT / "examples/train_gpt.py"), "--deepspeed_config",
           str(ROOT / "configs/acco_cpu.json"), "--mode", mode, "--steps", str(args.steps), "--n_layer",
           str(args.n_layer), "--n_embd", str(args.n_embd), "--n_head", "8", "--eval_interval", "1000",
           "--eval_batches", "2", "--results", out]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run(cmd, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shown = " ".join(c.replace(str(ROOT) + "/", "") for c in cmd[:-2])
    return json.load(open(out)), f"DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 {shown}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--n_embd", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/memory.json"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp()
    stock, cmd_stock = run("zero1", args, os.path.join(tmp, "zero1.json"))
    acco, cmd_acco = run("acco", args, os.path.join(tmp, "acco.json"))
    import torch
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import GPT
    n = sum(p.numel() for p in GPT(args.n_layer, 8, args.n_embd, 128).parameters())
    w, b = 2, 4
    formula = 8 * n + b * n + 8 * n / w
    rows = [("stock ZeRO-1", stock["peak_rss_mb"], None), ("ACCO", acco["peak_rss_mb"], acco["acco"]["buffer_bytes"])]
    print(f"\nGPT {n / 1e6:.1f}M parameters, fp32, 2 CPU ranks (gloo), torch {torch.__version__}")
    print("| engine | peak RSS rank 0 (MB) | ACCO buffers (MB) |")
    print("|---|---|---|")
    for name, rss, buf in rows:
        print(f"| {name} | {rss:.0f} | {'-' if buf is None else f'{buf / 2**20:.1f}'} |")
    print(f"difference: {acco['peak_rss_mb'] - stock['peak_rss_mb']:.0f} MB; formula 8N + bN + 8N/W = "
          f"{formula / 2**20:.1f} MB (N={n}, b={b}, W={w})")
    print(f"commands: {cmd_stock}\n          {cmd_acco}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump({"n_params": n, "stock_peak_rss_mb": stock["peak_rss_mb"], "acco_peak_rss_mb": acco["peak_rss_mb"],
               "acco_buffer_bytes": acco["acco"]["buffer_bytes"], "formula_bytes": formula,
               "commands": [cmd_stock, cmd_acco]}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
