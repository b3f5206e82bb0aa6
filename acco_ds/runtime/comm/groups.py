"""Process groups every host needs: the communication thread's copy of a group, and node-aware layouts.

A process group must be created by every rank, for every group, in the same
order, so the communication thread's copies are made by enumerating all of
them (``side_group``).
"""

from datetime import timedelta
from typing import List, Optional

import torch.distributed as tdist

from ...config import collectives_layout, ranks_per_node, spans_nodes
from . import collectives, lifetime
from .collectives import NodeLayout


def every_group(group) -> List[List[int]]:
    """The ranks of every group like ``group`` that some rank belongs to (``group`` as each rank sees
    it), the same sorted list on every rank (collective: every rank of the job calls it)."""
    mine = tdist.get_process_group_ranks(group if group is not None else tdist.group.WORLD)
    everyone = [None] * tdist.get_world_size()
    tdist.all_gather_object(everyone, sorted(mine))
    return [list(ranks) for ranks in sorted({tuple(ranks) for ranks in everyone})]


def side_group(group, timeout_s: float):
    """A new group with the same ranks as ``group`` (collective: every rank of the job calls it)."""
    return lifetime.new_subgroups(every_group(group), timedelta(seconds=timeout_s))


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


__all__ = ["every_group", "side_group", "node_layout", "crosses_nodes"]
