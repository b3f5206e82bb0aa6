"""RoundDriver: the rounds of ``acco``, ``dpu`` and ``sync`` (and the local-SGD inner steps) on any host.

A host keeps each parameter group as one flat, padded buffer of the model
dtype (the parameters are views into it), and this rank's fp32 master
partition of it, stepped by a torch optimizer that sees only that partition.
The driver does the rest, the same way for every host:

* during backward, a post-accumulate-grad hook adds each ``param.grad`` into
  a flat accumulator laid out like the flat parameters and frees it
  (``buffers.FlatBuffers``), so gradients never exist twice;
* ``count_micro_batch()`` after every backward, ``round_may_end()`` asks the
  schedule (``algorithms.rounds``);
* ``finish_round()`` waits for the finished job (sync: runs it) and installs
  what it gathered; the host then reads ``take_commits()`` (its step counters,
  learning-rate scheduler, ``outer.after_inner_step()``), and
  ``start_round()`` hands the accumulated gradients to the communication
  thread, which runs the round's job (``job.RoundJob``: reduce-scatter, Peek
  or commit, all-gather over the same buffer);
* ``show_committed()`` points the parameters at the committed weights for a
  reader (``views.ParamView``), ``finalize()`` installs them for good.

Gradients are averaged per micro-batch: the host divides each micro-batch loss
by ``gradient_accumulation_steps`` (DeepSpeed's convention, and the PyTorch
loop's), the job multiplies that back and divides the reduced sum by the
global micro-batch count, all-reduced with the gradient norms. So adaptive
accumulation (different counts per worker) still yields the exact mean.

A host subclasses the driver and calls ``setup_rounds``; it may override
``loss_scale_now`` (16-bit loss scaling), ``job_options`` (tensor-parallel
norms), ``after_result`` (its own per-step bookkeeping) and ``before_job``.
"""

import functools
import time
from typing import List, Optional

import torch
import torch.distributed as tdist

from ...algorithms.rounds import COMMIT, SYNC, RoundSchedule, keeps_shard
from . import experts
from .buffers import FlatBuffers, allocated_bytes
from ..comm.worker import CommWorker
from ..comm.compression import round_codec
from .host_memory import pin_mmap_threshold
from .job import CommResult, KeptShard, RoundJob
from .peers import RoundPeers, align_rounds
from .state import heal_state, load_heal_state
from ..outer.interface import OuterLoop, OuterLoopHost, Shards, build_outer_loop
from .stats import RoundLog
from .update import ShardUpdate
from .views import ParamView


