"""The outer update of the local-SGD family, on fp32 shards of the anchor.

    m ← μ m + δ̄ / λ;   m ← clamp(m, −c, c)  (optional)
    x ← x − η (δ̄ / λ + μ m)   Nesterov (torch's SGD with nesterov=True; DiLoCo)
    x ← x − η m               heavy ball (CO2: η = α, μ = β)

``δ̄`` is the averaged pseudo-gradient (start − end of a period: positive is
the descent direction), ``x`` the anchor (the last global model), ``m`` the
outer momentum. With λ = 1 and no clipping this is exactly
``torch.optim.SGD(lr=η, momentum=μ, nesterov=...)`` stepped on ``x`` with
gradient ``δ̄`` (torch starts its momentum buffer at the first gradient,
which equals ``μ·0 + δ̄``).
"""

from typing import Optional

import torch


@torch.no_grad()
def outer_step(x: torch.Tensor, m: torch.Tensor, mean_delta: torch.Tensor, *, lr: float, momentum: float,
               nesterov: bool, staleness_penalty: float = 1.0, momentum_clip: Optional[float] = None) -> None:
    """One outer step in place on the shards ``x`` and ``m`` (fp32)."""
    g = mean_delta if staleness_penalty == 1.0 else mean_delta / staleness_penalty
    m.mul_(momentum).add_(g)
    if momentum_clip is not None:
        m.clamp_(-momentum_clip, momentum_clip)
    if nesterov:
        x.sub_(g.add(m, alpha=momentum), alpha=lr)
    else:
        x.sub_(m, alpha=lr)


__all__ = ["outer_step"]
