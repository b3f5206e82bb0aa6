"""acco_ds.patch() on a real (1-rank, gloo) process group: after patch, ``deepspeed.initialize``
builds an ACCOEngine for a config with an enabled "acco" block and a stock DeepSpeedEngine
otherwise; a PipelineModule with ACCO enabled is refused; unpatch() restores stock behaviour.

    python tests/integrations/patch_check.py OUT.json
"""

import json
import sys
from datetime import timedelta

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

import acco_ds
from acco_ds.deepspeed.engine import ACCOEngine

deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
out = {}


def config(acco):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "torch_adam": True}}, "steps_per_print": 1000}
    if acco is not None:
        cfg["acco"] = acco
    return cfg


def build(cfg, how="config"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    kwargs = {"config": cfg} if how == "config" else {"config_params": cfg}  # Accelerate passes config_params
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), **kwargs)
    return engine


def train(engine, micro):
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(micro):
        x = torch.randn(2, 4, generator=g)
        loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


original = deepspeed.initialize
out["stock_before_patch"] = type(build(config({"enabled": True}))).__name__  # not patched: config ignored
acco_ds.patch()
acco_ds.patch()
out["idempotent"] = deepspeed.initialize.__wrapped__ is original and acco_ds.is_patched()
engine = build(config({"enabled": True, "mode": "acco"}))
out["acco_engine"] = type(engine).__name__
out["acco_is_subclass"] = isinstance(engine, ACCOEngine) and isinstance(engine, deepspeed.DeepSpeedEngine)
train(engine, 7)  # k=1: commits after micro-batches 3, 5, 7
out["acco_global_steps"] = engine.global_steps
out["acco_config_params_engine"] = type(build(config({"enabled": True}), how="config_params")).__name__
out["disabled_engine"] = type(build(config({"enabled": False}))).__name__
out["no_block_engine"] = type(build(config(None))).__name__
out["name_restored"] = deepspeed.DeepSpeedEngine is not ACCOEngine  # the swap is scoped to the call
# A PipelineModule of one stage gets ACCO's pipeline engine (Megatron-DeepSpeed's default engine).
pipe = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 1)], num_stages=1)
pipe_engine = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=config({"enabled": True}))[0]
out["pipeline_engine"] = type(pipe_engine).__name__
out["pipeline_name_restored"] = deepspeed.PipelineEngine.__name__ == "PipelineEngine"
acco_ds.unpatch()
out["unpatched"] = deepspeed.initialize is original and not acco_ds.is_patched()
out["after_unpatch_engine"] = type(build(config({"enabled": True}))).__name__
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
print(json.dumps(out))

