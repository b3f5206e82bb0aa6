"""ACCOEngine: a DeepSpeedEngine whose ZeRO-1 optimizer runs ACCO rounds.

Only the glue lives here. The engine

* builds ``ACCOZeroOptimizer`` instead of ``DeepSpeedZeroOptimizer`` (same
  constructor arguments, swapped in for the duration of DeepSpeed's own
  ``_configure_zero_optimizer``);
* drives rounds from completed backward passes, so every way frameworks call
  DeepSpeed works: ``step()`` after each micro-batch, or ``backward()`` per
  micro-batch and ``step()`` only at the boundary
  (``set_gradient_accumulation_boundary`` keeps having no side effects);
* shows users the committed weights: ``save_checkpoint``, the module's
  ``state_dict()`` (read by Hugging Face ``save_pretrained`` and Accelerate)
  and evaluation (``eval()`` until ``train()``) see θ_t, never the estimate
  θ̃ the compute side may be working at. The parameters are pointed at the
  buffer that already holds θ_t: no copy, no extra memory;
* ``acco_finalize()`` (also run by ``destroy()``) commits the step whose two
  half-batches are complete, so N iterations give N optimizer steps;
* does the per-committed-step bookkeeping that ``_take_model_step`` does in
  stock DeepSpeed: ``global_steps``, ``global_samples``, ``skipped_steps``,
  the LR scheduler (once per committed step, so a Peek sees the learning rate
  of the step it anticipates), the global gradient norm, progress logs and
  monitor events.

``backward()`` is DeepSpeed's: the loss is divided by
``gradient_accumulation_steps`` (unless ``scale_wrt_gas=False``: the caller
did it) and scaled by the loss scale, so 16-bit gradients have stock's
headroom. The round job multiplies that divisor back and divides the reduced
sum by the global micro-batch count instead, the exact mean also when
workers contribute different counts.
"""

import contextlib

import torch.distributed as tdist

from ..config import check, check_deepspeed_config, parse_acco_config, replica_group_size
from ..runtime.rounds.job import CommResult
from ..runtime.comm import lifetime
from ..runtime.comm.groups import every_group
from ..runtime.outer.interface import OuterLoopHost, make_groups, needs_replicas
from . import checkpoint, moe, reshard
from .layout import launch_layout
from .compat import BFLOAT16, ZERO_OPTIMIZATION, DeepSpeedEngine, check_instance, ds_engine, log_dist, logger
from .compat import comm as dist
from ..runtime.rounds.stats import banner, report_lines, round_stats
from .progress import _report_commit, _say
from .zero1 import ACCOZeroOptimizer


