"""ACCOZeroOptimizer: DeepSpeed's ZeRO-1 optimizer driven by ACCO's rounds.

It reuses everything ZeRO-1 builds: the flat, padded parameter buffers
(``bit16_groups_flat``), their equal partitions, this rank's fp32 master
partition (``single_partition_of_fp32_groups``), the wrapped torch optimizer
that only sees that partition, the loss scaler and the checkpoint format. It
replaces how gradients travel:

* during backward, a post-accumulate-grad hook adds each ``param.grad`` into
  a flat accumulator laid out like the flat parameters and frees it
  (``buffers.FlatBuffers``), so gradients never exist twice;
* when a round ends the accumulated gradients move to the communication
  buffer and the communication thread reduce-scatters them
  (``collectives``), runs the sharded update (``update.ShardUpdate``: Peek or
  commit) and all-gathers the new parameters over the same buffer;
* when the next round ends those parameters are copied into the compute
  parameters.

Gradients are averaged per micro-batch: micro-batch losses are not divided
by anything, the reduced sum is divided by the global micro-batch count,
which is all-reduced with the gradient norms (the one small collective every
ZeRO-1 step also does). So adaptive accumulation (different counts per
worker) still yields the exact mean.

What users read is the committed iterate: ``committed_flats()`` says where it
is when the compute parameters hold an estimate, and the engine points the
module's parameters there for saving and evaluation.
"""

import functools
import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as tdist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import logger

from . import collectives
from .buffers import FlatBuffers
from .comm import CommWorker
from .config import ACCOConfig
from .reference import clip_coefficient
from .rounds import COMMIT, SYNC, Round, RoundSchedule
from .update import ShardUpdate

ACCO_STATE_KEY = "acco"


@dataclass
class CommResult:
    """What the communication side reports for one round."""
    round_index: int
    op: str  # peek | commit
    global_micro: int  # micro-batches (all ranks) in the gradient the update used
    worker_micro: List[int]  # per rank, of the newly reduced part
    grad_norm: float  # norm of the mean gradient, before clipping (nan/inf if non-finite)
    finite: bool  # the update was applied (False: skipped, parameters unchanged)
    new_overflow: bool  # the newly reduced part had non-finite values
    comm_s: float = 0.0
    phases: Optional[dict] = None  # seconds of comm_s by phase: reduce_scatter, stats_allreduce, update, all_gather
    accounted: bool = False  # the engine already counted this commit (global_steps, LR scheduler)


@dataclass
class RoundStats:
    index: int
    kind: str
    micro_batches: int  # local
    compute_s: float  # time on the compute side, excluding waiting
    wait_s: float  # time the compute side waited for the communication
    comm_s: float  # duration of the communication job of this round
    global_micro: Optional[int] = None
    worker_micro: Optional[List[int]] = None


