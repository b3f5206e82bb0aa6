"""sparseloco under tensor parallelism: the contract's chunks are cut from whole tensors.

A tensor-parallel rank holds a slice of each split tensor (Megatron's ``tensor_model_parallel`` parameters,
split along ``partition_dim``), and ZeRO-1 a partition of its slices' flat buffer, so no rank holds a whole
chunk of a split tensor. At a sync every rank of the replica therefore:

1. assembles the whole model's error buffer: an all-gather over its replica's data-parallel ranks (its
   tensor-parallel slice's flat buffer), then one over its tensor-parallel group per split tensor
   (concatenated along ``partition_dim``); replicated tensors are its own copy;
2. packs its share of the whole model's chunks: the chunks are dealt out in order to the replica's
   ``tp x k`` positions, and a position's outer group (the same position in every replica) gathers that
   share from every replica, exactly as without tensor parallelism;
3. hands its chunks' residual and average back to every rank of the replica: two all-reduces (over the
   tensor-parallel group, then the replica's data-parallel ranks) of whole-model buffers that are zero
   outside the sender's chunks, so each value has one sender and the sum is exact; every rank keeps the
   part that is its own (its slice, its ZeRO-1 partition).

The cost is what tensor parallelism adds here, plainly: during a sync every rank holds three fp32 buffers of
the whole model (error, residual, average), and each moves O(N) bytes inside its replica.
"""

import math
from typing import List, Tuple

import torch
import torch.distributed as tdist

from ...ops.reference import chunk_offsets


def whole_layout(shards, tp: int) -> List[List[Tuple[int, int, tuple, tuple, object]]]:
    """Per parameter group, per parameter: (offset in the flat buffer, numel, shape, whole shape, split dim or
    None). A split parameter without Megatron's ``partition_dim`` is refused by name (before any collective)."""
    layout = []
    for params in shards.params:
        rows = []
        for p, offset in params:
            dim = None
            if getattr(p, "tensor_model_parallel", False):
                dim = getattr(p, "partition_dim", None)
                if dim is None or getattr(p, "partition_stride", 1) != 1:
                    raise ValueError(f'acco.mode "sparseloco" cuts chunks from whole tensors: a tensor-parallel '
                                     f'parameter of shape {tuple(p.shape)} needs Megatron\'s partition_dim '
                                     f'attribute (and partition_stride 1) to be put back together. Set them '
                                     f'where the parameter is split, or use mode "diloco"')
            whole = list(p.shape)
            if dim is not None:
                whole[dim] *= tp
            rows.append((offset, p.numel(), tuple(p.shape), tuple(whole), dim))
        layout.append(rows)
    return layout


class WholeTensors:
    """The whole-model chunk layout of one rank of a tensor-parallel replica (see the module docstring).

    Args:
        layout: ``whole_layout(shards, groups.tensor_parallel)``.
        shards: the replica's ZeRO-1 state (``params[i]``: the TP-local parameters of group ``i`` with their
            offsets in the group's flat buffer).
        groups: this rank's replica layout (``model_main``: the tensor-parallel group).
        chunk: elements per chunk.
    """

    def __init__(self, layout, shards, groups, chunk: int):
        self.groups, self.tp = groups, groups.tensor_parallel
        self.tp_group = groups.model_main
        self.partition = shards.partition
        self.layout = layout
        if tdist.get_world_size(self.tp_group) != self.tp:
            raise ValueError('acco.mode "sparseloco" with tensor parallelism runs without pipeline stages: the '
                             'model-parallel group here also spans pipeline stages, whose tensors are not split. '
                             'Use tensor or pipeline parallelism alone with sparseloco, or mode "diloco"')
        self.tp_rank = tdist.get_rank(self.tp_group)
        offsets = chunk_offsets([math.prod(w) for rows in self.layout for *_, w, _ in rows], chunk)
        chunks, positions = offsets.numel() - 1, self.tp * groups.k
        position = self.tp_rank * groups.k + groups.shard
        lo, hi = chunks * position // positions, chunks * (position + 1) // positions
        self.lo, self.hi = int(offsets[lo]), int(offsets[hi])
        self.offsets = offsets[lo:hi + 1] - offsets[lo]  # this rank's chunks, relative to self.lo
        self.numel = int(offsets[-1])

    @property
    def chunks(self) -> int:
        return self.offsets.numel() - 1

    def assemble(self, error: List[torch.Tensor]) -> torch.Tensor:
        """The whole model's error buffer, every group's tensors end to end (the contract's order)."""
        parts = []
        for e, rows in zip(error, self.layout):
            flat = self._replica_gather(e)
            for offset, n, shape, _, dim in rows:
                t = flat[offset:offset + n].view(shape)
                if dim is not None:
                    pieces = [torch.empty_like(t) for _ in range(self.tp)]
                    tdist.all_gather(pieces, t.contiguous(), group=self.tp_group)
                    t = torch.cat(pieces, dim=dim)
                parts.append(t.reshape(-1))
        return torch.cat(parts)

    def _replica_gather(self, e: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel slice's flat buffer from its ZeRO-1 partitions (k ranks)."""
        if self.groups.k == 1:
            return e
        flat = e.new_empty(self.groups.k * e.numel())
        tdist.all_gather_into_tensor(flat, e, group=self.groups.replica_main)
        return flat

    def spread(self, both: torch.Tensor, error: List[torch.Tensor]) -> List[torch.Tensor]:
        """Hand every rank of the replica its part: ``both`` is [residual, average] over the whole model, zero
        outside this rank's chunks (summed in place); ``error`` (this rank's partitions) takes its residual, and
        the return is its partitions of the average."""
        tdist.all_reduce(both, group=self.tp_group)
        if self.groups.k > 1:
            tdist.all_reduce(both, group=self.groups.replica_main)
        out, at = [], 0
        for e, rows, P in zip(error, self.layout, self.partition):
            local = both.new_zeros(2, self.groups.k * P)
            for offset, n, shape, whole, dim in rows:
                size = math.prod(whole)
                t = both[:, at:at + size].reshape(2, *whole)
                if dim is not None:
                    t = t.narrow(dim + 1, self.tp_rank * shape[dim], shape[dim])
                local[:, offset:offset + n] = t.reshape(2, -1)
                at += size
            mine = local[:, self.groups.shard * P:(self.groups.shard + 1) * P]
            e.copy_(mine[0])
            out.append(mine[1].clone())
        return out


__all__ = ["WholeTensors"]
