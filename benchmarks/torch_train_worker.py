"""One rank of benchmarks/torch_host.py: the torch-host counterpart of train_worker.py (no DeepSpeed, ever).

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python benchmarks/torch_train_worker.py \
        --config configs/acco_cpu.json --steps 12 --warmup_steps 3 --results out.json

Same GPT, data, held-out batches, optimizer and learning-rate schedule as train_worker.py
(examples/train_gpt.py's; the model and data code is a copy, because train_worker.py and
train_gpt.py import DeepSpeed at module level), same flags where they apply, same JSON record
fields. The DeepSpeed config is read as DeepSpeed reads it: ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``, ``gradient_clipping``, the ``"acco"`` block, ``optimizer.params``
(a torch AdamW: lr, betas, eps, weight decay on matrices only) and ``scheduler.params``
(WarmupCosineLR, as a LambdaLR). Three ways to train:

* default: the plain module, ``acco_ds.torch.initialize`` (every mode: acco, dpu, sync, diloco, co2, edit);
* ``--fsdp``: FSDP2 on ``acco_ds.torch.replica_mesh(k)`` (k = ``--replica_group_size`` or the config's
  ``acco.local_sgd.replica_group_size``), blocks then root, then ``acco_ds.torch.initialize`` (local-SGD modes);
* ``--stock_hsdp``: the baseline, no acco_ds at all: FSDP2 HSDP on
  ``init_device_mesh("cpu", (world // k, k), mesh_dim_names=("replicate", "shard"))``, a plain torch AdamW,
  ``clip_grad_norm_``; gradient accumulation as FSDP2 documents it for HSDP: every micro-batch
  reduce-scatters inside its replica, only the last one of a step all-reduces across the replicas
  (``set_requires_all_reduce``).

The loop is the plain PyTorch one (``(loss / gas).backward()`` per micro-batch, ``optimizer.step()``,
``optimizer.zero_grad()``, ``scheduler.step()``); ``acco_ds.torch.finalize`` at the end, timed.
``--steps`` counts ``optimizer.step()`` calls (``--tokens`` a budget of them). Throughput after
``--warmup_steps``, evaluations excluded; veth/loopback byte counters as train_worker.py reads them
(``harness.link_tx_bytes``); peak RSS ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` per rank.
Race flags as train_worker.py's (``--target_loss``, ``--time_cap_s``) plus ``--min_tokens``: no stop
before that many tokens (so the record also holds the validation at an equal token budget).
"""

import argparse
import json
import math
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
# harness imports no DeepSpeed
from harness import acco_totals, counters_now, link_tx_bytes, lo_tx_bytes, write_counters_after_close  # noqa: E402

from gpt import GPT, Batches, add_model_args, evaluate, load_corpus, param_groups, warmup_cosine  # noqa: E402


def gather(values):
    """``values`` (floats) of every rank, in rank order."""
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


