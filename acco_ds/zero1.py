"""ACCOZeroOptimizer: DeepSpeed's ZeRO-1 optimizer driven by ACCO's rounds.

It reuses everything ZeRO-1 builds: the flat, padded bit16 parameter buffers
(``bit16_groups_flat``), their equal partitions, the fp32 master partition of
this rank (``single_partition_of_fp32_groups``), the wrapped torch optimizer
that only sees that partition, the loss scaler and the checkpoint format. It
replaces how gradients travel:

* after every backward the bit16 ``param.grad`` are packed (unscaled by the
  loss scale) into a flat fp32 accumulator laid out exactly like the flat
  parameters, and ``param.grad`` is freed;
* when a round ends the accumulator goes to the communication thread, which
  reduce-scatters it (this rank receives the sum of its partition over all
  ranks), runs the optimizer update on the partition (``peek``: computed into
  the send buffer only; ``commit``: state advanced) and all-gathers the new
  parameters into a second flat buffer;
* at the end of the next round that buffer is copied into the compute
  parameters.

Gradients are averaged per micro-batch: micro-batch losses are not divided
by anything, the reduced sum is divided by the global micro-batch count,
which is all-reduced with the gradient statistics. So adaptive accumulation
(different counts per worker) still yields the exact mean.

Buffers beyond stock ZeRO-1, for N parameters, W ranks and b bytes per model
parameter: two fp32 accumulators (8N), the gathered next parameters (bN), and
two fp32 partitions (8N/W, the reduced gradient and the one kept from an
estimate round).
"""

import copy
import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch
import torch.distributed as tdist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import logger

from .comm import CommWorker
from .config import ACCOConfig
from .reference import clip_coefficient
from .rounds import COMMIT, SYNC, Round, RoundSchedule

ACCO_STATE_KEY = "acco"

# torch >= 2.13 renamed the flat-tensor collectives; keep working on older releases.
_reduce_scatter = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
_all_gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor


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


def _fast_adam_kind(opt) -> Optional[str]:
    """'torch' / 'fused' when the fused update can replace ``opt.step()``, else None."""
    groups = opt.param_groups
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        for g in groups:
            if g.get("amsgrad") or g.get("maximize") or g.get("differentiable") or g.get("capturable"):
                return None
            if torch.is_tensor(g["lr"]) or any(torch.is_tensor(b) for b in g["betas"]):
                return None
        return "torch"
    try:
        from deepspeed.ops.adam import FusedAdam
    except Exception:  # noqa: BLE001 - optional op
        FusedAdam = None
    if FusedAdam is not None and type(opt) is FusedAdam and all(g.get("bias_correction", True) for g in groups):
        return "fused"
    return None


