"""ACCOEngine: a DeepSpeedEngine whose ZeRO-1 optimizer runs ACCO rounds.

Only the glue lives here. The engine

* builds ``ACCOZeroOptimizer`` instead of ``DeepSpeedZeroOptimizer`` (same
  constructor arguments, swapped in for the duration of DeepSpeed's own
  ``_configure_zero_optimizer``);
* drives rounds from completed backward passes, so every way frameworks call
  DeepSpeed works: ``step()`` after each micro-batch, or ``backward()`` per
  micro-batch and ``step()`` only at the boundary
  (``set_gradient_accumulation_boundary`` keeps having no side effects);
* does the per-committed-step bookkeeping that ``_take_model_step`` does in
  stock DeepSpeed: ``global_steps``, ``global_samples``, ``skipped_steps``,
  the LR scheduler (once per committed step, so a Peek sees the learning rate
  of the step it anticipates), the global gradient norm, progress logs and
  monitor events.

Micro-batch losses are not divided by ``gradient_accumulation_steps``: the
optimizer divides the reduced gradient sum by the global micro-batch count.
``backward()`` still returns ``loss / gradient_accumulation_steps`` when
``scale_wrt_gas`` is true, as DeepSpeed does, for logging code that expects it.
"""

import functools
import deepspeed.runtime.engine as ds_engine
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import log_dist

from .config import parse_acco_config, validate_against_deepspeed
from .rounds import COMMIT
from .zero1 import ACCOZeroOptimizer, CommResult


