"""Train the small GPT of examples/train_gpt.py with ACCO or local SGD in plain PyTorch: no DeepSpeed, FSDP2 optional.

    torchrun --nproc_per_node 4 examples/fsdp2_train_gpt.py --config configs/fsdp2_diloco_cpu.json --fsdp
    torchrun --nproc_per_node 4 examples/fsdp2_train_gpt.py --config configs/fsdp2_diloco_cpu.json

Same model, same data, same hyperparameters as the DeepSpeed example
``examples/train_gpt.py`` (byte-level GPT on the Python standard library's own
``.py`` files, last 10% held out; AdamW lr 2e-3, betas (0.9, 0.95), weight
decay 0.1 on matrices; DeepSpeed's WarmupCosineLR of configs/*_cpu.json). The
data and model are ``examples/gpt.py``, as there; this script never imports
DeepSpeed.

Read it top to bottom: set-up, training loop, summary. The ACCO lines:

* ``acco_ds.torch.initialize(model, optimizer, config)`` once, after building
  a plain torch optimizer; the loop stays a plain PyTorch loop
  (``(loss / gradient_accumulation_steps).backward()`` per micro-batch, then
  ``optimizer.step()`` and ``optimizer.zero_grad()``);
* ``acco_ds.torch.finalize`` at the end (the last period's sync);
* with ``--fsdp``, each replica of ``k`` ranks (``acco.local_sgd.replica_group_size``)
  shards the model with FSDP2 on its own mesh, ``acco_ds.torch.replica_mesh(k)``.
  That runs the local-SGD modes (diloco, co2, edit). Without ``--fsdp`` the
  plain module runs every mode (acco, dpu, sync, diloco, co2, edit).

``model.eval()`` forward passes see the committed weights (the anchor in the
local-SGD modes), so validation measures the model you would keep.
"""

import argparse
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
import acco_ds.torch  # noqa: E402

from gpt import GPT, Batches, add_model_args, evaluate, load_corpus, param_groups, warmup_cosine  # noqa: E402

