"""EDiT's sync on a replica's ZeRO-1 shards: staleness zero, overlapped with the next forward pass.

At a sync point the compute side computes this replica's pseudo-gradient
``δ = x − θ`` (anchor minus master shard) and hands the rest to the outer
communication thread, which

1. sums ``‖δ‖²`` over the replica group and exchanges every replica's norm,
   inner-step count and period time across the outer group (one small
   all-reduce);
2. turns them into the weights of ``algorithms.penalty`` (anomaly
   elimination, norm weighting, A-EDiT's step weighting) and scales ``δ``;
3. chunk by chunk, in forward order (``outer.layerwise``): all-reduces the
   chunk across replicas, applies the outer step to the anchor, copies it to
   the master shard, all-gathers it into the replica's bit16 parameters, and
   releases the chunk to the forward pre-hooks waiting for it.

With ``pseudo_grad_clip`` the outer step needs ``‖δ̄‖`` over the whole model,
so every chunk is reduced before the first is applied (less overlap).

The thread uses the outer group's side copy and the replica group's side copy;
the latter belongs to the inner communication thread, which is idle until the
sync is collected (the host calls ``OuterLoop.wait`` before it reuses that group).
"""

import math
import sys
import time
from typing import Callable, List

import torch
import torch.distributed as tdist

from ...algorithms.penalty import AnomalyDetector, clip_scale, replica_weights
from .layerwise import ChunkGate, chunk_bounds, last_chunk
from ..rounds.update import squared_norm


SWITCH_INTERVAL_S = 2e-4


