"""The arithmetic of one syncer shard of ``"mode": "decoupled"``: its slice of θ_g, the outer momentum, the
version and Delayed Nesterov's buffer (docs/design/decoupled.md). No sockets, no threads."""

from typing import List, Optional

import torch

from ..update import outer_step
from . import wire


class ShardState:
    """The arithmetic of one shard: θ_g slice ``x``, momentum ``m``, version, Delayed Nesterov's buffer."""

    def __init__(self, outer_lr: float, outer_momentum: float, nesterov: bool, merge: str = "tokens",
                 staleness: str = "none", nesterov_delay: int = 1):
        self.lr, self.mu, self.nesterov = outer_lr, outer_momentum, nesterov
        self.merge, self.staleness, self.N = merge, staleness, max(1, int(nesterov_delay))
        self.x: Optional[torch.Tensor] = None
        self.m = self.buffer = None
        self.since = 0
        self.version = wire.NO_VERSION

    @property
    def empty(self) -> bool:
        return self.x is None

    def adopt(self, theta: torch.Tensor) -> None:
        self.x = theta.detach().to(torch.float32).clone()
        self.m = torch.zeros_like(self.x)
        self.buffer = torch.zeros_like(self.x) if self.staleness == "delayed_nesterov" else None
        self.version = 0

    def mean(self, deltas: List[torch.Tensor], tokens: List[int]) -> torch.Tensor:
        """Σ w Δ / Σ w; equal weights (merge "equal", or equal tokens) sum then divide, as an all-reduce does.
        Unequal weights are applied in float64 (a weight of up to 2^64 tokens stays exact enough)."""
        if len(deltas) == 1:
            return deltas[0]  # read only below: a Δ received without a copy stays so
        if self.merge == "equal" or len(set(tokens)) == 1:
            out = deltas[0].clone()
            for d in deltas[1:]:
                out += d
            return out.div_(len(deltas))
        total = float(sum(int(t) for t in tokens))
        out = torch.zeros(deltas[0].shape, dtype=torch.float64)
        for d, t in zip(deltas, tokens):
            out.add_(d, alpha=float(t) / total)
        return out.to(torch.float32)

    @torch.no_grad()
    def step(self, mean: torch.Tensor) -> None:
        if self.staleness == "delayed_nesterov":
            self.buffer += mean
            self.since += 1
            if self.since < self.N:
                self.x.sub_(mean, alpha=self.lr / self.N)
            else:
                self.m.mul_(self.mu).add_(self.buffer, alpha=1.0 / self.N)
                self.x.sub_(mean.div(self.N).add_(self.m, alpha=self.mu), alpha=self.lr)
                self.buffer.zero_()
                self.since = 0
        else:
            outer_step(self.x, self.m, mean, lr=self.lr, momentum=self.mu, nesterov=self.nesterov)
        self.version += 1

    def state_dict(self) -> dict:
        return {"x": self.x, "m": self.m, "buffer": self.buffer, "since": self.since, "version": self.version}

    def load_state_dict(self, sd: dict) -> None:
        self.x, self.m, self.buffer = sd["x"], sd["m"], sd["buffer"]
        self.since, self.version = int(sd["since"]), int(sd["version"])


__all__ = ["ShardState"]
