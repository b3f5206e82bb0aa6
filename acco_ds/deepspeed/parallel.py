"""Process groups (tensor-parallel layouts, node-aware collectives) and norm masks.

With an ``mpu`` (Megatron-DeepSpeed), the data-parallel ranks of each
model-parallel position form their own group: with TP = 2 on 4 ranks the
data-parallel groups are {0, 2} and {1, 3}, the model-parallel ones {0, 1}
and {2, 3}. A process group must be created by every rank, for every group,
in the same order, so the communication thread's copies are made by
enumerating all of them (``side_group``).

ZeRO-1 counts each parameter once in the global gradient norm: a parameter
split across model-parallel ranks on every rank, a replicated one only on
model-parallel rank 0 (``stage_1_and_2.py``); the squares are summed over the
data-parallel group and then over the model-parallel group. ``norm_segments``
gives the ranges of this rank's flat shard that count, for the job's norm.
"""

from datetime import timedelta
from typing import List, Optional, Tuple

import torch.distributed as tdist

from ..config import collectives_layout, ranks_per_node
from ..config_local import spans_nodes
from ..runtime import collectives
from ..runtime.collectives import NodeLayout
from .compat import is_model_parallel_parameter


def every_group(group) -> List[List[int]]:
    """The ranks of every group like ``group`` that some rank belongs to (``group`` as each rank sees
    it), the same sorted list on every rank (collective: every rank of the job calls it)."""
    mine = tdist.get_process_group_ranks(group if group is not None else tdist.group.WORLD)
    everyone = [None] * tdist.get_world_size()
    tdist.all_gather_object(everyone, sorted(mine))
    return [list(ranks) for ranks in sorted({tuple(ranks) for ranks in everyone})]


def side_group(group, timeout_s: float):
    """A new group with the same ranks as ``group`` (collective: every rank of the job calls it)."""
    own, _ = tdist.new_subgroups_by_enumeration(every_group(group), timeout=timedelta(seconds=timeout_s))
    return own


def node_layout(group, side, acco) -> Optional[NodeLayout]:
    """The node-aware layout of this rank's ZeRO-1 ``group`` when the hierarchical layout applies
    (collective: each group's node and rail groups are created on every rank), else None. A group inside
    one node (a local-SGD replica on its node) stays flat: nothing of it crosses nodes. ``side``: the
    communication thread's copy of ``group``, kept as the layout's flat group."""
    world = tdist.get_world_size()
    if collectives_layout(acco, world) != "hierarchical":
        return None
    return collectives.node_layout(every_group(group), ranks_per_node(acco, world), flat=side,
                                   timeout_s=acco.timeout_s)


def crosses_nodes(group, acco) -> bool:
    """Does ``group`` (None: the world) have ranks on more than one node?"""
    ranks = tdist.get_process_group_ranks(group if group is not None else tdist.group.WORLD)
    return spans_nodes(ranks, acco, tdist.get_world_size())


def norm_segments(opt) -> List[List[Tuple[int, int]]]:
    """Per ZeRO-1 group, the (start, length) ranges of this rank's partition that count in the norm."""
    out = []
    for i, params in enumerate(opt.round_robin_bit16_groups):
        part = int(opt.partition_size[i])
        lo, hi = opt.rank * part, (opt.rank + 1) * part
        if opt.model_parallel_rank == 0:
            out.append([(0, part)])  # everything counts (padding is zero)
            continue
        ranges = []
        for p, offset in zip(params, opt.round_robin_bit16_offsets[i]):
            start, end = max(offset, lo), min(offset + p.numel(), hi)
            if start < end and is_model_parallel_parameter(p):
                ranges.append((start - lo, end - start))
        out.append(ranges)
    return out


__all__ = ["every_group", "side_group", "node_layout", "crosses_nodes", "norm_segments"]