# ------------------------------------------------------------------------------------------ main


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", "--deepspeed_config", dest="config", required=True,
                   help="a DeepSpeed JSON config of configs/ (read as described above)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--tokens", type=int, default=0, help="stop after this many training tokens (overrides --steps)")
    p.add_argument("--mode", choices=["acco", "dpu", "sync", "diloco", "co2", "edit"], default=None)
    p.add_argument("--accumulation", choices=["fixed", "adaptive"], default=None)
    p.add_argument("--sync_every", type=int, default=None, help="local-SGD: inner steps per period (H)")
    p.add_argument("--replica_group_size", type=int, default=None,
                   help="local-SGD: ranks per replica (k); --stock_hsdp: the shard size")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 on acco_ds.torch.replica_mesh(k) (local-SGD modes)")
    p.add_argument("--stock_hsdp", action="store_true", help="the baseline: FSDP2 HSDP, torch AdamW, no acco_ds")
    p.add_argument("--target_loss", type=float, default=None,
                   help="race: stop at the first validation at or below this loss")
    p.add_argument("--time_cap_s", type=float, default=None, help="race: or after this much training time")
    p.add_argument("--min_tokens", type=int, default=0,
                   help="race: no stop before this many tokens, and a validation when they are reached")
    p.add_argument("--compression", choices=["int8", "fp8"], default=None,
                   help="acco.compression.dtype (its default apply_to: what crosses nodes)")
    p.add_argument("--micro_batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--gas", type=int, default=None, help="override gradient_accumulation_steps")
    add_model_args(p)  # --n_layer --n_head --n_embd --block_size --corpus_bytes
    p.add_argument("--eval_interval", type=int, default=10, help="optimizer steps between validations")
    p.add_argument("--eval_batches", type=int, default=8)
    p.add_argument("--warmup_steps", type=int, default=0, help="steps excluded from the throughput figures")
    p.add_argument("--results", default=None, help="write a JSON summary here (rank 0)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout_s", type=float, default=300, help="process group timeout")
    args = p.parse_args()
    if args.fsdp and args.stock_hsdp:
        raise SystemExit("--fsdp and --stock_hsdp exclude each other")

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(args.config) as f:
        config = json.load(f)
    if args.micro_batch:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.gas:
        config["gradient_accumulation_steps"] = args.gas
    acco = config.setdefault("acco", {"enabled": True})
    if args.mode:
        acco["mode"] = args.mode
    if args.accumulation:
        acco["accumulation"] = args.accumulation
    if args.compression:
        acco["compression"] = {"dtype": args.compression}
    local = acco.get("mode") in ("diloco", "co2", "edit")
    if local:  # as train_worker.py: ACCO-only keys dropped, H and k from the flags
        for key in ("accumulation", "max_micro_batches_per_round"):
            acco.pop(key, None)
        acco.setdefault("local_sgd", {})
        if args.sync_every:
            acco["local_sgd"]["sync_every"] = args.sync_every
        if args.replica_group_size:
            acco["local_sgd"]["replica_group_size"] = args.replica_group_size
    k = args.replica_group_size or acco.get("local_sgd", {}).get("replica_group_size") or int(
        os.environ.get("LOCAL_WORLD_SIZE", world))
    micro_bs, gas = config["train_micro_batch_size_per_gpu"], config.get("gradient_accumulation_steps", 1)
    clip = float(config.get("gradient_clipping", 0.0))
    opt = config.get("optimizer", {}).get("params", {})
    sched = config.get("scheduler", {})

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size)
    n_params = sum(p.numel() for p in model.parameters())
    if args.stock_hsdp or args.fsdp:
        from torch.distributed.fsdp import fully_shard
        if args.stock_hsdp:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (world // k, k), mesh_dim_names=("replicate", "shard"))
        else:
            import acco_ds.torch
            mesh = acco_ds.torch.replica_mesh(k)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(param_groups(model, opt.get("weight_decay", 0.0)), lr=opt.get("lr", 1e-3),
                                  betas=tuple(opt.get("betas", (0.9, 0.999))), eps=opt.get("eps", 1e-8))
    if args.stock_hsdp:
        label = f"stock FSDP2 HSDP ({world // k} replicas x {k} shards)"
    else:
        import acco_ds.torch
        host = {key: config[key] for key in ("acco", "gradient_accumulation_steps", "gradient_clipping",
                                             "train_micro_batch_size_per_gpu") if key in config}
        model, optimizer = acco_ds.torch.initialize(model, optimizer, host)
        label = acco.get("mode", "acco") + ("" if local else "/" + acco.get("accumulation", "fixed"))
        label += f" (acco_ds.torch{', FSDP2 on replica_mesh(%d)' % k if args.fsdp else ''})"
    if sched and sched.get("type") != "WarmupCosineLR":
        raise SystemExit(f"scheduler {sched.get('type')}: only WarmupCosineLR is translated")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(**sched.get("params", {})) if sched
                                                  else (lambda s: 1.0))

    train = Batches(data[:split], args.block_size, micro_bs, seed=args.seed + 1 + rank)
    val = Batches(data[split:], args.block_size, micro_bs, seed=args.seed)
    samples_per_step = micro_bs * gas * world
    steps = math.ceil(args.tokens / (samples_per_step * args.block_size)) if args.tokens else args.steps
    min_steps = math.ceil(args.min_tokens / (samples_per_step * args.block_size))
    if rank == 0:
        print(f"GPT {n_params / 1e6:.2f}M params | {label} | {world} ranks | micro-batch {micro_bs} x {gas} "
              f"accumulation | {samples_per_step * args.block_size} tokens/step | {steps} steps | no DeepSpeed",
              flush=True)
    outer = getattr(optimizer, "outer", None)

    history = [{"step": 0, "tokens": 0, "time": 0.0, "val_loss": evaluate(model, val, args.eval_batches)}]
    step_tx, losses, micro, step, eval_time, stop = [], [], 0, 0, 0.0, False
    start = time.perf_counter()
    warm = {"time": start, "step": 0, "stats": None, "tx": link_tx_bytes()}
    run_start = {"tx": warm["tx"], "lo": lo_tx_bytes()}
    end = warm

    def mark():
        return {"time": time.perf_counter() - eval_time, "step": step, "stats": acco_totals(optimizer),
                "tx": link_tx_bytes()}

    while not stop and step < steps:
        for i in range(gas):
            x, y = train.get(micro)
            if args.stock_hsdp:  # HSDP accumulation: all-reduce across replicas on the last micro-batch only
                model.set_requires_all_reduce(i == gas - 1)
            loss = model(x, y)
            (loss / gas).backward()
            losses.append(loss.item())
            micro += 1
        if args.stock_hsdp and clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        step += 1
        tx = link_tx_bytes()
        if tx is not None:
            step_tx.append(tx[0])
        finished = step >= steps
        eval_due = step % args.eval_interval == 0 or finished or step == min_steps
        if eval_due and outer is not None:
            outer.wait()  # a sync in flight is training work: inside the timed window
        if (args.warmup_steps and warm["step"] == 0 and step >= args.warmup_steps) or finished:
            m = mark()
            if warm["step"] == 0 and args.warmup_steps and step >= args.warmup_steps:
                warm = m
            end = m
        elapsed = time.perf_counter() - start - eval_time
        train_loss = sum(losses[-2 * gas:]) / len(losses[-2 * gas:])
        if eval_due:
            t0 = time.perf_counter()
            history.append({"step": step, "tokens": step * samples_per_step * args.block_size, "time": elapsed,
                            "val_loss": evaluate(model, val, args.eval_batches), "train_loss": train_loss})
            eval_time += time.perf_counter() - t0
            if (args.target_loss is not None or args.time_cap_s is not None) and not finished and step >= min_steps:
                hit = ((args.target_loss is not None and history[-1]["val_loss"] <= args.target_loss) or
                       (args.time_cap_s is not None and elapsed >= args.time_cap_s))
                flag = torch.tensor([float(hit)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the ranks' clocks differ a little
                if flag.item() > 0:
                    stop, end = True, mark()
        if rank == 0 and (eval_due or step == 1):
            print(f"step {step:4d} | train loss {train_loss:.3f} | val {history[-1]['val_loss']:.3f} | "
                  f"{step * samples_per_step / max(elapsed, 1e-9):.1f} samples/s", flush=True)

    elapsed, measured = end["time"] - start, end["time"] - warm["time"]
    measured_steps = end["step"] - warm["step"]
    stats = optimizer.acco_stats() if hasattr(optimizer, "acco_stats") else None
    finalize_s, finalized_loss = None, None
    if not args.stock_hsdp:
        t0 = time.perf_counter()
        acco_ds.torch.finalize(model, optimizer)
        finalize_s = time.perf_counter() - t0
    run_end = counters_now()
    if finalize_s is not None:
        finalized_loss = evaluate(model, val, args.eval_batches)
    samples = end["step"] * samples_per_step
    summary = {
        "host": "torch", "label": label, "world_size": world, "steps": end["step"],
        "tokens": samples * args.block_size, "train_time_s": elapsed,
        "tokens_per_s": samples * args.block_size / elapsed, "samples_per_s": samples / elapsed,
        "step_time_s": elapsed / max(end["step"], 1), "first_loss": history[0]["val_loss"],
        "final_val_loss": history[-1]["val_loss"], "finalize_s": finalize_s,
        "final_val_loss_finalized": finalized_loss, "final_train_loss": sum(losses[-2 * gas:]) / len(losses[-2 * gas:]),
        "history": history, "step_tx_bytes": [b - a for a, b in zip(step_tx, step_tx[1:])],
        "micro_batches": micro, "skipped_steps": getattr(optimizer, "skipped_steps", 0),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak_cuda_mb": None,
        "measured_steps": measured_steps, "measured_time_s": measured,
        "measured_samples_per_s": measured_steps * samples_per_step / measured if measured > 0 else None,
        "measured_step_time_s": measured / max(measured_steps, 1),
    }
    summary["peak_rss_mb_per_rank"] = [v[0] for v in gather([summary["peak_rss_mb"]])]
    if end["tx"] is not None and warm["tx"] is not None:
        got = gather([a - b for a, b in zip(end["tx"], warm["tx"])])
        summary["measured_tx_bytes_per_rank"] = [int(t[0]) for t in got]
        summary["measured_tcp_retransmits_per_rank"] = [int(t[1]) for t in got]
    if run_end["tx"] is not None and run_start["tx"] is not None:
        lo = run_end["lo"] - run_start["lo"] if run_end["lo"] is not None and run_start["lo"] is not None else -1
        got = gather([run_end["tx"][0] - run_start["tx"][0], lo])
        summary["run_tx_bytes_per_rank"] = [int(t[0]) for t in got]
        summary["run_lo_tx_bytes_per_rank"] = [int(t[1]) for t in got]
    if stats is not None:
        stats = {key: v for key, v in stats.items() if key != "last_rounds"}
        stats["micro_batches_per_rank"] = [int(v[0]) for v in gather([micro])]
        if warm["stats"] is not None and end["stats"] is not None:
            stats["measured"] = {key: end["stats"][key] - warm["stats"][key] for key in end["stats"]}
        stats["lines"] = optimizer.acco_report()
        summary["acco"] = stats
    if rank == 0:
        print(f"\n==== summary ====\nrun            : {label} on {world} ranks (cpu), no DeepSpeed\n"
              f"steps / tokens : {summary['steps']} / {summary['tokens']:,}\n"
              f"time           : {elapsed:.1f} s ({summary['samples_per_s']:.1f} samples/s; after warm-up "
              f"{summary['measured_samples_per_s'] or 0:.1f})\n"
              f"peak memory    : {max(summary['peak_rss_mb_per_rank']):.0f} MB resident on the largest rank\n"
              f"val loss       : {summary['first_loss']:.3f} -> {summary['final_val_loss']:.3f}"
              + (f" (after finalize {finalized_loss:.3f})" if finalized_loss is not None else ""), flush=True)
        for name, text in (summary.get("acco") or {}).get("lines", []):
            print(f"{name:<15}: {text}")
        if args.results:
            os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
            with open(args.results, "w") as f:
                json.dump(summary, f, indent=1, default=str)
            print(f"results        : {args.results}", flush=True)
    if hasattr(optimizer, "close"):
        optimizer.close()
    write_counters_after_close(args.results, rank, run_start)
    dist.barrier()
    dist.destroy_process_group()
    assert "deepspeed" not in sys.modules, "torch_train_worker.py must run without DeepSpeed"
    if args.stock_hsdp:
        assert "acco_ds.torch" not in sys.modules, "--stock_hsdp must not use acco_ds"


if __name__ == "__main__":
    main()
