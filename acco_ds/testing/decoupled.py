"""Float64 reference of ``"mode": "decoupled"`` (Decoupled DiLoCo): learners that never wait for each other.

This is the test oracle of docs/design/decoupled.md. It writes the rule as directly as possible, on one flat
parameter vector, in virtual time, and knows nothing of sockets, shards or processes.

The syncer holds the global model ``θ_g`` (version ``v``, starting at 0 with the initial weights) and the outer
momentum ``m``. Learner ``i`` (a replica group of ``k`` ranks) runs::

    loop:  θ ← θ_g(v_i)  (the version it last received);  H inner steps
           send  Δ_i = θ_g(v_i) − θ,  its tokens (or steps),  v_i
           wait for the merge that holds Δ_i;  adopt its θ_g and version

The syncer merges every pending Δ once at least ``K`` (``min_quorum``, capped by the number of live learners) are
pending and either the grace window has passed since the K-th arrived or every live learner is pending::

    Δ̄ = Σ w_i Δ_i / Σ w_i        (w_i = tokens, or 1 with merge "equal")
    outer step on Δ̄              (Nesterov SGD, torch's rule; or Delayed Nesterov, below)
    v ← v + 1;  every merged learner gets θ_g(v)

Staleness ``v − v_i`` is not corrected under ``"none"``. ``"delayed_nesterov"`` (Liu et al., arXiv 2401.09135,
momentum activation c = 0) folds the momentum in only every ``N`` merges and applies the plain averaged
pseudo-gradient in between::

    B ← B + Δ̄;  j ← j + 1
    j < N:   x ← x − η Δ̄ / N
    j = N:   m ← μ m + B / N;  x ← x − η (Δ̄ / N + μ m);  B ← 0;  j ← 0

Over a window of N merges ``x`` moves by ``η (B/N + μ m)``: one Nesterov step on the window's mean. With N = 1
it is plain Nesterov.

A learner that dies before its Δ is merged has it dropped (it is not there to adopt the result); a relaunched
learner starts from the current θ_g. Every merge is logged (``MergeRecord``); ``replay`` recomputes the same
θ_g from a log alone, whatever the timing that produced it, which is how a run of the engine (where arrival
order depends on wall time) is checked.
"""

import heapq
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .simulator import make_replicas, replica_inner_step

from torch.nn.utils import parameters_to_vector, vector_to_parameters


@dataclass
class Contribution:
    """One learner's pseudo-gradient inside a merge."""
    learner: int
    base: int  # the version v_i its period started from
    steps: int  # inner steps in its period
    tokens: int  # its merge weight under "tokens"

    @property
    def as_dict(self) -> dict:
        return {"learner": self.learner, "base": self.base, "steps": self.steps, "tokens": self.tokens}


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
                                                    int(c["tokens"])) for c in d["contributions"]],
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


