"""Mixture of experts (``deepspeed.moe.layer.MoE``) under acco_ds: the expert groups and the layout rules.

DeepSpeed's ZeRO-1 keeps expert parameters in param groups of their own
(``moe: True``, ``name`` = the expert group name ``ep_size_<e>``) and
partitions each over the expert-data-parallel group of that name: with
``ep_size`` e on W data-parallel ranks, expert-parallel groups are runs of e
consecutive ranks, and the ranks at the same position of every run hold the
same experts. The round modes use DeepSpeed's groups as they are (the
driver reduce-scatters and all-gathers each expert group over its own
group). The local-SGD modes run ZeRO-1 inside a replica of k consecutive
ranks: expert parallelism must live inside the replica (e divides k), and the
inner step partitions an expert group over the ranks of *this replica* that
hold those experts (``replica_expert_groups``). Across replicas, the ranks at
the same position of every replica hold the same expert shard: that is the
outer group the loop already averages over.
"""

from datetime import timedelta
from typing import Dict, List

import torch.distributed as tdist

from ..runtime.comm import lifetime


def ep_sizes(engine) -> Dict[str, int]:
    """Expert group name -> ep_size of the engine's expert parameters (empty without MoE). The names are those
    of the module's expert parameters (DeepSpeed marks them ``allreduce=False`` with a ``group_name``: MoE and
    AutoEP layers alike): DeepSpeed's group dictionaries hold every expert group the process ever created."""
    if not getattr(engine, "has_moe_layers", False):
        return {}
    names = {p.group_name for p in engine.module.parameters()
             if getattr(p, "allreduce", True) is False and hasattr(p, "group_name")}
    return {name: tdist.get_world_size(engine.expert_parallel_group[name]) for name in sorted(names)}


def replica_expert_groups(engine, dp_groups: List[List[int]], k: int, timeout_s: float) -> Dict[str, object]:
    """Per expert group name, this rank's expert-data-parallel group inside its replica: the ranks of its
    replica (``k`` consecutive ranks of its data-parallel group) at its position in the expert-parallel run
    (collective: every rank creates every group in the same order). The rulebook has refused an ``ep_size``
    that does not divide ``k`` already."""
    out = {}
    me = tdist.get_rank()
    for name, e in sorted(ep_sizes(engine).items()):
        mine = tdist.get_process_group_ranks(engine.expert_parallel_group[name])
        lists = []
        for dp in dp_groups:
            for g in range(len(dp) // k):
                replica = dp[g * k:(g + 1) * k]
                lists += [replica[j::e] for j in range(e)]
        home = next(ranks for ranks in lists if me in ranks)
        if not set(mine) <= set(next(dp[g * k:(g + 1) * k] for dp in dp_groups if me in dp
                                     for g in range(len(dp) // k) if me in dp[g * k:(g + 1) * k])):
            raise ValueError(f"ACCO local-SGD with MoE layers: this rank's expert-parallel group {mine} (expert "
                             f"group {name}) crosses its replica: expert parallelism must live inside a replica "
                             f"of replica_group_size {k} consecutive ranks (DeepSpeed's default layout; do not set "
                             f"use_data_before_expert_parallel_)")
        group = lifetime.new_subgroups(lists, timedelta(seconds=timeout_s))  # ended with the engine's groups
        assert sorted(tdist.get_process_group_ranks(group)) == sorted(home)
        out[name] = group
    return out


def reshard_strides(opt, saved_ep_sizes, saved_counts, old_k: int) -> List[int]:
    """Per parameter group of ``opt`` (an ``ACCOZeroOptimizer``), its ``ep_size`` (1: dense) for a resharding
    load (``runtime.reshard.Plan``'s ``strides``): an expert group keeps its ``ep_size``, its partitions are
    regathered over its old expert-data-parallel group and re-split over the new one. ``saved_ep_sizes``: the
    ACCO state's (None: saved without it); ``saved_counts``: ZeRO's partition count per group of the saved
    files, in replicas of ``old_k`` ranks. Refuses by name another ``ep_size`` and expert groups laid out
    otherwise than DeepSpeed's default."""
    groups = opt.optimizer.param_groups
    if not any(g.get("moe", False) for g in groups):
        return [1] * len(groups)
    check_ep_sizes(saved_ep_sizes, opt._ep_sizes())
    replica = tdist.get_process_group_ranks(opt.dp_process_group if opt.dp_process_group is not None
                                            else tdist.group.WORLD)
    strides = []
    for i, group in enumerate(groups):
        e = opt.world_size // opt.partition_count[i] if group.get("moe", False) else 1
        if e > 1 and sorted(tdist.get_process_group_ranks(opt.real_dp_process_group[i])) != \
                sorted(replica[opt.rank % e::e]):
            raise ValueError(f"ACCO: a resharding load needs DeepSpeed's default expert layout (expert-parallel "
                             f"groups of ep_size {e} consecutive ranks), which expert group {group['name']} does "
                             f"not have (use_data_before_expert_parallel_?). Resume with the saved layout, or "
                             f"load only the module weights (load_optimizer_states=False)")
        strides.append(e)
    if saved_counts is not None and list(saved_counts) != [old_k // e for e in strides]:
        raise ValueError(f"ACCO: this checkpoint's expert groups were partitioned {list(saved_counts)} ways in "
                         f"replicas of {old_k} ranks, which is not this run's ep_size "
                         f"{dict(opt._ep_sizes())}: changing ep_size repartitions every expert's optimizer state, "
                         f"which is not supported. Resume with the saved ep_size, or load only the module weights "
                         f"(load_checkpoint(..., load_optimizer_states=False, load_lr_scheduler_states=False))")
    return strides


def check_ep_sizes(saved, now) -> None:
    """Refuse an ACCO checkpoint saved with other expert-parallel sizes (``saved``/``now``: name -> ep_size;
    ``saved`` None: saved before acco_ds knew experts, nothing to check)."""
    if saved is None or dict(saved) == dict(now):
        return
    raise ValueError(f"ACCO: this checkpoint was saved with expert parallelism {dict(saved) or 'none (no MoE)'} but "
                     f"this run has {dict(now) or 'none (no MoE)'}: changing ep_size repartitions every expert's "
                     f"optimizer state, which is not supported. Resume with the saved ep_size, or load only the "
                     f"module weights (load_checkpoint(..., load_optimizer_states=False, "
                     f"load_lr_scheduler_states=False))")


__all__ = ["ep_sizes", "replica_expert_groups", "reshard_strides", "check_ep_sizes"]