class ACCOEngine(OuterLoopHost, DeepSpeedEngine):
    """DeepSpeed engine with ACCO. Create it through ``acco_ds.initialize`` (or
    ``deepspeed.initialize`` after ``acco_ds.patch()``), never directly."""

    def __init__(self, *args, **kwargs):
        config, config_class = kwargs.get("config"), kwargs.get("config_class")
        acco = parse_acco_config(config if isinstance(config, dict) else {})
        if not acco.enabled:
            raise ValueError('ACCOEngine needs "acco": {"enabled": true} in the DeepSpeed config')
        if config_class is not None:
            _check_config(acco, config_class, kwargs, client_optimizer=kwargs.get("optimizer") is not None)
        # Set before Module.__init__ runs inside DeepSpeedEngine.__init__. _acco_groups: the process groups ACCO
        # creates for this engine, destroyed with it (or at interpreter exit).
        self.__dict__.update(acco_config=acco, _acco_lr_kwargs=None, _acco_applied=False, _acco_eval_view=False,
                             _acco_groups=[])
        with lifetime.owned_by(self._acco_groups):
            super().__init__(*args, **kwargs)
        lifetime.end_at_exit(self, _close_at_exit)
        check_instance(self, "DeepSpeedEngine")
        if not isinstance(self.optimizer, ACCOZeroOptimizer):
            raise ValueError("ACCO needs an optimizer and ZeRO stage 1 (got optimizer "
                             f"{type(self.optimizer).__name__}): set \"optimizer\" in the config or pass one to "
                             "initialize, and \"zero_optimization\": {\"stage\": 1}")
        if self.optimizer.outer.replica_ranks is not None:
            self.save_zero_checkpoint = True  # every replica's ranks hold their own optimizer state
        self.optimizer.outer.attach(self.module)
        if self._config.zero_config.overlap_comm:
            log_dist("ACCO: zero_optimization.overlap_comm is not used; ACCO overlaps communication with "
                     "whole rounds of compute", ranks=[0])
        opt = self.optimizer
        # The module's state_dict() (save_pretrained, Accelerate's get_state_dict) sees committed weights.
        self.module.register_state_dict_pre_hook(lambda *_: self._acco_show_committed())
        self.module.register_state_dict_post_hook(lambda *_: opt.view.restore(all_levels=False))
        # A replica that heals from this one (acco.fault_tolerance) takes this rank's counters and LR schedule.
        opt.counters, opt.load_counters = (lambda: checkpoint.own_counters(self),
                                           lambda saved: checkpoint.apply_own_counters(self, saved))
        _say(banner(acco, opt))
        opt.outer.join()  # replicas that come and go join the others here, before the first inner step

    # -------------------------------------------------------- construction
    def _configure_zero_optimizer(self, optimizer):
        acco = self.acco_config
        check_instance(self, "DeepSpeedEngine", ("seq_data_parallel_group", "communication_data_type"))
        groups, experts = _replica_layout(self, acco)

        def build(*args, **kwargs):
            if groups is not None:
                kwargs["dp_process_group"] = groups.replica_main
            if experts is not None:
                kwargs["expert_data_parallel_group"] = experts
            kwargs.setdefault("communication_data_type", self.communication_data_type)
            return ACCOZeroOptimizer(*args, acco_config=acco, replica_groups=groups, **kwargs)

        original = ds_engine.DeepSpeedZeroOptimizer
        ds_engine.DeepSpeedZeroOptimizer = build
        try:
            return super()._configure_zero_optimizer(optimizer)
        finally:
            ds_engine.DeepSpeedZeroOptimizer = original

    def _get_zero_ckpt_name(self, checkpoints_path, tag):
        # Stock names the file by the rank in the optimizer's group: a replica group under an outer loop,
        # so every replica would write the same files. Name it by the data-parallel rank instead.
        if _replica_ranks(self) is None:
            return super()._get_zero_ckpt_name(checkpoints_path, tag)
        dp_rank = dist.get_rank(group=self.seq_data_parallel_group)
        return self._get_rank_zero_ckpt_name(checkpoints_path, tag, self.checkpoint_mp_rank, dp_rank,
                                             self.bfloat16_enabled())

    def _get_all_zero_checkpoint_names(self, load_dir, tag, bf16_mode):
        # ZeRO-1 reads the files by rank in its group: under an outer loop, this replica's ranks' files.
        names, ranks = super()._get_all_zero_checkpoint_names(load_dir, tag, bf16_mode), _replica_ranks(self)
        return names if names is None or ranks is None else [names[r] for r in ranks]

    def _do_optimizer_sanity_check(self, basic_optimizer):
        # Stock DeepSpeed sends bf16 + grad_accum_dtype=fp32 to BF16_Optimizer; ACCO keeps ZeRO-1
        # and accumulates in fp32 itself.
        kind = super()._do_optimizer_sanity_check(basic_optimizer)
        if kind == BFLOAT16 and self.zero_optimization_stage() == 1:
            return ZERO_OPTIMIZATION
        return kind

    # -------------------------------------------------------------- backward
    _acco_rounds_in_backward = True  # False: the pipeline schedule ends them (deepspeed/pipeline.py)

    def _backward_epilogue(self):
        """After every backward (its gradients are already in the accumulator): count the micro-batch, and
        end the round when it is due."""
        self._stop_timers(self.engine_timers.backward_inner_timers)
        opt = self.optimizer
        if self._acco_rounds_in_backward:
            opt.count_micro_batch()
            if opt.round_may_end():
                self._acco_end_round()
        opt.exit_backward()
        self._stop_timers(self.engine_timers.backward_timers)

    def allreduce_gradients(self, bucket_size=None):
        # Gradients travel in ACCO rounds, never through DeepSpeed's all-reduce.
        return None

    # ------------------------------------------------------------------ step
    def _take_model_step(self, lr_kwargs):
        """``DeepSpeedEngine.step()`` at accumulation boundaries: updates already happened when their round
        ended (in backward); only ``was_step_applied()`` and the LR-scheduler arguments are settled here."""
        self.__dict__["_acco_lr_kwargs"] = lr_kwargs
        if self.optimizer.schedule.adaptive:  # a user collective between steps finds no rank waiting on a peer
            self._acco_align_rounds()
        self._step_applied = self._acco_applied
        self.__dict__["_acco_applied"] = False

    def _acco_end_round(self) -> None:
        self.optimizer.finish_round()
        self._acco_count_commits()  # before the next job reads the learning rate
        self.optimizer.start_round()

    def _acco_align_rounds(self) -> int:
        """Every rank ends the same round before a read (see ``RoundDriver.align_rounds``)."""
        return self.optimizer.align_rounds(self._acco_end_round)

    def _acco_count_commits(self) -> None:
        """The per-committed-step bookkeeping of stock ``_take_model_step``, for each finished commit."""
        for result in self.optimizer.take_commits():
            self._acco_count_commit(result)

    def _acco_count_commit(self, result: CommResult) -> None:
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
        self.global_samples += result.global_micro * self.optimizer.outer.replicas * self.train_micro_batch_size_per_gpu()
        self.optimizer.outer.after_inner_step()
        _report_commit(self, result)

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
        """Per-round figures (micro-batches, compute, communication, waiting, the fraction hidden, the last
        rounds), the outer loop's figures, and the engine's counters."""
        s = round_stats(self.optimizer)
        s.update(global_steps=self.global_steps, global_samples=self.global_samples, skipped_steps=self.skipped_steps)
        return s

    def acco_report(self) -> list:
        """The mode's lines of a run summary, ``(label, text)`` pairs in its own terms (ACCO's rounds, or the
        outer loop's replicas, syncs, bytes and overlap); ``examples/train_gpt.py`` prints them."""
        return report_lines(self.optimizer)

    @property
    def outer(self):
        """The outer loop (``OuterLoopHost.acco_syncs`` reads it)."""
        return self.optimizer.outer

    # ------------------------------------------------- committed weights
    @contextlib.contextmanager
    def acco_committed_weights(self):
        """Within this block the module's parameters are the committed weights θ_t (matching
        ``global_steps`` and the optimizer state), also mid-round where the compute side has an estimate."""
        self._acco_show_committed()
        try:
            yield
        finally:
            self.optimizer.view.restore(all_levels=False)

    def _acco_show_committed(self) -> None:
        opt = self.optimizer
        if opt.view.depth == 0 and opt.schedule.adaptive:
            self._acco_align_rounds()  # an outer read (save_checkpoint, eval) has aligned already
        opt.show_committed()
        self._acco_count_commits()

    def save_checkpoint(self, save_dir, *args, **kwargs):
        if self.optimizer.outer.per_replica_counters:
            checkpoint.save_own_counters(self, args, kwargs)
        with self.acco_committed_weights(), checkpoint.save_errors(save_dir):
            return super().save_checkpoint(save_dir, *args, **kwargs)

    def load_checkpoint(self, load_dir, *args, **kwargs):
        opt = self.optimizer
        if isinstance(opt, ACCOZeroOptimizer) and opt.schedule.adaptive:
            self._acco_align_rounds()  # the in-flight job must be one every rank submitted
        if isinstance(opt, ACCOZeroOptimizer):
            opt.host_counters = None  # set again by a loaded ACCO state that holds this rank's own counters
        with checkpoint.load_errors(load_dir, kwargs.get("tag") or (args[0] if args else None),
                                    replicas=_replica_ranks(self) is not None):
            out = super().load_checkpoint(load_dir, *args, **kwargs)
        checkpoint.load_own_counters(self)
        # The save counted a finished commit (it waited for it): the uninterrupted run then reports
        # that step as applied at its next step(), so the resumed run does too.
        pending = self.optimizer.pending
        self.__dict__["_acco_applied"] = bool(pending is not None and pending.finite and pending.commits)
        return out

    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        # Another data-parallel size or replica layout is resharded; the same layout is DeepSpeed's own load.
        return reshard.load_zero_checkpoint(self, load_dir, tag, load_optimizer_states, super()._load_zero_checkpoint)

    def train(self, mode=True):
        # eval() shows the committed weights until train() gives the compute side its own back.
        opt = getattr(self, "optimizer", None)
        if isinstance(opt, ACCOZeroOptimizer) and mode == self._acco_eval_view:
            if mode:
                opt.view.restore(all_levels=False)
            else:
                self._acco_show_committed()
            self.__dict__["_acco_eval_view"] = not mode
        return super().train(mode)

    def eval(self):
        return self.train(False)

    # ------------------------------------------------------------- lifecycle
    def acco_finalize(self) -> bool:
        """Commit the step whose gradients are complete and install the committed weights: after N
        iterations, N optimizer steps (local-SGD: the last sync). Training may go on afterwards; it restarts
        with a start-up round. Returns whether a step was committed."""
        self.__dict__["_acco_eval_view"] = False
        steps = self.global_steps
        self.optimizer.commit_everything(self._acco_end_round)
        self._acco_count_commits()
        return self.global_steps > steps

    def destroy(self):
        opt = getattr(self, "optimizer", None)
        if isinstance(opt, ACCOZeroOptimizer) and opt.comm.group is not None:
            try:
                self.acco_finalize()
            except Exception as err:  # noqa: BLE001 - a failed peer must not turn destroy into a crash
                logger.warning(f"ACCO: could not commit the last step while destroying the engine: {err}")
            opt.comm.close()
        super().destroy()
        lifetime.release(self, self._acco_groups)