class ACCOEngine(DeepSpeedEngine):
    """DeepSpeed engine with ACCO. Create it through ``acco_ds.initialize`` (or
    ``deepspeed.initialize`` after ``acco_ds.patch()``), never directly."""

    def __init__(self, *args, **kwargs):
        config, config_class = kwargs.get("config"), kwargs.get("config_class")
        acco = parse_acco_config(config if isinstance(config, dict) else {})
        if not acco.enabled:
            raise ValueError('ACCOEngine needs "acco": {"enabled": true} in the DeepSpeed config')
        if config_class is not None:
            validate_against_deepspeed(acco, config_class)
            if not config_class.managed_gradient_accumulation:
                raise ValueError("ACCO drives gradient accumulation itself: remove "
                                 "managed_gradient_accumulation=false from the DeepSpeed config")
            if kwargs.get("optimizer") is None and config_class.optimizer_name is None:
                raise ValueError('ACCO needs an optimizer: add "optimizer": {"type": "AdamW", "params": {...}} to '
                                 'the DeepSpeed config or pass optimizer= to initialize')
            if config_class.zero_config.zenflow is not None:
                raise ValueError("ZenFlow and ACCO both replace the ZeRO-1 update: remove zero_optimization.zenflow")
        # Set before Module.__init__ runs inside DeepSpeedEngine.__init__.
        self.__dict__["acco_config"] = acco
        self.__dict__["_acco_lr_kwargs"] = None
        self.__dict__["_acco_applied"] = False
        super().__init__(*args, **kwargs)
        if not isinstance(self.optimizer, ACCOZeroOptimizer):
            raise ValueError("ACCO needs an optimizer and ZeRO stage 1 (got optimizer "
                             f"{type(self.optimizer).__name__}): set \"optimizer\" in the config or pass one to "
                             "initialize, and \"zero_optimization\": {\"stage\": 1}")
        zc = self._config.zero_config
        if zc.overlap_comm:
            log_dist("ACCO: zero_optimization.overlap_comm is not used; ACCO overlaps communication with "
                     "whole rounds of compute", ranks=[0])
        log_dist(f"ACCO engine: mode={acco.mode} accumulation={acco.accumulation} "
                 f"micro-batches/round={self.optimizer.schedule.min_micro}..{self.optimizer.schedule.max_micro} "
                 f"kernels={self.optimizer.kernels.name} update="
                 f"{'fused Adam' if self.optimizer._adam else 'generic Peek'}", ranks=[0])

    # -------------------------------------------------------- construction
    def _configure_zero_optimizer(self, optimizer):
        original = ds_engine.DeepSpeedZeroOptimizer
        ds_engine.DeepSpeedZeroOptimizer = functools.partial(ACCOZeroOptimizer, acco_config=self.acco_config)
        try:
            return super()._configure_zero_optimizer(optimizer)
        finally:
            ds_engine.DeepSpeedZeroOptimizer = original

    # -------------------------------------------------------------- backward
    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        # The optimizer divides by the global micro-batch count, so the loss is not divided here.
        # scale_wrt_gas=False means the caller already divided it (Hugging Face Trainer does):
        # undo that when packing, so every micro-batch still weighs 1/count in the mean.
        self.optimizer.grad_prescale = 1.0 if scale_wrt_gas else float(self.gradient_accumulation_steps())
        try:
            out = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)
        finally:
            self.optimizer.grad_prescale = 1.0
        if scale_wrt_gas and isinstance(out, torch.Tensor):
            out = out / self.gradient_accumulation_steps()
        return out

    def _backward_prologue_per_tensor(self, grad):
        # Direct tensor.backward(): same rule, no 1/gradient_accumulation_steps.
        return grad

    def _backward_epilogue(self):
        """After every backward: pack gradients, and end the round when it is due."""
        self._stop_timers(self.engine_timers.backward_inner_timers)
        opt = self.optimizer
        opt.accumulate_gradients()
        opt.emulate_slow_worker()
        if opt.round_may_end():
            result = opt.end_round()
            if result is not None and result.op == COMMIT:
                self._acco_on_commit(result)
        opt.exit_backward()
        self._stop_timers(self.engine_timers.backward_timers)

    def allreduce_gradients(self, bucket_size=None):
        # Gradients travel in ACCO rounds, never through DeepSpeed's all-reduce.
        return None

    # ------------------------------------------------------------------ step
    def _take_model_step(self, lr_kwargs):
        """Called by ``DeepSpeedEngine.step()`` at accumulation boundaries.

        Updates already happened when their round ended (in backward); here
        only ``was_step_applied()`` and the LR-scheduler arguments are settled.
        """
        self.__dict__["_acco_lr_kwargs"] = lr_kwargs
        self._step_applied = self._acco_applied
        self.__dict__["_acco_applied"] = False

    def _acco_on_commit(self, result: CommResult) -> None:
        if result.finite:
            self.__dict__["_acco_applied"] = True
            if self.lr_scheduler is not None:
                try:
                    self.lr_scheduler.step(**(self._acco_lr_kwargs or {}))
                except TypeError:
                    # Same fallback as DeepSpeed for schedulers that want the batch size (Megatron).
                    self.lr_scheduler.step(self.train_batch_size())
        else:
            self.skipped_steps += 1
        self._global_grad_norm = result.grad_norm
        self.global_steps += 1
        self.global_samples += result.global_micro * self.train_micro_batch_size_per_gpu()
        if self.steps_per_print() and self.global_steps % self.steps_per_print() == 0:
            self._report_progress(self.global_steps)
            s = self.optimizer.round_stats()
            hidden = s["hidden_comm_fraction"]
            log_dist(f"ACCO step={self.global_steps}: rounds={s['rounds']} "
                     f"micro-batches/round={s['mean_micro_per_round']:.2f} "
                     f"compute={s['compute_s']:.2f}s comm={s['comm_s']:.2f}s waited={s['wait_s']:.2f}s "
                     f"hidden={'n/a' if hidden is None else f'{100 * hidden:.0f}%'}", ranks=[0])
        if self.monitor.enabled and self.global_rank == 0:
            s = self.optimizer.round_stats()
            events = [("Train/Samples/acco_global_micro_batches", result.global_micro, self.global_samples),
                      ("Train/Samples/acco_comm_s", result.comm_s, self.global_samples),
                      ("Train/Samples/acco_wait_s_total", s["wait_s"], self.global_samples)]
            self.monitor.write_events(events)

    def set_train_batch_size(self, train_batch_size):
        micro_dp = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % micro_dp == 0 and train_batch_size // micro_dp != self.gradient_accumulation_steps():
            raise ValueError(f"ACCO cannot change gradient_accumulation_steps during training (asked for train "
                             f"batch size {train_batch_size}, i.e. {train_batch_size // micro_dp} accumulation "
                             f"steps, configured {self.gradient_accumulation_steps()}): disable batch-size "
                             f"ramp-up (Megatron: --rampup-batch-size)")
        super().set_train_batch_size(train_batch_size)

    # --------------------------------------------------------- observability
    def acco_stats(self) -> dict:
        """Per-round figures: totals of micro-batches, compute, communication
        and waiting time, the fraction of communication hidden, the last
        rounds, and the counters of the engine."""
        s = self.optimizer.round_stats()
        s.update(global_steps=self.global_steps, global_samples=self.global_samples, skipped_steps=self.skipped_steps)
        return s

    # ------------------------------------------------------------- lifecycle
    def acco_drain(self) -> None:
        """Wait for in-flight communication (e.g. before timing or evaluation)."""
        self.optimizer.drain()

    def destroy(self):
        if isinstance(getattr(self, "optimizer", None), ACCOZeroOptimizer):
            self.optimizer.comm.close()
        super().destroy()


__all__ = ["ACCOEngine"]