class LayerwiseSync:
    """One rank's part of EDiT's outer step.

    Args:
        shards: ``outer_loop.Shards`` of this rank's replica.
        groups: ``outer_loop.ReplicaGroups``.
        settings: ``LocalSGDConfig``.
        worker: the outer ``CommWorker`` (its group is ``groups.outer_side``).
    """

    def __init__(self, shards, groups, settings, worker, compression=None):
        self.shards, self.groups, self.worker = shards, groups, worker
        self.compression = compression  # compression.OuterCompression: quantized chunk all-reduces (or None)
        self.weighting, self.clip, self.timed = settings.weighting, settings.pseudo_grad_clip, settings.sync_time_s
        a = settings.anomaly
        self.detector = AnomalyDetector(groups.replicas, a.ewma_alpha, a.warmup_syncs, a.threshold) \
            if a.enabled else None
        self.partition = shards.partition
        self.chunks = [(i, lo, hi) for i, P in enumerate(self.partition) for lo, hi in chunk_bounds(P)]
        self.gate = ChunkGate(len(self.chunks), shards.device.type == "cuda", on_failure=worker.wait)
        self.delta = [torch.empty_like(m) for m in shards.masters]
        self.anomalies = 0  # replica-periods left out of the average
        self.history: List[dict] = []  # per sync: norms, weights, anomalous, steps, elapsed (small)
        self._handles = []
        self._switch = sys.getswitchinterval()

    # ------------------------------------------------------------ compute side
    def attach(self, module: torch.nn.Module) -> None:
        """Forward pre-hooks: a module waits for the chunks that hold its own parameters."""
        first, where = 0, {}
        for i, params in enumerate(self.shards.params):
            bounds = [(lo, hi) for g, lo, hi in self.chunks if g == i]
            for p, off in params:
                where[id(p)] = first + last_chunk(off, p.numel(), self.partition[i], bounds)
            first += len(bounds)
        self._handles = self.gate.install_hooks(module, where)

    @torch.no_grad()
    def start(self, anchor, momentum, steps: int, elapsed: float, outer: Callable) -> None:
        """Compute δ and submit the sync; returns at once."""
        for d, x, m in zip(self.delta, anchor, self.shards.masters):
            torch.sub(x, m, out=d)
        self.gate.arm()
        # The sync thread takes the GIL between its many small steps while the forward pass runs Python:
        # a shorter switch interval than CPython's 5 ms keeps it from waiting that long each time.
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL_S))
        self.worker.submit(lambda: self._job(anchor, momentum, steps, elapsed, outer))

    def record(self, info: dict) -> None:
        """After the sync was collected (compute side)."""
        sys.setswitchinterval(self._switch)
        self.anomalies += sum(info["anomalous"])
        self.history.append({k: v for k, v in info.items() if k not in ("seconds", "bytes")})

    def close(self) -> None:
        sys.setswitchinterval(self._switch)
        for h in self._handles:
            h.remove()
        self._handles = []

    # -------------------------------------------------------- communication side
    def _job(self, anchor, momentum, steps, elapsed, outer) -> dict:
        t0 = time.perf_counter()
        try:
            g = self.groups
            R, me = g.replicas, g.replica
            info = torch.zeros(3 * R, dtype=torch.float64, device=self.delta[0].device)
            info[me] = self._replica_sum(squared_norm(self.delta, self.shards.norm_segments))
            info[R + me], info[2 * R + me] = steps, elapsed
            tdist.all_reduce(info, group=g.outer_side)
            values = info.tolist()
            norms = [math.sqrt(v) for v in values[:R]]
            anomalous = self.detector.observe(norms) if self.detector is not None else [False] * R
            weights = replica_weights(norms, weighting=self.weighting, steps=values[R:2 * R] if self.timed else None,
                                      anomalous=anomalous)
            for d in self.delta:
                d.mul_(weights[me])
            mean_norm = None  # ‖δ̄‖, taken only to clip it
            if self.clip is None:  # pipelined: each chunk is installed as soon as it is reduced
                for c in range(len(self.chunks)):
                    self._reduce(c)
                    self._install(c, anchor, momentum, outer, 1.0)
            else:
                for c in range(len(self.chunks)):
                    self._reduce(c)
                mean_norm = math.sqrt(self._replica_sum(squared_norm(self.delta, self.shards.norm_segments)))
                scale = clip_scale(mean_norm, self.clip)
                for c in range(len(self.chunks)):
                    self._install(c, anchor, momentum, outer, scale)
            sent = info.numel() * info.element_size() + (self._sent if self.compression is not None else
                                                         sum(d.numel() * d.element_size() for d in self.delta))
            return {"norms": norms, "anomalous": anomalous, "weights": weights, "steps": values[R:2 * R],
                    "elapsed": values[2 * R:], "mean_norm": mean_norm, "seconds": time.perf_counter() - t0,
                    "bytes": sent}
        except BaseException:
            self.gate.fail()
            raise

    def _replica_sum(self, value: float) -> float:
        return self.groups.reduce(value, self.delta[0].device, side=True)

    def _reduce(self, c: int) -> None:
        i, lo, hi = self.chunks[c]
        if self.compression is not None:
            self._sent = (0 if c == 0 else self._sent) + self.compression.all_reduce(
                self.delta[i][lo:hi], (i, lo), self.groups.outer_side)
            return
        tdist.all_reduce(self.delta[i][lo:hi], group=self.groups.outer_side)

    def _install(self, c: int, anchor, momentum, outer: Callable, scale: float) -> None:
        i, lo, hi = self.chunks[c]
        d = self.delta[i][lo:hi]
        if scale != 1.0:
            d.mul_(scale)
        x = anchor[i][lo:hi]
        outer(x, momentum[i][lo:hi], d)
        self.shards.masters[i][lo:hi].copy_(x)
        if self.shards.flats is not None:  # (FSDP2 gathers its shards itself)
            rank, group = self.shards.gather_at(i, self.groups, side=True)  # an expert group: its own ranks
            flat, P = self.shards.flats[i], self.partition[i]
            k = flat.numel() // P
            parts = [flat[r * P + lo:r * P + hi] for r in range(k)]
            parts[rank].copy_(x)
            if k > 1:
                tdist.all_gather(parts, parts[rank].clone(), group=group)
        self.gate.release(c)


__all__ = ["LayerwiseSync"]
