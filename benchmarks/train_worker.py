"""One rank of the cluster benchmark (benchmarks/cluster.py): the quickstart GPT of
examples/train_gpt.py (same model, data and summary, imported from there), plus what a
measurement needs.

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python benchmarks/train_worker.py \
        --deepspeed_config configs/acco_cpu.json --steps 12 --warmup_steps 3 --results out.json

What it adds to the example:

* ``--mode`` / ``--accumulation`` override the config's acco block (``--mode zero1`` removes it:
  stock DeepSpeed; ``--mode diloco|co2|edit`` with ``--sync_every H --replica_group_size k`` the local-SGD
  modes, ACCO-only keys dropped; ``--mode edit --sync_time_s T`` A-EDiT (the run lasts ``--tokens``
  counted from the step counts exchanged at each sync, or ``--until_syncs S``), which evaluates every
  ``--eval_syncs`` syncs; ``--penalty`` EDiT's pseudo-gradient penalty); ``--tokens`` sets the run's length as a token budget (the run stops at
  the first committed step whose samples reach it, so adaptive steps of more micro-batches run fewer steps).
* ``--warmup_steps``: the throughput figures (``measured_*``) leave the first steps out; the window
  runs from commit to commit, evaluations excluded.
* Bytes on the wire: when gloo is bound to one interface (GLOO_SOCKET_IFNAME, a veth of
  ``harness.Network``), each rank reads its interface's tx counter and TCP retransmits at both ends of
  the measured window, and rank 0 all-gathers them (``measured_tx_bytes_per_rank``). The same counters
  and the loopback's are also read before the first step and after the engine's finalize (the last
  synchronisation), so ``run_tx_bytes_per_rank`` / ``run_lo_tx_bytes_per_rank`` hold every byte of the
  training loop (two ranks in one namespace read the same counters).
* ACCO engines are finalized (``acco_finalize``) before the summary: ``finalize_s`` and the validation
  loss of the model the run delivers (``final_val_loss_finalized``); ``acco_stats()`` is read before it.
* ``--slow_rank R --slow_factor F`` (benchmark only): rank R's micro-batches take F times as long. ACCO
  runs get the engine's ``acco.emulation`` block; stock DeepSpeed has none, so this loop sleeps
  (F - 1) x the micro-batch's compute time after its backward, the same way.
* ``--spike_rank R --spike_from a --spike_steps n`` (benchmark only): rank R's replica trains on
  shuffled labels for inner steps a .. a+n-1 (an adversarial period).
* ``--results``: a JSON record (rank 0): throughput, losses and validation history, ACCO round
  figures, per-rank micro-batch counts, peak memory.
"""

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_gpt import (GPT, Batches, add_model_args, evaluate, gather_counts, load_corpus,  # noqa: E402
                       param_groups, print_summary, run_label)

import deepspeed  # noqa: E402
from harness import acco_totals, counters_now, link_tx_bytes, lo_tx_bytes, write_counters_after_close  # noqa: E402
from tqdm import tqdm  # noqa: E402

