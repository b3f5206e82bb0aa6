"""Muon against AdamW as the inner optimizer of diloco and sparseloco, on the CPU.

    python benchmarks/muon_race.py [--steps 64] [--sync_every 4] [--eval_every 4] [--out benchmarks/results/muon_race.json]

Two gloo ranks on this machine, two replicas of one rank each (``replica_group_size`` 1: Muon needs every
matrix whole on its rank), the quickstart GPT of ``examples/gpt.py`` (4 layers, 128 wide, 0.84M parameters,
byte-level stdlib corpus) and the sparse race's batch (``configs/diloco_cpu.json``: micro-batch 8 x 128 tokens,
4 micro-batches per rank per inner step, clipping 1.0, WarmupCosineLR over 1000 steps with 10 of warm-up).
AdamW: lr 0.002, betas (0.9, 0.95), weight decay 0.1 on matrices. Muon: DeepSpeed's ``"type": "Muon"`` with
``muon_lr`` 0.02, momentum 0.95, and ``adam_lr`` 0.002 with the same betas for the rest; weight decay 0.1 on
matrices, 0 on biases and norms (the same groups as AdamW). DeepSpeed puts a matrix on AdamW only when its name
holds ``embed`` or ``lm_head``; the GPT's token embedding (also the tied output head) and position embedding
are ``tok`` and ``pos``, so the script registers them as ``tok_embed`` and ``pos_embed``: embeddings and the
head stay on AdamW, as Muon users run it. Every run starts from the same weights and draws the same batches.

Every ``--eval_every`` inner steps rank 0 and 1 evaluate the committed model (the anchor) on the same 8
held-out batches. Target: diloco + AdamW's final validation loss (the baseline); per run the inner steps and
tokens to reach it, and the final validation loss. Prints a table, writes the JSON record.
"""

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, Batches, evaluate, load_corpus, param_groups  # noqa: E402

ADAMW = {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                     "torch_adam": True}}
MUON = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 0.002, "momentum": 0.95, "betas": [0.9, 0.95],
                                   "eps": 1e-8, "weight_decay": 0.1}}
SPARSE = {"chunk": 4096, "topk": 64, "error_decay": 0.95, "value_bits": 2}  # sparseloco's defaults
RUNS = [("diloco + AdamW", "diloco", ADAMW), ("diloco + Muon", "diloco", MUON),
        ("sparseloco + AdamW", "sparseloco", ADAMW), ("sparseloco + Muon", "sparseloco", MUON)]
MICRO_BS, GAS, BLOCK, SEED = 8, 4, 128, 1234


class RaceGPT(GPT):
    """``examples/gpt.py``'s GPT with its embeddings registered under names holding ``embed`` (DeepSpeed's
    rule for what Muon leaves to AdamW); the forward pass is the same."""

    def __init__(self):
        super().__init__()
        self.tok_embed, self.pos_embed = self._modules.pop("tok"), self._modules.pop("pos")

    tok = property(lambda self: self.tok_embed)
    pos = property(lambda self: self.pos_embed)


def config(mode, optimizer, sync_every):
    local = {"sync_every": sync_every, "replica_group_size": 1, **(SPARSE if mode == "sparseloco" else {})}
    return {"train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
            "steps_per_print": 1_000_000, "zero_optimization": {"stage": 1}, "optimizer": optimizer,
            "scheduler": {"type": "WarmupCosineLR",
                          "params": {"total_num_steps": 1000, "warmup_num_steps": 10, "cos_min_ratio": 0.1}},
            "acco": {"enabled": True, "mode": mode, "local_sgd": local}}


def rank_main(rank, port, cfg, steps, eval_every, queue):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import acco_ds
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(SEED)
    data = load_corpus(8_000_000)
    split = int(0.9 * len(data))
    model = RaceGPT()
    engine, _, _, _ = acco_ds.initialize(model=model, model_parameters=param_groups(model, 0.1), config=cfg)
    train = Batches(data[:split], BLOCK, MICRO_BS, seed=SEED + 1 + rank)
    val = Batches(data[split:], BLOCK, MICRO_BS, seed=SEED)
    history = [{"step": 0, "val_loss": evaluate(engine, val, 8)}]
    micro, start = 0, time.perf_counter()
    while engine.global_steps < steps:
        x, y = train.get(micro)
        micro += 1
        engine.backward(engine(x, y))
        engine.step()
        if engine.global_steps % eval_every == 0 and engine.global_steps != history[-1]["step"]:
            history.append({"step": engine.global_steps, "val_loss": evaluate(engine, val, 8)})
    train_s = time.perf_counter() - start
    engine.acco_finalize()
    final = evaluate(engine, val, 8)
    engine.destroy()
    if rank == 0:
        queue.put({"history": history, "final_val_loss": final, "train_s": train_s})


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cfg, steps, eval_every):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, cfg, steps, eval_every, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return out


def reach(history, target):
    return next((p["step"] for p in history if p["val_loss"] <= target), None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64, help="inner steps per run")
    ap.add_argument("--sync_every", type=int, default=4)
    ap.add_argument("--eval_every", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "muon_race.json"))
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    results, t0 = [], time.time()
    for label, mode, optimizer in RUNS:
        r = run(config(mode, optimizer, args.sync_every), args.steps, args.eval_every)
        results.append({"run": label, "config": config(mode, optimizer, args.sync_every), **r})
        print(f"{label}: final validation loss {r['final_val_loss']:.4f} ({r['train_s']:.1f} s)", flush=True)
    target = results[0]["final_val_loss"]
    tokens_per_step = MICRO_BS * GAS * 2 * BLOCK
    lines = [f"Target: diloco + AdamW's final validation loss {target:.4f} after {args.steps} inner steps "
             f"({args.steps * tokens_per_step:,} tokens), H = {args.sync_every}, 2 replicas of 1 rank.", "",
             "| run | inner steps to target | tokens to target | validation loss at step "
             f"{args.steps // 2} | final validation loss | training time (s) |", "|---|---|---|---|---|---|"]
    for r in results:
        step = reach(r["history"], target)
        r["steps_to_target"] = step
        mid = next((p["val_loss"] for p in r["history"] if p["step"] == args.steps // 2), float("nan"))
        lines.append(f"| {r['run']} | {step if step is not None else 'not reached'} | "
                     f"{'–' if step is None else f'{step * tokens_per_step:,}'} | {mid:.4f} | "
                     f"{r['final_val_loss']:.4f} | {r['train_s']:.1f} |")
    text = "\n".join(lines)
    print(text)
    record = {"command": "python " + " ".join(sys.argv), "target": target, "tokens_per_step": tokens_per_step,
              "steps": args.steps, "sync_every": args.sync_every, "runs": results, "table": text,
              "wall_s": time.time() - t0, "torch": torch.__version__}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
