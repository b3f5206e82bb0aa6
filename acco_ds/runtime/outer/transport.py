"""How an outer loop averages across replicas: the one place a loop's groups are used.

A sync of any local-SGD loop runs, in this order:

* ``begin()``: the sync starts (a quorum, when replicas come and go; a replica that joins takes its
  peer's state here and then contributes nothing to this sync);
* ``average(tensors)`` (blocking) or ``average_async(tensors)`` then ``collect()``: every tensor
  becomes its mean over the replicas, in place;
* or ``gather(bytes)``: every replica's bytes with its merge weight (sparseloco's payloads, whose indices
  differ per replica: no all-reduce can sum them);
* ``commit()``: whether every participant got the mean (when False the loop discards the sync:
  anchor and momentum stay as they were).

``GroupTransport`` (here) is the fixed fleet: an all-reduce over the outer group (the ranks that hold
the same shard in every replica), from the main thread or, asynchronously, from a communication thread
of its own; ``begin`` does nothing and every sync commits. ``fault_tolerance.TorchFTTransport`` runs the
same calls through torchft's Manager.
"""

import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as tdist

from ..comm.compression import OuterCompression
from ..comm.worker import CommWorker
from .interface import ReplicaGroups


class GroupTransport:
    """The outer all-reduce over process groups (``ReplicaGroups.outer_main`` / ``outer_side``).

    Args:
        groups: this rank's replica layout.
        compression: the quantized all-reduce (None: full precision).
        worker: the communication thread of asynchronous averages (None: the loop only blocks).
    """

    fault_tolerant = False
    committed: Optional[int] = None  # every sync commits: the period schedule counts them
    early_syncs = 0  # no joiners here: every period runs its length

    def __init__(self, groups: ReplicaGroups, compression: Optional[OuterCompression],
                 worker: Optional[CommWorker]):
        self.groups, self.compression, self.worker = groups, compression, worker
        self.bytes = 0  # bytes this rank handed to outer all-reduces (payload; the wire adds framing)

    @property
    def participants(self) -> int:
        return self.groups.replicas

    def begin(self) -> bool:
        """A sync starts; True when this replica just took its state from a peer (never here)."""
        return False

    def average(self, tensors: List[torch.Tensor], keys=None, weight: float = 1.0, side: bool = False) -> float:
        """Average ``tensors`` in place across the replicas; returns the seconds it took. ``keys``: per tensor,
        whose error-feedback residual a compressed all-reduce uses (default: its index); ``side``: called from
        the communication thread (its own group). ``weight`` is the merge weight of a fault-tolerant sync; a
        fixed fleet weighs every replica alike."""
        group = self.groups.outer_side if side else self.groups.outer_main
        start = time.perf_counter()
        for i, t in enumerate(tensors):
            if self.compression is not None:
                key = keys[i] if keys is not None else (i, 0)
                self.bytes += self.compression.all_reduce(t, key, group, divide_by=self.groups.replicas)
                continue
            self.bytes += t.numel() * t.element_size()
            tdist.all_reduce(t, group=group)
            t.div_(self.groups.replicas)
        return time.perf_counter() - start

    def gather(self, mine: torch.Tensor, weight: float = 1.0) -> List[Tuple[torch.Tensor, float]]:
        """Every replica's ``mine`` (bytes, the same size on every replica; sparse payloads), in replica order,
        each with its merge weight (1 in a fixed fleet): one all-gather over the outer group."""
        gathered = [torch.empty_like(mine) for _ in range(self.groups.replicas)]
        tdist.all_gather(gathered, mine, group=self.groups.outer_main)
        self.bytes += mine.numel()
        return [(buf, 1.0) for buf in gathered]

    def average_async(self, tensors: List[torch.Tensor], keys=None, weight: float = 1.0) -> None:
        """Start ``average`` on the communication thread; ``collect`` waits for it."""
        self.worker.submit(lambda: self.average(tensors, keys, side=True))

    @property
    def busy(self) -> bool:
        """An asynchronous average was started and not collected."""
        return self.worker is not None and self.worker.busy

    def collect(self) -> float:
        """Wait for the asynchronous average; returns the seconds it took on its thread."""
        return self.worker.wait() or 0.0

    def commit(self) -> bool:
        return True

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


__all__ = ["GroupTransport"]
