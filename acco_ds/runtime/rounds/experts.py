"""Mixture of experts in the rounds: where each parameter group is partitioned.

A dense parameter group is partitioned over the round group (the data-parallel group, or a local-SGD
replica), with its node-aware layout and compression. An expert group is partitioned over its own
expert-data-parallel group (the ranks that hold the same experts), flat: its reduce-scatter and all-gather
run there, compressed when the rounds are (each other rank of that group a peer). Micro-batch counts and
gradient norms stay on the round group: the squared norms of every rank's shards, summed over the round
group, count each expert once, as stock ZeRO-1's global norm does.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as tdist

from .buffers import RoundCompression


@dataclass
class Places:
    """Per parameter group: the world size of the group partitioning it, the compression of its buffers,
    the job's ``(side group, rank)`` (None: the round group), and the outer loop's ``(rank, main, side)``
    (None: the replica group). ``parts``/``gather`` are None when no group has experts."""
    world_sizes: List[int]
    compressions: list
    parts: Optional[list]
    gather: Optional[list]


def places(expert_groups: Optional[list], groups: int, world_size: int,
           compression: Optional[RoundCompression]) -> Places:
    """``expert_groups``: per parameter group None (dense) or ``(main, side)`` (see ``RoundDriver.setup_rounds``)."""
    if expert_groups is None:
        return Places([world_size] * groups, [compression] * groups, None, None)
    sizes, comps, parts, gather = [], [], [], []
    for e in expert_groups:
        if e is None:
            sizes.append(world_size)
            comps.append(compression)
            parts.append(None)
            gather.append(None)
            continue
        size, rank = tdist.get_world_size(e[0]), tdist.get_rank(e[0])
        sizes.append(size)
        comps.append(None if compression is None or size == 1 else
                     RoundCompression(size, compression.residual_dtype))
        parts.append((e[1], rank))
        gather.append((rank, e[0], e[1]))
    return Places(sizes, comps, parts, gather)


def buffer_part(driver, i: int):
    """``(rank, group)`` of a ``RoundDriver``'s buffer ``i`` partition, on the communication thread's groups."""
    part = driver.parts[i] if getattr(driver, "parts", None) is not None else None
    return (driver.rank, driver.comm.group) if part is None else (part[1], part[0])


__all__ = ["Places", "places", "buffer_part"]
