"""EDiT and A-EDiT: zero-staleness syncs applied layer by layer during the next forward pass.

A sync point is DiLoCo's (``δ = x − θ``, one outer step, every replica takes
the new anchor), but the outer step runs on the communication thread, chunk
by chunk in forward order (``edit_sync.LayerwiseSync``), while the next
forward pass proceeds: a module's forward waits only until its own
parameters are synced (``layerwise.ChunkGate``). EDiT's pseudo-gradient
penalty (anomaly elimination, norm weighting, clipping) is
``algorithms.penalty``.

A-EDiT (``sync_time_s``): a period ends when that much wall time passed
since the last sync (read from ``clock``; every rank of a replica takes its
slowest rank's time), whatever the replica's step count; replicas are
weighted by their inner steps of the period, and each keeps its own step
counters (``per_replica_counters``).
"""

import math
import time
from typing import List, Tuple

import torch
import torch.distributed as tdist

from ...algorithms.penalty import clip_scale
from ..rounds.update import squared_norm
from .base import LocalSGD
from .edit_sync import LayerwiseSync


class EDiT(LocalSGD):
    """The outer loop of mode ``edit``. Args: as ``LocalSGD``."""

    overlapped = True

    def __init__(self, acco, shards, groups):
        super().__init__(acco, shards, groups)
        # Replicas that come and go sync blocking (``base._blocking_sync``): a quorum's commit comes after the
        # whole all-reduce, so no layer may be installed before it.
        self.sync = None if self.transport.fault_tolerant else \
            LayerwiseSync(shards, groups, self.local, self.outer_comm, self.compression)
        self.timed = self.schedule.timed
        self.per_replica_counters = self.timed  # A-EDiT replicas run different step counts
        self.clock = time.monotonic  # A-EDiT's period timer; tests inject their own with set_clock
        self.period_start = self.clock()
        self._elapsed = 0.0  # period time at the last inner step (the replica's slowest rank)
        self._submitted_at = None
        self.max_sync_wait = 0.0  # longest time this replica waited for the others at a sync
        self.read_syncs = 0  # syncs collected by a read rather than by training

    # ------------------------------------------------------------- sync points
    def attach(self, module: torch.nn.Module) -> None:
        if self.sync is not None:
            self.sync.attach(module)  # forward waits per layer during a sync

    def wait(self) -> None:
        self.wait_sync()  # the layer-wise sync uses the inner thread's group

    def before_read(self) -> None:
        self.wait_sync(read=True)

    def settle(self) -> None:
        self.wait_sync(read=True)

    def set_clock(self, clock) -> None:
        """A-EDiT's period timer reads ``clock()`` (seconds); the current period restarts now."""
        self.clock = clock
        self.period_start = clock()

    def time_up(self) -> bool:
        """A-EDiT: has the period's time passed? Every rank of the replica takes its slowest rank's time."""
        if not self.timed:
            return False
        # Every rank of the replica (its data- and model-parallel ranks) takes its slowest rank's time.
        elapsed = self.groups.reduce(self.clock() - self.period_start, self.anchor[0].device, op=tdist.ReduceOp.MAX)
        self._elapsed = elapsed
        return elapsed >= self.local.sync_time_s

    def waited_s(self) -> float:
        """Seconds the compute side has waited for outer communication so far (hooks included)."""
        return self.outer_wait_s + (self.sync.gate.waited_s if self.sync is not None else 0.0)

    def wait_sync(self, read: bool = False) -> None:
        """Wait for the layer-wise sync in flight (the next inner step and every read need it). A read
        (``read``) collects it without counting the wait, so ``outer_hidden_fraction`` covers the syncs
        that training itself collected."""
        if self.outer_comm is None or not self.outer_comm.busy:
            return
        t0 = time.perf_counter()
        info = self.outer_comm.wait()
        if read:
            self.read_syncs += 1
        else:
            self.outer_comm_s += info["seconds"]
            self.outer_wait_s += time.perf_counter() - t0 + self.sync.gate.waited_s
        self.sync.gate.waited_s = 0.0
        self.transport.bytes += info["bytes"]
        self.sync.record(info)
        if self.timed:  # the next period started when the last replica arrived
            waited = max(info["elapsed"]) - info["elapsed"][self.groups.replica]
            self.period_start = self._submitted_at + waited
            self.max_sync_wait = max(self.max_sync_wait, waited)

    @torch.no_grad()
    def _sync(self, sync) -> None:
        if self.sync is None:  # replicas that come and go: blocking, the next period starts after it
            self._blocking_sync()
            self.period_start = self.clock()
            return
        self.wait_sync()
        self._submitted_at = self.clock()
        self.sync.start(self.anchor, self.momentum, sync.steps, self._elapsed, self._outer_one)

    # ---------------------------------------------------------- observability
    def period_words(self) -> Tuple[str, str]:
        if not self.timed:
            return super().period_words()
        t = self.local.sync_time_s
        return f"sync_time_s={t:g} (A-EDiT)", f"a sync every {t:g} s of wall time (A-EDiT)"

    def scale_mean(self, mean_deltas):
        """Blocking syncs: ``pseudo_grad_clip`` on the averaged pseudo-gradient's global norm."""
        clip = self.local.pseudo_grad_clip
        if clip is None:
            return mean_deltas
        norm = math.sqrt(self.groups.reduce(squared_norm(mean_deltas, self.shards.norm_segments), self.anchor[0].device))
        scale = clip_scale(norm, clip)
        return [d.mul_(scale) for d in mean_deltas] if scale != 1.0 else mean_deltas

    def stats(self) -> dict:
        own = {} if self.sync is None else {"anomalies": self.sync.anomalies, "sync_history": self.sync.history}
        return {**own, "read_syncs": self.read_syncs,
                "max_sync_wait_s": self.max_sync_wait if self.timed else None, **super().stats()}

    def report(self) -> List[Tuple[str, str]]:
        s = self.stats()
        lines = super().report()
        if self.sync is not None:
            lines.append(("anomalies", f"{s['anomalies']} replica-periods left out of the average"))
        if self.timed and s.get("sync_history"):
            steps = [[int(h["steps"][r]) for h in s["sync_history"]] for r in range(s["replicas"])]
            lines.append(("inner steps", "per period, replica by replica (min/mean/max): " + ", ".join(
                f"{min(x)}/{sum(x) / len(x):.1f}/{max(x)}" for x in steps) +
                f"; longest wait at a sync {s['max_sync_wait_s']:.2f} s"))
        return lines

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        sd = super().state_dict()
        detector = self.sync.detector if self.sync is not None else None
        sd["edit"] = {"detector": detector.state_dict() if detector is not None else None,
                      "period_elapsed_s": self.clock() - self.period_start,
                      "anomalies": self.sync.anomalies if self.sync is not None else 0}
        return sd

    def load_state_dict(self, sd) -> None:
        super().load_state_dict(sd)
        edit = sd.get("edit") or {}
        if self.sync is not None and self.sync.detector is not None and edit.get("detector") is not None:
            self.sync.detector.load_state_dict(edit["detector"])
        if self.sync is not None:
            self.sync.anomalies = edit.get("anomalies", 0)
        self.period_start = self.clock() - edit.get("period_elapsed_s", 0.0)  # the period timer goes on

    def reshard_state(self, first, mine, plan) -> dict:
        sd = super().reshard_state(first, mine, plan)
        edit = mine[0].get("edit") or {}
        sd["edit"] = {"detector": None, "period_elapsed_s": edit.get("period_elapsed_s", 0.0),
                      "anomalies": edit.get("anomalies", 0)}
        if self.sync.detector is not None:
            plan.not_carried.append("EDiT's anomaly-detector statistics (kept per replica, and the replicas "
                                    "changed): they restart their warm-up")
        if self.per_replica_counters:
            plan.not_carried.append("A-EDiT's uneven step counts: each new replica takes its mapped old "
                                    "replica's global_steps, samples, LR schedule and period timer")
        return sd

    def restart(self) -> None:
        super().restart()
        self.period_start = self.clock()

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        super().close()


__all__ = ["EDiT"]
