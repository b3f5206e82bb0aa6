"""Pure-torch implementation of the acco_ds op: the reference the native
kernels are tested against, and the fallback when they cannot be built.

They follow torch.optim.Adam(W)'s single-tensor step operation by operation,
so they agree with it (the tests check) and show plainly what the fused
kernels compute in one pass.
"""

from typing import Optional

import torch


@torch.no_grad()
def adamw_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 out: Optional[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, grad_scale: float, commit: bool, adamw: bool = True) -> None:
    """Adam(W) update of a flat fp32 shard from a gradient *sum*.

    The gradient is ``grad * grad_scale``; ``step`` is the 1-based step the
    update corresponds to. ``commit=True`` advances ``master``, ``exp_avg`` and
    ``exp_avg_sq``; ``commit=False`` (a Peek) leaves them untouched and only
    writes the would-be parameters into ``out`` (cast to ``out.dtype``).
    """
    if not commit:
        # The naive Peek: work on copies (the fused kernel needs none).
        master, exp_avg, exp_avg_sq = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    g = grad * grad_scale
    if weight_decay != 0:
        if adamw:
            master.mul_(1 - lr * weight_decay)  # decoupled (AdamW)
        else:
            g = g.add(master, alpha=weight_decay)  # L2 (Adam)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if out is not None:
        out.copy_(master)
