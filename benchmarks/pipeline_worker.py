"""One rank of the pipeline benchmark (benchmarks/pipeline.py): the GPT of examples/gpt.py (its ``Block``,
initialisation, corpus and batches) cut into a DeepSpeed ``PipelineModule`` of ``--pp`` stages, trained with
``train_batch()`` under stock ZeRO-1 (``--mode zero1``) or an acco_ds mode (sync, acco, dpu, diloco).

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python benchmarks/pipeline_worker.py \
        --mode diloco --sync_every 8 --steps 64 --results out.json

* Layers: token embedding, position embedding, ``n_layer`` blocks, final LayerNorm, and the output head tied
  to the token embedding (a ``TiedLayerSpec`` on the first and the last stage, as Megatron ties its word
  embeddings); blocks are split evenly over the stages (``partition_method="type:PipeBlock"``).
* DeepSpeed's topology puts rank ``stage * dp + d``: with PP 2 x DP 2, data-parallel rank 0 is ranks 0 and 2,
  data-parallel rank 1 is ranks 1 and 3 (benchmarks/pipeline.py puts each data-parallel rank's stages in one
  namespace: a "node"). diloco: ``replica_group_size 1``, so a replica is one data-parallel rank with all its
  stages, and the outer all-reduce (per stage) is what crosses the nodes.
* Timing: every pipeline instruction (forward, backward, sends, receives, reductions, optimizer step) is timed
  on every rank (an instance copy of the engine's instruction map, nothing patched in DeepSpeed or acco_ds),
  and every ``train_batch()``.
* Validation of the committed model (``engine.eval()`` / ``eval_batch`` / ``engine.train()``: under diloco the
  global model) every ``--eval_interval`` steps, on ``--eval_batches`` held-out micro-batches split over the
  data-parallel ranks; the training time excludes it. Bytes: gloo's interface counter (harness.link_tx_bytes)
  at the loop's start and end, the evaluations' bytes taken out.
"""

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, Batches, Block, add_model_args, load_corpus, param_groups  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402
from harness import link_tx_bytes, skip_deepspeed_shm_op  # noqa: E402

import acco_ds  # noqa: E402

VOCAB = 256


class TokEmbed(nn.Embedding):
    """The token embedding; on the last stage the same weight is the output head (``head``)."""

    def __init__(self, n_embd):
        super().__init__(VOCAB, n_embd)
        GPT._init(self)


def head(module, x):
    return x @ module.weight.t()


class PosAdd(nn.Module):

    def __init__(self, n_embd, block_size):
        super().__init__()
        self.pos = nn.Embedding(block_size, n_embd)
        GPT._init(self.pos)

    def forward(self, x):
        return x + self.pos(torch.arange(x.shape[1], device=x.device))


class PipeBlock(Block):

    def __init__(self, n_embd, n_head):
        super().__init__(n_embd, n_head)
        self.apply(GPT._init)


def loss_fn(logits, y):
    return F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))


def build(args):
    layers = [TiedLayerSpec("tok", TokEmbed, args.n_embd), LayerSpec(PosAdd, args.n_embd, args.block_size)]
    layers += [LayerSpec(PipeBlock, args.n_embd, args.n_head) for _ in range(args.n_layer)]
    layers += [LayerSpec(nn.LayerNorm, args.n_embd), TiedLayerSpec("tok", TokEmbed, args.n_embd, forward_fn=head)]
    return PipelineModule(layers=layers, num_stages=args.pp, loss_fn=loss_fn, partition_method="type:PipeBlock")


def config_of(args):
    config = json.loads((ROOT / "configs" / "acco_cpu.json").read_text())
    config.update(train_micro_batch_size_per_gpu=args.micro_batch, gradient_accumulation_steps=args.gas)
    if args.mode == "zero1":
        config.pop("acco")
    elif args.mode == "diloco":
        config["acco"] = {"enabled": True, "mode": "diloco",
                          "local_sgd": {"sync_every": args.sync_every, "replica_group_size": 1}}
    else:
        config["acco"] = {"enabled": True, "mode": args.mode}
    return config


