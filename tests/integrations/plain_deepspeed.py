"""An unmodified plain DeepSpeed script (no acco_ds import): the runner must give it ACCO.

    deepspeed --module acco_ds.cli.run tests/integrations/plain_deepspeed.py --deepspeed_config X --out DIR
"""

import argparse
import json
import os

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
rank = torch.distributed.get_rank()
g = torch.Generator().manual_seed(rank)
losses = []
while engine.global_steps < args.steps:
    x = torch.randn(4, 8, generator=g)
    loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"engine": type(engine).__name__, "global_steps": engine.global_steps, "local_rank": args.local_rank,
               "losses": losses}, f)
