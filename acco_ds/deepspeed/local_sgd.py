"""The outer loop of the local-SGD modes (``diloco``, ``co2``, ``edit``) on ACCO's ZeRO-1.

The data-parallel ranks split into ``R = W / k`` replica groups of ``k``
consecutive ranks. ``ACCOZeroOptimizer`` runs with a replica group as its
ZeRO-1 group, so every inner step is plain ZeRO-1 inside the group (``sync``
rounds) and the inner optimizer state is sharded ``k`` ways. The ranks that
hold the same shard index in every group form an *outer group*; the outer
step runs there on fp32 shards, so the anchor ``x`` (the last global model),
the outer momentum ``m`` and, in ``co2``, the period start ``s`` and the
in-flight pseudo-gradient are sharded like the master weights.

The period schedule is ``algorithms.periods``; the outer update is
``runtime.outer.outer_step``. In ``co2`` the all-reduce of a period's
pseudo-gradient runs on a communication thread of its own (own process group,
own CUDA stream) for the whole next period. ``edit``'s outer step runs on that
thread too, overlapped with the next forward pass (``deepspeed.edit``); A-EDiT
ends its periods on the time read from ``clock``.
"""

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as tdist

from ..algorithms.periods import CO2, EDIT, PeriodSchedule
from ..runtime import collectives
from ..runtime.comm import CommWorker
from ..runtime.outer import outer_step
from .edit import LayerwiseSync


@dataclass
class ReplicaGroups:
    k: int  # ranks per replica group
    replicas: int  # R
    replica: int  # this rank's replica index
    shard: int  # this rank's index inside its replica (its ZeRO-1 partition)
    replica_ranks: List[int]
    outer_ranks: List[int]
    replica_main: object  # ZeRO-1's group (main thread)
    replica_side: object  # the inner communication thread's copy
    outer_main: object  # blocking outer all-reduce (main thread)
    outer_side: object  # co2's outer communication thread


def make_groups(dp_ranks: List[int], k: int, timeout_s: float) -> ReplicaGroups:
    """Create every replica and outer group (collective: all ranks call it alike) and return this rank's."""
    me = tdist.get_rank()
    R = len(dp_ranks) // k
    replicas = [dp_ranks[g * k:(g + 1) * k] for g in range(R)]
    outers = [[replicas[g][i] for g in range(R)] for i in range(k)]
    timeout = timedelta(seconds=timeout_s)
    made = [tdist.new_subgroups_by_enumeration(lists, timeout=timeout)[0]
            for lists in (replicas, replicas, outers, outers)]
    g = next(i for i, ranks in enumerate(replicas) if me in ranks)
    return ReplicaGroups(k, R, g, replicas[g].index(me), replicas[g], outers[replicas[g].index(me)], *made)


