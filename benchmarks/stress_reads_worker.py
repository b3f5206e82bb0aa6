"""One rank of ``stress_reads.py``: trains a small MLP and reads it at random points, as a user would.

Each trial builds an engine (DeepSpeed host: ``acco_ds.initialize``; torch host: ``acco_ds.torch``) and runs,
with micro-batch counts drawn from a seed shared by every rank (so every rank calls the same things in the
same order, at any point of a round):

    k1 micro-batches, eval() + a forward + dist.all_reduce + train()
    k2 micro-batches, module.state_dict()
    up to the next step boundary, a user dist.all_reduce (between steps)
    k3 micro-batches, save_checkpoint (DeepSpeed host) or committed_weights (torch host)
    k4 micro-batches, acco_finalize / finalize, destroy

A deadlock shows up as a rank that never prints "trial N done": the harness then sends SIGUSR1 (every
thread's stack into the log, via faulthandler) and kills the ranks.

    python benchmarks/stress_reads_worker.py SPEC_JSON      (RANK, WORLD_SIZE, MASTER_* set by the harness)
"""

import faulthandler
import json
import os
import random
import signal
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
faulthandler.register(signal.SIGUSR1, all_threads=True)

SPEC = json.loads(Path(sys.argv[1]).read_text())
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
GAS, MICRO, DIM = 4, 4, 64


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))


def batch(i):
    g = torch.Generator().manual_seed(1000 * RANK + i)
    x = torch.randn(MICRO, DIM, generator=g)
    return x, x.flip(1)


def config(seed):
    rng = random.Random(seed)  # the same on every rank
    acco = {"enabled": True, "mode": SPEC["mode"], "accumulation": SPEC["accumulation"], "timeout_s": 30,
            "emulation": {"comm_delay_s": rng.choice([0.0, 0.005, 0.02]), "slow_rank": rng.randrange(WORLD),
                          "slow_factor": rng.choice([1.0, 2.0, 4.0])}}
    if SPEC["accumulation"] == "adaptive":
        low = GAS // 2 if SPEC["mode"] == "acco" else GAS  # micro-batches per round (the minimum)
        acco["max_micro_batches_per_round"] = rng.choice([low + 1, 2 * low, 4 * low])
    acco.update(SPEC.get("acco", {}))  # a scenario's fixed settings (the issue's: no emulation)
    if SPEC.get("int8"):
        acco["compression"] = {"dtype": "int8", "apply_to": ["rounds"]}
    if SPEC.get("ranks_per_node"):
        acco["collectives"] = {"ranks_per_node": SPEC["ranks_per_node"]}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "acco": acco}


def loss_of(net, i):
    x, y = batch(i)
    return torch.nn.functional.mse_loss(net(x), y)


class DeepSpeedTrial:
    def __init__(self, cfg):
        import acco_ds
        self.engine, *_ = acco_ds.initialize(model=model(), config=cfg)
        self.net = self.engine  # what eval() and a forward go through
        self.micro = 0

    def train(self, n):
        for _ in range(n):
            self.engine.backward(loss_of(self.engine, self.micro))
            self.engine.step()
            self.micro += 1

    def eval_read(self):
        self.net.eval()
        with torch.no_grad():
            loss = loss_of(self.net, 10**6).detach()
        dist.all_reduce(loss)
        self.net.train()

    def state_dict(self):
        return self.engine.module.state_dict()

    def save(self, where):
        self.engine.save_checkpoint(where)

    def finish(self):
        self.engine.acco_finalize()
        self.engine.destroy()


class TorchTrial(DeepSpeedTrial):
    def __init__(self, cfg):
        import acco_ds.torch
        self.net = model()
        opt = torch.optim.AdamW(self.net.parameters(), lr=1e-3)
        torch_cfg = {k: cfg[k] for k in ("acco", "gradient_accumulation_steps", "gradient_clipping")}
        self.net, self.opt = acco_ds.torch.initialize(self.net, opt, torch_cfg)
        self.micro = 0

    def train(self, n):
        for _ in range(n):
            (loss_of(self.net, self.micro) / GAS).backward()
            self.micro += 1
            if self.micro % GAS == 0:
                self.opt.step()
                self.opt.zero_grad()

    def state_dict(self):
        with self.opt.committed_weights():
            return self.net.state_dict()

    def save(self, where):
        self.state_dict()

    def finish(self):
        self.opt.finalize()


def main():
    host = SPEC.get("host", "deepspeed")
    if host == "deepspeed":
        import deepspeed
        import harness
        harness.skip_deepspeed_shm_op()
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for trial in range(SPEC["trials"]):
        seed = SPEC["seed"] * 1000 + trial
        rng = random.Random(seed + 1)
        t = (DeepSpeedTrial if host == "deepspeed" else TorchTrial)(config(seed))
        if SPEC.get("pattern") == "issue45":  # the report's sequence: 40 calls, eval, 40, save, 10
            t.train(40)
            t.eval_read()
            t.train(40)
            with tempfile.TemporaryDirectory() as where:
                t.save(where)
            t.train(10)
            t.finish()
            print(f"trial {trial} done", flush=True)
            continue
        t.train(rng.randrange(1, 3 * GAS))
        t.eval_read()
        t.train(rng.randrange(0, 3 * GAS))
        t.state_dict()
        t.train((-t.micro) % GAS)  # to the step boundary
        flag = torch.ones(1)
        dist.all_reduce(flag)  # a user collective between steps
        t.train(rng.randrange(0, 3 * GAS))
        with tempfile.TemporaryDirectory() as where:
            t.save(where)
        t.train(rng.randrange(0, 2 * GAS))
        t.finish()
        print(f"trial {trial} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
