"""The outer loop of the local-SGD modes (``diloco``, ``co2``) on ACCO's ZeRO-1.

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
own CUDA stream) for the whole next period.
"""

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as tdist

from ..algorithms.periods import CO2, PeriodSchedule
from ..runtime import collectives
from ..runtime.comm import CommWorker
from ..runtime.outer import outer_step


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
        acco: the ``ACCOConfig`` (mode ``diloco`` or ``co2``).
        groups: ``make_groups``' result.
    """

    def __init__(self, opt, acco, groups: ReplicaGroups):
        self.opt, self.groups = opt, groups
        self.settings = acco.outer
        self.schedule = PeriodSchedule(acco.mode, acco.local_sgd.sync_every if acco.local_sgd else 20)
        masters = opt.single_partition_of_fp32_groups
        self.anchor = [m.detach().clone() for m in masters]  # every replica starts at θ0 (DeepSpeed broadcast it)
        self.momentum = [torch.zeros_like(m) for m in masters]
        co2 = acco.mode == CO2
        self.start = [m.detach().clone() for m in masters] if co2 else None
        self.in_flight = [torch.zeros_like(m) for m in masters] if co2 else None
        self.outer_comm = CommWorker(groups.outer_ranks, torch.device(opt.device), acco.timeout_s,
                                     group=groups.outer_side) if co2 else None
        self.outer_comm_s = 0.0  # seconds the outer all-reduces took on their thread
        self.outer_wait_s = 0.0  # seconds the compute side waited for them

    # ------------------------------------------------------------- sync points
    def after_inner_step(self) -> None:
        sync = self.schedule.after_inner_step()
        if sync is not None:
            self._sync(sync)

    def finalize(self) -> None:
        """Leave every replica on one model: apply what is in flight, average the unfinished period."""
        sync = self.schedule.final_sync()
        if sync is not None:
            self._sync(sync)

    @torch.no_grad()
    def _sync(self, sync) -> None:
        masters = self.opt.single_partition_of_fp32_groups
        starts = self.start if self.start is not None else self.anchor
        deltas = [s - m for s, m in zip(starts, masters)]  # δ = start − end of the period
        if sync.wait_previous:
            self._collect()
            self._outer(self.in_flight)
        if sync.blocking:  # the compute side waits for all of it
            t0 = time.perf_counter()
            for d in deltas:
                tdist.all_reduce(d, group=self.groups.outer_main)
                d.div_(self.groups.replicas)
            self.outer_comm_s += time.perf_counter() - t0
            self.outer_wait_s += time.perf_counter() - t0
            self._outer(deltas)
            new = self.anchor
        elif sync.send:  # co2: jump to the new global model plus this replica's own progress, send that progress
            new = [x - d for x, d in zip(self.anchor, deltas)]
            for buf, d in zip(self.in_flight, deltas):
                buf.copy_(d)
            self.outer_comm.submit(self._all_reduce_job)
        else:  # co2's last sync with no inner step since the previous one: every replica takes the anchor
            new = self.anchor
        if self.start is not None:
            for s, n in zip(self.start, new):
                s.copy_(n)
        self._install(new)

    def _outer(self, mean_deltas) -> None:
        st = self.settings
        for x, m, d in zip(self.anchor, self.momentum, mean_deltas):
            outer_step(x, m, d, lr=st["outer_lr"], momentum=st["outer_momentum"], nesterov=st["nesterov"],
                       staleness_penalty=st["staleness_penalty"], momentum_clip=st["outer_momentum_clip"])

    def _all_reduce_job(self):
        start = time.perf_counter()
        for d in self.in_flight:
            tdist.all_reduce(d, group=self.groups.outer_side)
            d.div_(self.groups.replicas)
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
        for i, (master, shard) in enumerate(zip(opt.single_partition_of_fp32_groups, shards)):
            if master is not shard:
                master.copy_(shard)
            self._gather(opt.bit16_groups_flat[i], i, master)

    def _gather(self, flat: torch.Tensor, i: int, shard: torch.Tensor) -> None:
        part = int(self.opt.partition_size[i])
        mine = flat.narrow(0, self.groups.shard * part, part)
        mine.copy_(shard)
        collectives.all_gather(flat, mine, self.groups.replica_main)

    # ------------------------------------------------------------ what users read
    @torch.no_grad()
    def anchor_flats(self) -> Optional[List[torch.Tensor]]:
        """The anchor in the model dtype, gathered into the (idle) communication buffers."""
        out = []
        for i, buf in enumerate(self.opt.buffers):
            self._gather(buf.gathered, i, self.anchor[i])
            out.append(buf.gathered)
        return out

    def stats(self) -> dict:
        """Syncs done, and for co2 how much of the outer communication the compute side waited for."""
        comm, wait = self.outer_comm_s, self.outer_wait_s
        return {"syncs": self.schedule.period, "sync_every": self.schedule.sync_every, "replicas": self.groups.replicas,
                "replica_group_size": self.groups.k, "outer_comm_s": comm, "outer_wait_s": wait,
                "outer_hidden_fraction": max(0.0, 1.0 - wait / comm) if comm > 0 else None}

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        self._collect()  # an in-flight average is saved as received: resume applies it at the next sync
        clone = lambda ts: None if ts is None else [t.clone() for t in ts]  # noqa: E731
        return {"schedule": self.schedule.state_dict(), "replicas": self.groups.replicas, "k": self.groups.k,
                "anchor": clone(self.anchor), "momentum": clone(self.momentum), "start": clone(self.start),
                "in_flight": clone(self.in_flight)}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        from ..config import checkpoint_mismatch
        if (sd["replicas"], sd["k"]) != (self.groups.replicas, self.groups.k):
            raise checkpoint_mismatch("replica layout (replicas, replica_group_size)", (sd["replicas"], sd["k"]),
                                      (self.groups.replicas, self.groups.k))
        self._collect()
        self.schedule.load_state_dict(sd["schedule"])
        for name in ("anchor", "momentum", "start", "in_flight"):
            mine = getattr(self, name)
            for dst, src in zip(mine or [], sd[name] or []):
                dst.copy_(src)

    def close(self) -> None:
        if self.outer_comm is not None:
            self.outer_comm.close()


__all__ = ["LocalSGD", "ReplicaGroups", "make_groups"]
