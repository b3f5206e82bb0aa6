"""Hugging Face Trainer with --deepspeed and an "acco" block, unmodified except for
running under `acco_ds.cli.run`. Trains a tiny GPT-2 built from a config (no download),
saves a checkpoint, then a second Trainer resumes from it."""

import argparse
import json
import os
import sysconfig

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, TrainerCallback

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("steps", type=int)
parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it, as to any HF script
cli = parser.parse_args()
out, steps = cli.out, cli.steps
text = open(os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py"), "rb").read()
block = 32
data = [{"input_ids": torch.tensor(list(text[i:i + block])), "labels": torch.tensor(list(text[i:i + block]))}
        for i in range(0, 64 * block * 8, block)]
ds_config = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto", "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                              "torch_adam": True}},
    "acco": {"enabled": True, "mode": "acco"},
}


class Record(TrainerCallback):
    """Engine counters next to the Trainer's own, after every optimizer step."""

    def __init__(self):
        self.rows = []

    def on_step_end(self, args, state, control, model=None, **kw):
        engine = self.trainer.model_wrapped
        self.rows.append({"hf_step": state.global_step, "engine_steps": engine.global_steps,
                          "engine": type(engine).__name__})


def make_trainer(max_steps):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=block, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=max_steps, learning_rate=3e-3, logging_steps=1, save_steps=steps,
                             save_strategy="steps", deepspeed=ds_config, report_to=[], use_cpu=True,
                             dataloader_drop_last=True, seed=0, disable_tqdm=True)
    record = Record()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[record])
    record.trainer = trainer
    return trainer, record


trainer, record = make_trainer(steps)
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
rank = torch.distributed.get_rank()
# save_model: the weights HF writes are the engine's trained weights, loadable without DeepSpeed.
final = os.path.join(out, "final")
trainer.save_model(final)
trainer.accelerator.wait_for_everyone()
reloaded = GPT2LMHeadModel.from_pretrained(final)
trained = trainer.model_wrapped.module.state_dict()
saved = reloaded.state_dict()
saved_model_matches = (set(saved) == set(trained) and len(saved) > 0
                       and all(torch.equal(v, trained[k]) for k, v in saved.items()))
checkpoint = os.path.join(out, f"checkpoint-{steps}")
first = {"rows": record.rows, "losses": losses, "saved_model_matches": saved_model_matches,
         "checkpoint_files": sorted(os.listdir(checkpoint)),
         "engine_steps_at_end": trainer.model_wrapped.global_steps}
# Resume: a fresh Trainer continues from the checkpoint saved at `steps`.
trainer2, record2 = make_trainer(steps + 2)
trainer2.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{steps}"))
second = {"rows": record2.rows}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"first": first, "resumed": second}, f)
