"""Layer-wise synchronisation (EDiT): the next forward pass runs while the outer step lands.

The flat parameters of each ZeRO-1 group are partitioned across the ``k``
ranks of a replica: rank ``r`` holds ``[r·P, (r+1)·P)``. Each shard is cut at
the same local offsets into ``CHUNKS`` pieces, so chunk ``c`` is the same
slice of every shard and can be all-gathered with equal sizes. DeepSpeed
lays parameters out in registration order, which is forward order for the
usual transformer: with one rank per replica the chunks are consecutive
layers; with ``k`` ranks chunk ``c`` holds a slice of each ``k``-th of the model.

The communication thread releases chunks in order (``ChunkGate.release``);
a forward pre-hook on every module with parameters of its own waits only
for the last chunk that holds any of them (``ChunkGate.wait``).
"""

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

CHUNKS = 8  # pieces per shard: enough to overlap, few enough that each collective stays large


def chunk_bounds(partition_size: int, chunks: int = CHUNKS) -> List[Tuple[int, int]]:
    """``(lo, hi)`` shard-local bounds of each chunk (empty chunks dropped)."""
    cuts = [round(c * partition_size / chunks) for c in range(chunks + 1)]
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def last_chunk(offset: int, numel: int, partition_size: int, bounds: Sequence[Tuple[int, int]]) -> int:
    """Index of the last chunk that holds flat elements ``[offset, offset + numel)``."""
    first_rank, last_rank = offset // partition_size, (offset + numel - 1) // partition_size
    if first_rank != last_rank:  # crosses a shard boundary: runs to the end of the first shard
        return len(bounds) - 1
    local = (offset + numel - 1) % partition_size
    return next(c for c, (lo, hi) in enumerate(bounds) if lo <= local < hi)


class ChunkGate:
    """Per-chunk completion, set by the communication thread and awaited by forward pre-hooks.

    Args:
        chunks: total chunks of one sync (over every parameter group).
        cuda: the chunks are written on a side CUDA stream; a waiter's stream waits on its event.
        on_failure: called on the compute side when the sync failed (it raises the error).
    """

    def __init__(self, chunks: int, cuda: bool, on_failure: Callable[[], None]):
        self.chunks, self.cuda, self.on_failure = chunks, cuda, on_failure
        self._cond = threading.Condition()
        self._done = chunks  # chunks released in the current sync (all: no sync in flight)
        self._failed = False
        self._events: List[Optional[torch.cuda.Event]] = [None] * chunks
        self.waited_s = 0.0  # compute-side seconds spent waiting in hooks

    def arm(self) -> None:
        with self._cond:
            self._done, self._failed = 0, False

    def release(self, chunk: int) -> None:
        """Communication thread: chunk ``chunk`` (and every one before it) is installed."""
        if self.cuda:
            self._events[chunk] = torch.cuda.Event()
            self._events[chunk].record()
        with self._cond:
            self._done = max(self._done, chunk + 1)
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def wait(self, chunk: int) -> None:
        if self._done > chunk:  # fast path: nothing in flight
            return
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._done > chunk or self._failed)
            failed = self._failed and self._done <= chunk
        self.waited_s += time.perf_counter() - t0
        if failed:
            self.on_failure()
            raise RuntimeError("ACCO internal error: the layer-wise sync failed without an error")
        if self.cuda and self._events[chunk] is not None:
            torch.cuda.current_stream().wait_event(self._events[chunk])

    def install_hooks(self, module: torch.nn.Module, where: Dict[int, int]) -> list:
        """Forward pre-hooks on every submodule with parameters of its own; ``where`` maps ``id(param)``
        to the last chunk (over every group) that holds it."""
        handles = []
        for sub in module.modules():
            needed = [where[id(p)] for p in sub.parameters(recurse=False) if id(p) in where]
            if needed:
                last = max(needed)
                handles.append(sub.register_forward_pre_hook(lambda _m, _a, last=last: self.wait(last)))
        return handles


__all__ = ["CHUNKS", "ChunkGate", "chunk_bounds", "last_chunk"]