class ACCOZeroOptimizer(DeepSpeedZeroOptimizer):
    """ZeRO-1 with ACCO rounds. Constructed by ``ACCOEngine`` with all of
    DeepSpeed's ZeRO-1 arguments plus ``acco_config``."""

    def __init__(self, *args, acco_config: ACCOConfig, **kwargs):
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
        self._adam = _fast_adam_kind(self.optimizer)
        if self._adam is None and dist_rank() == 0:
            logger.info(f"ACCO: {type(self.optimizer).__name__} has no fused update; Peek uses the generic "
                        f"snapshot-step-restore path")

        group = self.dp_process_group if self.dp_process_group is not None else tdist.group.WORLD
        self.world_size = tdist.get_world_size(group)
        self.rank = tdist.get_rank(group)
        self.comm = CommWorker(tdist.get_process_group_ranks(group), torch.device(self.device), acco_config.timeout_s)

        # Flat buffers, one set per parameter group, laid out like bit16_groups_flat.
        self._acc, self._acc_comm, self._shard, self._kept, self._next_flat, self._next_parts = [], [], [], [], [], []
        self._pack_offsets = []
        for i, flat in enumerate(self.bit16_groups_flat):
            n, part = flat.numel(), int(self.partition_size[i])
            fp32 = dict(dtype=torch.float32, device=flat.device)
            self._acc.append(torch.zeros(n, **fp32))
            self._acc_comm.append(torch.zeros(n, **fp32))
            self._shard.append(torch.zeros(part, **fp32))
            self._kept.append(torch.zeros(part, **fp32))
            nxt = flat.detach().clone()
            self._next_flat.append(nxt)
            self._next_parts.append([nxt.narrow(0, r * part, part) for r in range(self.world_size)])
            self._pack_offsets.append(list(self.round_robin_bit16_offsets[i]))
        self._kept_count = 0
        self._kept_finite = True

        self.grad_prescale = 1.0  # set by the engine when the caller pre-divided the loss
        self.local_micro = 0  # micro-batches accumulated in the current round
        self._acc_dirty = False  # accumulator holds data from this round
        self._pending: Optional[CommResult] = None  # finished job whose round has not ended yet
        self._round_start = time.perf_counter()
        self._round_wait_s = 0.0
        self._last_backward_end = None
        self.history = deque(maxlen=10000)
        self.totals = {"rounds": 0, "micro_batches": 0, "compute_s": 0.0, "wait_s": 0.0, "comm_s": 0.0}

    # ------------------------------------------------------------------ hooks
    def create_gradient_handling_hooks(self):
        # ZeRO's per-parameter reduction hooks are replaced by packing after backward.
        self._grad_acc_hooks = []

    def backward_epilogue(self, *args, **kwargs):
        pass

    # --------------------------------------------------------- compute side
    @torch.no_grad()
    def accumulate_gradients(self) -> None:
        """Pack every ``param.grad`` into the fp32 accumulator (divided by the
        current loss scale, times ``grad_prescale``) and free it."""
        inv_scale = self.grad_prescale / float(self.loss_scale)
        for i, params in enumerate(self.round_robin_bit16_groups):
            grads, offsets = [], []
            for p, off in zip(params, self._pack_offsets[i]):
                if p.grad is not None:
                    grads.append(p.grad.contiguous())
                    offsets.append(off)
            if not grads:
                continue
            # First micro-batch of a round: copy instead of zero-then-add, when it covers every parameter.
            copy_ok = not self._acc_dirty and len(grads) == len(params)
            if not self._acc_dirty and not copy_ok:
                self._acc[i].zero_()
            self.kernels.pack(grads, self._acc[i], offsets, inv_scale, not copy_ok)
        self._acc_dirty = True
        for params in self.round_robin_bit16_groups:
            for p in params:
                p.grad = None
        self.local_micro += 1

    def emulate_slow_worker(self) -> None:
        em = self.acco.emulation
        now = time.perf_counter()
        if em.slow_rank == self.rank and em.slow_factor > 1.0 and self._last_backward_end is not None:
            time.sleep((em.slow_factor - 1.0) * (now - self._last_backward_end))
        self._last_backward_end = time.perf_counter()

    def round_may_end(self) -> bool:
        return self.schedule.may_end(self.local_micro, self._pending is not None or self.comm.done())

    def end_round(self) -> Optional[CommResult]:
        """Finish the current round: wait for its communication, install the
        gathered parameters, start the next round's communication."""
        rnd = self.schedule.current
        result = None
        t0 = time.perf_counter()
        if rnd.kind == SYNC:
            self._swap_accumulators()
            self.comm.submit(self._job(rnd, self.local_micro))
            result = self.comm.wait()
        elif rnd.comm is not None:
            result = self._pending if self._pending is not None else self.comm.wait()
            self._pending = None
        wait_s = time.perf_counter() - t0 + self._round_wait_s
        if result is not None:
            for flat, nxt in zip(self.bit16_groups_flat, self._next_flat):
                flat.copy_(nxt)
            self._after_result(rnd, result)
        now = time.perf_counter()
        stats = RoundStats(rnd.index, rnd.kind, self.local_micro, now - self._round_start - wait_s, wait_s,
                           result.comm_s if result is not None else 0.0)
        # A job reduces the previous round's gradients (sync: this round's): record its counts there.
        target = stats if rnd.kind == SYNC else (self.history[-1] if self.history else None)
        if result is not None and target is not None:
            target.worker_micro = result.worker_micro
            target.global_micro = sum(result.worker_micro)
        self.history.append(stats)
        for key, value in (("rounds", 1), ("micro_batches", stats.micro_batches), ("compute_s", stats.compute_s),
                           ("wait_s", stats.wait_s), ("comm_s", stats.comm_s)):
            self.totals[key] += value

        finished_micro = self.local_micro
        nxt = self.schedule.advance()
        self.local_micro = 0
        self._round_wait_s = 0.0
        self._round_start = time.perf_counter()
        if nxt.kind == SYNC:
            self._acc_dirty = False
        else:
            # Hand this round's gradients to the communication side; compute continues at once.
            self._swap_accumulators()
            self.comm.submit(self._job(nxt, finished_micro))
        return result

    def _swap_accumulators(self):
        self._acc, self._acc_comm = self._acc_comm, self._acc
        self._acc_dirty = False

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
    def _job(self, rnd: Round, local_micro: int):
        """The communication job for round ``rnd`` on the gradients in ``_acc_comm``."""

        def run() -> CommResult:
            start = time.perf_counter()
            if self.acco.emulation.comm_delay_s > 0:
                time.sleep(self.acco.emulation.comm_delay_s)
            g = self.comm.group
            works = [
                _reduce_scatter(shard, acc, op=tdist.ReduceOp.SUM, group=g, async_op=True)
                for shard, acc in zip(self._shard, self._acc_comm)
            ]
            for w in works:
                w.wait()
            # One small all-reduce: per-rank micro-batch counts, squared norms of the new part and of the total.
            stats = torch.zeros(self.world_size + 2, dtype=torch.float64, device=self._shard[0].device)
            stats[self.rank] = local_micro
            stats[-2] = sum(torch.linalg.vector_norm(s, dtype=torch.float64)**2 for s in self._shard)
            if rnd.add_kept_shard:
                for s, k in zip(self._shard, self._kept):
                    s.add_(k)
                stats[-1] = sum(torch.linalg.vector_norm(s, dtype=torch.float64)**2 for s in self._shard)
            else:
                stats[-1] = stats[-2]
            tdist.all_reduce(stats, group=g)
            worker_micro = [int(c) for c in stats[:self.world_size].tolist()]
            total = sum(worker_micro) + (self._kept_count if rnd.add_kept_shard else 0)
            norm = math.sqrt(float(stats[-1])) / total
            new_overflow = not math.isfinite(float(stats[-2]))
            finite = math.isfinite(norm) and (self._kept_finite or not rnd.add_kept_shard)
            commit = rnd.comm == COMMIT
            if finite:
                scale = clip_coefficient(norm, self.clip_grad) / total
                self._update(self._shard, scale, commit)
                if commit:
                    self._lazy_init_hp_params_optimizer_state()
            else:
                for i, master in enumerate(self.single_partition_of_fp32_groups):
                    self._next_parts[i][self.rank].copy_(master)
            if rnd.keep_shard:
                self._shard, self._kept = self._kept, self._shard
                self._kept_count, self._kept_finite = total, finite
            works = [
                _all_gather(nxt, parts[self.rank], group=g, async_op=True)
                for nxt, parts in zip(self._next_flat, self._next_parts)
            ]
            for w in works:
                w.wait()
            return CommResult(rnd.index, rnd.comm, total, worker_micro, norm, finite, new_overflow,
                              time.perf_counter() - start)

        return run

    def _update(self, shards: List[torch.Tensor], grad_scale: float, commit: bool) -> None:
        """Optimizer update of this rank's partition from the reduced gradient
        sums ``shards``; the result goes to this rank's part of the gather
        buffer. ``commit=False`` leaves the optimizer state untouched."""
        if self._adam is not None:
            for i, master in enumerate(self.single_partition_of_fp32_groups):
                self._fused_adam(i, master, shards[i], grad_scale, commit)
            return
        # Generic path (any torch optimizer): snapshot, step, restore.
        masters = self.single_partition_of_fp32_groups
        if not commit:
            saved = [(m.detach().clone(), copy.deepcopy(self.optimizer.state.get(m))) for m in masters]
        for m, s in zip(masters, shards):
            m.grad = s * grad_scale
        self.optimizer.step()
        for i, m in enumerate(masters):
            m.grad = None
            self._next_parts[i][self.rank].copy_(m)
        if not commit:
            for m, (value, state) in zip(masters, saved):
                m.data.copy_(value)
                if state is None:
                    self.optimizer.state.pop(m, None)
                else:
                    self.optimizer.state[m] = state

    def _fused_adam(self, i: int, master: torch.Tensor, grad: torch.Tensor, grad_scale: float, commit: bool):
        group = self.optimizer.param_groups[i]
        state = self.optimizer.state[master]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0) if self._adam == "torch" else 0
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
        if self._adam == "torch":
            adamw = bool(group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)))
        else:
            adamw = bool(self.optimizer.adam_w_mode)
        step = int(state["step"]) + 1
        beta1, beta2 = group["betas"]
        self.kernels.adamw_update(master, grad, state["exp_avg"], state["exp_avg_sq"], self._next_parts[i][self.rank],
                                  step=step, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                                  eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                                  grad_scale=grad_scale, commit=commit, adamw=adamw)
        if commit:
            state["step"] = state["step"] + 1

    # ---------------------------------------------------------- lifecycle
    def drain(self) -> None:
        """Wait for the in-flight communication; its result is applied when the round ends."""
        if self.comm.busy:
            self._pending = self.comm.wait()

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
        self.comm.close()
        super().destroy()

    # --------------------------------------------------------- checkpoints
    def state_dict(self):
        self.drain()
        sd = super().state_dict()
        pending = self._pending
        sd[ACCO_STATE_KEY] = {
            "world_size": self.world_size,
            "rank": self.rank,
            "schedule": self.schedule.state_dict(),
            "local_micro": self.local_micro,
            "acc_dirty": self._acc_dirty,
            "acc": [a.clone() for a in self._acc] if self._acc_dirty else None,
            "kept": [k.clone() for k in self._kept],
            "kept_count": self._kept_count,
            "kept_finite": self._kept_finite,
            "pending": asdict(pending) if pending is not None else None,
            "pending_params": [p[self.rank].clone() for p in self._next_parts] if pending is not None else None,
        }
        return sd

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False,
                        checkpoint_folder=None, load_serial=None, param_shapes=None):
        if self.comm.busy:
            self.comm.wait()
        mine = state_dict_list[self.rank] if state_dict_list is not None else {}
        acco = mine.get(ACCO_STATE_KEY) if load_optimizer_states else None
        if acco is not None and acco["world_size"] != self.world_size:
            raise ValueError(f"this ACCO checkpoint was saved by {acco['world_size']} data-parallel ranks but this "
                             f"run has {self.world_size}: its in-flight gradients are per rank. Resume with "
                             f"{acco['world_size']} ranks, or load only the module weights "
                             f"(load_checkpoint(..., load_optimizer_states=False, load_lr_scheduler_states=False))")
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
        self._acc_dirty = bool(acco["acc_dirty"])
        if self._acc_dirty:
            for a, saved in zip(self._acc, acco["acc"]):
                a.copy_(saved)
        for k, saved in zip(self._kept, acco["kept"]):
            k.copy_(saved)
        self._kept_count, self._kept_finite = int(acco["kept_count"]), bool(acco["kept_finite"])
        if acco["pending"] is not None:
            self._pending = CommResult(**acco["pending"])
            for parts, saved in zip(self._next_parts, acco["pending_params"]):
                parts[self.rank].copy_(saved)
            for nxt, parts in zip(self._next_flat, self._next_parts):
                _all_gather(nxt, parts[self.rank], group=self.comm.group)

    def _reset_rounds(self):
        self.schedule = RoundSchedule(self.schedule.mode, self.gradient_accumulation_steps, self.schedule.adaptive,
                                      self.schedule.max_micro)
        self.local_micro = 0
        self._acc_dirty = False
        self._pending = None
        self._kept_count, self._kept_finite = 0, True
        self._round_start = time.perf_counter()

    # -------------------------------------------------------- observability
    def round_stats(self) -> dict:
        t = dict(self.totals)
        t["hidden_comm_fraction"] = (1.0 - t["wait_s"] / t["comm_s"]) if t["comm_s"] > 0 else None
        t["mean_micro_per_round"] = t["micro_batches"] / t["rounds"] if t["rounds"] else None
        t["last_rounds"] = [asdict(s) for s in list(self.history)[-8:]]
        t["mode"], t["accumulation"] = self.acco.mode, self.acco.accumulation
        t["kernels"] = self.kernels.name
        t["optimizer_update"] = f"fused-adam ({self._adam})" if self._adam else "generic"
        t["buffer_bytes"] = self.buffer_bytes()
        return t

    def buffer_bytes(self) -> int:
        """Bytes of the buffers ACCO adds to ZeRO-1 on this rank (see the module docstring)."""
        bufs = self._acc + self._acc_comm + self._shard + self._kept + self._next_flat
        return sum(b.numel() * b.element_size() for b in bufs)


def dist_rank() -> int:
    return tdist.get_rank() if tdist.is_initialized() else 0


__all__ = ["ACCOZeroOptimizer", "CommResult", "RoundStats"]