class RoundDriver(OuterLoopHost):
    """The round machinery a host inherits. Attributes the host sets before ``setup_rounds``:
    ``acco`` (the ``ACCOConfig``) and ``gradient_accumulation_steps``."""

    def setup_rounds(self, *, flats: List[torch.Tensor], masters: List[torch.Tensor], optimizer, params,
                     group, side, layout, crosses_nodes: bool, replica_groups, accum_dtype: torch.dtype,
                     comm_dtype: torch.dtype, clip: float = 0.0, fused_adamw: Optional[bool] = None,
                     jit: Optional[bool] = None, norm_segments: Optional[list] = None,
                     expert_groups: Optional[list] = None) -> None:
        """Build the buffers, hooks, communication thread and outer loop.

        ``flats``/``masters``: per parameter group, the flat compute parameters and this rank's fp32 master
        partition (``optimizer`` steps only those); ``params``: per group, ``(parameter, offset)`` in flat
        order; ``group``: the ZeRO-1 group (a replica's under an outer loop), ``side`` the communication
        thread's copy of it, ``layout`` its node-aware layout (None: flat collectives). ``expert_groups``
        (mixture of experts, ``experts.py``): per parameter group, None (dense) or ``(main, side)``, the
        expert-data-parallel group that partitions that expert group and the communication thread's copy."""
        acco = self.acco
        device = flats[0].device
        self.compute_flats, self.master_shards, self.clip = flats, masters, clip
        self.round_group, self.accum_dtype, self.comm_dtype = group, accum_dtype, comm_dtype
        self.schedule = self.new_schedule()
        from ... import ops
        self.kernels = ops.load_kernels(acco.kernels, device, jit=jit)
        self.update = ShardUpdate(optimizer, masters, self.kernels, fused_adamw=fused_adamw)
        self.world_size, self.rank = tdist.get_world_size(group), tdist.get_rank(group)
        ranks = tdist.get_process_group_ranks(group)
        self.comm = CommWorker(ranks, device, acco.timeout_s, group=side)
        # Adaptive accumulation: ranks end rounds on their own, so reads meet through the store (peers.py).
        self.peers = RoundPeers(ranks, self.rank) if self.schedule.adaptive else None
        self.layout = layout
        if device.type == "cpu":
            pin_mmap_threshold()  # freed per-parameter gradients go back to the OS (see runtime.rounds.host_memory)
        overlap = self.schedule.overlaps  # without overlap the job gathers straight into the parameters
        self.codec, rounds_compression = round_codec(acco, self.kernels, layout, self.world_size, crosses_nodes)
        where = experts.places(expert_groups, len(flats), self.world_size, rounds_compression)
        self.parts = where.parts  # per group: the job's (side group, rank) of an expert group, else None
        self.buffers = [
            FlatBuffers(flat.numel(), master.numel(), ways, flat.dtype, accum_dtype, comm_dtype,
                        flat.device, keep_shard=keeps_shard(acco.mode), params=None if overlap else flat,
                        compression=compression)
            for flat, master, ways, compression in zip(flats, masters, where.world_sizes, where.compressions)
        ]
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._accumulate, i, offset))
                       for i, group_params in enumerate(params) for p, offset in group_params]
        self.view = ParamView(params, flats)
        self.log = RoundLog()
        # The outer loop (local-SGD modes: this ZeRO-1 group is one replica, the loop syncs the replicas).
        shards = Shards(masters, flats, lambda: [buf.spare() for buf in self.buffers], params,
                        host_state=functools.partial(heal_state, self),
                        load_host_state=functools.partial(load_heal_state, self), norm_segments=norm_segments,
                        gather=where.gather)
        self.outer: OuterLoop = build_outer_loop(acco, shards, replica_groups)
        self.host_counters = None  # the host's own counters, when each replica keeps its own (checkpoint)
        self.kept = KeptShard()
        self.local_micro = 0  # micro-batches accumulated in the current round
        self.round_scale = self.loss_scale_now()  # loss scale of the current round's gradients
        self.pending: Optional[CommResult] = None  # finished job whose round has not ended yet
        self._commits: List[CommResult] = []  # finished commits the host has not taken yet
        self._handed_next = (0, 1.0)  # (micro-batches, loss scale) of the gradients the next job reduces
        self._round_start = time.perf_counter()
        self._round_wait_s = 0.0
        em = acco.emulation  # benchmark emulation only: this rank computes slower
        self.slow = SlowRank(em.slow_factor) if em.slow_factor > 1.0 and em.slow_rank == tdist.get_rank() else None

    def new_schedule(self) -> RoundSchedule:
        gas = self.gradient_accumulation_steps
        return RoundSchedule(self.acco.round_mode(), self.acco.micro_batches_per_round(gas),
                             self.acco.max_micro_batches(gas))

    # ----------------------------------------------------------- host hooks
    def loss_scale_now(self) -> float:
        """The loss scale the next gradients are computed at (1: no loss scaling)."""
        return 1.0

    def job_options(self) -> dict:
        """Extra ``RoundJob`` arguments of this host (tensor-parallel norm segments and group)."""
        return {}

    def after_result(self, rnd, result: CommResult) -> None:
        """Main-thread bookkeeping of a finished job (before its commits are taken)."""

    def before_job(self) -> None:
        """Main thread, just before a job is handed to the communication thread (nothing is in flight)."""

    def counters(self) -> dict:
        """The host's step counters a replica that heals from this one takes (``acco.fault_tolerance``)."""
        return {}

    def load_counters(self, counters: dict) -> None:
        """Take a peer's ``counters()``."""

    # --------------------------------------------------------- compute side
    @torch.no_grad()
    def _accumulate(self, group: int, offset: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: add ``param.grad`` into the accumulator and free it."""
        dst = self.buffers[group].acc.narrow(0, offset, param.numel())
        dst.add_(param.grad.reshape(-1))
        param.grad = None

    def count_micro_batch(self) -> None:
        """After a backward: count the micro-batch (its gradients are already in the accumulator)."""
        self.local_micro += 1
        if self.slow is not None:
            self.slow.after_backward(self.outer.waited_s())

    def round_may_end(self) -> bool:
        return self.schedule.may_end(self.local_micro, self.pending is not None or self.comm.done())

    def _collect(self) -> Optional[CommResult]:
        """Wait for the in-flight job; a commit is queued for ``take_commits``."""
        result = self.comm.wait()
        if result is not None and result.commits:
            self._commits.append(result)
        return result

    def take_commits(self) -> List[CommResult]:
        """Commits finished since the last call, oldest first (each returned once)."""
        out, self._commits = self._commits, []
        return out

    def finish_round(self) -> Optional[CommResult]:
        """End the current round: wait for its communication (sync: run it), install what it gathered."""
        self.view.restore()
        self.outer.wait()
        rnd = self.schedule.current
        self._handed_next = (self.local_micro, self.round_scale)
        result = None
        t0 = time.perf_counter()
        if rnd.kind == SYNC:
            self._submit(rnd, self._handed_next)
            result = self._collect()
        elif rnd.comm is not None:
            if self.pending is None and self.peers is not None and not self.comm.done():
                with self.peers.waiting(rnd.index):  # a peer at a read sees it and ends its round
                    self.pending = self._collect()
            result = self.pending if self.pending is not None else self._collect()
            self.pending = None
        wait_s = time.perf_counter() - t0 + self._round_wait_s
        if result is not None:
            for flat, buf in zip(self.compute_flats, self.buffers):
                buf.install(flat)
            self.after_result(rnd, result)
        self.log.record(rnd.index, rnd.kind, self.local_micro, time.perf_counter() - self._round_start, wait_s,
                        result, counts_previous=rnd.kind != SYNC)
        return result

    def start_round(self) -> None:
        """Begin the next round; outside sync mode, hand the finished round's
        gradients to the communication thread at once."""
        nxt = self.schedule.advance()
        self.local_micro = 0
        self._round_wait_s = 0.0
        self._round_start = time.perf_counter()
        self.round_scale = self.loss_scale_now()
        if nxt.kind != SYNC:
            self._submit(nxt, self._handed_next)

    def _submit(self, rnd, handed) -> None:
        self.before_job()
        for buf in self.buffers:
            buf.hand_over()
        local_micro, loss_scale = handed
        self.comm.submit(RoundJob(rnd, self.buffers, self.master_shards, self.update, self.kept, self.comm.group,
                                  self.rank, self.world_size, local_micro, loss_scale,
                                  loss_divisor=self.gradient_accumulation_steps, layout=self.layout,
                                  codec=self.codec, flats=self.compute_flats, clip=self.clip,
                                  delay_s=self.acco.emulation.comm_delay_s, parts=self.parts, **self.job_options()))

    # ------------------------------------------------- what users read
    def drain(self) -> None:
        """Wait for the in-flight communication (its parameters are installed when the round ends)."""
        self.outer.before_read()
        if self.comm.busy:
            self.pending = self._collect()

    def committed_flats(self) -> Optional[List[torch.Tensor]]:
        """After ``drain()``: the flat buffers that hold the committed weights, when the compute parameters
        hold something else (an estimate, the iterate before a finished commit, a replica); else None."""
        outer = self.outer.committed_flats()
        if outer is not None:
            return outer
        if self.pending is not None and self.pending.commits:
            return [buf.gathered for buf in self.buffers]
        return None

    def show_committed(self) -> None:
        """Point the module's parameters at the committed weights (no copy) until ``view.restore()``; nests."""
        self.drain()
        self.view.show(self.committed_flats() if self.view.depth == 0 else None)  # nested: the outer read shows

    def finalize_rounds(self) -> bool:
        """Install the in-flight commit's weights and restart the rounds (the host first ends rounds
        until no gradient is left outside it). Returns whether there was a commit to install."""
        self.view.restore()
        self.drain()
        flats = self.committed_flats()
        if flats is not None:
            for flat, src in zip(self.compute_flats, flats):
                flat.copy_(src)
        self.reset_rounds()
        return flats is not None

    def align_rounds(self, end_round) -> int:
        """Make every rank end the same round before a read (collective over the round group; see
        ``peers.align_rounds``). Returns the most micro-batches any rank holds in its round."""
        return align_rounds(self, end_round)

    def commit_everything(self, end_round) -> None:
        """End of training: end rounds (``end_round()``) until every accumulated gradient is inside the
        in-flight commit, leave every replica on one model (local-SGD) and install the committed weights.
        Nothing is dropped: after N steps of a PyTorch loop, N optimizer steps."""
        self.view.restore()
        left = self.align_rounds(end_round)
        while left or self.schedule.current.comm not in (None, COMMIT):
            end_round()
            left = 0
        self.outer.finalize()
        self.finalize_rounds()

    # ---------------------------------------------------------- lifecycle
    def drop_in_flight(self) -> None:
        """The state is being replaced: the in-flight job belongs to the old one (its result is dropped)."""
        self.view.restore()
        if self.comm.busy:
            self.comm.wait()

    def reset_rounds(self) -> None:
        self.schedule = self.new_schedule()
        self.local_micro = 0
        for buf in self.buffers:
            buf.acc.zero_()
        self.pending = None
        self.kept.count, self.kept.finite = 0, True
        self.round_scale = self.loss_scale_now()
        self._round_start = time.perf_counter()

    def close_rounds(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.comm.close()
        self.outer.close()

    # -------------------------------------------------------- observability
    def buffer_bytes(self) -> dict:
        """Bytes of the buffers ACCO adds to ZeRO-1 on this rank, by buffer (see ``buffers``)."""
        return allocated_bytes(self.buffers)


class SlowRank:
    """Benchmark emulation of a slow worker (``acco.emulation``): stretch the compute between backward passes
    by ``factor``, leaving out the time spent waiting for local-SGD communication."""

    def __init__(self, factor: float):
        self.factor = factor
        self._last = None  # (end of the last backward, outer wait so far then)

    def after_backward(self, waited: float) -> None:
        now = time.perf_counter()
        if self._last is not None:
            then, waited_then = self._last
            time.sleep((self.factor - 1.0) * (now - then - (waited - waited_then)))
        self._last = (time.perf_counter(), waited)


__all__ = ["RoundDriver"]
