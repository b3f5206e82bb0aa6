"""One rank of ``decoupled_race.py``: a small GPT on the standard library's source, trained by ``acco_ds``
with the config given, until a step budget (``--steps``: every mode but decoupled, whose ranks agree on step
counts) or a training-time budget (``--seconds``: decoupled learners, which never meet). Every
``--eval-every-s`` seconds of training this rank evaluates what its users read (the committed model) on its own,
with no collective, and the time spent evaluating is left out of the training time. Writes
``{out}/rank{r}.json``: steps, tokens, training seconds, the evaluation trace and the engine's statistics."""

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..")]
import deepspeed  # noqa: E402

import acco_ds  # noqa: E402
from gpt import GPT, Batches, load_corpus, param_groups  # noqa: E402


@torch.no_grad()
def local_eval(engine, batches, n, device):
    engine.eval()
    total = sum(float(engine(*(t.to(device) for t in batches.get(i)))) for i in range(n))
    engine.train()
    return total / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--syncs", type=int, default=0, help="A-EDiT: syncs to train for")
    ap.add_argument("--seconds", type=float, default=0.0)
    ap.add_argument("--eval-every-s", type=float, default=4.0)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--data-rank-offset", type=int, default=0, help="a learner launched on its own: where its "
                                                                    "ranks' data streams start")
    ap.add_argument("--agree-eval", action="store_true", help="a learner of several ranks: its ranks evaluate "
                                                              "together (the committed view is gathered)")
    args = ap.parse_args()
    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    config = json.load(open(args.config))
    torch.manual_seed(1234)
    data = load_corpus(2_000_000)
    split = int(0.9 * len(data))
    model = GPT(args.n_layer, 4, args.n_embd, args.block)
    engine, _, _, _ = acco_ds.initialize(model=model, model_parameters=param_groups(model, 0.1), config=config)
    micro_bs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    train = Batches(data[:split], args.block, micro_bs, seed=1235 + rank + args.data_rank_offset)
    val = Batches(data[split:], args.block, micro_bs, seed=1234)
    tokens_per_inner_step = micro_bs * gas * args.block  # this rank's share of one inner step
    trace, micro, eval_time = [], 0, 0.0
    start = time.perf_counter()
    last_eval = -1e9

    def elapsed():
        return time.perf_counter() - start - eval_time

    def evaluate():
        nonlocal eval_time, last_eval
        t0 = time.perf_counter()
        trace.append({"time": elapsed(), "steps": engine.global_steps, "syncs": getattr(engine, "acco_syncs", 0),
                      "val_loss": local_eval(engine, val, args.eval_batches, engine.device)})
        eval_time += time.perf_counter() - t0
        last_eval = elapsed()

    evaluate()

    def due(mine: bool) -> bool:
        """Evaluate now? With ``--agree-eval`` the ranks go together once any rank's clock says so."""
        if not args.agree_eval:
            return mine
        flag = torch.tensor([float(mine)])
        deepspeed.comm.all_reduce(flag, op=deepspeed.comm.ReduceOp.MAX)
        return bool(flag.item())

    def more():
        if args.seconds and args.agree_eval:  # the ranks of a learner stop together, at a step's end
            if micro % gas:
                return True
            flag = torch.tensor([float(elapsed() < args.seconds)])
            deepspeed.comm.all_reduce(flag, op=deepspeed.comm.ReduceOp.MIN)
            return bool(flag.item())
        if args.seconds:
            return elapsed() < args.seconds
        if args.syncs:
            return getattr(engine, "acco_syncs", 0) < args.syncs
        return engine.global_steps < args.steps

    while more():
        x, y = train.get(micro)
        before = engine.global_steps
        engine.backward(engine(x.to(engine.device), y.to(engine.device)))
        engine.step()
        micro += 1
        if engine.global_steps != before and due(elapsed() - last_eval >= args.eval_every_s):
            evaluate()
    seconds = elapsed()
    if hasattr(engine, "acco_finalize"):
        engine.acco_finalize()
    evaluate()
    stats = engine.acco_stats() if hasattr(engine, "acco_stats") else {}
    out = {"rank": rank, "steps": engine.global_steps, "micro": micro, "seconds": seconds,
           "tokens": micro * micro_bs * args.block, "tokens_per_inner_step": tokens_per_inner_step, "trace": trace,
           "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, list, dict, type(None)))}}
    os.makedirs(args.out, exist_ok=True)
    json.dump(out, open(os.path.join(args.out, f"rank{rank}.json"), "w"), indent=1)
    engine.destroy()


if __name__ == "__main__":
    main()
