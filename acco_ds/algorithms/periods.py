"""The period schedule of the local-SGD family (DiLoCo, CO2, EDiT), as pure logic.

Replicas train alone for ``sync_every`` inner steps (a *period*), then
synchronise: every replica's pseudo-gradient ``δ = start − end`` of the
period is averaged across replicas and an outer optimizer step moves the
anchor ``x`` (the last global model).

``diloco`` (blocking)::

    period t:  every replica starts at x_t, runs H inner steps
    sync:      δ̄_t = mean_i δ_t^i;  x_{t+1} = OuterOpt(x_t, δ̄_t);  every replica restarts at x_{t+1}

``co2`` (overlapped, one period stale)::

    sync t:    send δ_t (all-reduce on the communication thread) while period t+1 computes
    sync t+1:  wait for δ̄_t;  x_{t+1} = OuterOpt(x_t, δ̄_t);  jump to x_{t+1} − δ_{t+1}^i;  send δ_{t+1}

``edit`` syncs like ``diloco`` (staleness zero); the engine overlaps the
outer step with the next forward pass, parameter group by parameter group.
A-EDiT (``sync_every=None``) ends a period when the engine says the period's
wall time is up, whatever its step count.

At the first sync of ``co2`` nothing is in flight yet: the replica goes on
from where it stood (the jump ``x_0 − δ_0 = θ_0^i``).

Nothing here touches tensors or threads; the engine asks the schedule what to
do after each inner step.
"""

from dataclasses import dataclass
from typing import Optional

DILOCO, CO2, EDIT = "diloco", "co2", "edit"


@dataclass(frozen=True)
class Sync:
    """What a sync point does."""
    period: int  # index of the period that just ended
    wait_previous: bool  # co2: wait for the previous period's averaged pseudo-gradient and apply it
    blocking: bool  # diloco: average this period's pseudo-gradient now and apply it
    send: bool  # co2: send this period's pseudo-gradient, applied at the next sync
    steps: int = 0  # inner steps in the period that just ended (A-EDiT weights replicas by them)
    early: bool = False  # ended before its time, for a joiner (fault_tolerance.join "early")


class PeriodSchedule:
    """Inner steps grouped into periods of ``sync_every``.

    Args:
        mode: ``diloco`` | ``co2`` | ``edit``.
        sync_every: inner steps per period (H); None: periods end on time (A-EDiT, ``edit`` only).
    """

    def __init__(self, mode: str, sync_every: Optional[int]):
        if mode not in (DILOCO, CO2, EDIT):
            raise ValueError(f"unknown local-SGD mode {mode!r}")
        if sync_every is None and mode != EDIT:
            raise ValueError("time-based periods (sync_every=None) are A-EDiT's: mode 'edit' only")
        if sync_every is not None and sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.mode, self.sync_every = mode, sync_every
        self.period = 0  # index of the current period (= syncs done)
        self.inner = 0  # inner steps done in the current period
        self.in_flight = False  # co2: a pseudo-gradient was sent and not applied yet

    @property
    def timed(self) -> bool:
        """A-EDiT: the period ends on wall time."""
        return self.sync_every is None

    def after_inner_step(self, time_up: bool = False, end_now: bool = False):
        """Count one inner step; return the ``Sync`` to run when the period ends, else None.
        ``time_up``: A-EDiT's period time has passed (ignored with step-based periods). ``end_now``: end the
        period here whatever its length (a replica waits to join: the sync heals it now)."""
        self.inner += 1
        due = time_up if self.timed else self.inner >= self.sync_every
        if not (due or end_now):
            return None
        return self._end_period(early=not due)

    def final_sync(self):
        """At the end of training: the sync that leaves every replica on one model (None: nothing to do)."""
        if self.inner == 0 and not self.in_flight:
            return None
        # co2: apply what is in flight; then average the last (possibly partial) period at once.
        sync = Sync(self.period, wait_previous=self.in_flight, blocking=self.inner > 0, send=False, steps=self.inner)
        self.period += 1 if self.inner else 0
        self.inner, self.in_flight = 0, False
        return sync

    def _end_period(self, early: bool = False) -> Sync:
        sync = Sync(self.period, wait_previous=self.in_flight, blocking=self.mode != CO2,
                    send=self.mode == CO2, steps=self.inner, early=early)
        self.period += 1
        self.inner = 0
        self.in_flight = sync.send
        return sync

    def restart(self) -> None:
        """A new period from now (the weights were replaced): nothing counted, nothing in flight."""
        self.inner, self.in_flight = 0, False

    def state_dict(self) -> dict:
        return {"mode": self.mode, "sync_every": self.sync_every, "period": self.period, "inner": self.inner,
                "in_flight": self.in_flight}

    def load_state_dict(self, sd: dict) -> None:
        for key in ("mode", "sync_every"):
            if sd[key] != getattr(self, key):
                raise ValueError(f"checkpoint was saved with local-SGD {key}={sd[key]!r} but this run has "
                                 f"{getattr(self, key)!r}: resume with the same acco block")
        self.period, self.inner = int(sd["period"]), int(sd["inner"])
        self.in_flight = bool(sd["in_flight"])


__all__ = ["PeriodSchedule", "Sync", "DILOCO", "CO2", "EDIT"]
