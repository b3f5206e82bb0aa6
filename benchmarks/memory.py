"""Memory of ACCO vs stock DeepSpeed ZeRO-1, side by side from the same training script.

    python benchmarks/memory.py [--n_layer 8 --n_embd 448 --steps 4]
    python benchmarks/memory.py --convergence [--steps 150]   # bf16 vs fp32 accumulation, same data
    python benchmarks/memory.py --workload states [--steps 4]  # model-states workload (issue 19, item 7)
    python benchmarks/memory.py --workload states --compression  # the same with int8 rounds (residuals)

For each precision (fp32 model; bf16 model; bf16 model with
``data_types.grad_accum_dtype = "fp32"``) it runs examples/train_gpt.py for a
few steps on 2 CPU ranks (gloo), once with stock ZeRO-1 (no acco block) and
once with ACCO, same model, data and config otherwise. It reports each rank-0
process's peak resident memory (``ru_maxrss``; on a GPU also
``torch.cuda.max_memory_allocated``), ACCO's own buffers as allocated
(``engine.acco_stats()["buffer_bytes"]``) and the formula of
``acco_ds.memory`` next to them, and the budget of issue 8:
ACCO peak - stock peak <= 1.25 x bN + 32 MB. Results go to
benchmarks/results/memory.json.

``--workload states``: a model whose peak is model states, not activations (about 21M
parameters: embedding 4096x1024 tied as the output head and four 1024<->4096 linears;
micro-batch 2 x 8 tokens, accumulation 2; AdamW; 2 ranks), fp32 and bf16, stock ZeRO-1 and
ACCO side by side: peak RSS of each rank and, on rank 0, RSS at phases (after initialize, after
the first backward, after the first optimizer step, end), against the budget
ACCO - stock <= 1.5 x bN + 64 MB. It runs ``benchmarks/memory_probe.py``'s workers (that script
also attributes the bytes to buffers); results go to benchmarks/results/memory_states.json.
An activation-heavy peak (the GPT) hides ACCO's buffers; this one does not.

Stock ZeRO-1 has no stage-1 path for bf16 + fp32 accumulation (DeepSpeed
switches to BF16_Optimizer); that row compares with stock bf16 ZeRO-1.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [  # (label, model dtype, grad_accum_dtype)
    ("fp32", "fp32", None),
    ("bf16", "bf16", None),
    ("bf16, grad_accum_dtype fp32", "bf16", "fp32"),
]


def config_for(dtype, accum, acco, micro=None, gas=None):
    cfg = json.load(open(ROOT / "configs/acco_cpu.json"))
    if micro:
        cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = micro, gas
    cfg["acco"]["kernels"] = "auto"
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if accum:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    if not acco:
        cfg.pop("acco")
    return cfg


def run(cfg, args, tmp, name, model=None):
    path = os.path.join(tmp, f"{name}.json")
    json.dump(cfg, open(path, "w"))
    out = os.path.join(tmp, f"{name}_result.json")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(args.port),
           str(ROOT / "benchmarks/train_worker.py"), "--deepspeed_config", path, "--steps", str(args.steps),
           "--results", out] + (model or ["--n_layer", str(args.n_layer), "--n_embd", str(args.n_embd), "--n_head",
                                         "8", "--eval_interval", "1000", "--eval_batches", "2", "--corpus_bytes",
                                         "2000000"])
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), OMP_NUM_THREADS="1")
    subprocess.run(cmd, env=env, check=True, timeout=1200, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(out))


def convergence(args):
    """The quickstart GPT, same data and steps, ACCO with bf16 vs fp32 gradient accumulation (and fp32).

    Micro-batch 2 x 16 accumulation (8 micro-batches per round): with 2 per round both accumulations round
    once (a bf16 add rounds the fp32 sum) and agree exactly, so that would show nothing."""
    import torch
    tmp = tempfile.mkdtemp()
    model = ["--eval_interval", str(max(args.steps // 5, 1)), "--eval_batches", "8"]
    rows = []
    for label, dtype, accum in [("fp32 model", "fp32", None), ("bf16 model, bf16 accumulation", "bf16", None),
                                ("bf16 model, fp32 accumulation", "bf16", "fp32")]:
        r = run(config_for(dtype, accum, acco=True, micro=2, gas=16), args, tmp, f"conv_{dtype}_{accum}", model)
        rows.append({"case": label, "history": r["history"], "final_val_loss": r["final_val_loss"],
                     "final_train_loss": r["final_train_loss"], "skipped_steps": r["skipped_steps"]})
    steps = [h["step"] for h in rows[0]["history"]]
    print(f"\nACCO (acco/fixed), quickstart GPT (examples/train_gpt.py defaults), 2 CPU ranks, micro-batch 2 x 16 "
          f"accumulation (8 per round), {args.steps} steps, same data; validation loss by step; torch "
          f"{torch.__version__}")
    print("| run | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for r in rows:
        print(f"| {r['case']} | " + " | ".join(f"{h['val_loss']:.3f}" for h in r["history"]) + " |")
    cmd = f"python benchmarks/memory.py --convergence --steps {args.steps}"
    print(f"command: {cmd}")
    out = Path(args.out).with_name("memory_convergence.json")
    json.dump({"rows": rows, "command": cmd, "torch": torch.__version__}, open(out, "w"), indent=1)


def states_workload(args):
    """The model-states workload (see the module docstring), fp32 and bf16, stock vs ACCO."""
    import torch

    import memory_probe as probe
    tmp = tempfile.mkdtemp(prefix="acco_memstates_")
    rows, port = [], args.port
    for dtype in ("fp32", "bf16"):
        stock = probe.launch("stock", dtype, args.steps, "", port, tmp)
        acco = probe.launch("acco", dtype, args.steps, "", port + 1, tmp)
        port += 2
        n, b = stock[0]["n_params"], 4 if dtype == "fp32" else 2
        budget = (1.5 * b * n) / 2**20 + 64
        rows.append({"dtype": dtype, "n_params": n, "b": b, "bN_mb": b * n / 2**20, "budget_mb": budget,
                     "stock_peak_mb": [r["phases"]["end"]["peak"] / 2**20 for r in stock],
                     "acco_peak_mb": [r["phases"]["end"]["peak"] / 2**20 for r in acco],
                     "phases": {ph: {"stock_rss_mb": stock[0]["phases"][ph]["rss"] / 2**20,
                                     "stock_peak_mb": stock[0]["phases"][ph]["peak"] / 2**20,
                                     "acco_rss_mb": acco[0]["phases"][ph]["rss"] / 2**20,
                                     "acco_peak_mb": acco[0]["phases"][ph]["peak"] / 2**20}
                                for ph in ("after initialize", "after first backward", "after first optimizer step",
                                           "end")},
                     "acco_buffers": acco[0]["buffer_bytes"]})
    n = rows[0]["n_params"]
    print(f"\nModel-states workload: {n / 1e6:.2f}M parameters (embedding 4096x1024 tied head, four 1024<->4096 "
          f"linears), micro-batch 2 x 8 tokens x 2 accumulation, AdamW, 2 ranks (gloo, DS_ACCELERATOR=cpu), "
          f"{args.steps} steps; torch {torch.__version__}, {os.cpu_count()} cores")
    print("| model | bN (MB) | stock peak RSS rank 0 / 1 (MB) | ACCO peak RSS rank 0 / 1 (MB) | "
          "ACCO - stock, worst rank (MB) | ACCO - stock / bN | budget 1.5 bN + 64 (MB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        extra = max(a - s for a, s in zip(r["acco_peak_mb"], r["stock_peak_mb"]))
        r["extra_mb"] = extra
        print(f"| {r['dtype']} | {r['bN_mb']:.0f} | {r['stock_peak_mb'][0]:.0f} / {r['stock_peak_mb'][1]:.0f} | "
              f"{r['acco_peak_mb'][0]:.0f} / {r['acco_peak_mb'][1]:.0f} | {extra:+.0f} | "
              f"{extra / r['bN_mb']:.2f} | {r['budget_mb']:.0f} |")
    print("\nRank 0 by phase, RSS now / peak so far (MB):")
    print("| model | phase | stock | ACCO | ACCO - stock (peak) |")
    print("|---|---|---|---|---|")
    for r in rows:
        for ph, v in r["phases"].items():
            print(f"| {r['dtype']} | {ph} | {v['stock_rss_mb']:.0f} / {v['stock_peak_mb']:.0f} | "
                  f"{v['acco_rss_mb']:.0f} / {v['acco_peak_mb']:.0f} | {v['acco_peak_mb'] - v['stock_peak_mb']:+.0f} |")
    cmd = f"python benchmarks/memory.py --workload states --steps {args.steps}"
    print(f"command: {cmd}")
    out = Path(args.out).with_name("memory_states.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump({"rows": rows, "command": cmd, "torch": torch.__version__, "cores": os.cpu_count()},
              open(out, "w"), indent=1)


def _against_stock(args, world, runs, tmp):
    """Stock ZeRO-1, then each ``(label, probe spec, estimate_memory kwargs)`` of ``runs`` on the model-states
    workload (fp32, ``world`` ranks): peak RSS per rank, measured − stock (worst rank) beside the estimate."""
    import memory_probe as probe
    from acco_ds.memory import estimate_memory
    stock = probe.launch("stock", "fp32", args.steps, "", args.port, tmp, world=world)
    n, rows = stock[0]["n_params"], []
    for i, (label, spec, estimate) in enumerate(runs):
        res = probe.launch(spec, "fp32", args.steps, "", args.port + 1 + i, tmp, world=world)
        est = estimate_memory(params=n, gpus=world, dtype="fp32", verbose=False, **estimate)
        extra = [(a["phases"]["end"]["peak"] - s["phases"]["end"]["peak"]) / 2**20 for a, s in zip(res, stock)]
        rows.append({"run": label, "measured_extra_mb": extra, "estimated_extra_mb": est["extra_bytes"] / 2**20,
                     "peak_mb": [a["phases"]["end"]["peak"] / 2**20 for a in res],
                     "buffers_mb": {k: v / 2**20 for k, v in (res[0]["buffer_bytes"] or {}).items()}})
    stock_peaks = " / ".join(f"{s['phases']['end']['peak'] / 2**20:.0f}" for s in stock)
    return n, rows, stock_peaks


def _save(args, rows, cmd, name):
    import torch
    print(f"command: {cmd}")
    out = Path(args.out).with_name(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump({"rows": rows, "command": cmd, "torch": torch.__version__}, open(out, "w"), indent=1)


def local_sgd_workload(args):
    """The model-states workload on 4 ranks: stock ZeRO-1 vs sync, acco and diloco/co2 with k = 1 and 2,
    measured peak RSS beside ``acco-ds memory``'s estimate (fp32). Without overlap (sync, the local-SGD
    inner steps) no communication buffer is allocated: sync costs what stock costs."""
    import torch
    world = 4
    layouts = (("sync", world), ("acco", world), ("diloco", 1), ("diloco", 2), ("co2", 2))
    runs = [(f"{mode} k={k}", mode if k == world else f"{mode}:{k}", dict(mode=mode, replica_group_size=k))
            for mode, k in layouts]
    n, rows, stock_peaks = _against_stock(args, world, runs, tempfile.mkdtemp(prefix="acco_memlocal_"))
    print(f"\nModel-states workload, {n / 1e6:.2f}M parameters, fp32, {world} ranks (gloo, DS_ACCELERATOR=cpu), "
          f"{args.steps} inner steps, sync_every 2; torch {torch.__version__}, {os.cpu_count()} cores")
    print("| mode | k (replica group) | R | stock peak RSS per rank (MB) | peak RSS per rank (MB) | "
          "measured − stock, worst rank (MB) | acco-ds memory estimate − stock (MB) |")
    print("|---|---|---|---|---|---|---|")
    for (mode, k), r in zip(layouts, rows):
        print(f"| {mode} | {k} | {world // k} | {stock_peaks} | {' / '.join(f'{v:.0f}' for v in r['peak_mb'])} | "
              f"{max(r['measured_extra_mb']):+.0f} | {r['estimated_extra_mb']:+.0f} |")
    _save(args, rows, f"python benchmarks/memory.py --workload states --local --steps {args.steps}",
          "memory_local_sgd.json")


def compression_workload(args):
    """The model-states workload on 2 ranks (fp32): stock ZeRO-1 vs acco and sync, uncompressed and with int8
    rounds (error-feedback residuals: one partition per other rank, fp32), measured peak RSS beside
    ``acco-ds memory``'s estimate."""
    import torch
    comp = {"dtype": "int8", "apply_to": ["rounds"]}
    runs = [(spec, spec, dict(mode=spec.split("+")[0], compression=comp if "+int8" in spec else None))
            for spec in ("acco", "acco+int8", "sync", "sync+int8")]
    n, rows, stock_peaks = _against_stock(args, 2, runs, tempfile.mkdtemp(prefix="acco_memcomp_"))
    print(f"\nModel-states workload, {n / 1e6:.2f}M parameters, fp32, 2 ranks (gloo, DS_ACCELERATOR=cpu), "
          f"{args.steps} steps; torch {torch.__version__}, {os.cpu_count()} cores")
    print("| run | stock peak RSS per rank (MB) | peak RSS per rank (MB) | measured − stock, worst rank (MB) | "
          "acco-ds memory estimate − stock (MB) | residuals allocated (MB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {stock_peaks} | {' / '.join(f'{v:.0f}' for v in r['peak_mb'])} | "
              f"{max(r['measured_extra_mb']):+.0f} | {r['estimated_extra_mb']:+.0f} | "
              f"{r['buffers_mb'].get('residuals', 0):.0f} |")
    _save(args, rows, f"python benchmarks/memory.py --workload states --compression --steps {args.steps}",
          "memory_compression.json")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--n_embd", type=int, default=448)
    p.add_argument("--steps", type=int, default=None, help="default 4 (memory), 150 (--convergence)")
    p.add_argument("--convergence", action="store_true")
    p.add_argument("--local", action="store_true", help="with --workload states: diloco/co2 on 4 ranks, k = 1 and 2")
    p.add_argument("--compression", action="store_true",
                   help="with --workload states: acco and sync with int8 rounds beside uncompressed, 2 ranks")
    p.add_argument("--workload", default="gpt", choices=["gpt", "states"],
                   help="gpt: examples/train_gpt.py (activation-heavy); states: few large layers (model states)")
    p.add_argument("--port", type=int, default=29631)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/memory.json"))
    args = p.parse_args()
    if args.convergence:
        args.steps = args.steps or 150
        return convergence(args)
    args.steps = args.steps or 4
    if args.workload == "states":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        if args.compression:
            return compression_workload(args)
        return local_sgd_workload(args) if args.local else states_workload(args)
    import torch

    from acco_ds.memory import acco_buffer_bytes
    from acco_ds.runtime.rounds.buffers import padded_numel
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import GPT
    n = sum(p.numel() for p in GPT(args.n_layer, 8, args.n_embd, 128).parameters())
    tmp = tempfile.mkdtemp()
    rows = []
    for label, dtype, accum in CASES:
        stock = run(config_for(dtype, None, acco=False), args, tmp, f"stock_{dtype}")
        acco = run(config_for(dtype, accum, acco=True), args, tmp, f"acco_{dtype}_{accum}")
        b = 4 if dtype == "fp32" else 2
        buffers = acco["acco"]["buffer_bytes"]
        formula = acco_buffer_bytes(padded_numel(n, 2), 2, dtype, accum)
        extra = acco["peak_rss_mb"] - stock["peak_rss_mb"]
        budget = (1.25 * b * n if accum is None else 4 * n) / 2**20 + 32
        rows.append({"case": label, "n_params": n, "b": b, "stock_peak_rss_mb": stock["peak_rss_mb"],
                     "acco_peak_rss_mb": acco["peak_rss_mb"], "extra_mb": extra, "budget_mb": budget,
                     "model_mb": b * n / 2**20, "acco_buffers": buffers, "formula_bytes": formula,
                     "stock_peak_cuda_mb": stock.get("peak_cuda_mb"), "acco_peak_cuda_mb": acco.get("peak_cuda_mb"),
                     "stock_final_train_loss": stock["final_train_loss"],
                     "acco_final_train_loss": acco["final_train_loss"]})
    print(f"\nGPT {n / 1e6:.2f}M parameters, 2 ranks (gloo, DS_ACCELERATOR=cpu), {args.steps} steps, "
          f"micro-batch 8 x 4 accumulation, AdamW; torch {torch.__version__}, {platform.processor() or 'cpu'}, "
          f"{os.cpu_count()} cores")
    print("| model | stock ZeRO-1 peak RSS (MB) | ACCO peak RSS (MB) | ACCO - stock (MB) | budget (MB) | "
          "ACCO buffers: accumulator + communication + shards (MB) | formula (MB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        bb = r["acco_buffers"]
        parts = f"{bb['accumulator'] / 2**20:.1f} + {bb['communication'] / 2**20:.1f} + " \
                f"{(bb['shards'] + bb['reduced']) / 2**20:.1f} = {bb['total'] / 2**20:.1f}"
        print(f"| {r['case']} | {r['stock_peak_rss_mb']:.0f} | {r['acco_peak_rss_mb']:.0f} | {r['extra_mb']:+.0f} | "
              f"{r['budget_mb']:.0f} | {parts} | {r['formula_bytes'] / 2**20:.1f} |")
    cmd = f"python benchmarks/memory.py --n_layer {args.n_layer} --n_embd {args.n_embd} --steps {args.steps}"
    print(f"budget: 1.25 x bN + 32 MB (fp32 accumulation on bf16: 4N + 32 MB); command: {cmd}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump({"rows": rows, "command": cmd, "torch": torch.__version__, "cores": os.cpu_count()},
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
