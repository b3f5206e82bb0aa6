"""Process groups (tensor-parallel layouts, node-aware collectives) and norm masks.

With an ``mpu`` (Megatron-DeepSpeed), the data-parallel ranks of each
model-parallel position form their own group: with TP = 2 on 4 ranks the
data-parallel groups are {0, 2} and {1, 3}, the model-parallel ones {0, 1}
and {2, 3}. Their communication-thread copies and node-aware layouts are made
by ``runtime.comm.groups``.

ZeRO-1 counts each parameter once in the global gradient norm: a parameter
split across model-parallel ranks on every rank, a replicated one only on
model-parallel rank 0 (``stage_1_and_2.py``); the squares are summed over the
data-parallel group and then over the model-parallel group. ``norm_segments``
gives the ranges of this rank's flat shard that count, for the job's norm.
"""

from typing import List, Tuple

from .compat import is_model_parallel_parameter


def norm_segments(opt, rank: int) -> List[List[Tuple[int, int]]]:
    """Per ZeRO-1 group, the (start, length) ranges of ``rank``'s partition that count in the norm: on
    model-parallel rank 0 every parameter but a pipeline stage's copy of a tied weight (``ds_pipe_replicated``,
    counted on its first stage), elsewhere the model-parallel slices only."""
    out = []
    for i, params in enumerate(opt.round_robin_bit16_groups):
        part = int(opt.partition_size[i])
        lo, hi = rank * part, (rank + 1) * part
        counted = [(p, offset) for p, offset in zip(params, opt.round_robin_bit16_offsets[i])
                   if not getattr(p, "ds_pipe_replicated", False) and
                   (opt.model_parallel_rank == 0 or is_model_parallel_parameter(p))]
        if len(counted) == len(params):
            out.append([(0, part)])  # everything counts (padding is zero)
            continue
        ranges = []
        for p, offset in counted:
            start, end = max(offset, lo), min(offset + p.numel(), hi)
            if start < end:
                ranges.append((start - lo, end - start))
        out.append(ranges)
    return out


__all__ = ["norm_segments"]
