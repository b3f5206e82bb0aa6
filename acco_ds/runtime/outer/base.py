"""The shared base of the local-SGD outer loops (``diloco``, ``co2``, ``edit``, Streaming DiLoCo).

The data-parallel ranks split into ``R = W / k`` replica groups of ``k``
consecutive ranks. The host runs every inner step as plain ZeRO-1 inside the
group, so the inner optimizer state is sharded ``k`` ways. The ranks that
hold the same shard index in every group form an *outer group*; the outer
step runs there on fp32 shards, so the anchor ``x`` (the last global model)
and the outer momentum ``m`` are sharded like the master weights.

``LocalSGD`` owns what every mode shares: the anchor and momentum, the period
schedule (``algorithms.periods``), the average over the replicas (through a
``transport``: the outer process group, full precision or quantized, or torchft's
Manager when replicas come and go), the outer update
(``outer.update.outer_step``), the install of new weights into the replica,
the committed view, the state a checkpoint holds and the figures. Each mode is
a subclass that holds only its own rule (``_sync``, and what it keeps in
flight): ``diloco.DiLoCo``, ``co2.CO2``, ``edit.EDiT``,
``streaming.StreamingDiLoCo``.
"""

from typing import List, Optional, Tuple

import torch
import torch.distributed as tdist

from ...algorithms.periods import PeriodSchedule
from ..comm import collectives
from ..comm.compression import OuterCompression, load_outer_residuals
from ..comm.worker import CommWorker
from . import words
from .fault_tolerance import JoinsAndHeals
from .interface import OuterLoop, ReplicaGroups, Shards
from .transport import GroupTransport
from .update import outer_step


