"""Hugging Face Trainer with an "acco" block in its DeepSpeed config and nothing else: no acco_ds
import, no runner. Launched with plain ``torchrun``, the startup hook installed with acco_ds must
give it the ACCO engine (stock DeepSpeed with ACCO_DS_AUTOPATCH=0).

    torchrun --nproc_per_node 2 tests/integrations/hf_trainer_autopatch.py OUT STEPS
"""

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

out, steps = sys.argv[1], int(sys.argv[2])
block = 16
g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, 64, (64, block), generator=g)
data = [{"input_ids": t, "labels": t} for t in tokens]
ds_config = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto", "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                              "torch_adam": True}},
    "acco": {"enabled": True, "kernels": "torch"},
}


class Record(TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_step_end(self, args, state, control, **kw):
        engine = self.trainer.model_wrapped
        self.rows.append({"hf_step": state.global_step, "engine": type(engine).__name__,
                          "engine_steps": engine.global_steps})


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=block, n_embd=32, n_layer=1, n_head=2))
args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=steps, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                         deepspeed=ds_config, report_to=[], use_cpu=True, dataloader_drop_last=True, seed=0,
                         disable_tqdm=True)
record = Record()
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[record])
record.trainer = trainer
trainer.train()
rank = torch.distributed.get_rank()
result = {"deepspeed": type(trainer.deepspeed).__name__, "model_wrapped": type(trainer.model_wrapped).__name__,
          "rows": record.rows, "acco_ds_imported": "acco_ds" in sys.modules}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
if rank == 0:
    print("engine:", result["deepspeed"])
