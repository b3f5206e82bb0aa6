"""Train a small GPT with ACCO, on the Python standard library's own source code.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config configs/acco_cpu.json

Read it top to bottom: the training loop and the summary; the model and the data are
``examples/gpt.py`` (shared with the PyTorch/FSDP2 example). The only ACCO-specific
lines are ``acco_ds.initialize`` (instead of ``deepspeed.initialize``) and the
``"acco"`` block in the JSON config; everything else is a plain DeepSpeed
script (forward, ``engine.backward``, ``engine.step`` every micro-batch).

The corpus needs no download: the ``.py`` files of the running Python's
standard library, read as bytes (a 256-token vocabulary). The last 10% is
held out for validation.

(The cluster benchmark trains this same model on this same data with
``benchmarks/train_worker.py``, which adds what a measurement needs: bytes
on the wire, warm-up exclusion, a slowed rank, a JSON record.)
"""

import argparse
import json
import math
import os
import resource
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
import deepspeed  # noqa: E402

import acco_ds  # noqa: E402

from gpt import GPT, Batches, add_model_args, load_corpus, param_groups  # noqa: E402,F401 - re-exported

# ------------------------------------------------------------------------- training


@torch.no_grad()
def evaluate(engine, batches, n_batches, device):
    """Mean validation loss over fixed batches, split across ranks."""
    engine.eval()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    total = torch.zeros(2, device=device)
    for i in range(rank, n_batches, world):
        x, y = batches.get(i)
        total += torch.tensor([float(engine(x.to(device), y.to(device))), 1.0], device=device)
    deepspeed.comm.all_reduce(total)
    engine.train()
    return (total[0] / total[1]).item()


def run_label(config):
    """"acco/fixed", "dpu/adaptive", "diloco", "edit (A-EDiT)" ... or "stock ZeRO-1" (plain DeepSpeed)."""
    acco = config.get("acco", {})
    if not acco.get("enabled"):
        return "stock ZeRO-1"
    mode = acco.get("mode", "acco")
    if mode in ("diloco", "co2", "edit", "sparseloco", "decoupled"):  # the local-SGD family: synced every period
        return mode + (" (A-EDiT)" if "sync_time_s" in acco.get("local_sgd", {}) else "") + \
            (" (fault-tolerant replica)" if "fault_tolerance" in acco else "")
    return mode + "/" + acco.get("accumulation", "fixed")


def gather_counts(value, device):
    """``value`` of every rank, in rank order."""
    mine = torch.tensor([float(value)], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(deepspeed.comm.get_world_size())]
    deepspeed.comm.all_gather(every, mine)
    return [int(t.item()) for t in every]