class ACCOZeroOptimizer(DeepSpeedZeroOptimizer):
    """ZeRO-1 with ACCO rounds. Constructed by ``ACCOEngine`` with all of
    DeepSpeed's ZeRO-1 arguments plus ``acco_config`` and
    ``communication_data_type`` (the reduce-scatter dtype)."""

    def __init__(self, *args, acco_config: ACCOConfig, communication_data_type: Optional[torch.dtype] = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        if self.partition_gradients:
            raise ValueError("ACCO runs on ZeRO stage 1: set zero_optimization.stage to 1")
        if self.has_moe_layers:
            raise ValueError("ACCO does not support MoE layers (expert parallel groups): train without MoE")
        if self.model_parallel_world_size > 1:
            raise ValueError("ACCO does not support tensor/model parallelism yet: use a model parallel size of 1")
        self.acco = acco_config
        gas = self.gradient_accumulation_steps
        self.schedule = RoundSchedule(acco_config.mode, gas, acco_config.accumulation == "adaptive",
                                      acco_config.max_micro_batches(gas))

        from . import ops
        self.kernels = ops.load_kernels(acco_config.kernels, self.device)
        self.update = ShardUpdate(self.optimizer, self.single_partition_of_fp32_groups, self.kernels)

        group = self.dp_process_group if self.dp_process_group is not None else tdist.group.WORLD
        self.world_size = tdist.get_world_size(group)
        self.rank = tdist.get_rank(group)
        self.comm = CommWorker(tdist.get_process_group_ranks(group), torch.device(self.device), acco_config.timeout_s)

        self.accum_dtype = self.gradient_accumulation_dtype or self.dtype
        self.comm_dtype = communication_data_type or self.dtype
        self.buffers = [
            FlatBuffers(flat.numel(), int(self.partition_size[i]), self.world_size, self.dtype, self.accum_dtype,
                        self.comm_dtype, flat.device) for i, flat in enumerate(self.bit16_groups_flat)
        ]
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulate, i, offset))
            for i, params in enumerate(self.round_robin_bit16_groups)
            for p, offset in zip(params, self.round_robin_bit16_offsets[i])
        ]
        self._kept_count = 0
        self._kept_finite = True

        self.grad_prescale = 1.0  # set by the engine when the caller pre-divided the loss
        self.local_micro = 0  # micro-batches accumulated in the current round
        self._round_scale = float(self.loss_scale)  # loss scale of the current round's gradients
        self._pending: Optional[CommResult] = None  # finished job whose round has not ended yet
        self._view = 0  # >0: the module's parameters point at the committed weights (see committed_flats)
        self._round_start = time.perf_counter()
        self._round_wait_s = 0.0
        self._last_backward_end = None
        self.history = deque(maxlen=10000)
        self.totals = {"rounds": 0, "micro_batches": 0, "compute_s": 0.0, "wait_s": 0.0, "comm_s": 0.0,
                       "reduce_scatter_s": 0.0, "stats_allreduce_s": 0.0, "update_s": 0.0, "all_gather_s": 0.0}

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
        dst.add_(param.grad.reshape(-1), alpha=self.grad_prescale)
        param.grad = None

    def count_micro_batch(self) -> None:
        """After a backward: count the micro-batch (its gradients are already in the accumulator)."""
        self.local_micro += 1

    def emulate_slow_worker(self) -> None:
        em = self.acco.emulation
        now = time.perf_counter()
        if em.slow_rank == self.rank and em.slow_factor > 1.0 and self._last_backward_end is not None:
            time.sleep((em.slow_factor - 1.0) * (now - self._last_backward_end))
        self._last_backward_end = time.perf_counter()

    def round_may_end(self) -> bool:
        return self.schedule.may_end(self.local_micro, self._pending is not None or self.comm.done())

    def end_round(self, on_commit: Callable[[CommResult], None]) -> Optional[CommResult]:
        """Finish the current round: wait for its communication, install the
        gathered parameters, count a commit (``on_commit``, before the next
        job reads the learning rate), start the next round's communication."""
        self.restore_compute_params()
        rnd = self.schedule.current
        finished_micro, finished_scale = self.local_micro, self._round_scale
        result = None
        t0 = time.perf_counter()
        if rnd.kind == SYNC:
            self._hand_over()
            self.comm.submit(self._job(rnd, finished_micro, finished_scale))
            result = self.comm.wait()
        elif rnd.comm is not None:
            result = self._pending if self._pending is not None else self.comm.wait()
            self._pending = None
        wait_s = time.perf_counter() - t0 + self._round_wait_s
        if result is not None:
            for flat, buf in zip(self.bit16_groups_flat, self.buffers):
                flat.copy_(buf.gathered)
            self._after_result(rnd, result)
            if result.op == COMMIT and not result.accounted:
                result.accounted = True
                on_commit(result)
        self._record(rnd, result, wait_s)

        nxt = self.schedule.advance()
        self.local_micro = 0
        self._round_wait_s = 0.0
        self._round_start = time.perf_counter()
        self._round_scale = float(self.loss_scale)
        if nxt.kind != SYNC:
            # Hand this round's gradients to the communication side; compute continues at once.
            self._hand_over()
            self.comm.submit(self._job(nxt, finished_micro, finished_scale))
        return result

    def _hand_over(self):
        for buf in self.buffers:
            buf.hand_over()

    def _record(self, rnd: Round, result: Optional[CommResult], wait_s: float) -> None:
        now = time.perf_counter()
        stats = RoundStats(rnd.index, rnd.kind, self.local_micro, now - self._round_start - wait_s, wait_s,
                           result.comm_s if result is not None else 0.0)
        # A job reduces the previous round's gradients (sync: this round's): record its counts there.
        target = stats if rnd.kind == SYNC else (self.history[-1] if self.history else None)
        if result is not None and target is not None:
            target.worker_micro = result.worker_micro
            target.global_micro = sum(result.worker_micro)
        self.history.append(stats)
        for key, value in ((result.phases or {}) if result is not None else {}).items():
            self.totals[key + "_s"] += value
        for key, value in (("rounds", 1), ("micro_batches", stats.micro_batches), ("compute_s", stats.compute_s),
                           ("wait_s", stats.wait_s), ("comm_s", stats.comm_s)):
            self.totals[key] += value

    def _after_result(self, rnd: Round, result: CommResult) -> None:
        """Loss-scale bookkeeping on the main thread (the scale is read by backward)."""
        self.overflow = not result.finite
        if result.new_overflow:
            if self.dynamic_loss_scale:
                self.loss_scaler.update_scale(True)
            logger.warning(f"ACCO: non-finite gradients in round {rnd.index} (rank {self.rank}); the update is "
                           f"skipped on every rank" + (f", loss scale lowered to {self.loss_scale}"
                                                       if self.dynamic_loss_scale else
                                                       ": check the learning rate, data and gradient_clipping"))
        elif result.op == COMMIT and result.finite and self.dynamic_loss_scale:
            self.loss_scaler.update_scale(False)

    # --------------------------------------------------- communication side
    def _job(self, rnd: Round, local_micro: int, loss_scale: float):
        """The communication job for round ``rnd`` on the gradients handed over
        to the communication buffers (accumulated at loss scale ``loss_scale``)."""

        def run() -> CommResult:
            start = time.perf_counter()
            if self.acco.emulation.comm_delay_s > 0:
                time.sleep(self.acco.emulation.comm_delay_s)
            g = self.comm.group
            for buf in self.buffers:
                collectives.reduce_scatter(buf.reduced, buf.send, g)
            t_rs = time.perf_counter()
            # One small all-reduce: per-rank micro-batch counts, squared norms of the new part and of the total.
            stats = torch.zeros(self.world_size + 2, dtype=torch.float64, device=self.buffers[0].shard.device)
            stats[self.rank] = local_micro
            inv_scale = 1.0 / loss_scale
            for buf in self.buffers:
                if rnd.keep_shard:  # estimate round: the real round adds this part again
                    buf.kept.copy_(buf.reduced)
                    buf.kept_scale = inv_scale
                if buf.reduced is not buf.shard:
                    buf.shard.copy_(buf.reduced)
                if inv_scale != 1.0:
                    buf.shard.mul_(inv_scale)
            stats[-2] = sum(torch.linalg.vector_norm(b.shard, dtype=torch.float64)**2 for b in self.buffers)
            if rnd.add_kept_shard:
                for buf in self.buffers:
                    buf.shard.add_(buf.kept, alpha=buf.kept_scale)
                stats[-1] = sum(torch.linalg.vector_norm(b.shard, dtype=torch.float64)**2 for b in self.buffers)
            else:
                stats[-1] = stats[-2]
            t_stats = time.perf_counter()
            tdist.all_reduce(stats, group=g)
            t_update = time.perf_counter()
            worker_micro = [int(c) for c in stats[:self.world_size].tolist()]
            total = sum(worker_micro) + (self._kept_count if rnd.add_kept_shard else 0)
            norm = math.sqrt(float(stats[-1])) / total
            new_overflow = not math.isfinite(float(stats[-2]))
            finite = math.isfinite(norm) and (self._kept_finite or not rnd.add_kept_shard)
            commit = rnd.comm == COMMIT
            outs = [buf.gathered_part(self.rank) for buf in self.buffers]
            if finite:
                scale = clip_coefficient(norm, self.clip_grad) / total
                self.update([b.shard for b in self.buffers], scale, commit, outs)
                if commit:
                    self._lazy_init_hp_params_optimizer_state()
            else:
                for out, master in zip(outs, self.single_partition_of_fp32_groups):
                    out.copy_(master)
            if rnd.keep_shard:
                self._kept_count, self._kept_finite = total, finite
            t_ag = time.perf_counter()
            for buf, out in zip(self.buffers, outs):
                collectives.all_gather(buf.gathered, out, g)
            end = time.perf_counter()
            # The shard arithmetic between the collectives counts as update.
            phases = {"reduce_scatter": t_rs - start, "stats_allreduce": t_update - t_stats,
                      "update": (t_stats - t_rs) + (t_ag - t_update), "all_gather": end - t_ag}
            return CommResult(rnd.index, rnd.comm, total, worker_micro, norm, finite, new_overflow, end - start,
                              phases)

        return run

    # ------------------------------------------------- what users read
    def drain(self, on_commit: Optional[Callable[[CommResult], None]] = None) -> None:
        """Wait for the in-flight communication (its parameters are installed
        when the round ends). With ``on_commit``, a finished commit is counted
        now rather than at the end of the round."""
        if self.comm.busy:
            self._pending = self.comm.wait()
        p = self._pending
        if on_commit is not None and p is not None and p.op == COMMIT and not p.accounted:
            p.accounted = True
            on_commit(p)

    def committed_flats(self) -> Optional[List[torch.Tensor]]:
        """After ``drain()``: the flat buffers that hold the committed
        weights, when the compute parameters hold something else (an
        estimate, or the iterate before a finished commit); None when the
        compute parameters are the committed weights."""
        if self._pending is not None and self._pending.op == COMMIT:
            return [buf.gathered for buf in self.buffers]
        return None

    def _point_params(self, flats: List[torch.Tensor]) -> None:
        for i, params in enumerate(self.round_robin_bit16_groups):
            for p, meta, offset in zip(params, self.round_robin_bit16_meta[i], self.round_robin_bit16_offsets[i]):
                p.data = flats[i].narrow(0, offset, meta.numel()).view(meta.shape)

    def show_committed(self, on_commit) -> None:
        """Point the module's parameters at the committed weights (no copy) until
        ``restore_compute_params()``; nests."""
        self.drain(on_commit)
        flats = self.committed_flats()
        if self._view == 0 and flats is not None:
            self._point_params(flats)
            self._view = 1
        elif self._view:
            self._view += 1

    def restore_compute_params(self, all_levels: bool = True) -> None:
        if self._view == 0:
            return
        self._view = 0 if all_levels else self._view - 1
        if self._view == 0:
            self._point_params(self.bit16_groups_flat)

    def finalize(self, on_commit) -> bool:
        """Commit the step whose gradients are complete, install the committed
        weights, and restart the rounds (a start-up round comes next). Returns
        whether a step was committed."""
        self.restore_compute_params()
        self.drain(on_commit)
        flats = self.committed_flats()
        if self.local_micro:
            logger.warning(f"ACCO finalize: {self.local_micro} micro-batches of the unfinished round "
                           f"{self.schedule.current.index} belong to no complete step and are not applied")
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

    def checkpoint_event_epilogue(self):
        pass

    def step(self, closure=None):
        raise RuntimeError("ACCOZeroOptimizer.step() is driven by the ACCO engine: call engine.step(), "
                           "not engine.optimizer.step()")

    def destroy(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.comm.close()
        super().destroy()

    # --------------------------------------------------------- checkpoints
    def _my_part(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        part = int(self.partition_size[i])
        return flat.narrow(0, self.rank * part, part)

    def state_dict(self):
        self.drain()
        sd = super().state_dict()
        pending = self._pending
        sd[ACCO_STATE_KEY] = {
            "world_size": self.world_size,
            "rank": self.rank,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "schedule": self.schedule.state_dict(),
            "local_micro": self.local_micro,
            "round_scale": self._round_scale,
            "acc": [b.acc.clone() for b in self.buffers] if self.local_micro else None,
            "kept": [b.kept.clone() for b in self.buffers],
            "kept_scale": [b.kept_scale for b in self.buffers],
            "kept_count": self._kept_count,
            "kept_finite": self._kept_finite,
            # The module weights in the checkpoint are the committed ones; the compute
            # parameters (an estimate in a real round) are restored from these partitions.
            "compute_part": [self._my_part(f, i).clone() for i, f in enumerate(self.bit16_groups_flat)],
            "pending": asdict(pending) if pending is not None else None,
            "pending_part": [self._my_part(b.gathered, i).clone() for i, b in enumerate(self.buffers)]
            if pending is not None else None,
        }
        return sd

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False,
                        checkpoint_folder=None, load_serial=None, param_shapes=None):
        if self.comm.busy:
            self.comm.wait()
        self.restore_compute_params()
        mine = state_dict_list[self.rank] if state_dict_list is not None and self.rank < len(state_dict_list) else {}
        acco = mine.get(ACCO_STATE_KEY) if load_optimizer_states else None
        if acco is not None and acco["world_size"] != self.world_size:
            raise ValueError(f"this ACCO checkpoint was saved by {acco['world_size']} data-parallel ranks but this "
                             f"run has {self.world_size}: its in-flight gradients are per rank. Resume with "
                             f"{acco['world_size']} ranks, or load only the module weights "
                             f"(load_checkpoint(..., load_optimizer_states=False, load_lr_scheduler_states=False))")
        gas = acco.get("gradient_accumulation_steps") if acco is not None else None
        if gas is not None and gas != self.gradient_accumulation_steps:
            raise ValueError(f"this ACCO checkpoint was saved with gradient_accumulation_steps={gas} but this run "
                             f"has {self.gradient_accumulation_steps}: its in-flight rounds hold that many "
                             f"micro-batches. Resume with gradient_accumulation_steps={gas}, or load only the module "
                             f"weights (load_checkpoint(..., load_optimizer_states=False, "
                             f"load_lr_scheduler_states=False))")
        super().load_state_dict(state_dict_list, load_optimizer_states, load_from_fp32_weights, checkpoint_folder,
                                load_serial, param_shapes)
        self._reset_rounds()
        if acco is None:
            if load_optimizer_states and state_dict_list is not None:
                logger.warning("ACCO: the checkpoint has no ACCO state (saved without ACCO?); rounds restart "
                               "with a start-up round")
            return
        self.schedule.load_state_dict(acco["schedule"])
        self.local_micro = int(acco["local_micro"])
        self._round_scale = float(acco["round_scale"])
        for buf, acc in zip(self.buffers, acco["acc"] or [None] * len(self.buffers)):
            if acc is not None:
                buf.acc.copy_(acc)
        for buf, saved, scale in zip(self.buffers, acco["kept"], acco["kept_scale"]):
            buf.kept.copy_(saved)
            buf.kept_scale = scale
        self._kept_count, self._kept_finite = int(acco["kept_count"]), bool(acco["kept_finite"])
        g = self.comm.group
        for i, (flat, saved) in enumerate(zip(self.bit16_groups_flat, acco["compute_part"])):
            self._my_part(flat, i).copy_(saved)
            collectives.all_gather(flat, self._my_part(flat, i), g)
        if acco["pending"] is not None:
            self._pending = CommResult(**acco["pending"])
            for i, (buf, saved) in enumerate(zip(self.buffers, acco["pending_part"])):
                out = buf.gathered_part(self.rank)
                out.copy_(saved)
                collectives.all_gather(buf.gathered, out, g)

    def _reset_rounds(self):
        self.schedule = RoundSchedule(self.schedule.mode, self.gradient_accumulation_steps, self.schedule.adaptive,
                                      self.schedule.max_micro)
        self.local_micro = 0
        for buf in self.buffers:
            buf.acc.zero_()
        self._pending = None
        self._kept_count, self._kept_finite = 0, True
        self._round_scale = float(self.loss_scale)
        self._round_start = time.perf_counter()

    # -------------------------------------------------------- observability
    def round_stats(self) -> dict:
        t = dict(self.totals)
        t["hidden_comm_fraction"] = (1.0 - t["wait_s"] / t["comm_s"]) if t["comm_s"] > 0 else None
        t["mean_micro_per_round"] = t["micro_batches"] / t["rounds"] if t["rounds"] else None
        t["last_rounds"] = [asdict(s) for s in list(self.history)[-8:]]
        t["mode"], t["accumulation"] = self.acco.mode, self.acco.accumulation
        t["kernels"] = self.kernels.name
        t["optimizer_update"] = self.update.name
        t["buffer_bytes"] = self.buffer_bytes()
        return t

    def buffer_bytes(self) -> dict:
        """Bytes of the buffers ACCO adds to ZeRO-1 on this rank, by buffer (see ``buffers``)."""
        out = {}
        for buf in self.buffers:
            for key, n in buf.nbytes().items():
                out[key] = out.get(key, 0) + n
        out["total"] = sum(out.values())
        return out


__all__ = ["ACCOZeroOptimizer", "CommResult", "RoundStats"]
