"""EDiT's pseudo-gradient penalty, as pure logic on replica norms (no tensors).

At a sync every replica ``i`` brings its pseudo-gradient ``δ^i`` (start −
end of the period), its global norm ``‖δ^i‖`` and, in A-EDiT, the number of
inner steps ``s_i`` it ran in the period. The averaged pseudo-gradient is
``δ̄ = Σ_i w_i δ^i`` with::

    w_i ∝ a_i · s_i · e^{−‖δ^i‖}   (weighting "norm": softmax of −‖δ‖ over the kept replicas)
    w_i ∝ a_i · s_i                (weighting "mean")
    a_i = 0 if replica i is anomalous this period, else 1;  s_i = 1 outside A-EDiT

normalised to sum 1. Clipping of ``δ̄`` itself (``δ̄ · min(1, c / (‖δ̄‖ + 1e-6))``)
needs ``‖δ̄‖`` and is done by the caller with ``clip_coefficient``.

Anomaly elimination keeps, per replica, statistics of its norm: the plain
mean and variance (Welford) over the first ``warmup_syncs`` syncs, an
exponentially weighted mean and variance (``ewma_alpha``) after. Once warm,
a norm whose z-score ``(‖δ^i‖ − mean_i) / std_i`` exceeds ``threshold`` marks
the replica anomalous: it contributes zero that period (it still restarts
from the new global model), and its norm does *not* update its statistics
(EDiT's reference code feeds the inflated norm in, which widens the band the
next outlier must clear).
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence


@dataclass
class AnomalyDetector:
    """Per-replica norm statistics and the z-score test."""
    replicas: int
    alpha: float = 0.02
    warmup_syncs: int = 10
    threshold: float = 3.0
    count: List[int] = field(default_factory=list)
    mean: List[float] = field(default_factory=list)
    var: List[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.count:
            self.count, self.mean, self.var = [0] * self.replicas, [0.0] * self.replicas, [0.0] * self.replicas

    def z_score(self, i: int, norm: float) -> Optional[float]:
        """None while replica ``i`` is warming up."""
        if self.count[i] < max(self.warmup_syncs, 2):
            return None
        std = math.sqrt(self.var[i])
        return (norm - self.mean[i]) / std if std > 0 else (math.inf if norm > self.mean[i] else 0.0)

    def observe(self, norms: Sequence[float]) -> List[bool]:
        """Flag this sync's anomalous replicas and update the others' statistics."""
        flags = []
        for i, n in enumerate(norms):
            z = self.z_score(i, n)
            anomalous = z is not None and (not math.isfinite(n) or z > self.threshold)
            flags.append(anomalous)
            if not anomalous and math.isfinite(n):
                self._update(i, n)
        return flags

    def _update(self, i: int, n: float) -> None:
        c = self.count[i] = self.count[i] + 1
        d = n - self.mean[i]
        if c <= max(self.warmup_syncs, 2):  # Welford: the plain mean and (population) variance so far
            self.mean[i] += d / c
            self.var[i] += (d * (n - self.mean[i]) - self.var[i]) / c
        else:  # exponentially weighted mean and variance
            self.mean[i] += self.alpha * d
            self.var[i] = (1.0 - self.alpha) * (self.var[i] + self.alpha * d * d)

    def state_dict(self) -> dict:
        return {"count": list(self.count), "mean": list(self.mean), "var": list(self.var)}

    def load_state_dict(self, sd: dict) -> None:
        if len(sd["count"]) != self.replicas:
            raise ValueError(f"anomaly statistics were saved for {len(sd['count'])} replicas, this run has "
                             f"{self.replicas}")
        self.count, self.mean, self.var = list(sd["count"]), list(sd["mean"]), list(sd["var"])


def replica_weights(norms: Sequence[float], *, weighting: str = "mean", steps: Optional[Sequence[float]] = None,
                    anomalous: Optional[Sequence[bool]] = None) -> List[float]:
    """``w_i`` of the module docstring. All zero when every replica is anomalous (the outer step then
    gets a zero pseudo-gradient: momentum alone moves the anchor)."""
    R = len(norms)
    keep = [not (anomalous or [False] * R)[i] for i in range(R)]
    s = list(steps) if steps is not None else [1.0] * R
    if weighting == "norm":
        low = min((n for n, k in zip(norms, keep) if k), default=0.0)  # shift: a stable softmax
        raw = [k * si * math.exp(-(n - low)) if k else 0.0 for n, si, k in zip(norms, s, keep)]
    elif weighting == "mean":
        raw = [float(si) if k else 0.0 for si, k in zip(s, keep)]
    else:
        raise ValueError(f'unknown weighting {weighting!r}: "mean" or "norm"')
    total = sum(raw)
    return [r / total for r in raw] if total > 0 else [0.0] * R


def clip_scale(norm: float, clip: Optional[float]) -> float:
    """EDiT's clip of the averaged pseudo-gradient: ``min(1, c / (‖δ̄‖ + 1e-6))``; 1 without a clip."""
    return 1.0 if clip is None else min(1.0, clip / (norm + 1e-6))


__all__ = ["AnomalyDetector", "replica_weights", "clip_scale"]
