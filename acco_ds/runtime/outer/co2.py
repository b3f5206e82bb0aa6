"""CO2: the outer all-reduce hidden behind the next period, applied one period late.

At the end of period t the replica sends ``δ_t = s_t − θ`` (where it started
the period minus where it ended) to the all-reduce, which runs on a
communication thread of its own (own process group, own CUDA stream) while
every replica computes period t+1 from where it stood. At the end of period
t+1 the replica waits for ``δ̄_t``, the outer step gives ``x_{t+1}`` (heavy
ball by default: ``m ← β m + δ̄/λ``, optionally clamped, ``x ← x − α m``),
and the replica jumps to ``x_{t+1} − δ_{t+1}``: the new global model plus
its own progress of period t+1, which it sends next. The applied
pseudo-gradient is one period stale; the staleness penalty λ damps it.
At the first sync nothing is in flight: the replica goes on where it stood.
"""

import time

import torch

from .base import LocalSGD


class CO2(LocalSGD):
    """The outer loop of mode ``co2``: ``start`` (where each period began) and ``in_flight`` (the sent
    pseudo-gradient, replaced by its mean when the all-reduce is done) are sharded like the anchor.
    Args: as ``LocalSGD``."""

    overlapped = True

    def __init__(self, acco, shards, groups):
        super().__init__(acco, shards, groups)
        self.start = [m.detach().clone() for m in shards.masters]
        self.in_flight = [torch.zeros_like(m) for m in shards.masters]
        # What this replica sent, kept where a sync can be discarded (replicas that come and go): a discarded
        # mean leaves the period's progress to be sent again.
        self.sent = [torch.zeros_like(m) for m in shards.masters] if self.transport.fault_tolerant else None
        self.sent_steps = 0  # inner steps that progress covers (merge "tokens")

    @torch.no_grad()
    def _sync(self, sync) -> None:
        masters = self.shards.masters
        deltas = [s - m for s, m in zip(self.start, masters)]  # δ = start − end of the period
        if sync.wait_previous:
            self.settle()
            if self.transport.commit():
                self._outer(self.in_flight)
            else:  # the mean was discarded: this replica's progress of that period is sent again with this one
                for d, sent in zip(deltas, self.sent):
                    d.add_(sent)
                self.unsent_steps += self.sent_steps
        if sync.blocking or sync.send:
            self.begin_sync()
            if self.healed:  # this replica just took a peer's state: it stands at the anchor, nothing to send
                for d in deltas:
                    d.zero_()
        if sync.blocking:  # the last sync of a run: average this period at once
            self._average(deltas)
            if self.transport.commit():
                self._outer(deltas)
                self.unsent_steps = 0
            new = self.anchor
        elif sync.send:  # jump to the new global model plus this replica's own progress, send that progress
            new = [x - d for x, d in zip(self.anchor, deltas)]
            for buf, d in zip(self.in_flight, deltas):
                buf.copy_(d)
            if self.sent is not None:
                for buf, d in zip(self.sent, deltas):
                    buf.copy_(d)
            self.transport.average_async(self.in_flight, weight=self.merge_weight())
            self.sent_steps, self.unsent_steps = self.unsent_steps, 0
        else:  # the last sync with no inner step since the previous one: every replica takes the anchor
            new = self.anchor
        for s, n in zip(self.start, new):
            s.copy_(n)
        self._install(new)

    def settle(self) -> None:
        """Wait for the in-flight average (it arrives in ``in_flight``)."""
        if self.transport.busy:
            t0 = time.perf_counter()
            self.outer_comm_s += self.transport.collect()
            self.outer_wait_s += time.perf_counter() - t0

    @torch.no_grad()
    def after_join(self, mean) -> None:
        """A replica that joined starts its period at the new anchor, with nothing in flight."""
        super().after_join(mean)
        for s, x in zip(self.start, self.anchor):
            s.copy_(x)
        for buf in self.in_flight + (self.sent or []):
            buf.zero_()
        self.schedule.in_flight = False

    def state_dict(self) -> dict:
        sd = super().state_dict()  # settled: an in-flight average is saved as received, applied at the next sync
        sd.update(start=[t.clone() for t in self.start], in_flight=[t.clone() for t in self.in_flight])
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd) -> None:
        super().load_state_dict(sd)
        for mine, saved in ((self.start, sd["start"]), (self.in_flight, sd["in_flight"])):
            for dst, src in zip(mine, saved):
                dst.copy_(src)

    def reshard_state(self, first, mine, plan) -> dict:
        sd = super().reshard_state(first, mine, plan)
        # start: where this replica's period began (its own); in_flight: after a save, the received mean (the
        # same in every replica), applied at the next sync.
        sd.update(start=plan.piece([s["start"] for s in mine]), in_flight=plan.piece([s["in_flight"] for s in first]))
        return sd

    @torch.no_grad()
    def restart(self) -> None:
        super().restart()
        for dst, src in zip(self.start, self.shards.masters):
            dst.copy_(src)
        for buf in self.in_flight:
            buf.zero_()


__all__ = ["CO2"]
