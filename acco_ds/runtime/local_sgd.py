"""The outer loop of the local-SGD modes (``diloco``, ``co2``, ``edit``), an ``OuterLoop``.

The data-parallel ranks split into ``R = W / k`` replica groups of ``k``
consecutive ranks. The host runs every inner step as plain ZeRO-1 inside the
group, so the inner optimizer state is sharded ``k`` ways. The ranks that
hold the same shard index in every group form an *outer group*; the outer
step runs there on fp32 shards, so the anchor ``x`` (the last global model),
the outer momentum ``m`` and, in ``co2``, the period start ``s`` and the
in-flight pseudo-gradient are sharded like the master weights.

The period schedule is ``algorithms.periods``; the outer update is
``runtime.outer.outer_step``. In ``co2`` the all-reduce of a period's
pseudo-gradient runs on a communication thread of its own (own process group,
own CUDA stream) for the whole next period. ``edit``'s outer step runs on that
thread too, overlapped with the next forward pass (``runtime.edit_sync``);
A-EDiT ends its periods on the time read from ``clock``.
"""

import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as tdist

from ..algorithms.periods import CO2, EDIT, PeriodSchedule
from . import collectives
from .comm import CommWorker
from .compression import OuterCompression, load_outer_residuals
from .edit_sync import LayerwiseSync
from .outer import outer_step
from . import local_sgd_words as words
from .outer_loop import OuterLoop, ReplicaGroups, Shards