# ------------------------------------------------------------------------- training


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="JSON: gradient_accumulation_steps, gradient_clipping, acco")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--fsdp", action="store_true", help="shard each replica with FSDP2 (local-SGD modes)")
    add_model_args(parser)  # --n_layer --n_head --n_embd --block_size --corpus_bytes
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--eval_interval", type=int, default=10, help="steps between validations")
    parser.add_argument("--eval_batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save", default=None, help="write a checkpoint folder here at the end")
    parser.add_argument("--out", default=None, help="write the summary as JSON here (rank 0)")
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR...; gloo on CPU, nccl on GPUs.
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(args.config) as f:
        config = json.load(f)
    acco_cfg = config["acco"]
    mode = acco_cfg.get("mode", "acco")
    gas = config.get("gradient_accumulation_steps", 1)
    micro_bs = config.get("train_micro_batch_size_per_gpu", 8)  # informational for the torch host; we read it

    torch.manual_seed(args.seed)  # the same initial weights on every rank (initialize broadcasts rank 0's anyway)
    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size).to(device)
    n_params = sum(p.numel() for p in model.parameters())

    if args.fsdp:
        # One FSDP2 mesh per replica of k consecutive ranks: FSDP2 shards inside a replica, the outer loop
        # averages across replicas every sync_every steps. Blocks first, then the root (embeddings, ln_f).
        from torch.distributed.fsdp import fully_shard
        k = acco_cfg.get("local_sgd", {}).get("replica_group_size")
        mesh = acco_ds.torch.replica_mesh(k if isinstance(k, int) else None)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    # The ACCO line: the returned optimizer is the one to step, schedule and save.
    model, optimizer = acco_ds.torch.initialize(model, optimizer, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(warmup_num_steps=10, total_num_steps=1000, cos_min_ratio=0.1))  # configs/*_cpu.json's

    train = Batches(data[:split], args.block_size, micro_bs, seed=args.seed + 1 + rank)  # each rank its own stream
    val = Batches(data[split:], args.block_size, micro_bs, seed=args.seed)
    samples_per_step = micro_bs * gas * world
    label = mode + (f" on FSDP2 ({world // mesh.size()} replicas x {mesh.size()} ranks)" if args.fsdp else "")
    if rank == 0:
        print(f"GPT {n_params / 1e6:.2f}M params | {label} | {world} ranks ({device}) | micro-batch {micro_bs} x "
              f"{gas} accumulation | {samples_per_step * args.block_size} tokens/step | {args.steps} steps | "
              f"corpus {len(data) / 1e6:.1f}MB of stdlib source", flush=True)

    first_val_loss = val_loss = evaluate(model, val, args.eval_batches, device)
    micro, losses, eval_time = 0, [], 0.0
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        for _ in range(gas):
            x, y = train.get(micro)
            loss = model(x.to(device), y.to(device))
            (loss / gas).backward()  # ACCO: a round may end here and commit a step
            losses.append(loss.item())
            micro += 1
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % args.eval_interval == 0 or step == args.steps:
            t0 = time.perf_counter()
            val_loss = evaluate(model, val, args.eval_batches, device)
            eval_time += time.perf_counter() - t0
            if rank == 0:
                train_loss = sum(losses[-2 * gas:]) / len(losses[-2 * gas:])
                elapsed = time.perf_counter() - start - eval_time
                print(f"step {step:4d} | train loss {train_loss:.3f} | val loss {val_loss:.3f} | "
                      f"lr {scheduler.get_last_lr()[0]:.2e} | {step * samples_per_step / elapsed:.1f} samples/s",
                      flush=True)

    # The end: commit the last step / sync the last period, then validate the committed weights.
    acco_ds.torch.finalize(model, optimizer)
    elapsed = time.perf_counter() - start - eval_time  # training time, evaluations left out
    val_loss = evaluate(model, val, args.eval_batches, device)
    train_loss = sum(losses[-2 * gas:]) / len(losses[-2 * gas:])
    report = optimizer.acco_report()  # every rank calls it; rank 0 prints its own
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], device=device)  # MB (Linux)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)

    steps, samples = optimizer.global_steps, optimizer.global_steps * samples_per_step
    summary = {"mode": mode, "fsdp": args.fsdp, "world": world, "steps": steps, "samples": samples,
               "tokens": samples * args.block_size, "seconds": elapsed, "samples_per_s": samples / elapsed,
               "first_val_loss": first_val_loss, "val_loss": val_loss, "train_loss": train_loss,
               "peak_rss_mb_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "peak_rss_mb_max": rss.item(), "acco_report": [list(line) for line in report]}
    if rank == 0:
        print("\n==== summary ====")
        print(f"run            : {label} on {world} ranks ({device}), acco_ds.torch, no DeepSpeed")
        print(f"steps / tokens : {steps} / {summary['tokens']:,}")
        print(f"time           : {elapsed:.1f} s  ({summary['samples_per_s']:.1f} samples/s, "
              f"{summary['tokens'] / elapsed:,.0f} tokens/s, {elapsed / max(steps, 1):.3f} s/step)")
        print(f"peak memory    : {summary['peak_rss_mb_rank0']:.0f} MB resident on rank 0, "
              f"{summary['peak_rss_mb_max']:.0f} MB on the largest rank")
        print(f"val loss       : {first_val_loss:.3f} -> {val_loss:.3f} (train {train_loss:.3f}; ln(256) = "
              f"{math.log(256):.3f} is chance)")
        for name, text in report:
            print(f"{name:<15}: {text}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)

    if args.save:  # collective: every rank writes its shard, rank 0 the full weights (model.pt)
        acco_ds.torch.save(args.save, model, optimizer, client_state={"step": args.steps, "micro": micro})
        if rank == 0:
            print(f"checkpoint     : {args.save}", flush=True)
    optimizer.close()
    dist.destroy_process_group()
    assert "deepspeed" not in sys.modules, "this example must run without DeepSpeed"


if __name__ == "__main__":
    main()