class LocalSGD:
    """Anchor, outer momentum and the sync points of one rank's shard.

    Args:
        opt: the ``ACCOZeroOptimizer`` whose ZeRO-1 group is this rank's replica group.
        acco: the ``ACCOConfig`` (mode ``diloco``, ``co2`` or ``edit``).
        groups: ``make_groups``' result.
    """

    def __init__(self, opt, acco, groups: ReplicaGroups):
        from ..config import LocalSGDConfig
        self.opt, self.groups = opt, groups
        self.settings = acco.outer
        ls = acco.local_sgd or LocalSGDConfig()
        self.schedule = PeriodSchedule(acco.mode, None if ls.sync_time_s else ls.sync_every)
        self.sync_time_s = ls.sync_time_s
        self.clock = time.monotonic  # A-EDiT's period timer; tests inject their own with set_clock
        self.period_start = self.clock()
        self._elapsed = 0.0  # A-EDiT: period time at the last inner step (the replica's slowest rank)
        self._submitted_at = None
        self.max_sync_wait = 0.0  # A-EDiT: longest time this replica waited for the others at a sync
        self.read_syncs = 0  # edit: syncs collected by a read rather than by training
        self.counters = None  # A-EDiT: this replica's engine counters, saved with it (see before_save)
        masters = opt.single_partition_of_fp32_groups
        self.anchor = [m.detach().clone() for m in masters]  # every replica starts at θ0 (DeepSpeed broadcast it)
        self.momentum = [torch.zeros_like(m) for m in masters]
        co2 = acco.mode == CO2
        self.start = [m.detach().clone() for m in masters] if co2 else None
        self.in_flight = [torch.zeros_like(m) for m in masters] if co2 else None
        side = co2 or acco.mode == EDIT
        self.outer_comm = CommWorker(groups.outer_ranks, torch.device(opt.device), acco.timeout_s,
                                     group=groups.outer_side) if side else None
        self.edit = LayerwiseSync(opt, groups, ls, self.outer_comm) if acco.mode == EDIT else None
        self.outer_comm_s = 0.0  # seconds the outer all-reduces took on their thread
        self.outer_wait_s = 0.0  # seconds the compute side waited for them

    # ------------------------------------------------------------- sync points
    def after_inner_step(self) -> None:
        sync = self.schedule.after_inner_step(self._time_up() if self.schedule.timed else False)
        if sync is not None:
            self._sync(sync)

    def finalize(self) -> None:
        """Leave every replica on one model: apply what is in flight, average the unfinished period."""
        self.wait_sync()
        sync = self.schedule.final_sync()
        if sync is not None:
            self._sync(sync)
        self.wait_sync()

    def set_clock(self, clock) -> None:
        """A-EDiT's period timer reads ``clock()`` (seconds); the current period restarts now."""
        self.clock = clock
        self.period_start = clock()

    def _time_up(self) -> bool:
        """A-EDiT: has the period's time passed? Every rank of the replica takes its slowest rank's time."""
        elapsed = self.clock() - self.period_start
        if self.groups.k > 1:
            t = torch.tensor([elapsed], dtype=torch.float64, device=self.anchor[0].device)
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=self.groups.replica_main)
            elapsed = float(t)
        self._elapsed = elapsed
        return elapsed >= self.sync_time_s

    def waited_s(self) -> float:
        """Seconds the compute side has waited for outer communication so far (edit: hooks included)."""
        return self.outer_wait_s + (self.edit.gate.waited_s if self.edit is not None else 0.0)

    def wait_sync(self, read: bool = False) -> None:
        """edit: wait for the layer-wise sync in flight (the next inner step and every read need it).
        ``read``: a read (state_dict, eval, save) collects it; its time then counts as neither hidden nor
        waited, so ``outer_hidden_fraction`` covers the syncs that training itself collected."""
        if self.edit is None or not self.outer_comm.busy:
            return
        t0 = time.perf_counter()
        info = self.outer_comm.wait()
        if read:
            self.read_syncs += 1
        else:
            self.outer_comm_s += info["seconds"]
            self.outer_wait_s += time.perf_counter() - t0 + self.edit.gate.waited_s
        self.edit.gate.waited_s = 0.0
        self.edit.record(info)
        if self.schedule.timed:  # the next period started when the last replica arrived
            waited = max(info["elapsed"]) - info["elapsed"][self.groups.replica]
            self.period_start = self._submitted_at + waited
            self.max_sync_wait = max(self.max_sync_wait, waited)

    @torch.no_grad()
    def _sync(self, sync) -> None:
        if self.edit is not None:
            self.wait_sync()
            self._submitted_at = self.clock()
            self.edit.start(self.anchor, self.momentum, sync.steps, self._elapsed, self._outer_one)
            return
        masters = self.opt.single_partition_of_fp32_groups
        starts = self.start if self.start is not None else self.anchor
        deltas = [s - m for s, m in zip(starts, masters)]  # δ = start − end of the period
        if sync.wait_previous:
            self._collect()
            self._outer(self.in_flight)
        if sync.blocking:  # the compute side waits for all of it
            seconds = self._average(deltas, self.groups.outer_main)
            self.outer_comm_s += seconds
            self.outer_wait_s += seconds
            self._outer(deltas)
            new = self.anchor
        elif sync.send:  # co2: jump to the new global model plus this replica's own progress, send that progress
            new = [x - d for x, d in zip(self.anchor, deltas)]
            for buf, d in zip(self.in_flight, deltas):
                buf.copy_(d)
            self.outer_comm.submit(lambda: self._average(self.in_flight, self.groups.outer_side))
        else:  # co2's last sync with no inner step since the previous one: every replica takes the anchor
            new = self.anchor
        if self.start is not None:
            for s, n in zip(self.start, new):
                s.copy_(n)
        self._install(new)

    def _outer(self, mean_deltas) -> None:
        for x, m, d in zip(self.anchor, self.momentum, mean_deltas):
            self._outer_one(x, m, d)

    def _outer_one(self, x, m, mean_delta) -> None:
        """The outer step on one shard (edit: on one chunk of it)."""
        st = self.settings
        outer_step(x, m, mean_delta, lr=st["outer_lr"], momentum=st["outer_momentum"], nesterov=st["nesterov"],
                   staleness_penalty=st["staleness_penalty"], momentum_clip=st["outer_momentum_clip"])

    def _average(self, tensors, group) -> float:
        """Average ``tensors`` in place across the replicas (the outer group); returns the seconds it took."""
        start = time.perf_counter()
        for t in tensors:
            tdist.all_reduce(t, group=group)
            t.div_(self.groups.replicas)
        return time.perf_counter() - start

    def _collect(self) -> None:
        """co2: wait for the in-flight average (it arrives in ``in_flight``)."""
        if self.outer_comm is not None and self.outer_comm.busy:
            t0 = time.perf_counter()
            self.outer_comm_s += self.outer_comm.wait() or 0.0
            self.outer_wait_s += time.perf_counter() - t0

    def _install(self, shards) -> None:
        """Master shards ← ``shards``; the replica's bit16 weights ← their all-gather."""
        opt = self.opt
        for flat, master, shard in zip(opt.bit16_groups_flat, opt.single_partition_of_fp32_groups, shards):
            if master is not shard:
                master.copy_(shard)
            collectives.all_gather_part(flat, master, self.groups.shard, self.groups.replica_main)

    # ------------------------------------------------------------ what users read
    @torch.no_grad()
    def anchor_flats(self) -> Optional[List[torch.Tensor]]:
        """The anchor in the model dtype, gathered into the (idle) communication buffers."""
        for buf, shard in zip(self.opt.buffers, self.anchor):
            collectives.all_gather_part(buf.gathered, shard, self.groups.shard, self.groups.replica_main)
        return [buf.gathered for buf in self.opt.buffers]

    def stats(self) -> dict:
        """Syncs done, and for co2/edit how much of the outer communication the compute side waited for."""
        comm, wait = self.outer_comm_s, self.outer_wait_s
        extra = {} if self.edit is None else {
            "anomalies": self.edit.anomalies, "sync_history": self.edit.history, "read_syncs": self.read_syncs,
            "max_sync_wait_s": self.max_sync_wait if self.schedule.timed else None}
        return {**extra, "syncs": self.schedule.period, "sync_every": self.schedule.sync_every,
                "replicas": self.groups.replicas,
                "replica_group_size": self.groups.k, "outer_comm_s": comm, "outer_wait_s": wait,
                "outer_hidden_fraction": max(0.0, 1.0 - wait / comm) if comm > 0 else None}

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        self._collect()  # an in-flight average is saved as received: resume applies it at the next sync
        self.wait_sync(read=True)
        clone = lambda ts: None if ts is None else [t.clone() for t in ts]  # noqa: E731
        edit = None if self.edit is None else {
            "detector": self.edit.detector.state_dict() if self.edit.detector is not None else None,
            "period_elapsed_s": self.clock() - self.period_start, "anomalies": self.edit.anomalies}
        return {"schedule": self.schedule.state_dict(), "replicas": self.groups.replicas, "k": self.groups.k,
                "edit": edit, "counters": self.counters,
                "anchor": clone(self.anchor), "momentum": clone(self.momentum), "start": clone(self.start),
                "in_flight": clone(self.in_flight)}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        from ..config import checkpoint_mismatch
        if (sd["replicas"], sd["k"]) != (self.groups.replicas, self.groups.k):
            raise checkpoint_mismatch("replica layout (replicas, replica_group_size)", (sd["replicas"], sd["k"]),
                                      (self.groups.replicas, self.groups.k))
        self._collect()
        self.wait_sync(read=True)
        self.schedule.load_state_dict(sd["schedule"])
        if self.edit is not None:
            edit = sd.get("edit") or {}
            if self.edit.detector is not None and edit.get("detector") is not None:
                self.edit.detector.load_state_dict(edit["detector"])
            self.edit.anomalies = edit.get("anomalies", 0)
            self.period_start = self.clock() - edit.get("period_elapsed_s", 0.0)  # the period timer goes on
        self.counters = sd.get("counters")
        for name in ("anchor", "momentum", "start", "in_flight"):
            mine = getattr(self, name)
            for dst, src in zip(mine or [], sd[name] or []):
                dst.copy_(src)

    def close(self) -> None:
        if self.edit is not None:
            self.edit.close()
        if self.outer_comm is not None:
            self.outer_comm.close()


