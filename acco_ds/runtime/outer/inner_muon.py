"""Muon as the inner optimizer of the local-SGD modes (``"optimizer": {"type": "Muon", ...}``).

Muon orthogonalizes the update of each 2-D weight matrix with a Newton-Schulz
iteration, so it needs every matrix whole. DeepSpeed's ZeRO-1 (``stage_1_and_2._muon_all_gather_partitions``)
gathers the slices of each Muon matrix to the ranks whose partitions hold part of it; acco_ds runs Muon where
the inner ZeRO-1 group is one rank (``local_sgd.replica_group_size = 1``, DiLoCo as published): that rank's
fp32 master partition is the whole flat buffer, every matrix is whole in it, and nothing is gathered.

DeepSpeed's ``deepspeed.initialize`` tags each parameter ``use_muon`` (2-D and more, names without
``embed``/``lm_head``) and its engine splits the optimizer into a Muon group and an AdamW group
(``MuonWithAuxAdam``): biases, norms and embeddings go to AdamW, as Muon users do. ``MuonShardUpdate`` runs
both halves on the master partition:

* Muon group, per matrix ``W`` with gradient ``g`` (clipped, averaged): ``M ← β M + (1 − β) g``;
  ``U = (1 − β) g + β M`` (Nesterov, DeepSpeed's ``grad.lerp_(momentum, β)``);
  ``O = NS₅(U) · sqrt(max(1, rows / cols))``; ``W ← W (1 − lr·wd) − lr · O``.
* AdamW group: the fused AdamW kernel the other optimizers use (bias correction, decoupled weight decay).

``NS₅`` is DeepSpeed's standard quintic iteration (coefficients 3.4445, −4.7750, 2.0315; five steps; the
matrix first divided by its Frobenius norm + 1e-7; transposed when it has more rows than columns), run in
the master dtype (fp32). DeepSpeed's ``gram`` method is the same iteration on the Gram matrix, and it picks
fp16 / bf16 on an accelerator that has them; acco_ds computes either in fp32, so ``ns_method`` changes nothing
here. The momentum is one flat fp32 tensor the size of the partition, ``optimizer.state[master]
["momentum_buffer"]``: it travels in DeepSpeed's checkpoint like Adam's moments.
"""

import math
from typing import List

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def newton_schulz(G: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of DeepSpeed's ``zeropower_via_newtonschulz5``, in ``G``'s dtype."""
    a, b, c = NS_COEFFICIENTS
    X = G.mT if G.size(-2) > G.size(-1) else G
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if G.size(-2) > G.size(-1) else X


def muon_direction(grad: torch.Tensor, momentum: torch.Tensor, beta: float) -> torch.Tensor:
    """Advance ``momentum`` (in place) by ``grad`` and return the orthogonalized Nesterov direction."""
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp(momentum, beta)
    rows, cols = update.size(-2), update.size(-1)
    return newton_schulz(update) * (math.sqrt(rows / cols) if rows > cols else 1.0)


def is_muon(optimizer) -> bool:
    """Does ``optimizer`` hold DeepSpeed's Muon param groups (each has ``use_muon``)?"""
    return any("use_muon" in group for group in optimizer.param_groups)


class MuonShardUpdate:
    """The inner update of a one-rank ZeRO-1 group with DeepSpeed's ``MuonWithAuxAdam``.

    ``params``: per param group, ``(parameter, offset)`` in the flat buffer (the master partition is the
    whole flat buffer); ``adam_w_mode``: the auxiliary Adam's decoupled weight decay (DeepSpeed's
    ``adam_w_mode``, default True)."""

    name = "Muon + AdamW"

    def __init__(self, optimizer, masters: List[torch.Tensor], kernels, params, adam_w_mode: bool = True):
        self.optimizer, self.masters, self.kernels = optimizer, masters, kernels
        self.params, self.adam_w_mode = params, adam_w_mode
        for i, (master, group_params) in enumerate(zip(masters, params)):
            end = max((offset + p.numel() for p, offset in group_params), default=0)
            if end > master.numel():
                raise ValueError(f"Muon needs every weight matrix whole on its rank, but parameter group {i}'s "
                                 f"partition holds {master.numel()} of its {end} elements: set "
                                 "acco.local_sgd.replica_group_size to 1")

    def __call__(self, grads: List[torch.Tensor], grad_scale: float, commit: bool, outs: List[torch.Tensor]) -> None:
        if not commit:
            raise RuntimeError("Muon runs in the local-SGD modes only: they commit every inner step (no Peek)")
        for i, master in enumerate(self.masters):
            group = self.optimizer.param_groups[i]
            if group.get("use_muon"):
                self._muon(group, master, grads[i], grad_scale, self.params[i])
            else:
                self._adamw(group, master, grads[i], grad_scale, outs[i])
                continue
            outs[i].copy_(master)

    def _muon(self, group, master, grad, grad_scale, group_params) -> None:
        state = self.optimizer.state[master]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(master)
        momentum = state["momentum_buffer"]
        lr, decay, beta = float(group["lr"]), float(group.get("weight_decay", 0.0)), float(group["momentum"])
        for p, offset in group_params:
            n, shape = p.numel(), p.shape
            g = grad.narrow(0, offset, n).view(shape) * grad_scale
            if g.dim() > 2:  # convolution filters, as DeepSpeed: one row per output channel
                g = g.view(len(g), -1)
            o = muon_direction(g, momentum.narrow(0, offset, n).view(g.shape), beta)
            w = master.narrow(0, offset, n)
            w.mul_(1 - lr * decay).add_(o.reshape(-1), alpha=-lr)

    def _adamw(self, group, master, grad, grad_scale, out) -> None:
        state = self.optimizer.state[master]
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        self.kernels.adamw_update(master, grad, state["exp_avg"], state["exp_avg_sq"], out,
                                  step=int(state["step"]) + 1, lr=float(group["lr"]), beta1=float(beta1),
                                  beta2=float(beta2), eps=float(group.get("eps", 1e-8)),
                                  weight_decay=float(group.get("weight_decay", 0.0)), grad_scale=grad_scale,
                                  commit=True, adamw=self.adam_w_mode)
        state["step"] = int(state["step"]) + 1


__all__ = ["MuonShardUpdate", "muon_direction", "newton_schulz", "is_muon"]