import acco_ds  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--steps", type=int, default=30, help="committed optimizer steps")
    parser.add_argument("--tokens", type=int, default=0,
                        help="stop after this many training tokens (overrides --steps)")
    parser.add_argument("--mode", choices=["acco", "dpu", "sync", "zero1", "diloco", "co2", "edit", "sparseloco"],
                        default=None,
                        help="override the config's acco.mode; zero1 removes the acco block (stock DeepSpeed)")
    parser.add_argument("--accumulation", choices=["fixed", "adaptive"], default=None)
    parser.add_argument("--sync_every", type=int, default=None, help="diloco/co2: inner steps per period (H)")
    parser.add_argument("--replica_group_size", type=int, default=None, help="diloco/co2: ranks per replica (k)")
    parser.add_argument("--sync_time_s", type=float, default=None,
                        help="edit: A-EDiT, sync on wall time; the run lasts --tokens or --until_syncs syncs")
    parser.add_argument("--until_syncs", type=int, default=None, help="A-EDiT: outer syncs to run")
    parser.add_argument("--eval_syncs", type=int, default=2, help="A-EDiT: syncs between validations")
    parser.add_argument("--penalty", choices=["none", "anomaly", "all"], default="none",
                        help="edit: EDiT's pseudo-gradient penalty (anomaly: elimination only; all: anomaly "
                             "elimination, norm weighting, clip of the average at 1.0)")
    parser.add_argument("--spike_rank", type=int, default=-1,
                        help="benchmark only: this rank's replica trains on shuffled labels for --spike_steps")
    parser.add_argument("--spike_from", type=int, default=0, help="first inner step of the spike")
    parser.add_argument("--spike_steps", type=int, default=0)
    parser.add_argument("--target_loss", type=float, default=None,
                        help="race: stop at the first validation of the committed model at or below this loss")
    parser.add_argument("--time_cap_s", type=float, default=None,
                        help="race: or at the first validation after this much training time (evaluations excluded)")
    parser.add_argument("--collectives", choices=["auto", "flat", "hierarchical"], default=None,
                        help='acco.collectives.layout ("auto": hierarchical with more than one node of several ranks)')
    parser.add_argument("--fragments", type=int, default=None, help="diloco: Streaming DiLoCo fragments (F)")
    parser.add_argument("--fragment_sync_delay", type=int, default=None, help="Streaming DiLoCo: τ")
    parser.add_argument("--fragment_update_alpha", type=float, default=None, help="Streaming DiLoCo: α")
    parser.add_argument("--overlap", type=int, default=None, help="sparseloco: the gather behind N inner steps")
    parser.add_argument("--entropy_coding", choices=["zlib", "none"], default=None, help="sparseloco's coding")
    parser.add_argument("--compression", choices=["int8", "fp8"], default=None,
                        help="acco.compression.dtype (what crosses nodes is compressed: apply_to auto)")
    parser.add_argument("--no_error_feedback", action="store_true", help="acco.compression.error_feedback false")
    parser.add_argument("--compression_block", type=int, default=None, help="acco.compression.block_size")
    parser.add_argument("--micro_batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    parser.add_argument("--gas", type=int, default=None, help="override gradient_accumulation_steps")
    add_model_args(parser)  # --n_layer --n_head --n_embd --block_size --corpus_bytes
    parser.add_argument("--eval_interval", type=int, default=10, help="committed steps between validations")
    parser.add_argument("--eval_batches", type=int, default=8)
    parser.add_argument("--warmup_steps", type=int, default=0, help="steps excluded from the throughput figures")
    parser.add_argument("--slow_rank", type=int, default=-1, help="benchmark only: slow this rank's compute")
    parser.add_argument("--slow_factor", type=float, default=1.0)
    parser.add_argument("--results", default=None, help="write a JSON summary here (rank 0)")
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.micro_batch:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.gas:
        config["gradient_accumulation_steps"] = args.gas
    if args.mode == "zero1":
        config.pop("acco", None)
    elif args.mode or args.accumulation or (args.slow_factor > 1 and "acco" in config):
        config.setdefault("acco", {"enabled": True})
        if args.mode:
            config["acco"]["mode"] = args.mode
        if args.accumulation:
            config["acco"]["accumulation"] = args.accumulation
        if args.collectives:
            config["acco"]["collectives"] = {"layout": args.collectives}
        if args.compression:
            config["acco"]["compression"] = {"dtype": args.compression}
            if args.no_error_feedback:
                config["acco"]["compression"]["error_feedback"] = False
            if args.compression_block:
                config["acco"]["compression"]["block_size"] = args.compression_block
        if args.slow_factor > 1:
            config["acco"]["emulation"] = {"slow_rank": args.slow_rank, "slow_factor": args.slow_factor}
        if config["acco"].get("mode") in ("diloco", "co2", "edit", "sparseloco"):
            for key in ("accumulation", "max_micro_batches_per_round"):  # ACCO-only keys are rejected there
                config["acco"].pop(key, None)
            local = config["acco"].setdefault("local_sgd", {})
            if args.sync_every:
                local["sync_every"] = args.sync_every
            if args.sync_time_s:
                local["sync_time_s"] = args.sync_time_s
            if args.replica_group_size:
                local["replica_group_size"] = args.replica_group_size
            for key in ("fragments", "fragment_sync_delay", "fragment_update_alpha", "overlap"):
                if getattr(args, key) is not None:
                    local[key] = getattr(args, key)
            if args.entropy_coding:
                local["entropy_coding"] = None if args.entropy_coding == "none" else args.entropy_coding
            if args.penalty != "none":
                local["anomaly"] = {"enabled": True, "warmup_syncs": 3}
            if args.penalty == "all":
                local.update(weighting="norm", pseudo_grad_clip=1.0)
    args.deepspeed_config = None  # the dict below is the config now

    torch.manual_seed(args.seed)
    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size)
    opt_params = config.get("optimizer", {}).get("params", {})
    engine, _, _, _ = acco_ds.initialize(args=args, model=model,
                                         model_parameters=param_groups(model, opt_params.get("weight_decay", 0.0)),
                                         config=config)
    device = engine.device
    micro_bs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    train = Batches(data[:split], args.block_size, micro_bs, seed=args.seed + 1 + rank)
    val = Batches(data[split:], args.block_size, micro_bs, seed=args.seed)
    tokens_per_step = micro_bs * gas * world * args.block_size
    steps = math.ceil(args.tokens / tokens_per_step) if args.tokens else args.steps
    samples_goal = math.ceil(args.tokens / args.block_size) if args.tokens else None

    timed = args.sync_time_s is not None  # A-EDiT: replicas run different step counts, syncs agree

    def samples():
        """Samples trained so far over all replicas (A-EDiT: from the step counts exchanged at each sync)."""
        if not timed:
            return engine.global_samples
        outer = engine.optimizer.outer.stats()
        return micro_bs * gas * outer["replica_group_size"] * sum(sum(h["steps"]) for h in outer["sync_history"])

    race = {"stop": False}  # --target_loss / --time_cap_s reached, agreed by every rank at a validation

    def done():
        if race["stop"]:
            return True
        # A token budget: adaptive steps hold more samples than tokens_per_step; A-EDiT's samples() moves
        # only when a sync's step counts arrive, the same on every rank.
        if samples_goal is not None:
            return samples() >= samples_goal
        return engine.acco_syncs >= args.until_syncs if timed else engine.global_steps >= steps
    label = run_label(config)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"GPT {n_params / 1e6:.2f}M params | {label} | {world} ranks | micro-batch {micro_bs} x "
              f"{gas} accumulation | {tokens_per_step} tokens/step | {steps} steps | corpus {len(data) / 1e6:.1f}MB "
              f"of stdlib source", flush=True)

    history = [{"step": 0, "tokens": 0, "time": 0.0, "val_loss": evaluate(engine, val, args.eval_batches, device)}]
    step_tx = []
    bar = tqdm(total=steps, unit="step", dynamic_ncols=True) if rank == 0 else None
    # Benchmark only: stock DeepSpeed has no ACCO emulation block, so slow its rank here, the same way.
    slow_here = args.slow_factor > 1 and rank == args.slow_rank and not config.get("acco", {}).get("enabled")
    micro, losses, eval_time = 0, [], 0.0
    start = time.perf_counter()
    warm = {"time": start, "step": 0, "samples": 0, "stats": None, "tx": link_tx_bytes()}
    run_start = {"tx": warm["tx"], "lo": lo_tx_bytes()}
    end = warm
    spiked = args.spike_steps and rank // (world // engine.optimizer.replicas) == args.spike_rank // (
        world // engine.optimizer.replicas)
    last_sync = 0
    while not done():
        x, y = train.get(micro)
        if spiked and args.spike_from <= engine.global_steps < args.spike_from + args.spike_steps:
            y = y.flatten()[torch.randperm(y.numel())].view_as(y)  # shuffled labels: an adversarial period
        before = engine.global_steps
        t0 = time.perf_counter()
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)  # with ACCO, a round may end here and commit a step
        if slow_here:
            time.sleep((args.slow_factor - 1) * (time.perf_counter() - t0))
        engine.step()
        micro += 1
        losses.append(loss.item())
        if engine.global_steps == before:
            continue
        tx_now = link_tx_bytes()
        if tx_now is not None:  # per inner step: the veth counter after it (peak bytes per step)
            step_tx.append(tx_now[0])
        finished = done()
        # A-EDiT evaluates after every --eval_syncs syncs (a step count is not the same on every rank).
        eval_due = (engine.acco_syncs >= last_sync + args.eval_syncs if timed else
                    engine.global_steps % args.eval_interval == 0) or finished
        if eval_due and hasattr(engine.optimizer, "outer"):
            # edit's sync may still be in flight: finish it inside the timed window (it is training work, and
            # A-EDiT's step counts come with it), not inside the evaluation's excluded time.
            engine.optimizer.outer.wait()
            finished = done()  # A-EDiT: the sync's step counts may complete the budget
        # A step was committed: the module holds the new parameters.
        first_after_warmup = args.warmup_steps and warm["step"] == 0 and engine.global_steps >= args.warmup_steps
        if first_after_warmup or finished:
            # The measured window runs from commit to commit (a final evaluation, which waits for the round
            # already in flight and may commit it, stays outside).
            mark = {"time": time.perf_counter() - eval_time, "step": engine.global_steps,
                    "samples": samples(), "stats": acco_totals(engine), "tx": link_tx_bytes()}
            if first_after_warmup:
                warm = mark
            end = mark
        elapsed = time.perf_counter() - start - eval_time
        tokens = samples() * args.block_size
        train_loss = sum(losses[-2 * gas:]) / len(losses[-2 * gas:])
        if eval_due:
            last_sync = engine.acco_syncs if timed else 0
            t0 = time.perf_counter()
            history.append({"step": engine.global_steps, "tokens": tokens, "time": elapsed,
                            "val_loss": evaluate(engine, val, args.eval_batches, device), "train_loss": train_loss})
            eval_time += time.perf_counter() - t0
            if (args.target_loss is not None or args.time_cap_s is not None) and not finished:
                hit = ((args.target_loss is not None and history[-1]["val_loss"] <= args.target_loss) or
                       (args.time_cap_s is not None and elapsed >= args.time_cap_s))
                flag = torch.tensor([float(hit)], device=device)
                deepspeed.comm.all_reduce(flag, op=deepspeed.comm.ReduceOp.MAX)  # ranks' clocks differ a little
                if flag.item() > 0:
                    race["stop"] = True  # the measured window ends here, at this commit
                    end = {"time": time.perf_counter() - eval_time, "step": engine.global_steps,
                           "samples": samples(), "stats": acco_totals(engine), "tx": link_tx_bytes()}
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens / elapsed:,.0f}")
    elapsed = end["time"] - start
    measured = end["time"] - warm["time"]
    measured_steps = end["step"] - warm["step"]
    if bar is not None:
        bar.close()
    # Read the engine's figures before finalize (it ends the period schedule), then finalize: the last
    # synchronisation (local-SGD) or the last commit (ACCO), timed, and the loss of the model delivered.
    stats = engine.acco_stats() if hasattr(engine, "acco_stats") else None
    finalize_s, finalized_loss = None, None
    if hasattr(engine, "acco_finalize"):
        t0 = time.perf_counter()
        engine.acco_finalize()
        finalize_s = time.perf_counter() - t0
    run_end = counters_now()
    if finalize_s is not None:
        finalized_loss = evaluate(engine, val, args.eval_batches, device)

    summary = {
        "label": label, "world_size": world, "steps": end["step"], "tokens": end["samples"] * args.block_size,
        "train_time_s": elapsed, "tokens_per_s": end["samples"] * args.block_size / elapsed,
        "samples_per_s": end["samples"] / elapsed, "step_time_s": elapsed / max(end["step"], 1),
        "first_loss": history[0]["val_loss"], "final_val_loss": history[-1]["val_loss"],
        "finalize_s": finalize_s, "final_val_loss_finalized": finalized_loss,
        "final_train_loss": sum(losses[-2 * gas:]) / len(losses[-2 * gas:]), "history": history,
        "step_tx_bytes": [b - a for a, b in zip(step_tx, step_tx[1:])],  # this rank's node, per inner step
        "micro_batches": micro, "skipped_steps": engine.skipped_steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        # Throughput after --warmup_steps (all steps when 0).
        "measured_steps": measured_steps, "measured_time_s": measured,
        "measured_samples_per_s": (end["samples"] - warm["samples"]) / measured,
        "measured_step_time_s": measured / max(measured_steps, 1),
    }
    if end["tx"] is not None:  # bytes this rank sent on gloo's interface over the measured steps
        sent = torch.tensor([float(a - b) for a, b in zip(end["tx"], warm["tx"])], dtype=torch.float64,
                            device=device)
        gathered = [torch.zeros_like(sent) for _ in range(world)]
        deepspeed.comm.all_gather(gathered, sent)
        summary["measured_tx_bytes_per_rank"] = [int(t[0].item()) for t in gathered]
        summary["measured_tcp_retransmits_per_rank"] = [int(t[1].item()) for t in gathered]
    if run_end["tx"] is not None and run_start["tx"] is not None:
        # Every byte of the training loop, first step to the end of finalize, on gloo's interface and on lo.
        lo = (run_end["lo"] - run_start["lo"]) if run_end["lo"] is not None and run_start["lo"] is not None else -1
        sent = torch.tensor([float(run_end["tx"][0] - run_start["tx"][0]), float(lo)], dtype=torch.float64,
                            device=device)
        gathered = [torch.zeros_like(sent) for _ in range(world)]
        deepspeed.comm.all_gather(gathered, sent)
        summary["run_tx_bytes_per_rank"] = [int(t[0].item()) for t in gathered]
        summary["run_lo_tx_bytes_per_rank"] = [int(t[1].item()) for t in gathered]
    if stats is not None:
        stats.pop("last_rounds", None)
        stats["micro_batches_per_rank"] = gather_counts(micro, device)
        if warm["stats"] is not None:
            stats["measured"] = {k: end["stats"][k] - warm["stats"][k] for k in end["stats"]}
        stats["lines"] = engine.acco_report()  # the mode's own summary lines (examples/train_gpt.py prints them)
        summary["acco"] = stats
    if rank == 0:
        print_summary(label, world, device, summary["steps"], summary["tokens"], elapsed, summary["first_loss"],
                      summary["final_val_loss"], summary["final_train_loss"], summary.get("acco"))
        if args.results:
            os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
            with open(args.results, "w") as f:
                json.dump(summary, f, indent=1)
            print(f"results        : {args.results}")
    engine.destroy()
    write_counters_after_close(args.results, rank, run_start)  # once destroy() closed the comm threads


if __name__ == "__main__":
    main()
