"""The parts of the float64 reference of ``"mode": "decoupled"`` (``testing.decoupled``): the merge log's
records, the syncer's arithmetic and the learners (their periods, the adoption of a merge under adopt "wait" and
"overlap", the up-link's quantization)."""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..runtime.rounds.buffers import padded_numel
from .compressed import Quantizer
from .simulator import make_replicas, replica_inner_step


@dataclass
class Contribution:
    """One learner's pseudo-gradient inside a merge."""
    learner: int
    base: int  # the version v_i its period started from
    steps: int  # inner steps in its period
    tokens: int  # its merge weight under "tokens"
    adopted_after: int = 0  # inner steps of its period taken before it adopted ``base`` (adopt "overlap")

    @property
    def as_dict(self) -> dict:
        return {"learner": self.learner, "base": self.base, "steps": self.steps, "tokens": self.tokens,
                "adopted_after": self.adopted_after}


@dataclass
class MergeRecord:
    """One merge: the version it made, who was in it, and how stale each was (``version − 1 − base``)."""
    version: int
    contributions: List[Contribution]
    time: float = 0.0

    @property
    def staleness(self) -> List[int]:
        return [self.version - 1 - c.base for c in self.contributions]

    def as_dict(self) -> dict:
        return {"version": self.version, "time": self.time, "learners": [c.learner for c in self.contributions],
                "tokens": [c.tokens for c in self.contributions], "staleness": self.staleness,
                "contributions": [c.as_dict for c in self.contributions]}

    @classmethod
    def from_dict(cls, d: dict) -> "MergeRecord":
        return cls(int(d["version"]), [Contribution(int(c["learner"]), int(c["base"]), int(c["steps"]),
                                                    int(c["tokens"]), int(c.get("adopted_after", 0)))
                                       for c in d["contributions"]],
                   float(d.get("time", 0.0)))


class OuterRule:
    """The syncer's arithmetic on a flat vector: the weighted mean and the outer step (reference form)."""

    def __init__(self, theta0: torch.Tensor, *, outer_lr: float, outer_momentum: float, nesterov: bool,
                 merge: str = "tokens", staleness: str = "none", nesterov_delay: int = 1):
        if merge not in ("tokens", "equal") or staleness not in ("none", "delayed_nesterov"):
            raise ValueError(f"unknown merge {merge!r} or staleness {staleness!r}")
        self.x = theta0.clone()
        self.m = torch.zeros_like(self.x)
        self.buffer = torch.zeros_like(self.x)
        self.since = 0
        self.version = 0
        self.lr, self.mu, self.nesterov = outer_lr, outer_momentum, nesterov
        self.merge, self.staleness, self.N = merge, staleness, nesterov_delay
        self.history = {0: self.x.clone()}  # θ_g of every version

    def mean(self, deltas: Sequence[torch.Tensor], tokens: Sequence[int]) -> torch.Tensor:
        w = [1.0] * len(deltas) if self.merge == "equal" or len(set(tokens)) == 1 else [float(t) for t in tokens]
        total = sum(w)
        out = torch.zeros_like(self.x)
        for wi, d in zip(w, deltas):
            out += wi * d
        return out / total

    def step(self, mean: torch.Tensor) -> None:
        lr, mu = self.lr, self.mu
        if self.staleness == "delayed_nesterov":
            self.buffer += mean
            self.since += 1
            if self.since < self.N:
                self.x -= lr * mean / self.N
            else:
                self.m = mu * self.m + self.buffer / self.N
                self.x -= lr * (mean / self.N + mu * self.m)
                self.buffer.zero_()
                self.since = 0
        else:
            self.m = mu * self.m + mean
            self.x -= lr * (mean + mu * self.m if self.nesterov else self.m)
        self.version += 1
        self.history[self.version] = self.x.clone()


