"""ACCOZeroOptimizer: DeepSpeed's ZeRO-1 optimizer driven by ACCO's rounds.

It reuses everything ZeRO-1 builds: the flat, padded parameter buffers
(``bit16_groups_flat``), their equal partitions, this rank's fp32 master
partition (``single_partition_of_fp32_groups``), the wrapped torch optimizer
that only sees that partition, the loss scaler and the checkpoint format. How
gradients travel is ``runtime.rounds.driver.RoundDriver``'s (the same rounds as the
torch host's): backward hooks add each gradient into a flat accumulator, and
when a round ends the communication thread reduce-scatters it, runs the Peek
or commit and all-gathers the next parameters over the same buffer.

Here is only the DeepSpeed glue: ZeRO's reduction hooks switched off, the loss
scaler (once per committed step), tensor-parallel norms, ZeRO's lazy state
link, and ACCO's state inside ZeRO's checkpoint. The engine reads finished
commits with ``take_commits()`` (it steps the LR scheduler and counts
``global_steps`` there) between ``finish_round`` and ``start_round``, so the
next Peek sees the learning rate of its step.
"""

import time
from typing import Optional

import torch
import torch.distributed as tdist

from ..config import ACCOConfig
from ..runtime.outer.inner_muon import MuonShardUpdate, is_muon
from ..runtime.rounds.driver import RoundDriver
from ..runtime.rounds.job import CommResult
from . import checkpoint, moe
from .compat import PARAM_SLICE_MAPPINGS, DeepSpeedZeroOptimizer, check_instance, fused_adamw, logger
from .loss_scale import account_loss_scale
from ..runtime.comm.groups import crosses_nodes, node_layout, side_group
from .parallel import norm_segments
from .progress import _say


