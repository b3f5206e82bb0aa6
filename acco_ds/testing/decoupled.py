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

With adopt ``"overlap"`` a learner trains on after its send (its next period's steps count from the send) and
takes the merge at the first inner-step boundary after it was made, ``s ≥ 1`` steps into its next period, keeping
what it learned since the send; that period ends after ``max(H, s)`` steps (never before its merge is adopted,
so a learner never waits)::

    send:   Δ = θ_g(v_i) − θ;  sent ← θ
    adopt:  θ ← θ_g(v') + (θ − sent);  v_i ← v'       (s steps after the send; 0 steps: θ ← θ_g(v'))

so every inner step's progress lands in exactly one Δ; the log records ``s`` (``adopted_after``) per
contribution. The up-link may be block-quantized (``compression``): each rank r of learner i sends
``deq(Q(Δ_r + e_ir))`` of its ZeRO-1 slice, ``e_ir`` its error-feedback residual (``testing.compressed``'s
``Quantizer``, the wire format of ``ops.reference``); the syncer merges the dequantized values.

A learner that dies before its Δ is merged has it dropped (it is not there to adopt the result); a relaunched
learner starts from the current θ_g. Every merge is logged (``MergeRecord``); ``replay`` recomputes the same
θ_g from a log alone, whatever the timing that produced it, which is how a run of the engine (where arrival
order depends on wall time) is checked.
"""

import heapq
import math
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .decoupled_parts import Contribution, Learners, MergeRecord, OuterRule, auto_grace


def simulate_decoupled(model: torch.nn.Module, loss_fn: Callable, micro_batch: Callable, *, learners: int,
                       group_size, gradient_accumulation_steps: int, sync_every: int, periods: int,
                       optimizer_fn: Callable, outer_lr: float, outer_momentum: float, nesterov: bool,
                       min_quorum: int = 1, grace_s: float = 0.0, merge: str = "tokens", staleness: str = "none",
                       nesterov_delay: Optional[int] = None, step_time: Optional[Sequence[float]] = None,
                       deaths: Optional[Dict[int, float]] = None, rejoins: Optional[Dict[int, float]] = None,
                       tokens_per_step=1, lr_lambda=None, clip: float = 0.0, adopt: str = "wait",
                       compression: Optional[dict] = None, dtype: torch.dtype = torch.float64) -> dict:
    """Run every learner ``periods`` periods of ``sync_every`` inner steps in virtual time (``step_time[i]``
    seconds per inner step of learner i, default 1). ``deaths[i]``: learner i dies at that time (its period in
    progress, and a Δ waiting for its merge, are dropped); ``rejoins[i]``: it comes back then, from the current
    θ_g, with its periods left. Returns ``{"theta": θ_g, "version": v, "versions": {v: θ_g}, "log":
    [MergeRecord], "learner_periods": [...], "idle_s": [...]}``. With ``min_quorum`` = learners and
    ``grace_s`` 0 (adopt "wait", no compression) the result is ``simulate_local_sgd("diloco", ...)``'s anchor.
    ``adopt``: "wait" or "overlap" (module docstring); ``compression``: the up-link's ``{"dtype",
    "block_size", "error_feedback"}``. ``group_size`` and ``tokens_per_step``: one for every learner, or a list
    (learners of different sizes; their ranks are numbered learner after learner, ``Learners``)."""
    if adopt not in ("wait", "overlap"):
        raise ValueError(f"adopt must be 'wait' or 'overlap', got {adopt!r}")
    M = learners
    step_time = list(step_time or [1.0] * M)
    tokens = [tokens_per_step] * M if isinstance(tokens_per_step, int) else list(tokens_per_step)
    deaths, rejoins = dict(deaths or {}), dict(rejoins or {})
    L = Learners(model, loss_fn, micro_batch, M, group_size, gradient_accumulation_steps, optimizer_fn, clip,
                 lr_lambda, dtype, compression)
    rule = OuterRule(L.theta(0), outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov, merge=merge,
                     staleness=staleness, nesterov_delay=nesterov_delay or M)
    H = sync_every
    adopted, steps = [0] * M, [H] * M
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

    def start(i, t, adopt_at=0):
        """Learner ``i`` sent at time ``t`` (0 steps into the next period), or adopts at ``t``, ``adopt_at``
        steps into it (overlap): compute that period (``max(H, adopt_at)`` steps) and schedule its arrival."""
        if done[i] >= periods:
            live.discard(i)
            return
        steps[i] = max(H, adopt_at)
        delta = L.period(i, rule.history[rule.version], steps[i], adopt_at)
        base[i], adopted[i] = rule.version, adopt_at
        push(t + (steps[i] - adopt_at) * step_time[i], 0, "arrive", i, epoch[i], delta)

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
            sent_at = waiting_since.pop(j)
            done[j] += 1
            if adopt == "wait":
                idle[j] += t - sent_at
                start(j, t)
            else:  # the first step boundary after the merge; the learner never waits
                s = max(1, math.ceil((t - sent_at) / step_time[j] - 1e-9))
                start(j, sent_at + s * step_time[j], s)
        pending.clear()

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
            L.forget(i)
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
            pending[i] = (data[1], Contribution(i, base[i], steps[i], steps[i] * tokens[i], adopted[i]), t)
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
           compression: Optional[dict] = None, dtype: torch.dtype = torch.float64) -> dict:
    """θ_g after every merge of ``log`` (``MergeRecord``s or their ``as_dict()``), recomputed from the log alone:
    learner i's contribution to a merge is its next period (``steps`` inner steps on its next data) trained from θ_g
    of the recorded base version, adopted ``adopted_after`` steps into it (adopt "overlap"), its Δ quantized as the
    up-link sent it (``compression``). Every learner must appear in the log in the order it trained (a learner that
    died has periods that never reached a merge: they are not in the log and used no data here, so a replay of a run
    with deaths matches only when the engine's data follow the same rule).
    Returns ``{"theta": θ_g, "versions": {v: θ_g}}``."""
    records = [r if isinstance(r, MergeRecord) else MergeRecord.from_dict(r) for r in log]
    L = Learners(model, loss_fn, micro_batch, learners, group_size, gradient_accumulation_steps, optimizer_fn,
                 clip, lr_lambda, dtype, compression)
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
            deltas.append(L.period(c.learner, rule.history[c.base], c.steps, c.adopted_after))
        rule.step(rule.mean(deltas, [c.tokens for c in rec.contributions]))
    return {"theta": rule.x, "versions": rule.history}


__all__ = ["simulate_decoupled", "replay", "OuterRule", "MergeRecord", "Contribution", "auto_grace"]