class Learners:
    """M learners of ``k`` ranks in float64 (``k``: one size, or each learner's); the ranks are numbered learner
    after learner, and rank ``r`` reads ``micro_batch(r, n)`` (learners of one size: learner ``i``'s rank ``j`` is
    ``i k + j``). ``compression``: ``{"dtype", "block_size", "error_feedback"}`` of the up-link, or None (fp32)."""

    def __init__(self, model, loss_fn, micro_batch, M, k, gas, optimizer_fn, clip, lr_lambda, dtype,
                 compression: Optional[dict] = None):
        self.sizes = [k] * M if isinstance(k, int) else [int(n) for n in k]
        if len(self.sizes) != M:
            raise ValueError(f"group sizes {self.sizes} name {len(self.sizes)} learners, not {M}")
        self.first = [sum(self.sizes[:i]) for i in range(M)]  # each learner's first rank
        self.M, self.gas, self.loss_fn, self.micro_batch, self.clip = M, gas, loss_fn, micro_batch, clip
        self.models, self.opts, self.scheds, self.params = make_replicas(model, M, optimizer_fn, lr_lambda, dtype)
        self.nxt = [0] * sum(self.sizes)
        self.dtype = dtype
        self.sent: List[Optional[torch.Tensor]] = [None] * M  # each learner's weights at its last send
        self.quant = None if compression is None else Quantizer(compression["dtype"], compression["block_size"],
                                                                 compression.get("error_feedback", True))

    def theta(self, i: int) -> torch.Tensor:
        return parameters_to_vector([p.detach() for p in self.params[i]]).clone()

    def set(self, i: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(value.to(self.dtype).clone(), self.params[i])

    def forget(self, i: int) -> None:
        """Learner ``i`` died: its relaunch has no weights at a send and no error-feedback residuals."""
        self.sent[i] = None
        if self.quant is not None:
            self.quant.residuals = {key: r for key, r in self.quant.residuals.items() if key[0] != i}

    def period(self, i: int, base: torch.Tensor, steps: int, adopt_at: int = 0) -> torch.Tensor:
        """Learner ``i``'s period of ``steps`` inner steps from θ_g ``base``: the first ``adopt_at`` steps go on
        from its own weights, then ``θ ← base + (θ − sent)`` (adopt_at 0: ``θ ← base``); returns the Δ = base − θ
        that reaches the syncer (quantized as the up-link sends it)."""

        def adopt():
            self.set(i, base if self.sent[i] is None else base + (self.theta(i) - self.sent[i]))

        if adopt_at == 0:
            self.set(i, base)
        for n in range(steps):
            if n == adopt_at and n > 0:
                adopt()
            ranks = range(self.first[i], self.first[i] + self.sizes[i])
            replica_inner_step(self.models[i], self.params[i], ranks, self.gas,
                               self.nxt, self.loss_fn, self.micro_batch, self.opts[i], self.clip, self.scheds[i])
        if adopt_at >= steps > 0:
            adopt()
        self.sent[i] = self.theta(i)
        return self.uplink(i, base - self.sent[i])

    def uplink(self, i: int, delta: torch.Tensor) -> torch.Tensor:
        """What the syncer merges of ``delta``: itself, or each rank's ZeRO-1 slice (the flat vector padded to
        ``padded_numel(n, k)``, k equal parts) quantized with that rank's residual, dequantized."""
        if self.quant is None:
            return delta
        n, k = delta.numel(), self.sizes[i]
        padded = torch.cat([delta, delta.new_zeros(padded_numel(n, k) - n)])
        P = padded.numel() // k
        return torch.cat([self.quant.send(padded[r * P:(r + 1) * P], key=(i, r)) for r in range(k)])[:n]


def auto_grace(period_ewma: Optional[float], fraction: float = 0.1) -> float:
    """``grace_s: "auto"``: a tenth of the learners' mean period (EWMA of arrival-to-arrival times); 0 before
    any period has been measured. The engine's syncer uses the same rule."""
    return 0.0 if period_ewma is None else fraction * period_ewma


__all__ = ["Contribution", "MergeRecord", "OuterRule", "Learners", "auto_grace"]
