"""The optimizer update of one rank's shard: ``Peek`` (estimate) or commit.

``Opt(θ, g)`` advances the optimizer (moments, step count, master weights);
``Peek(θ, g)`` computes the same update with the same step index and learning
rate and changes nothing. Both write the new parameters, cast to the model
dtype, straight into this rank's part of the all-gather buffer.

Adam and AdamW (torch's, or DeepSpeed's FusedAdam) use the fused kernel
(``acco_ds.ops.adamw_update``): a Peek reads the state and writes only the
output, no clone. Any other torch optimizer gets the generic Peek: snapshot
the shard and its state, step, restore.
"""

import copy
from typing import List, Optional

import torch


NORM_CHUNK = 1 << 16  # elements per float64 norm chunk on the CPU (512 KiB temporary)
# On a GPU each chunk costs a few kernel launches from the communication thread: 64K-element chunks made a
# 124M-parameter model's rounds launch ~12,000 kernels (H100: ACCO at a third of stock's tokens/s, the
# launches holding the GIL the compute thread needs). 4M elements: 32 MiB of float64 temporary, ~30 chunks.
NORM_CHUNK_DEVICE = 1 << 22


def squared_norm(shards: List[torch.Tensor], segments: Optional[list] = None) -> float:
    """Sum of squares of fp32 shards (of the ``(begin, length)`` segments of each, if given), accumulated
    in float64 chunk by chunk: a float64 copy of a whole shard would add 8N/W bytes to the peak."""
    # Summed on the device, in the same order: one host sync per norm, not one per chunk.
    total = torch.zeros((), dtype=torch.float64, device=shards[0].device)
    chunk = NORM_CHUNK if shards[0].device.type == "cpu" else NORM_CHUNK_DEVICE
    for i, shard in enumerate(shards):
        for begin, length in ([(0, shard.numel())] if segments is None else segments[i]):
            for start in range(begin, begin + length, chunk):
                part = shard[start:min(start + chunk, begin + length)]
                total += torch.linalg.vector_norm(part, dtype=torch.float64)**2
    return float(total)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """DeepSpeed ZeRO's clipping rule: divide by max(1, (norm + 1e-6) / max_norm)."""
    if max_norm <= 0:
        return 1.0
    return 1.0 / max(1.0, (norm + 1e-6) / max_norm)


def fast_adam_kind(opt, fused_adamw: Optional[bool] = None) -> Optional[str]:
    """'torch' / 'fused' when the fused update can replace ``opt.step()``, else None.

    ``fused_adamw`` is the host's word on a fused Adam of its own (the DeepSpeed
    host recognises ``FusedAdam`` in ``deepspeed/compat.py``): None when ``opt``
    is not one, else whether it runs in AdamW mode. The runtime imports no host."""
    groups = opt.param_groups
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        for g in groups:
            if g.get("amsgrad") or g.get("maximize") or g.get("differentiable") or g.get("capturable"):
                return None
            if torch.is_tensor(g["lr"]) or any(torch.is_tensor(b) for b in g["betas"]):
                return None
        return "torch"
    if fused_adamw is not None and all(g.get("bias_correction", True) for g in groups):
        return "fused"
    return None


class ShardUpdate:
    """Runs Peek/commit on the fp32 master shards of a ZeRO-1 optimizer.

    Args:
        optimizer: the wrapped torch optimizer; its param groups hold the fp32
            master shards (``masters``), one per group.
        masters: ``single_partition_of_fp32_groups`` of ZeRO-1.
        kernels: ``acco_ds.ops.Kernels`` (native or torch).
        fused_adamw: the host's fused Adam, if ``optimizer`` is one: whether it
            runs in AdamW mode (see ``fast_adam_kind``).
    """

    def __init__(self, optimizer, masters: List[torch.Tensor], kernels, fused_adamw: Optional[bool] = None):
        self.optimizer, self.masters, self.kernels = optimizer, masters, kernels
        self.adam = fast_adam_kind(optimizer, fused_adamw)
        self.fused_adamw = fused_adamw

    @property
    def name(self) -> str:
        return f"fused Adam ({self.adam})" if self.adam else "generic Peek"

    def __call__(self, grads: List[torch.Tensor], grad_scale: float, commit: bool, outs: List[torch.Tensor]) -> None:
        """Update from gradient sums ``grads`` (times ``grad_scale``) into ``outs``;
        ``commit=False`` leaves master weights and optimizer state untouched."""
        if self.adam is not None:
            for i, master in enumerate(self.masters):
                self._fused_adam(i, master, grads[i], grad_scale, commit, outs[i])
            return
        if not commit:
            saved = [(m.detach().clone(), copy.deepcopy(self.optimizer.state.get(m))) for m in self.masters]
        for m, g in zip(self.masters, grads):
            m.grad = g * grad_scale
        self.optimizer.step()
        for m, out in zip(self.masters, outs):
            m.grad = None
            out.copy_(m)
        if not commit:
            for m, (value, state) in zip(self.masters, saved):
                m.data.copy_(value)
                if state is None:
                    self.optimizer.state.pop(m, None)
                else:
                    self.optimizer.state[m] = state

    def _fused_adam(self, i, master, grad, grad_scale, commit, out):
        group = self.optimizer.param_groups[i]
        state = self.optimizer.state[master]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0) if self.adam == "torch" else 0
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
        if self.adam == "torch":
            adamw = bool(group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)))
        else:
            adamw = bool(self.fused_adamw)
        beta1, beta2 = group["betas"]
        self.kernels.adamw_update(master, grad, state["exp_avg"], state["exp_avg_sq"], out,
                                  step=int(state["step"]) + 1, lr=float(group["lr"]), beta1=float(beta1),
                                  beta2=float(beta2), eps=float(group["eps"]),
                                  weight_decay=float(group["weight_decay"]), grad_scale=grad_scale, commit=commit,
                                  adamw=adamw)
        if commit:
            state["step"] = state["step"] + 1


__all__ = ["ShardUpdate", "fast_adam_kind", "clip_coefficient"]