class ACCOZeroOptimizer(RoundDriver, DeepSpeedZeroOptimizer):
    """ZeRO-1 with ACCO rounds. Constructed by ``ACCOEngine`` with all of
    DeepSpeed's ZeRO-1 arguments plus ``acco_config`` and
    ``communication_data_type`` (the reduce-scatter dtype)."""

    def __init__(self, *args, acco_config: ACCOConfig, communication_data_type: Optional[torch.dtype] = None,
                 replica_groups=None, **kwargs):
        DeepSpeedZeroOptimizer.__init__(self, *args, **kwargs)
        check_instance(self, "DeepSpeedZeroOptimizer")
        self.acco = acco_config
        self.replica_index = replica_groups.replica if replica_groups is not None else 0
        group = self.dp_process_group if self.dp_process_group is not None else tdist.group.WORLD
        side = replica_groups.replica_side if replica_groups is not None else side_group(group, acco_config.timeout_s)
        params = [list(zip(ps, offs)) for ps, offs in zip(self.round_robin_bit16_groups,
                                                          self.round_robin_bit16_offsets)]
        # Tensor and pipeline parallelism: the norm counts each parameter once and is summed over the
        # model-parallel group (the inner communication thread's copy; an outer loop's own copy for EDiT).
        mp = self.model_parallel_world_size > 1
        self.mp_side = side_group(self.model_parallel_group, acco_config.timeout_s) if mp else None
        self.norm_segments = norm_segments(self, tdist.get_rank(group)) if mp else None
        if mp and replica_groups is not None:
            replica_groups.model_main = self.model_parallel_group
            replica_groups.model_side = side_group(self.model_parallel_group, acco_config.timeout_s)
            tp = getattr(self.mpu, "get_tensor_model_parallel_world_size", None)  # a pipeline grid's slice
            replica_groups.tensor_parallel = int(tp()) if tp is not None else self.model_parallel_world_size
        expert_groups = self._expert_groups(acco_config.timeout_s)
        self.setup_rounds(flats=self.bit16_groups_flat, masters=self.single_partition_of_fp32_groups,
                          optimizer=self.optimizer, params=params, group=group, side=side,
                          layout=node_layout(group, side, acco_config), crosses_nodes=crosses_nodes(group, acco_config),
                          replica_groups=replica_groups, accum_dtype=self.gradient_accumulation_dtype or self.dtype,
                          comm_dtype=communication_data_type or self.dtype, clip=self.clip_grad,
                          fused_adamw=fused_adamw(self.optimizer), norm_segments=self.norm_segments,
                          expert_groups=expert_groups)
        self._flat_place = {id(p): (i, offset) for i, group_params in enumerate(params) for p, offset in group_params}
        if is_muon(self.optimizer):  # DeepSpeed's MuonWithAuxAdam: whole matrices on a one-rank inner group
            self.update = MuonShardUpdate(self.optimizer, self.single_partition_of_fp32_groups, self.kernels, params,
                                          adam_w_mode=bool(getattr(self.optimizer, "adam_w_mode", True)))

    def _expert_groups(self, timeout_s: float):
        """Mixture of experts: per parameter group, None (dense) or the expert-data-parallel group ZeRO-1
        partitions that expert group over (``real_dp_process_group``) with the communication thread's copy
        of it, one copy per expert group name (collective: every rank has the same groups in the same order).
        None when the model has no experts."""
        if not getattr(self, "has_moe_layers", False):
            return None
        copies, out = {}, []
        for i, group in enumerate(self.optimizer.param_groups):
            if not group.get("moe", False):
                out.append(None)
                continue
            main = self.real_dp_process_group[i]
            if group["name"] not in copies:
                copies[group["name"]] = side_group(main, timeout_s)
            out.append((main, copies[group["name"]]))
        return out

    def _ep_sizes(self) -> dict:
        """Expert group name -> ep_size (empty without MoE): saved in ACCO's state, checked at load."""
        if not getattr(self, "has_moe_layers", False):
            return {}
        names = {g["name"] for g in self.optimizer.param_groups if g.get("moe", False)}
        return {name: tdist.get_world_size(self.ep_process_group[name]) for name in sorted(names)}

    # ----------------------------------------------------- the driver's hooks
    def loss_scale_now(self) -> float:
        return float(self.loss_scale)

    def job_options(self) -> dict:
        return {"norm_segments": self.norm_segments, "mp_group": self.mp_side}

    def after_result(self, rnd, result: CommResult) -> None:
        """ZeRO's lazy state link, and the loss scaler once per committed step, as stock ZeRO-1 updates it
        once per step."""
        self.overflow = not result.finite
        if result.commits and result.finite:
            self._lazy_init_hp_params_optimizer_state()
        if result.commits:
            account_loss_scale(self, rnd, result)

    def reduce_tied(self, weights_and_groups) -> None:
        """Pipeline stages: sum the tied weights' accumulated gradients over their tied groups, as stock sums
        their ``.grad`` (ACCO's hooks moved them into the flat accumulator)."""
        for weight, group in weights_and_groups:
            place = self._flat_place.get(id(weight))
            if place is not None:
                i, offset = place
                tdist.all_reduce(self.buffers[i].acc.narrow(0, offset, weight.numel()), group=group)

    # ------------------------------------------------------------------ hooks
    def create_gradient_handling_hooks(self):
        # ZeRO's per-parameter reduction hooks are replaced by ACCO's accumulation hooks.
        self._grad_acc_hooks = []

    def backward_epilogue(self, *args, **kwargs):
        pass

    # ---------------------------------------------------------- lifecycle
    def checkpoint_event_prologue(self):
        t0 = time.perf_counter()
        self.drain()
        self._round_wait_s += time.perf_counter() - t0

    def step(self, closure=None):
        raise RuntimeError("ACCOZeroOptimizer is driven by the ACCO engine: call engine.step(), not optimizer.step()")

    def destroy(self):
        self.close_rounds()
        super().destroy()

    def state_dict(self):
        self.drain()
        sd = super().state_dict()
        sd[checkpoint.ACCO_STATE_KEY] = checkpoint.save_state(self)
        sd[checkpoint.ACCO_STATE_KEY]["ep_sizes"] = self._ep_sizes()
        if self.replica_index:
            # DeepSpeed's ds_to_universal gathers each parameter's fragments from every file it maps: only
            # replica 0's are mapped, so a universal checkpoint holds one copy of the model (replica 0's).
            sd[PARAM_SLICE_MAPPINGS] = [{} for _ in sd[PARAM_SLICE_MAPPINGS]]
        return sd

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False,
                        checkpoint_folder=None, load_serial=None, param_shapes=None):
        self.outer.before_read()
        self.drop_in_flight()
        acco = checkpoint.find_state(self, state_dict_list) if load_optimizer_states else None
        if acco is not None and not acco.get("resharded"):
            moe.check_ep_sizes(acco.get("ep_sizes"), self._ep_sizes())
        super().load_state_dict(state_dict_list, load_optimizer_states, load_from_fp32_weights, checkpoint_folder,
                                load_serial, param_shapes)
        self.reset_rounds()
        if acco is not None:
            checkpoint.load_state(self, acco)
        elif checkpoint_folder:  # DeepSpeed's universal checkpoint: weights and optimizer state, nothing in flight
            self.outer.restart()
            _say(f"ACCO: loaded the universal checkpoint {checkpoint_folder}: rounds restart with a start-up round "
                 f"at its weights" + ("; the outer loop starts over from them (anchor = the loaded weights, outer "
                 "momentum zero, a new period): a universal checkpoint holds no outer state (load_checkpoint of the "
                 "acco_ds checkpoint itself carries it)" if self.outer.replica_ranks is not None else ""))
        elif load_optimizer_states and state_dict_list is not None:
            logger.warning("ACCO: the checkpoint has no ACCO state (saved without ACCO?); rounds restart "
                           "with a start-up round")

    def _restore_from_bit16_weights(self):
        # DeepSpeed's load without optimizer states (and load_module_only, through refresh_fp32_params):
        # the module weights were replaced: rounds restart, and the outer loop starts over from the loaded
        # weights (its anchor is the loaded model).
        self.drop_in_flight()
        super()._restore_from_bit16_weights()
        self.reset_rounds()
        self.outer.restart()


__all__ = ["ACCOZeroOptimizer"]
