"""ACCOZeroOptimizer: DeepSpeed's ZeRO-1 optimizer driven by ACCO's rounds.

It reuses everything ZeRO-1 builds: the flat, padded parameter buffers
(``bit16_groups_flat``), their equal partitions, this rank's fp32 master
partition (``single_partition_of_fp32_groups``), the wrapped torch optimizer
that only sees that partition, the loss scaler and the checkpoint format. It
replaces how gradients travel:

* during backward, a post-accumulate-grad hook adds each ``param.grad`` into
  a flat accumulator laid out like the flat parameters and frees it
  (``runtime.buffers.FlatBuffers``), so gradients never exist twice;
* when a round ends (``finish_round``) the gathered parameters of the
  finished job become the compute parameters; ``start_round`` then hands
  the accumulated gradients to the communication thread, which runs the
  round's job (``runtime.job.RoundJob``: reduce-scatter, Peek or commit,
  all-gather over the same buffer).

Gradients are averaged per micro-batch: micro-batch losses are divided by
``gradient_accumulation_steps`` as in stock DeepSpeed (same 16-bit headroom),
the job multiplies that back and divides the reduced sum by the global
micro-batch count, all-reduced with the gradient norms. So adaptive
accumulation (different counts per worker) still yields the exact mean.

The engine reads finished commits with ``take_commits()`` (it steps the LR
scheduler and counts ``global_steps`` there) between ``finish_round`` and
``start_round``, so the next Peek sees the learning rate of its step.
"""

import functools
import time
from typing import List, Optional

import torch
import torch.distributed as tdist

from ..algorithms.rounds import SYNC, RoundSchedule
from ..config import ACCOConfig
from ..runtime.buffers import FlatBuffers, allocated_bytes
from ..runtime.compression import round_codec
from ..runtime.comm import CommWorker
from ..runtime.host_memory import pin_mmap_threshold
from ..runtime.job import CommResult, KeptShard, RoundJob
from ..runtime.outer_loop import OuterLoop, Shards, build_outer_loop
from ..runtime.stats import RoundLog
from ..runtime.update import ShardUpdate
from . import checkpoint
from .compat import DeepSpeedZeroOptimizer, check_instance, fused_adamw, logger
from .loss_scale import account_loss_scale
from .parallel import crosses_nodes, node_layout, norm_segments, side_group
from .views import ParamView


