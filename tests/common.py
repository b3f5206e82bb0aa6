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


# Mixture of experts: one DeepSpeed MoE layer of 4 experts, top-1, expert parallelism 2, deterministic (no noise,
# no random token selection, no dropped tokens); the loss adds the gate's load-balancing loss l_aux times L_AUX.
MOE_EXPERTS, MOE_EP, L_AUX = 4, 2, 0.01


class MoENet(nn.Module):
    """``fc_in`` -> ``deepspeed.moe.layer.MoE`` -> tanh -> ``fc_out``; forward returns ``(output, l_aux)``."""

    def __init__(self, ep_size: int = MOE_EP):
        super().__init__()
        from deepspeed.moe.layer import MoE
        self.fc_in = nn.Linear(7, 8)
        self.moe = MoE(8, nn.Linear(8, 8), num_experts=MOE_EXPERTS, ep_size=ep_size, k=1, min_capacity=0,
                       noisy_gate_policy=None, drop_tokens=False, use_rts=False)
        self.fc_out = nn.Linear(8, 3)

    def forward(self, x):
        h, l_aux, _ = self.moe(self.fc_in(x))
        return self.fc_out(torch.tanh(h)), l_aux


class DenseMoENet(nn.Module):
    """``MoENet`` in one process with every expert (the simulator's model): each token goes to its top-1
    expert, times its gate probability, as DeepSpeed's dispatch and combine compute it; l_aux as DeepSpeed's
    top-1 gate. Parameter names are the canonical names of ``moe_canonical``."""

    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(7, 8)
        self.gate = nn.Linear(8, MOE_EXPERTS, bias=False)
        self.expert = nn.ModuleList([nn.Linear(8, 8) for _ in range(MOE_EXPERTS)])
        self.fc_out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc_in(x)
        gates = torch.softmax(torch.nn.functional.linear(h.float(), self.gate.weight.float()), dim=1)
        mask = torch.nn.functional.one_hot(torch.argmax(gates, dim=1), num_classes=MOE_EXPERTS)
        weights = (gates * mask).to(h.dtype)
        out = sum(weights[:, e:e + 1] * self.expert[e](h) for e in range(MOE_EXPERTS))
        l_aux = torch.sum(gates.mean(0) * mask.float().mean(0)) * MOE_EXPERTS
        return self.fc_out(torch.tanh(out)), l_aux


def moe_canonical_names(module, ep_rank: int):
    """Canonical names (those of ``DenseMoENet``) of ``module.parameters()`` of a ``MoENet`` on a rank at
    position ``ep_rank`` of its expert-parallel group (its local expert i is global expert ep_rank * 2 + i)."""
    local = module.moe.num_local_experts
    names = []
    for name, _ in module.named_parameters():
        if ".deepspeed_experts." in name:
            i, what = name.split(".deepspeed_experts.")[1].split(".")
            names.append(f"expert.{ep_rank * local + int(i)}.{what}")
        elif ".gate." in name:
            names.append("gate.weight")
        else:
            names.append(name)
    return names


def moe_init(module, names) -> None:
    """Set every parameter from its canonical name (the same values in every process and model)."""
    with torch.no_grad():
        for name, p in zip(names, module.parameters()):
            g = torch.Generator().manual_seed(sum(ord(c) * 31**i for i, c in enumerate(name)) % (2**31))
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def make_model(seed: int = 0, kind: str = "tiny") -> nn.Module:
    torch.manual_seed(seed)
    if kind in ("moe", "moe_ep1"):  # a rank of the MoE model (DeepSpeed's layout: ep position = rank mod ep_size)
        import torch.distributed as tdist
        ep = MOE_EP if kind == "moe" else 1
        model = MoENet(ep)
        moe_init(model, moe_canonical_names(model, tdist.get_rank() % ep))
        return model
    if kind == "dense_moe":
        model = DenseMoENet()
        moe_init(model, [n for n, _ in model.named_parameters()])
        return model
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
    if isinstance(out, tuple):  # a mixture of experts: the user adds the load-balancing loss, as in DeepSpeed
        out, l_aux = out
        return ((out.float() - y)**2).mean() + L_AUX * l_aux
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
        if any(getattr(p, "allreduce", True) is False for p in module.parameters()):
            # DeepSpeed's MoE layers: a client optimizer keeps expert parameters in param groups of their own
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
            params = split_params_into_different_moe_groups_for_optimizer({"params": list(params), "name": "dense"})
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