class LocalSGD(JoinsAndHeals, OuterLoop):
    """Anchor, outer momentum and the sync points of one rank's shard; a subclass implements ``_sync``.

    Args:
        acco: the ``ACCOConfig`` (a local-SGD mode).
        shards: this rank's view of its replica's ZeRO-1 (or FSDP2) state.
        groups: ``interface.make_groups``' result.
    """

    overlapped = False  # the outer communication runs on a thread of its own (``outer_comm``)
    schedule_mode, dense_outer = None, True  # the periods' mode (None: acco.mode); compressible dense averages

    def __init__(self, acco, shards: Shards, groups: ReplicaGroups):
        from ...config import LocalSGDConfig
        from ...config import spans_nodes
        from ... import ops
        self.shards, self.groups = shards, groups
        self.replicas, self.replica_ranks = groups.replicas, groups.replica_ranks
        self.settings = acco.outer
        self.local = acco.local_sgd or LocalSGDConfig()
        self.schedule = PeriodSchedule(self.schedule_mode or acco.mode,
                                       None if self.local.sync_time_s else self.local.sync_every)
        self.anchor = [m.detach().clone() for m in shards.masters]  # every replica starts at θ0 (broadcast)
        self.momentum = [torch.zeros_like(m) for m in shards.masters]
        # Quantized outer all-reduce with error feedback across periods (None: full precision).
        crosses = spans_nodes(groups.outer_ranks, acco, tdist.get_world_size())
        self.compression = OuterCompression.from_config(acco, ops.load_kernels(acco.kernels, shards.device), crosses) \
            if self.dense_outer else None
        self.fault_tolerance = acco.fault_tolerance
        if self.fault_tolerance is not None:  # replicas that come and go: the outer group is torchft's
            from .fault_tolerance import TorchFTTransport
            self.transport = TorchFTTransport(self.fault_tolerance, groups, self.heal_state, self.heal_load)
        else:
            worker = CommWorker(groups.outer_ranks, shards.device, acco.timeout_s, group=groups.outer_side) \
                if self.overlapped else None
            self.transport = GroupTransport(groups, self.compression, worker)
        self.outer_comm_s, self.outer_wait_s = 0.0, 0.0  # seconds the outer all-reduces took; the compute side waited
        self.healed = False  # this sync's quorum gave this replica a peer's state
        self.unsent_steps = 0  # inner steps whose progress no committed (or in-flight) sync holds yet

    @property
    def outer_comm(self) -> Optional[CommWorker]:
        """The outer communication thread (None: the loop's syncs block)."""
        return self.transport.worker

    @property
    def outer_bytes(self) -> int:
        """Bytes this rank handed to outer all-reduces (payload; the wire adds framing)."""
        return self.transport.bytes

    # ------------------------------------------------------------- sync points
    @property
    def syncs(self) -> int:
        committed = self.transport.committed  # a fault-tolerant transport counts the syncs that committed
        return self.schedule.period if committed is None else committed

    def after_inner_step(self) -> None:
        self.unsent_steps += 1
        sync = self.schedule.after_inner_step(self.time_up(), self.joiner_waiting())
        if sync is not None:
            self.transport.early_syncs += sync.early
            self._sync(sync)

    def time_up(self) -> bool:
        """Has the period's wall time passed? (Only periods that end on time ask: A-EDiT.)"""
        return False

    def _sync(self, sync) -> None:
        """Run the sync point ``sync`` (an ``algorithms.periods.Sync``): the mode's own rule."""
        raise NotImplementedError

    def finalize(self) -> None:
        """Leave every replica on one model: apply what is in flight, average the unfinished period."""
        self.wait()
        sync = self.schedule.final_sync()
        if sync is not None:
            self._sync(sync)
        self.wait()

    def settle(self) -> None:
        """Finish every outer collective in flight (before a save, a load or a restart); the base has none."""

    def waited_s(self) -> float:
        return self.outer_wait_s

    # ------------------------------------------------------------ shared steps
    def _outer(self, mean_deltas) -> None:
        for x, m, d in zip(self.anchor, self.momentum, mean_deltas):
            self._outer_one(x, m, d)

    def _outer_one(self, x, m, mean_delta) -> None:
        """The outer step on one shard (or a piece of it)."""
        st = self.settings
        outer_step(x, m, mean_delta, lr=st["outer_lr"], momentum=st["outer_momentum"], nesterov=st["nesterov"],
                   staleness_penalty=st["staleness_penalty"], momentum_clip=st["outer_momentum_clip"])

    def _average(self, tensors, keys=None) -> None:
        """Average ``tensors`` in place across the replicas on the main thread; the compute side waits for all
        of it. ``keys``: per tensor, whose error-feedback residual a compressed all-reduce uses."""
        seconds = self.transport.average(tensors, keys, self.merge_weight())
        self.outer_comm_s += seconds
        self.outer_wait_s += seconds

    def _blocking_sync(self) -> bool:
        """The blocking sync (diloco; edit when replicas come and go): ``δ = x − θ`` averaged, one outer step,
        every replica on the new anchor. Returns whether it committed (otherwise nothing changes: the replica
        goes on where it stands, its progress goes into the next sync)."""
        self.begin_sync()
        deltas = [x - m for x, m in zip(self.anchor, self.shards.masters)]  # δ = start − end of the period
        self._average(deltas)
        if not self.transport.commit():
            return False
        self._outer(self.scale_mean(deltas))
        self._install(self.anchor)
        self.unsent_steps = 0
        return True

    def begin_sync(self) -> None:
        """A sync starts (``transport.begin``). A replica that just took its peer's state (``healed``) stands
        at the anchor: its masters are installed into its weights, and it contributes nothing to this sync."""
        healed = self.transport.begin()
        if self.transport.fault_tolerant and tdist.get_world_size() > 1:
            # torchft picks a heal source per rank: every rank of the launch (the replica) agrees.
            t = torch.tensor([float(healed)], device=self.shards.device)
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
            healed = bool(t.item())
        self.healed = healed
        if healed:
            for master, x in zip(self.shards.masters, self.anchor):
                master.copy_(x)
            self._install(self.shards.masters)

    def merge_weight(self) -> float:
        """This replica's weight in the average: 1 in a fixed fleet. With replicas that come and go: 0 for a
        replica that just healed (it trained nothing on the model it holds), else 1 (merge "mean") or its inner
        steps not yet in a committed sync (merge "tokens")."""
        ft = self.fault_tolerance
        if ft is None:
            return 1.0
        if self.healed:
            return 0.0
        return float(self.unsent_steps) if ft.merge == "tokens" else 1.0

    def scale_mean(self, mean_deltas):
        """The averaged pseudo-gradient the outer step uses (EDiT clips it)."""
        return mean_deltas

    def _install(self, shards) -> None:
        """Master shards ← ``shards``; the replica's bit16 weights ← their all-gather (a host without flats,
        FSDP2, gathers its shards itself at the next forward)."""
        for i, (master, shard) in enumerate(zip(self.shards.masters, shards)):
            if master is not shard:
                master.copy_(shard)
            if self.shards.flats is not None:
                collectives.all_gather_part(self.shards.flats[i], master, *self.shards.gather_at(i, self.groups))

    # ------------------------------------------------------------ what users read
    @torch.no_grad()
    def committed_flats(self) -> Optional[List[torch.Tensor]]:
        """The anchor (the last global model) in the model dtype, gathered into the spare buffers (a host
        without flats gets the anchor shards themselves)."""
        if self.shards.flats is None:
            return self.anchor
        spare = self.shards.spare()
        for i, (buf, shard) in enumerate(zip(spare, self.anchor)):
            collectives.all_gather_part(buf, shard, *self.shards.gather_at(i, self.groups))
        return spare

    def period_words(self) -> Tuple[str, str]:
        """How periods end, in the start-up line's words and in the summary's."""
        return f"sync_every={self.schedule.sync_every}", f"a sync every {self.schedule.sync_every} inner steps"

    def banner(self) -> str:
        return words.banner(self)

    def stats(self) -> dict:
        """Syncs done, and how much of the outer communication the compute side waited for."""
        comm, wait = self.outer_comm_s, self.outer_wait_s
        return {**self.transport.stats(), "syncs": self.syncs, "sync_every": self.schedule.sync_every, "replicas": self.groups.replicas,
                "replica_group_size": self.groups.k, "outer_comm_s": comm, "outer_wait_s": wait,
                "outer_bytes": self.outer_bytes, "sync_time_s": self.local.sync_time_s,
                "outer_compression": None if self.compression is None else str(self.compression.codec),
                "outer_residual_bytes": 0 if self.compression is None else self.compression.nbytes(),
                "outer_hidden_fraction": max(0.0, 1.0 - wait / comm) if comm > 0 else None}

    def report(self) -> List[Tuple[str, str]]:
        return words.report(self)

    def progress(self) -> str:
        return words.progress(self)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The shard's outer state; a subclass adds what it keeps in flight (saved as received)."""
        self.settle()
        return {"schedule": self.schedule.state_dict(), "replicas": self.groups.replicas, "k": self.groups.k,
                "committed": self.transport.committed, "unsent_steps": self.unsent_steps,
                "anchor": [t.clone() for t in self.anchor], "momentum": [t.clone() for t in self.momentum],
                "residuals": None if self.compression is None else self.compression.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, sd: Optional[dict]) -> None:
        from ...config import checkpoint_mismatch
        if sd is None:
            raise ValueError("this checkpoint was saved without a local-SGD mode: its replicas have no anchor to "
                             "resume from. Load only the module weights (load_checkpoint(..., "
                             "load_optimizer_states=False, load_lr_scheduler_states=False))")
        self.check_kind(sd)
        if (sd["replicas"], sd["k"]) != (self.groups.replicas, self.groups.k):
            raise checkpoint_mismatch("replica layout (replicas, replica_group_size)", (sd["replicas"], sd["k"]),
                                      (self.groups.replicas, self.groups.k), replicas=True)
        self.settle()
        self.schedule.load_state_dict(sd["schedule"])
        if self.transport.committed is not None:
            self.transport.committed = sd.get("committed") or 0
        self.unsent_steps = sd.get("unsent_steps", 0)
        for mine, saved in ((self.anchor, sd["anchor"]), (self.momentum, sd["momentum"])):
            for dst, src in zip(mine, saved):
                dst.copy_(src)
        load_outer_residuals(self.compression, sd.get("residuals"))

    def reshard_state(self, first: list, mine: list, plan) -> dict:
        """The anchor and the outer momentum (the same in every replica) from old replica 0, re-partitioned;
        the period position from the mapped replica (the same everywhere but A-EDiT's step count)."""
        if first[0] is None:
            self.load_state_dict(None)  # raises: saved without a local-SGD mode
        self.check_kind(first[0])
        if any(s["residuals"] for s in first):
            plan.dropped.append("the outer all-reduce's error-feedback residuals (they restart at zero)")
        return {"schedule": mine[0]["schedule"], "replicas": self.groups.replicas, "k": self.groups.k,
                "anchor": plan.piece([s["anchor"] for s in first]),
                "momentum": plan.piece([s["momentum"] for s in first]), "residuals": {}}

    def check_kind(self, sd: dict) -> None:
        """Refuse the state of another kind of loop of the same mode (Streaming DiLoCo against DiLoCo)."""

    @torch.no_grad()
    def restart(self) -> None:
        """Anchor ← the current master shards; no momentum, nothing in flight, a new period."""
        self.settle()
        for dst, src in zip(self.anchor, self.shards.masters):
            dst.copy_(src)
        for buf in self.momentum:
            buf.zero_()
        if self.compression is not None:
            self.compression.load_state_dict(None)  # a new start: nothing left out of earlier sends
        self.schedule.restart()

    def close(self) -> None:
        self.transport.close()


__all__ = ["LocalSGD"]