# A-EDiT's replicas run different step counts, but DeepSpeed keeps one copy of the engine counters and
# the LR scheduler (rank 0's model-states file) and names the checkpoint after this rank's global_steps.
# Each rank's own copy travels in its ACCO state instead, and the tag is one every rank agrees on.
def _timed(engine):
    ls = getattr(engine.optimizer, "local_sgd", None)
    return ls if ls is not None and ls.schedule.timed else None


def before_save(engine, args, kwargs) -> None:
    """A-EDiT: name the checkpoint ``global_step<N>`` with N the most inner steps any replica ran (unless
    the caller named it), and put this replica's counters into its ACCO state."""
    timed = _timed(engine)
    if timed is None:
        return
    if not args and kwargs.get("tag") is None:
        steps = torch.tensor([engine.global_steps], dtype=torch.int64)
        tdist.all_reduce(steps, op=tdist.ReduceOp.MAX)
        kwargs["tag"] = f"global_step{int(steps)}"
    sched = engine.lr_scheduler
    timed.counters = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                      "skipped_steps": engine.skipped_steps,
                      "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict")
                      else None}


def after_load(engine) -> None:
    """A-EDiT: this replica's counters and LR schedule, not rank 0's."""
    timed = _timed(engine)
    saved = timed.counters if timed is not None else None
    if saved is None:
        return
    engine.global_steps, engine.global_samples = saved["global_steps"], saved["global_samples"]
    engine.skipped_steps = saved["skipped_steps"]
    if saved["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])


__all__ = ["LocalSGD", "ReplicaGroups", "make_groups", "before_save", "after_load"]
