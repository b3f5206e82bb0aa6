"""DeepSpeed's AutoEP on a tiny Hugging Face Mixtral (built from a config, random weights, no download): stock
ZeRO-1 and acco_ds's modes on the same model and data, one engine after the other in one launch.

    deepspeed --num_gpus 2 tests/integrations/autoep_mixtral.py --out DIR --modes sync,acco

Writes DIR/rank<r>.json: per run (``stock`` and each mode) the loss of every micro-batch and the final weights'
digest (every parameter's sum and norm, in float64, by name).
"""

import argparse
import json
import os

import deepspeed
import torch
from transformers import MixtralConfig, MixtralForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
parser.add_argument("--modes", default="sync,acco")
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
SHAPE = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                      max_position_embeddings=64)


def train(acco):
    torch.manual_seed(0)
    model = MixtralForCausalLM(SHAPE)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 1}, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
              "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral",
                                  "use_grouped_mm": False}}
    if acco is not None:
        config["acco"] = acco
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(100 + rank)
    pool = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(7))  # learnable: 4 sequences
    losses = []
    while engine.global_steps < args.steps:
        ids = pool[torch.randint(0, 4, (2,), generator=g)]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    digest = {name: [p.detach().double().sum().item(), p.detach().double().norm().item()]
              for name, p in engine.module.named_parameters()}
    return {"engine": type(engine).__name__, "steps": engine.global_steps, "losses": losses, "digest": digest}


out = {"stock": train(None)}
for mode in [m for m in args.modes.split(",") if m]:
    out[mode] = train({"enabled": True, "mode": mode, "kernels": "torch"})
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
