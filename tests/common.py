"""Model, data and configs shared by the test workers and the reference checks."""

import torch
from torch import nn

MICRO_BATCH = 4


class TinyNet(nn.Module):
    """Odd sizes on purpose: the flat buffer needs padding to split into partitions."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class DeepNet(nn.Module):
    """Four layers (eight parameters of 3 to 64 elements): enough for four Streaming DiLoCo fragments."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(7, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def make_model(seed: int = 0, kind: str = "tiny") -> nn.Module:
    torch.manual_seed(seed)
    return DeepNet() if kind == "deep" else TinyNet()


def micro_batch(worker: int, i: int):
    """Worker ``worker``'s ``i``-th micro-batch, the same in every process."""
    g = torch.Generator().manual_seed(100_003 * worker + i + 17)
    x = torch.randn(MICRO_BATCH, 7, generator=g)
    y = torch.randn(MICRO_BATCH, 3, generator=g)
    return x, y


def spiked_batch(worker: int, i: int, spike=None):
    """``micro_batch``, with targets scaled by ``spike["scale"]`` on worker ``spike["worker"]`` for
    micro-batches ``spike["from"] <= i < spike["to"]`` (an adversarial period for one replica)."""
    x, y = micro_batch(worker, i)
    if spike and worker == spike["worker"] and spike["from"] <= i < spike["to"]:
        y = y * spike["scale"]
    return x, y


def loss_fn(model, batch):
    x, y = batch
    dtype = next(model.parameters()).dtype
    out = model(x.to(dtype))
    return ((out.float() - y)**2).mean()


def param_groups(model):
    """Two groups (weights with decay, biases without), as LLM scripts do."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]


ADAM = {"lr": 0.02, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.05}


def ds_config(acco=None, gas=4, clip=0.0, optimizer="AdamW", dtype="fp32", scheduler=None, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": clip,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }
    if optimizer == "AdamW":
        cfg["optimizer"] = {"type": "AdamW", "params": {**ADAM, "torch_adam": True}}
    elif optimizer == "Adam":
        cfg["optimizer"] = {"type": "Adam", "params": {**ADAM, "torch_adam": True, "adam_w_mode": False}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1}
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    if acco is not None:
        cfg["acco"] = {"enabled": True, **acco}
    cfg.update(extra)
    return cfg


def reference_optimizer(name, groups=False):
    """The torch optimizer the engine config above builds, for the reference simulator."""

    def build(module):
        params = param_groups(module) if groups else module.parameters()
        if name == "AdamW":
            return torch.optim.AdamW(params, lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"],
                                     weight_decay=ADAM["weight_decay"])
        if name == "Adam":
            return torch.optim.Adam(params, lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"],
                                    weight_decay=ADAM["weight_decay"])
        if name == "plain SGD":  # no momentum: a pseudo-gradient's norm follows its gradients (EDiT tests)
            return torch.optim.SGD(params, lr=0.05)
        if name == "SGD":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
        raise ValueError(name)

    return build


def lr_factor(step: int) -> float:
    """LR multiplier for committed step ``step`` (LambdaLR convention)."""
    return 1.0 / (1.0 + 0.5 * step)