def timed_instructions(engine, totals):
    """The engine's instruction map with each entry timed into ``totals[name]`` (this engine only)."""

    def wrap(name, fn):
        def run(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                totals[name] += time.perf_counter() - t0
        return run

    engine._INSTRUCTION_MAP = {cls: wrap(cls.__name__, fn) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    ap.add_argument("--mode", default="zero1", choices=["zero1", "sync", "acco", "dpu", "diloco"])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="train_batch() calls")
    ap.add_argument("--warmup", type=int, default=3, help="train_batch() calls left out of the timings")
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--gas", type=int, default=4, help="micro-batches per train_batch() (m)")
    ap.add_argument("--sync_every", type=int, default=8)
    ap.add_argument("--eval_interval", type=int, default=0, help="validate every N steps (0: at the end only)")
    ap.add_argument("--eval_batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--results", default=None)
    add_model_args(ap)  # --n_layer --n_head --n_embd --block_size --corpus_bytes
    args = ap.parse_args()

    skip_deepspeed_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    torch.manual_seed(args.seed)
    model = build(args)
    engine, _, _, _ = acco_ds.initialize(model=model, model_parameters=param_groups(model, 0.1),
                                         config=config_of(args))
    dp, dp_size, stage = engine.grid.get_data_parallel_id(), engine.grid.get_data_parallel_world_size(), engine.stage_id
    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    train = Batches(data[:split], args.block_size, args.micro_batch, seed=args.seed + 1 + dp)
    val = Batches(data[split:], args.block_size, args.micro_batch, seed=args.seed)

    def batches():  # train_batch() pulls --gas micro-batches from this iterator (first and last stage)
        i = 0
        while True:
            yield train.get(i)
            i += 1

    train_iter = batches()
    instr = defaultdict(float)
    timed_instructions(engine, instr)

    def validate():
        """Mean loss of the committed model on the held-out micro-batches (split over data-parallel ranks)."""
        mine = list(range(dp, args.eval_batches, dp_size))
        engine.eval()
        loss = engine.eval_batch(iter([val.get(i) for i in mine]), num_micro_batches=len(mine))
        engine.train()
        total = torch.tensor([float(loss) * len(mine), float(len(mine))])
        deepspeed.comm.all_reduce(total)  # every stage holds its pipeline's loss: count each pipeline once
        return (total[0] / total[1]).item()

    history, batch_s, per_batch_instr = [], [], []
    excluded_tx, eval_s = 0, 0.0
    history.append({"step": 0, "time": 0.0, "val_loss": validate()})
    deepspeed.comm.barrier()
    tx0, start = link_tx_bytes(), time.perf_counter()
    for step in range(1, args.steps + 1):
        before = dict(instr)
        t0 = time.perf_counter()
        engine.train_batch(data_iter=train_iter)
        batch_s.append(time.perf_counter() - t0)
        per_batch_instr.append({k: v - before.get(k, 0.0) for k, v in instr.items()})
        if (args.eval_interval and step % args.eval_interval == 0) or step == args.steps:
            t_eval, tx_eval = time.perf_counter(), link_tx_bytes()
            elapsed = t_eval - start - eval_s
            history.append({"step": step, "time": elapsed, "val_loss": validate()})
            eval_s += time.perf_counter() - t_eval
            if tx_eval is not None:
                excluded_tx += link_tx_bytes()[0] - tx_eval[0]
    train_s = time.perf_counter() - start - eval_s
    tx1 = link_tx_bytes()
    measured = per_batch_instr[args.warmup:]
    out = {"rank": rank, "stage": stage, "dp": dp, "mode": args.mode, "train_s": train_s, "history": history,
           "batch_s": batch_s, "instr_s_per_batch": {k: sum(b.get(k, 0.0) for b in measured) / max(len(measured), 1)
                                                      for k in instr},
           "loop_tx_bytes": None if tx0 is None else tx1[0] - tx0[0] - excluded_tx,
           "stage_params": sum(p.numel() for p in model.parameters()), "steps": args.steps, "global_steps": engine.global_steps, "syncs": getattr(engine, "acco_syncs", None)}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, out)
    if rank == 0 and args.results:
        with open(args.results, "w") as f:
            json.dump({"ranks": gathered, "world": world, "pp": args.pp, "gas": args.gas,
                       "micro_batch": args.micro_batch, "config": config_of(args)}, f, indent=1)
        print(f"results: {args.results}", flush=True)
    engine.destroy()
    # Every rank leaves gloo together: a rank exiting while another still tears down its pipeline groups
    # has ended the other with "terminate called without an active exception".
    deepspeed.comm.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