class _Learners:
    """M learners of ``k`` ranks in float64; learner ``i``'s rank ``r`` reads ``micro_batch(i*k + r, n)``."""

    def __init__(self, model, loss_fn, micro_batch, M, k, gas, optimizer_fn, clip, lr_lambda, dtype):
        self.M, self.k, self.gas, self.loss_fn, self.micro_batch, self.clip = M, k, gas, loss_fn, micro_batch, clip
        self.models, self.opts, self.scheds, self.params = make_replicas(model, M, optimizer_fn, lr_lambda, dtype)
        self.nxt = [0] * (M * k)
        self.dtype = dtype

    def theta(self, i: int) -> torch.Tensor:
        return parameters_to_vector([p.detach() for p in self.params[i]]).clone()

    def set(self, i: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(value.to(self.dtype).clone(), self.params[i])

    def period(self, i: int, start: torch.Tensor, steps: int) -> torch.Tensor:
        """Train learner ``i`` ``steps`` inner steps from ``start``; return its Δ = start − end."""
        self.set(i, start)
        for _ in range(steps):
            replica_inner_step(self.models[i], self.params[i], range(i * self.k, (i + 1) * self.k), self.gas,
                               self.nxt, self.loss_fn, self.micro_batch, self.opts[i], self.clip, self.scheds[i])
        return start - self.theta(i)


def auto_grace(period_ewma: Optional[float], fraction: float = 0.1) -> float:
    """``grace_s: "auto"``: a tenth of the learners' mean period (EWMA of arrival-to-arrival times); 0 before
    any period has been measured. The engine's syncer uses the same rule."""
    return 0.0 if period_ewma is None else fraction * period_ewma


def simulate_decoupled(model: torch.nn.Module, loss_fn: Callable, micro_batch: Callable, *, learners: int,
                       group_size: int, gradient_accumulation_steps: int, sync_every: int, periods: int,
                       optimizer_fn: Callable, outer_lr: float, outer_momentum: float, nesterov: bool,
                       min_quorum: int = 1, grace_s: float = 0.0, merge: str = "tokens", staleness: str = "none",
                       nesterov_delay: Optional[int] = None, step_time: Optional[Sequence[float]] = None,
                       deaths: Optional[Dict[int, float]] = None, rejoins: Optional[Dict[int, float]] = None,
                       tokens_per_step: int = 1, lr_lambda=None, clip: float = 0.0,
                       dtype: torch.dtype = torch.float64) -> dict:
    """Run every learner ``periods`` periods of ``sync_every`` inner steps in virtual time (``step_time[i]``
    seconds per inner step of learner i, default 1). ``deaths[i]``: learner i dies at that time (its period in
    progress, and a Δ waiting for its merge, are dropped); ``rejoins[i]``: it comes back then, from the current
    θ_g, with its periods left. Returns ``{"theta": θ_g, "version": v, "versions": {v: θ_g}, "log":
    [MergeRecord], "learner_periods": [...], "idle_s": [...]}``. With ``min_quorum`` = learners and
    ``grace_s`` 0 the result is ``simulate_local_sgd("diloco", ...)``'s anchor."""
    M = learners
    step_time = list(step_time or [1.0] * M)
    deaths, rejoins = dict(deaths or {}), dict(rejoins or {})
    L = _Learners(model, loss_fn, micro_batch, M, group_size, gradient_accumulation_steps, optimizer_fn, clip,
                  lr_lambda, dtype)
    rule = OuterRule(L.theta(0), outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov, merge=merge,
                     staleness=staleness, nesterov_delay=nesterov_delay or M)
    live = set(range(M))
    pending: Dict[int, tuple] = {}  # learner -> (Δ, Contribution, arrival time)
    base = [0] * M
    done = [0] * M
    epoch = [0] * M  # bumps when a learner dies: its scheduled events become stale
    idle = [0.0] * M
    waiting_since: Dict[int, float] = {}
    log: List[MergeRecord] = []
    events: list = []
    seq = [0]
    last_arrival: Dict[int, float] = {}
    period_ewma: List[Optional[float]] = [None]

    def push(t, prio, kind, who, *data):
        seq[0] += 1
        heapq.heappush(events, (t, prio, seq[0], kind, who, data))

    def start(i, t):
        if done[i] >= periods:
            live.discard(i)
            return
        delta = L.period(i, rule.history[rule.version], sync_every)
        base[i] = rule.version
        push(t + sync_every * step_time[i], 0, "arrive", i, epoch[i], delta)

    def maybe_merge(t, check_only=False):
        need = max(1, min(min_quorum, len(live)))  # K, capped by the learners alive
        if len(pending) < need:
            return
        kth = sorted(p[2] for p in pending.values())[need - 1]  # when the K-th pending Δ arrived
        grace = auto_grace(period_ewma[0]) if grace_s == "auto" else float(grace_s)
        everyone = live <= set(pending)
        if not (everyone or t >= kth + grace - 1e-12):
            if not check_only:
                push(kth + grace, 1, "check", -1)
            return
        order = sorted(pending, key=lambda j: (pending[j][2], j))  # arrival order, then learner id
        contribs = [pending[j][1] for j in order]
        rule.step(rule.mean([pending[j][0] for j in order], [c.tokens for c in contribs]))
        log.append(MergeRecord(rule.version, contribs, t))
        for j in order:
            idle[j] += t - waiting_since.pop(j)
            done[j] += 1
        pending.clear()
        for j in order:
            start(j, t)

    for i in range(M):
        start(i, 0.0)
    for i, t in deaths.items():
        push(t, -1, "die", i)
    for i, t in rejoins.items():
        push(t, -1, "rejoin", i)
    while events:
        t, _, _, kind, i, data = heapq.heappop(events)
        if kind == "die":
            live.discard(i)
            epoch[i] += 1
            pending.pop(i, None)
            waiting_since.pop(i, None)
            maybe_merge(t)
        elif kind == "rejoin":
            live.add(i)
            start(i, t)
        elif kind == "arrive":
            if data[0] != epoch[i]:
                continue
            if i in last_arrival:
                span = t - last_arrival[i]
                period_ewma[0] = span if period_ewma[0] is None else 0.7 * period_ewma[0] + 0.3 * span
            last_arrival[i] = t
            pending[i] = (data[1], Contribution(i, base[i], sync_every, sync_every * tokens_per_step), t)
            waiting_since[i] = t
            maybe_merge(t)
        elif kind == "check":
            maybe_merge(t, check_only=True)
    return {"theta": rule.x, "version": rule.version, "versions": rule.history, "log": log,
            "learner_periods": done, "idle_s": idle}


def replay(log: Sequence, model: torch.nn.Module, loss_fn: Callable, micro_batch: Callable, *, learners: int,
           group_size: int, gradient_accumulation_steps: int, optimizer_fn: Callable, outer_lr: float,
           outer_momentum: float, nesterov: bool, merge: str = "tokens", staleness: str = "none",
           nesterov_delay: Optional[int] = None, lr_lambda=None, clip: float = 0.0,
           dtype: torch.dtype = torch.float64) -> dict:
    """θ_g after every merge of ``log`` (``MergeRecord``s or their ``as_dict()``), recomputed from the log alone:
    learner i's contribution to a merge is its next period (``steps`` inner steps on its next data) trained from
    θ_g of the recorded base version. Every learner must appear in the log in the order it trained (a learner
    that died has periods that never reached a merge: they are not in the log and used no data here, so a
    replay of a run with deaths matches only when the engine's data follow the same rule). Returns
    ``{"theta": θ_g, "versions": {v: θ_g}}``."""
    records = [r if isinstance(r, MergeRecord) else MergeRecord.from_dict(r) for r in log]
    L = _Learners(model, loss_fn, micro_batch, learners, group_size, gradient_accumulation_steps, optimizer_fn,
                  clip, lr_lambda, dtype)
    rule = OuterRule(L.theta(0), outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov, merge=merge,
                     staleness=staleness, nesterov_delay=nesterov_delay or learners)
    # A learner trains period p before any merge whose version is above its base: compute Δs in log order.
    for rec in records:
        if rec.version != rule.version + 1:
            raise ValueError(f"merge log out of order: version {rec.version} after {rule.version}")
        deltas = []
        for c in rec.contributions:
            if c.base not in rule.history:
                raise ValueError(f"merge {rec.version}: learner {c.learner} started from version {c.base}, "
                                 f"which this log never made")
            deltas.append(L.period(c.learner, rule.history[c.base], c.steps))
        rule.step(rule.mean(deltas, [c.tokens for c in rec.contributions]))
    return {"theta": rule.x, "versions": rule.history}


__all__ = ["simulate_decoupled", "replay", "OuterRule", "MergeRecord", "Contribution", "auto_grace"]
