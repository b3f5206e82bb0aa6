"""An Accelerate training loop with a DeepSpeed plugin whose config has an "acco" block;
acco_ds.patch() is the only ACCO line. save_state/load_state round-trip."""

import json
import os
import sys

import torch
from accelerate import Accelerator, DeepSpeedPlugin

import acco_ds

acco_ds.patch()
out, steps = sys.argv[1], int(sys.argv[2])
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
          "gradient_clipping": 1.0, "acco": {"enabled": True, "mode": "acco"}}
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=2,
                          )
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
g = torch.Generator().manual_seed(0)
xs = torch.randn(512, 8, generator=g)
dataset = torch.utils.data.TensorDataset(xs, xs.sum(1, keepdim=True))
loader = torch.utils.data.DataLoader(dataset, batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
engine = model
losses, micro = [], 0
for x, y in loader:
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss.item())
    micro += 1
    if engine.global_steps >= steps:
        break
accelerator.save_state(os.path.join(out, "state"))
before = [p.detach().clone() for p in model.parameters()]
steps_before = engine.global_steps
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)  # clobber, then restore from the saved state
accelerator.load_state(os.path.join(out, "state"))
restored = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
with open(os.path.join(out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
    json.dump({"engine": type(engine).__name__, "global_steps": steps_before, "micro": micro, "losses": losses,
               "restored": restored, "steps_after_load": engine.global_steps}, f)