def print_summary(label, world, device, steps, tokens, seconds, first_val_loss, val_loss, train_loss, acco=None):
    """The block the quickstart prints (rank 0); ``acco``: the mode's own lines (``engine.acco_report()``)
    and the micro-batches each rank trained on."""
    print("\n==== summary ====")
    print(f"run            : {label} on {world} ranks ({device})")
    print(f"steps / tokens : {steps} / {tokens:,}")
    if seconds > 0:
        print(f"time           : {seconds:.1f} s  ({tokens / seconds:,.0f} tokens/s, "
              f"{seconds / max(steps, 1):.3f} s/step)")
    else:  # a fault-tolerant replica that joined (and healed) after the target was reached
        print("time           : 0.0 s  (this process trained no step: the run had reached its target when it joined)")
    print(f"peak memory    : {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB resident on rank 0")
    print(f"val loss       : {first_val_loss:.3f} -> {val_loss:.3f} (train {train_loss:.3f}; ln(256) = "
          f"{math.log(256):.3f} is chance)" if train_loss == train_loss else
          f"val loss       : {first_val_loss:.3f} -> {val_loss:.3f} (no training step here)")
    if acco is not None:
        for name, text in acco["lines"]:
            print(f"{name:<15}: {text}")
        print(f"micro-batches  : per rank {acco['micro_batches_per_rank']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--syncs", type=int, default=6, help="A-EDiT only: outer syncs to train for")
    add_model_args(parser)  # --n_layer --n_head --n_embd --block_size --corpus_bytes
    parser.add_argument("--eval_interval", type=int, default=10, help="steps between validations")
    parser.add_argument("--eval_batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed_config
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    with open(args.deepspeed_config) as f:
        config = json.load(f)

    torch.manual_seed(args.seed)
    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size)
    weight_decay = config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
    # The one ACCO line: acco_ds.initialize instead of deepspeed.initialize (same arguments, same results).
    engine, _, _, _ = acco_ds.initialize(model=model, model_parameters=param_groups(model, weight_decay),
                                         config=config)
    device = engine.device
    micro_bs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    # Each rank its own stream; with fault tolerance each launch is one replica (REPLICA_GROUP_ID), so its
    # ranks are numbered after the earlier replicas' ranks.
    replica = int(os.environ.get("REPLICA_GROUP_ID", 0)) if "fault_tolerance" in config.get("acco", {}) else 0
    train = Batches(data[:split], args.block_size, micro_bs, seed=args.seed + 1 + replica * world + rank)
    val = Batches(data[split:], args.block_size, micro_bs, seed=args.seed)
    tokens_per_step = micro_bs * gas * world * args.block_size
    label = run_label(config)
    # A-EDiT syncs on wall time: replicas run different step counts, so the loop counts syncs, which every
    # rank agrees on (a loop on global_steps would leave ranks waiting for each other's collectives). So does a
    # fault-tolerant replica, which may join late: syncs count the global model's, whoever took part.
    timed = label.endswith("(A-EDiT)") or label.endswith("replica)")
    target = args.syncs if timed else args.steps

    def progress():
        return engine.acco_syncs if timed else engine.global_steps

    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"GPT {n_params / 1e6:.2f}M params | {label} | {world} ranks | micro-batch {micro_bs} x "
              f"{gas} accumulation | {tokens_per_step} tokens/step | {target} {'syncs' if timed else 'steps'} | corpus "
              f"{len(data) / 1e6:.1f}MB of stdlib source", flush=True)

    first_val_loss = val_loss = evaluate(engine, val, args.eval_batches, device)
    bar = tqdm(total=target, unit="sync" if timed else "step", dynamic_ncols=True) if rank == 0 else None
    micro, losses, eval_time = 0, [], 0.0
    elapsed, train_loss = 0.0, float("nan")  # stay so if a late fault-tolerant replica heals past the target
    start = time.perf_counter()
    while progress() < target:
        x, y = train.get(micro)
        before, done_before = engine.global_steps, progress()
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)  # with ACCO, a round may end here and commit a step
        engine.step()
        micro += 1
        losses.append(loss.item())
        if engine.global_steps == before:
            continue
        # A step was committed: the module holds the new parameters.
        elapsed = time.perf_counter() - start - eval_time  # training time, evaluations left out
        train_loss = sum(losses[-2 * gas:]) / len(losses[-2 * gas:])
        done = progress()
        if done != done_before and (done % args.eval_interval == 0 or done == target or timed):
            t0 = time.perf_counter()
            val_loss = evaluate(engine, val, args.eval_batches, device)
            eval_time += time.perf_counter() - t0
        if bar is not None:
            bar.update(done - done_before)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{engine.global_steps * tokens_per_step / elapsed:,.0f}")
    if bar is not None:
        bar.close()

    # Summary
    acco, micro_per_rank = None, gather_counts(micro, device)
    if hasattr(engine, "acco_report"):  # an ACCO engine (the "acco" block was enabled): the mode's own lines
        acco = {"lines": engine.acco_report(), "micro_batches_per_rank": micro_per_rank}
    # Tokens of the committed steps; A-EDiT's replicas ran different step counts: every micro-batch trained.
    tokens = (sum(micro_per_rank) * micro_bs * args.block_size if timed else
              engine.global_steps * tokens_per_step)
    if rank == 0:
        print_summary(label, world, device, engine.global_steps, tokens, elapsed, first_val_loss, val_loss,
                      train_loss, acco)
    engine.destroy()


if __name__ == "__main__":
    main()