class ACCOZeroOptimizer(DeepSpeedZeroOptimizer):
    """ZeRO-1 with ACCO rounds. Constructed by ``ACCOEngine`` with all of
    DeepSpeed's ZeRO-1 arguments plus ``acco_config`` and
    ``communication_data_type`` (the reduce-scatter dtype)."""

    def __init__(self, *args, acco_config: ACCOConfig, communication_data_type: Optional[torch.dtype] = None,
                 replica_groups=None, **kwargs):
        super().__init__(*args, **kwargs)
        check_instance(self, "DeepSpeedZeroOptimizer")
        self.acco = acco_config
        self.schedule = self._new_schedule()

        from .. import ops
        self.kernels = ops.load_kernels(acco_config.kernels, self.device)
        self.update = ShardUpdate(self.optimizer, self.single_partition_of_fp32_groups, self.kernels,
                                  fused_adamw=fused_adamw(self.optimizer))

        group = self.dp_process_group if self.dp_process_group is not None else tdist.group.WORLD
        self.world_size = tdist.get_world_size(group)
        self.rank = tdist.get_rank(group)
        side = replica_groups.replica_side if replica_groups is not None else side_group(group, acco_config.timeout_s)
        self.comm = CommWorker(tdist.get_process_group_ranks(group), torch.device(self.device), acco_config.timeout_s,
                               group=side)
        self.layout = node_layout(group, side, acco_config)  # None: flat collectives
        # Tensor parallelism: the norm counts each parameter once and is summed over the model-parallel group.
        tp = self.model_parallel_world_size > 1
        self.mp_side = side_group(self.model_parallel_group, acco_config.timeout_s) if tp else None
        self.norm_segments = norm_segments(self) if tp else None

        if torch.device(self.device).type == "cpu":
            pin_mmap_threshold()  # freed per-parameter gradients go back to the OS (see runtime.host_memory)
        self.accum_dtype = self.gradient_accumulation_dtype or self.dtype
        self.comm_dtype = communication_data_type or self.dtype
        # Without overlap (sync rounds, local-SGD inner steps) the job gathers straight into the parameters.
        overlap = self.schedule.overlaps
        self.codec, rounds_compression = round_codec(acco_config, self.kernels, self.layout, self.world_size,
                                                     crosses_nodes(group, acco_config))
        self.buffers = [
            FlatBuffers(flat.numel(), int(self.partition_size[i]), self.world_size, self.dtype, self.accum_dtype,
                        self.comm_dtype, flat.device, keep_shard=acco_config.mode == "acco",
                        params=None if overlap else flat, compression=rounds_compression)
            for i, flat in enumerate(self.bit16_groups_flat)
        ]
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulate, i, offset))
            for i, params in enumerate(self.round_robin_bit16_groups)
            for p, offset in zip(params, self.round_robin_bit16_offsets[i])
        ]
        self.view = ParamView(self.round_robin_bit16_groups, self.round_robin_bit16_meta,
                              self.round_robin_bit16_offsets, self.bit16_groups_flat)
        self.log = RoundLog()
        # The outer loop (local-SGD modes: this ZeRO-1 group is one replica, the loop syncs the replicas).
        self.outer: OuterLoop = build_outer_loop(acco_config, self._shards(), replica_groups)
        self.host_counters = None  # the engine's own counters, when each replica keeps its own (checkpoint)
        self.kept = KeptShard()
        self.local_micro = 0  # micro-batches accumulated in the current round
        self.round_scale = float(self.loss_scale)  # loss scale of the current round's gradients
        self.pending: Optional[CommResult] = None  # finished job whose round has not ended yet
        self._commits: List[CommResult] = []  # finished commits the engine has not taken yet
        self._handed_next = (0, 1.0)  # (micro-batches, loss scale) of the gradients the next job reduces
        self._round_start = time.perf_counter()
        self._round_wait_s = 0.0
        self._last_backward_end = None

    def _shards(self) -> Shards:
        params = [list(zip(ps, offs)) for ps, offs in zip(self.round_robin_bit16_groups,
                                                          self.round_robin_bit16_offsets)]
        return Shards(self.single_partition_of_fp32_groups, self.bit16_groups_flat,
                      lambda: [buf.spare() for buf in self.buffers], params)

    def _new_schedule(self) -> RoundSchedule:
        gas = self.gradient_accumulation_steps
        return RoundSchedule(self.acco.round_mode(), self.acco.micro_batches_per_round(gas),
                             self.acco.max_micro_batches(gas))

    # ------------------------------------------------------------------ hooks
    def create_gradient_handling_hooks(self):
        # ZeRO's per-parameter reduction hooks are replaced by ACCO's accumulation hooks.
        self._grad_acc_hooks = []

    def backward_epilogue(self, *args, **kwargs):
        pass

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
        em = self.acco.emulation
        if em.slow_factor > 1.0 and em.slow_rank == tdist.get_rank():  # benchmark emulation only
            _slow_down(self, em.slow_factor)

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
            result = self.pending if self.pending is not None else self._collect()
            self.pending = None
        wait_s = time.perf_counter() - t0 + self._round_wait_s
        if result is not None:
            for flat, buf in zip(self.bit16_groups_flat, self.buffers):
                buf.install(flat)
            self._after_result(rnd, result)
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
        self.round_scale = float(self.loss_scale)
        if nxt.kind != SYNC:
            self._submit(nxt, self._handed_next)

    def _submit(self, rnd, handed) -> None:
        for buf in self.buffers:
            buf.hand_over()
        local_micro, loss_scale = handed
        self.comm.submit(RoundJob(rnd, self.buffers, self.single_partition_of_fp32_groups, self.update, self.kept,
                                  self.comm.group, self.rank, self.world_size, local_micro, loss_scale,
                                  loss_divisor=self.gradient_accumulation_steps, norm_segments=self.norm_segments,
                                  mp_group=self.mp_side, layout=self.layout, codec=self.codec,
                                  flats=self.bit16_groups_flat,
                                  clip=self.clip_grad, delay_s=self.acco.emulation.comm_delay_s))

    def _after_result(self, rnd, result: CommResult) -> None:
        """Main-thread bookkeeping of a finished job: ZeRO's lazy state link, and the loss scaler once
        per committed step, as stock ZeRO-1 updates it once per step."""
        self.overflow = not result.finite
        if result.commits and result.finite:
            self._lazy_init_hp_params_optimizer_state()
        if result.commits:
            account_loss_scale(self, rnd, result)

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

    def finalize(self) -> bool:
        """Install the in-flight commit's weights and restart the rounds (the engine first ends rounds
        until no gradient is left outside it). Returns whether there was a commit to install."""
        self.view.restore()
        self.drain()
        flats = self.committed_flats()
        if flats is not None:
            for flat, src in zip(self.bit16_groups_flat, flats):
                flat.copy_(src)
        self._reset_rounds()
        return flats is not None

    # ---------------------------------------------------------- lifecycle
    def checkpoint_event_prologue(self):
        t0 = time.perf_counter()
        self.drain()
        self._round_wait_s += time.perf_counter() - t0

    def step(self, closure=None):
        raise RuntimeError("ACCOZeroOptimizer is driven by the ACCO engine: call engine.step(), not optimizer.step()")

    def destroy(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.comm.close()
        self.outer.close()
        super().destroy()

    def state_dict(self):
        self.drain()
        sd = super().state_dict()
        sd[checkpoint.ACCO_STATE_KEY] = checkpoint.save_state(self)
        return sd

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False,
                        checkpoint_folder=None, load_serial=None, param_shapes=None):
        self.outer.before_read()
        self._drop_in_flight()
        acco = checkpoint.find_state(self, state_dict_list) if load_optimizer_states else None
        super().load_state_dict(state_dict_list, load_optimizer_states, load_from_fp32_weights, checkpoint_folder,
                                load_serial, param_shapes)
        self._reset_rounds()
        if acco is not None:
            checkpoint.load_state(self, acco)
        elif load_optimizer_states and state_dict_list is not None:
            logger.warning("ACCO: the checkpoint has no ACCO state (saved without ACCO?); rounds restart "
                           "with a start-up round")

    def _restore_from_bit16_weights(self):
        # DeepSpeed's load without optimizer states (and load_module_only, through refresh_fp32_params):
        # the module weights were replaced: rounds restart, and the outer loop starts over from the loaded
        # weights (its anchor is the loaded model).
        self._drop_in_flight()
        super()._restore_from_bit16_weights()
        self._reset_rounds()
        self.outer.restart()

    def _drop_in_flight(self):
        """The state is being replaced: the in-flight job belongs to the old one (its result is dropped)."""
        self.view.restore()
        if self.comm.busy:
            self.comm.wait()

    def _reset_rounds(self):
        self.schedule = self._new_schedule()
        self.local_micro = 0
        for buf in self.buffers:
            buf.acc.zero_()
        self.pending = None
        self.kept.count, self.kept.finite = 0, True
        self.round_scale = float(self.loss_scale)
        self._round_start = time.perf_counter()

    # -------------------------------------------------------- observability
    def round_stats(self) -> dict:
        out = dict(self.log.summary(), mode=self.acco.mode, accumulation=self.acco.accumulation,
                   kernels=self.kernels.name, optimizer_update=self.update.name, buffer_bytes=self.buffer_bytes(),
                   compression=None if self.codec is None else str(self.codec),
                   compressed_bytes=None if self.codec is None else self.codec.sent_bytes)
        out.update(self.outer.stats())
        return out

    def buffer_bytes(self) -> dict:
        """Bytes of the buffers ACCO adds to ZeRO-1 on this rank, by buffer (see ``runtime.buffers``)."""
        return allocated_bytes(self.buffers)


def _slow_down(opt, factor: float) -> None:
    """Emulate a slow worker: stretch the compute since the last backward by ``factor``, leaving out the
    time spent waiting for local-SGD communication."""
    now, waited = time.perf_counter(), opt.outer.waited_s()
    if opt._last_backward_end is not None:
        then, waited_then = opt._last_backward_end
        time.sleep((factor - 1.0) * (now - then - (waited - waited_then)))
    opt._last_backward_end = (time.perf_counter(), waited)


__all__ = ["ACCOZeroOptimizer"]
