"""The communication job of one round, as named phases.

A round's job runs on the communication thread (``comm.CommWorker``) on the
gradients the compute side handed over when the previous round ended
(``buffers.FlatBuffers.hand_over``):

1. ``reduce_scatter``: every rank's accumulated gradient sum is reduced into
   this rank's partition (``collectives.reduce_scatter``);
2. ``unscale``: the partition is copied into the fp32 shard and divided by
   the loss scale it was accumulated at. An estimate round also keeps it
   (``kept``), and a real round adds the kept part back, so the commit uses
   the gradients of both half-batches;
3. ``stats_allreduce``: one small all-reduce of the per-rank micro-batch
   counts and the squared norms of the new part and of the whole gradient
   (the norm ZeRO-1 also all-reduces every step);
4. ``update``: the sharded optimizer update (``update.ShardUpdate``, Peek or
   commit) writes the new parameters into this rank's part of the
   all-gather buffer; a non-finite gradient skips it on every rank;
5. ``all_gather``: every rank's part is gathered, over the buffer the
   reduce-scatter read.

The job reports a ``CommResult``; it has no side effects beyond the buffers,
the optimizer state of a commit, and the ``KeptShard`` bookkeeping.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
import torch.distributed as tdist

from ...algorithms.rounds import COMMIT, Round
from ..comm import collectives, compression
from .update import clip_coefficient, squared_norm



@dataclass
class Phases:
    """Seconds of a job by phase (the shard arithmetic between collectives counts as update)."""
    reduce_scatter: float = 0.0
    stats_allreduce: float = 0.0
    update: float = 0.0
    all_gather: float = 0.0


@dataclass
class CommResult:
    """What the communication side reports for one round."""
    round_index: int
    op: str  # peek | commit
    global_micro: int  # micro-batches (all ranks) in the gradient the update used
    worker_micro: List[int]  # per rank, of the newly reduced part
    grad_norm: float  # norm of the mean gradient, before clipping (nan/inf if non-finite)
    finite: bool  # the update was applied (False: skipped, parameters unchanged)
    overflow_scale: float = math.inf  # smallest loss scale at which a part of the gradient was non-finite
    comm_s: float = 0.0
    phases: Phases = field(default_factory=Phases)

    @property
    def commits(self) -> bool:
        return self.op == COMMIT


@dataclass
class KeptShard:
    """What an estimate round leaves for the real round: how many
    micro-batches its kept shard sums, and whether it was finite."""
    count: int = 0
    finite: bool = True
    overflow_scale: float = math.inf  # loss scale at which it was non-finite (inf: it was finite)


@dataclass
class RoundJob:
    """One round's communication job; call it on the communication thread.

    ``rnd`` is the ``algorithms.rounds.Round`` whose communication this is,
    ``local_micro`` and ``loss_scale`` describe the handed-over gradients;
    each micro-batch loss was divided by ``loss_divisor`` before backward, as
    DeepSpeed does (``gradient_accumulation_steps``), so that 16-bit gradients
    keep stock DeepSpeed's headroom; the unscale multiplies it back.
    """
    rnd: Round
    buffers: list  # buffers.FlatBuffers, one per ZeRO-1 group
    masters: List[torch.Tensor]  # fp32 master partitions (copied out when the update is skipped)
    update: Callable  # update.ShardUpdate
    kept: KeptShard
    group: object
    rank: int
    world_size: int
    local_micro: int
    loss_scale: float
    loss_divisor: float = 1.0
    clip: float = 0.0
    delay_s: float = 0.0  # benchmark emulation of a slow network
    # Tensor parallelism: per buffer, the (start, length) ranges of the shard that count in the global
    # norm (parameters split across model-parallel ranks everywhere, replicated ones on one rank only),
    # and the communication thread's copy of the model-parallel group the norms are summed over.
    norm_segments: Optional[list] = None
    mp_group: object = None
    layout: object = None  # collectives.NodeLayout: node-aware reduce-scatter and all-gather (None: flat)
    codec: object = None  # compression.Codec: quantized reduce-scatter and all-gather (None: full precision)
    flats: Optional[list] = None  # with a codec: the compute parameters (the all-gather sends target - these)
    # Mixture of experts: per buffer, ``(group, rank)`` of the collectives that partition it (an expert group
    # is reduce-scattered and all-gathered over its expert-data-parallel group) or None for ``group``/``rank``
    # (and ``layout``). None: every buffer on the data-parallel group.
    parts: Optional[list] = None

    def __call__(self) -> CommResult:
        phases = Phases()
        start = time.perf_counter()
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        self.reduce_scatter()
        t1 = time.perf_counter()
        new_sq, total_sq = self.unscale()
        t2 = time.perf_counter()
        worker_micro, new_sq, total_sq = self.stats_allreduce(new_sq, total_sq)
        t3 = time.perf_counter()
        result = self.apply_update(worker_micro, new_sq, total_sq)
        t4 = time.perf_counter()
        self.all_gather()
        end = time.perf_counter()
        phases.reduce_scatter, phases.stats_allreduce = t1 - start, t3 - t2
        phases.update, phases.all_gather = (t2 - t1) + (t4 - t3), end - t4
        result.comm_s, result.phases = end - start, phases
        return result

    # ---------------------------------------------------------------- phases
    def reduce_scatter(self) -> None:
        for i, buf in enumerate(self.buffers):
            group, _ = self.part(i)
            if self.codec is not None and buf.compression is not None:
                compression.reduce_scatter(buf.shard, buf.send, group, self.codec, buf.residual)
            else:
                collectives.reduce_scatter(buf.reduced, buf.send, group)
            buf.sent()

    def unscale(self):
        """fp32 shard = reduced / loss scale (+ the kept part in a real round);
        returns the squared norms of the new part and of the whole."""
        inv_scale = self.loss_divisor / self.loss_scale
        for buf in self.buffers:
            if self.rnd.keep_shard:  # estimate round: the real round adds this part again
                buf.kept.copy_(buf.reduced)
                buf.kept_scale = inv_scale
            if buf.reduced is not buf.shard:
                buf.shard.copy_(buf.reduced)
            if inv_scale != 1.0:
                buf.shard.mul_(inv_scale)
        new_sq = self._squared_norm()
        if not self.rnd.add_kept_shard:
            return new_sq, new_sq
        for buf in self.buffers:
            buf.shard.add_(buf.kept, alpha=buf.kept_scale)
        return new_sq, self._squared_norm()

    def stats_allreduce(self, new_sq, total_sq):
        """Per-rank micro-batch counts and the two squared norms, summed over ranks."""
        stats = torch.zeros(self.world_size + 2, dtype=torch.float64, device=self.buffers[0].shard.device)
        stats[self.rank] = self.local_micro
        stats[self.world_size], stats[self.world_size + 1] = new_sq, total_sq
        tdist.all_reduce(stats, group=self.group)
        if self.mp_group is not None:  # the norms cover the whole model: sum them over the model-parallel ranks
            norms = stats[self.world_size:].clone()
            tdist.all_reduce(norms, group=self.mp_group)
            stats[self.world_size:] = norms
        values = stats.tolist()
        return [int(c) for c in values[:self.world_size]], values[-2], values[-1]

    def apply_update(self, worker_micro, new_sq: float, total_sq: float) -> CommResult:
        total = sum(worker_micro) + (self.kept.count if self.rnd.add_kept_shard else 0)
        norm = math.sqrt(total_sq) / total
        finite = math.isfinite(norm) and (self.kept.finite or not self.rnd.add_kept_shard)
        outs = self.outputs()
        if finite:
            scale = clip_coefficient(norm, self.clip) / total
            self.update([b.shard for b in self.buffers], scale, self.rnd.comm == COMMIT, outs)
        else:
            for out, master in zip(outs, self.masters):
                out.copy_(master)
            for buf in self.buffers:  # a non-finite send poisoned its residual: start error feedback afresh
                if buf.residual is not None:
                    buf.residual.zero_()
        new_overflow = not math.isfinite(new_sq)
        overflow_scale = self.loss_scale if new_overflow else math.inf
        if self.rnd.add_kept_shard:
            overflow_scale = min(overflow_scale, self.kept.overflow_scale)
        if self.rnd.keep_shard:
            self.kept.count, self.kept.finite, self.kept.overflow_scale = total, finite, overflow_scale
        return CommResult(self.rnd.index, self.rnd.comm, total, worker_micro, norm, finite, overflow_scale)

    def all_gather(self) -> None:
        for i, (buf, out) in enumerate(zip(self.buffers, self.outputs())):
            group, _ = self.part(i)
            if self.codec is not None and buf.compression is not None:
                compression.all_gather(buf.gathered, self.flats[i], out, group, self.codec)
            else:
                collectives.all_gather(buf.gathered, out, group)

    # --------------------------------------------------------------- helpers
    def part(self, i: int):
        """``(group, rank)`` of buffer ``i``'s reduce-scatter and all-gather (a node layout or a group)."""
        own = self.parts[i] if self.parts is not None else None
        return own if own is not None else (self.layout or self.group, self.rank)

    def outputs(self) -> List[torch.Tensor]:
        return [buf.update_out(self.part(i)[1]) for i, buf in enumerate(self.buffers)]

    def _squared_norm(self) -> float:
        return squared_norm([buf.shard for buf in self.buffers], self.norm_segments)


def result_from_dict(d: Optional[dict]) -> Optional[CommResult]:
    """A ``CommResult`` saved with ``dataclasses.asdict`` (checkpoints)."""
    if d is None:
        return None
    d = dict(d)
    for old in ("accounted", "new_overflow"):  # fields of acco_ds 0.1 checkpoints, no longer kept
        d.pop(old, None)
    phases = d.pop("phases", None) or {}
    return CommResult(**d, phases=Phases(**phases))


__all__ = ["RoundJob", "CommResult", "Phases", "KeptShard", "result_from_dict"]