def _check_config(acco, config_class, kwargs: dict, client_optimizer: bool):
    check_instance(config_class, "DeepSpeedConfig")
    check_instance(config_class.zero_config, "DeepSpeedZeroConfig")
    layout = launch_layout(kwargs.get("model"), kwargs.get("mpu"), gas=int(config_class.gradient_accumulation_steps))
    check_deepspeed_config(acco, config_class, layout, client_optimizer=client_optimizer)


def _replica_layout(engine, acco):
    """The local-SGD modes' replica groups (None in the round modes) and, for a model with MoE layers, each
    expert group's expert-data-parallel group inside the replica (None: DeepSpeed's own groups)."""
    ep_sizes = moe.ep_sizes(engine)
    layout = launch_layout(engine.module, engine.mpu, gas=engine.gradient_accumulation_steps(),
                           ep_sizes=tuple(ep_sizes.values()))
    check(acco, layout)  # experts as the engine made them (AutoEP swaps its layers in during initialize)
    if not needs_replicas(acco.mode):
        return None, None
    # ZeRO-1 runs inside one replica group; the outer loop syncs the replicas. Every data-parallel group (one per
    # tensor-parallel rank and pipeline stage) is cut into replicas alike, so a replica holds whole
    # model-parallel groups.
    dp_groups = every_group(engine.seq_data_parallel_group)
    k = replica_group_size(acco, layout)
    groups = make_groups(dp_groups, k, acco.timeout_s)
    experts = moe.replica_expert_groups(engine, dp_groups, k, acco.timeout_s) if ep_sizes else None
    return groups, experts


def _close_at_exit(engine):
    """At interpreter exit, for a script that did not call ``destroy()``: drain the work in flight, stop the
    communication threads and destroy the engine's groups (no last sync: a peer may be gone)."""
    opt = getattr(engine, "optimizer", None)
    if isinstance(opt, ACCOZeroOptimizer):
        opt.close_rounds()
    lifetime.destroy(engine._acco_groups)


def _replica_ranks(engine):
    opt = getattr(engine, "optimizer", None)
    return opt.outer.replica_ranks if isinstance(opt, ACCOZeroOptimizer) else None


__all__ = ["ACCOEngine"]