class LocalSGD(OuterLoop):
    """Anchor, outer momentum and the sync points of one rank's shard.

    Args:
        acco: the ``ACCOConfig`` (mode ``diloco``, ``co2`` or ``edit``).
        shards: this rank's view of its replica's ZeRO-1 state.
        groups: ``outer_loop.make_groups``' result.
    """

    def __init__(self, acco, shards: Shards, groups: ReplicaGroups):
        from ..config import LocalSGDConfig
        self.shards, self.groups = shards, groups
        self.replicas, self.replica_ranks = groups.replicas, groups.replica_ranks
        self.settings = acco.outer
        ls = acco.local_sgd or LocalSGDConfig()
        self.schedule = PeriodSchedule(acco.mode, None if ls.sync_time_s else ls.sync_every)
        self.sync_time_s = ls.sync_time_s
        self.clock = time.monotonic  # A-EDiT's period timer; tests inject their own with set_clock
        self.period_start = self.clock()
        self._elapsed = 0.0  # A-EDiT: period time at the last inner step (the replica's slowest rank)
        self._submitted_at = None
        self.max_sync_wait = 0.0  # A-EDiT: longest time this replica waited for the others at a sync
        self.read_syncs = 0  # edit: syncs collected by a read rather than by training
        self.per_replica_counters = self.schedule.timed  # A-EDiT replicas run different step counts
        masters = shards.masters
        self.anchor = [m.detach().clone() for m in masters]  # every replica starts at θ0 (DeepSpeed broadcast it)
        self.momentum = [torch.zeros_like(m) for m in masters]
        co2 = acco.mode == CO2
        self.start = [m.detach().clone() for m in masters] if co2 else None
        self.in_flight = [torch.zeros_like(m) for m in masters] if co2 else None
        side = co2 or acco.mode == EDIT
        self.outer_comm = CommWorker(groups.outer_ranks, shards.device, acco.timeout_s,
                                     group=groups.outer_side) if side else None
        from .. import ops
        # Quantized outer all-reduce with error feedback across periods (None: full precision).
        from ..config_local import spans_nodes
        crosses = spans_nodes(groups.outer_ranks, acco, tdist.get_world_size())
        self.compression = OuterCompression.from_config(acco, ops.load_kernels(acco.kernels, shards.device), crosses)
        self.edit = LayerwiseSync(shards, groups, ls, self.outer_comm, self.compression) \
            if acco.mode == EDIT else None
        self.outer_comm_s = 0.0  # seconds the outer all-reduces took on their thread
        self.outer_wait_s = 0.0  # seconds the compute side waited for them
        self.outer_bytes = 0  # bytes this rank handed to outer all-reduces (payload; the wire adds framing)
        self.mode = acco.mode

    # ------------------------------------------------------------- sync points
    @property
    def syncs(self) -> int:
        return self.schedule.period

    def attach(self, module: torch.nn.Module) -> None:
        if self.edit is not None:
            self.edit.attach(module)  # forward waits per layer during a sync

    def wait(self) -> None:
        self.wait_sync()  # edit: the layer-wise sync uses the inner thread's group

    def before_read(self) -> None:
        self.wait_sync(read=True)

    def after_inner_step(self) -> None:
        sync = self.schedule.after_inner_step(self._time_up() if self.schedule.timed else False)
        if sync is not None:
            self._sync(sync)

    def finalize(self) -> None:
        """Leave every replica on one model: apply what is in flight, average the unfinished period."""
        self.wait_sync()
        sync = self.schedule.final_sync()
        if sync is not None:
            self._sync(sync)
        self.wait_sync()

    def set_clock(self, clock) -> None:
        """A-EDiT's period timer reads ``clock()`` (seconds); the current period restarts now."""
        self.clock = clock
        self.period_start = clock()

    def _time_up(self) -> bool:
        """A-EDiT: has the period's time passed? Every rank of the replica takes its slowest rank's time."""
        elapsed = self.clock() - self.period_start
        if self.groups.k > 1:
            t = torch.tensor([elapsed], dtype=torch.float64, device=self.anchor[0].device)
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=self.groups.replica_main)
            elapsed = float(t)
        self._elapsed = elapsed
        return elapsed >= self.sync_time_s

    def waited_s(self) -> float:
        """Seconds the compute side has waited for outer communication so far (edit: hooks included)."""
        return self.outer_wait_s + (self.edit.gate.waited_s if self.edit is not None else 0.0)

    def wait_sync(self, read: bool = False) -> None:
        """edit: wait for the layer-wise sync in flight (the next inner step and every read need it).
        ``read``: a read (state_dict, eval, save) collects it; its time then counts as neither hidden nor
        waited, so ``outer_hidden_fraction`` covers the syncs that training itself collected."""
        if self.edit is None or not self.outer_comm.busy:
            return
        t0 = time.perf_counter()
        info = self.outer_comm.wait()
        if read:
            self.read_syncs += 1
        else:
            self.outer_comm_s += info["seconds"]
            self.outer_wait_s += time.perf_counter() - t0 + self.edit.gate.waited_s
        self.edit.gate.waited_s = 0.0
        self.outer_bytes += info["bytes"]
        self.edit.record(info)
        if self.schedule.timed:  # the next period started when the last replica arrived
            waited = max(info["elapsed"]) - info["elapsed"][self.groups.replica]
            self.period_start = self._submitted_at + waited
            self.max_sync_wait = max(self.max_sync_wait, waited)

    @torch.no_grad()
    def _sync(self, sync) -> None:
        if self.edit is not None:
            self.wait_sync()
            self._submitted_at = self.clock()
            self.edit.start(self.anchor, self.momentum, sync.steps, self._elapsed, self._outer_one)
            return
        masters = self.shards.masters
        starts = self.start if self.start is not None else self.anchor
        deltas = [s - m for s, m in zip(starts, masters)]  # δ = start − end of the period
        if sync.wait_previous:
            self._collect()
            self._outer(self.in_flight)
        if sync.blocking:  # the compute side waits for all of it
            seconds = self._average(deltas, self.groups.outer_main)
            self.outer_comm_s += seconds
            self.outer_wait_s += seconds
            self._outer(deltas)
            new = self.anchor
        elif sync.send:  # co2: jump to the new global model plus this replica's own progress, send that progress
            new = [x - d for x, d in zip(self.anchor, deltas)]
            for buf, d in zip(self.in_flight, deltas):
                buf.copy_(d)
            self.outer_comm.submit(lambda: self._average(self.in_flight, self.groups.outer_side))
        else:  # co2's last sync with no inner step since the previous one: every replica takes the anchor
            new = self.anchor
        if self.start is not None:
            for s, n in zip(self.start, new):
                s.copy_(n)
        self._install(new)

    def _outer(self, mean_deltas) -> None:
        for x, m, d in zip(self.anchor, self.momentum, mean_deltas):
            self._outer_one(x, m, d)

    def _outer_one(self, x, m, mean_delta) -> None:
        """The outer step on one shard (edit: on one chunk of it)."""
        st = self.settings
        outer_step(x, m, mean_delta, lr=st["outer_lr"], momentum=st["outer_momentum"], nesterov=st["nesterov"],
                   staleness_penalty=st["staleness_penalty"], momentum_clip=st["outer_momentum_clip"])

    def _average(self, tensors, group, keys=None) -> float:
        """Average ``tensors`` in place across the replicas (the outer group); returns the seconds it took.
        ``keys``: per tensor, whose error-feedback residual a compressed all-reduce uses (default: its index)."""
        start = time.perf_counter()
        for i, t in enumerate(tensors):
            if self.compression is not None:
                key = keys[i] if keys is not None else (i, 0)
                self.outer_bytes += self.compression.all_reduce(t, key, group, divide_by=self.groups.replicas)
                continue
            self.outer_bytes += t.numel() * t.element_size()
            tdist.all_reduce(t, group=group)
            t.div_(self.groups.replicas)
        return time.perf_counter() - start

    def _collect(self) -> None:
        """co2: wait for the in-flight average (it arrives in ``in_flight``)."""
        if self.outer_comm is not None and self.outer_comm.busy:
            t0 = time.perf_counter()
            self.outer_comm_s += self.outer_comm.wait() or 0.0
            self.outer_wait_s += time.perf_counter() - t0

    def _install(self, shards) -> None:
        """Master shards ← ``shards``; the replica's bit16 weights ← their all-gather (a host without flats,
        FSDP2, gathers its shards itself at the next forward)."""
        for i, (master, shard) in enumerate(zip(self.shards.masters, shards)):
            if master is not shard:
                master.copy_(shard)
            if self.shards.flats is not None:
                collectives.all_gather_part(self.shards.flats[i], master, self.groups.shard, self.groups.replica_main)

    # ------------------------------------------------------------ what users read
    @torch.no_grad()
    def committed_flats(self) -> Optional[List[torch.Tensor]]:
        """The anchor (the last global model) in the model dtype, gathered into the spare buffers (a host
        without flats gets the anchor shards themselves)."""
        if self.shards.flats is None:
            return self.anchor
        spare = self.shards.spare()
        for buf, shard in zip(spare, self.anchor):
            collectives.all_gather_part(buf, shard, self.groups.shard, self.groups.replica_main)
        return spare

    def banner(self) -> str:
        return words.banner(self)

    def stats(self) -> dict:
        """Syncs done, and for co2/edit how much of the outer communication the compute side waited for."""
        comm, wait = self.outer_comm_s, self.outer_wait_s
        extra = {} if self.edit is None else {
            "anomalies": self.edit.anomalies, "sync_history": self.edit.history, "read_syncs": self.read_syncs,
            "max_sync_wait_s": self.max_sync_wait if self.schedule.timed else None}
        return {**extra, "syncs": self.schedule.period, "sync_every": self.schedule.sync_every,
                "replicas": self.groups.replicas,
                "replica_group_size": self.groups.k, "outer_comm_s": comm, "outer_wait_s": wait,
                "outer_bytes": self.outer_bytes, "sync_time_s": self.sync_time_s,
                "outer_compression": None if self.compression is None else str(self.compression.codec),
                "outer_residual_bytes": 0 if self.compression is None else self.compression.nbytes(),
                "outer_hidden_fraction": max(0.0, 1.0 - wait / comm) if comm > 0 else None}

    def report(self) -> List[Tuple[str, str]]:
        return words.report(self)

    def progress(self) -> str:
        return words.progress(self)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        self._collect()  # an in-flight average is saved as received: resume applies it at the next sync
        self.wait_sync(read=True)
        clone = lambda ts: None if ts is None else [t.clone() for t in ts]  # noqa: E731
        edit = None if self.edit is None else {
            "detector": self.edit.detector.state_dict() if self.edit.detector is not None else None,
            "period_elapsed_s": self.clock() - self.period_start, "anomalies": self.edit.anomalies}
        return {"schedule": self.schedule.state_dict(), "replicas": self.groups.replicas, "k": self.groups.k,
                "edit": edit,
                "anchor": clone(self.anchor), "momentum": clone(self.momentum), "start": clone(self.start),
                "in_flight": clone(self.in_flight),
                "residuals": None if self.compression is None else self.compression.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, sd: Optional[dict]) -> None:
        from ..config import checkpoint_mismatch
        if sd is None:
            raise ValueError("this checkpoint was saved without a local-SGD mode: its replicas have no anchor to "
                             "resume from. Load only the module weights (load_checkpoint(..., "
                             "load_optimizer_states=False, load_lr_scheduler_states=False))")
        if sd.get("streaming") is not None and type(self) is LocalSGD:
            from .streaming import fragments_mismatch
            F = sd["streaming"]["fragments"]
            if F == 1:  # streaming only by its delay or alpha
                raise fragments_mismatch("Streaming DiLoCo's keys (fragments=1, its delay or alpha set)",
                                         "plain DiLoCo")
            raise fragments_mismatch(f"acco.local_sgd.fragments={F}", "1")
        if (sd["replicas"], sd["k"]) != (self.groups.replicas, self.groups.k):
            raise checkpoint_mismatch("replica layout (replicas, replica_group_size)", (sd["replicas"], sd["k"]),
                                      (self.groups.replicas, self.groups.k), replicas=True)
        self._collect()
        self.wait_sync(read=True)
        self.schedule.load_state_dict(sd["schedule"])
        if self.edit is not None:
            edit = sd.get("edit") or {}
            if self.edit.detector is not None and edit.get("detector") is not None:
                self.edit.detector.load_state_dict(edit["detector"])
            self.edit.anomalies = edit.get("anomalies", 0)
            self.period_start = self.clock() - edit.get("period_elapsed_s", 0.0)  # the period timer goes on
        for name in ("anchor", "momentum", "start", "in_flight"):
            mine = getattr(self, name)
            for dst, src in zip(mine or [], sd[name] or []):
                dst.copy_(src)
        load_outer_residuals(self.compression, sd.get("residuals"))

    @torch.no_grad()
    def restart(self) -> None:
        """Anchor, period start ← the current master shards; no momentum, nothing in flight, a new period."""
        self._collect()
        self.wait_sync(read=True)
        for name in ("anchor", "start"):
            for dst, src in zip(getattr(self, name) or [], self.shards.masters):
                dst.copy_(src)
        for buf in (self.momentum or []) + (self.in_flight or []):
            buf.zero_()
        if self.compression is not None:
            self.compression.load_state_dict(None)  # a new start: nothing left out of earlier sends
        self.schedule.restart()
        self.period_start = self.clock()

    def close(self) -> None:
        if self.edit is not None:
            self.edit.close()
        if self.outer_comm is not None:
            self.outer_comm.close()


__all__ = ["LocalSGD"]
