"""The learner side of ``"mode": "decoupled"``: a replica group that never waits for another.

Every rank of a learner holds its ZeRO-1 partition of the model (the fp32 master shards of every parameter
group, end to end, its own experts' among them: its *slice*) and talks to one syncer shard only (``link.Link``):
rank j of the learner's ``k`` data-parallel ranks at model-parallel position m (a tensor-parallel slice or a
pipeline stage, ``groups.model_main``) is the learner's rank ``m k + j`` and talks to shard ``m k + j``. Learners
of one shape (the same ``k``, tensor, pipeline and expert-parallel sizes) hold the same slice at the same rank; the
syncer refuses a learner of another shape (``layout_name``). A period (``sync_every`` inner
steps, or ``sync_every_s`` seconds) ends with::

    every rank:  Δ_j = anchor_j − master_j  → shard j (DELTA: fp32, or block-quantized with error feedback)
    one rank:    READY to shard 0 right after its DELTA (the shard reads them in order)
    k ranks:     each waits for its shard's ACK, the ranks agree that every slice is held, rank 0 says READY
    every rank:  PARAMS from shard j: θ_g slice of the merge that took this Δ, version v
                 masters ← θ_g (adopt "overlap": θ_g + the progress made since the send); anchor ← θ_g;
                 bit16 weights ← their all-gather inside the replica

With adopt ``wait`` a rank waits for PARAMS before its next inner step; with ``overlap`` it trains on and looks for
PARAMS after every inner step (the ranks of a learner agree, with one small all-reduce, to adopt at the same step),
and its next period ends once it is long enough and that merge is adopted: it never waits. A rank that loses its
shard (a restart) connects again and every rank re-sends its Δ slice (a shard answers a Δ it merged before the
restart with θ_g); the ranks adopt only once every one holds PARAMS of one version. ``join`` connects (an empty
syncer takes this learner's weights as θ_g version 0) and takes the current θ_g. The launch starts its own shards
(``own_shards``) unless ``local_sgd.syncer.address`` names a syncer started with ``acco-ds syncer``.
"""

import os
import random
import time
from typing import List, Optional

import torch
import torch.distributed as tdist

from ....config.decoupled import layout_name
from ..base import LocalSGD
from . import wire
from .exchange import Exchange
from .link import Heartbeat, Link, Uplink
from .own_shards import shard_address


class DecoupledLearner(Exchange, LocalSGD):
    """The outer loop of mode ``decoupled`` (see the module docstring). Args: as ``LocalSGD``."""

    schedule_mode = "diloco"

    def __init__(self, acco, shards, groups):
        super().__init__(acco, shards, groups)
        mp = 1 if groups.model_main is None else tdist.get_world_size(group=groups.model_main)
        self.slots = groups.k * mp  # the ranks of this learner; ``slot``: this rank's, its syncer shard
        self.slot = groups.shard + groups.k * (0 if mp == 1 else tdist.get_rank(group=groups.model_main))
        from ....algorithms.periods import PeriodSchedule
        ls = self.local
        self.timed = ls.sync_every_s is not None
        self.overlap = ls.adopt == "overlap"
        # adopt "overlap": a period ends once it is long enough and its previous merge is adopted (``time_up``)
        own = self.timed or self.overlap
        self.schedule = PeriodSchedule("edit" if own else "diloco", None if own else ls.sync_every)
        self.syncer_config = ls.syncer
        self.timeout_s = ls.syncer.timeout_s if ls.syncer is not None else 120.0
        max_bytes = int((ls.syncer.max_message_mb if ls.syncer is not None else 4096.0) * (1 << 20))
        if acco.compression.apply_to is None:  # "auto" judges groups that span nodes; a syncer may be anywhere
            self.compression = None
        self.uplink = Uplink(self.compression)
        self.learner = self._learner_id()
        self.incarnation = self._incarnation()
        self.version = 0
        self.merges = 0  # merges this learner took part in
        self.staleness: List[int] = []  # versions between this learner's base and each of its merges
        self.inflight: Optional[dict] = None  # the Δ sent and not adopted yet
        self.steps_since_send = 0
        self.adopted_after = 0  # inner steps of this period taken before its base was adopted (overlap)
        self.procs: list = []  # the shards this rank started (own_shards)
        self.period_start = time.monotonic()
        self.wire_s = 0.0  # seconds in the exchange with the syncer (send, merge wait, receive, adopt)
        self.max_wait_s = 0.0  # the longest pause between two inner steps for the exchange
        self.phase_s = {"send": 0.0, "wait": 0.0, "adopt": 0.0}  # where the exchange's time goes (wait: with resends)
        self.longest: dict = {}  # those phases within the longest pause
        self.numel = sum(m.numel() for m in shards.masters)
        self.address = shard_address(self)
        self.tokens_per_step = ls.tokens_per_step or 1
        self.link = Link(self.address, self.learner, self.incarnation, self.slot, self.timeout_s, max_bytes,
                         self.keys, self.tokens_per_step, layout_name(groups, mp, shards, self.numel))
        self.heartbeat = None

    # ------------------------------------------------------------------ layout
    def _learner_id(self) -> int:
        if self.syncer_config is not None and self.syncer_config.address:
            for name in ("ACCO_LEARNER_ID", "REPLICA_GROUP_ID"):
                if os.environ.get(name):
                    return int(os.environ[name])
        return self.groups.replica

    def _incarnation(self) -> int:
        """A random number per learner process, the same on every rank of the learner (rank 0 draws it)."""
        value = random.SystemRandom().getrandbits(62)
        if self.slots > 1:  # summed over the replica group, then over the model-parallel group
            t = torch.tensor([value if self.slot == 0 else 0], dtype=torch.int64, device=self.shards.device)
            for group in (self.groups.replica_main if self.groups.k > 1 else None, self.groups.model_main):
                if group is not None:
                    tdist.all_reduce(t, group=group)
            value = int(t.item())
        return value

    # ------------------------------------------------------------------ helpers
    def _flat(self, tensors) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])

    def _unflat_into(self, flat: torch.Tensor, targets) -> None:
        offset = 0
        for t in targets:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t).to(t.dtype))
            offset += n

    # ------------------------------------------------------------------ join
    @torch.no_grad()
    def join(self) -> None:
        """Connect to shard j; an empty syncer takes this learner's weights; take the current θ_g."""
        t0 = time.perf_counter()
        if self.link.open(self.timeout_s) == wire.NO_VERSION:
            self.link.send(self.link.mine("INIT", name="theta", tensor=self._flat(self.shards.masters)))
        self.link.send(self.link.mine("GET"))
        if self.slot == 0 and self.heartbeat is None:
            self.heartbeat = Heartbeat(self.link)
            self.heartbeat.start()
        msg = self._get_agreed(self.link.recv("PARAMS", "theta", self.numel), time.monotonic() + self.timeout_s)
        self._unflat_into(msg.tensor, self.shards.masters)
        self._unflat_into(msg.tensor, self.anchor)
        self._install(self.shards.masters)
        self.version = msg.version
        self.adopted_after = self.steps_since_send = 0
        self.period_start = time.monotonic()
        self.wire_s += time.perf_counter() - t0

    def time_up(self) -> bool:
        """Does the period end here? (The schedule asks when periods are timed, or with adopt "overlap".)"""
        if self.overlap and self.inflight is not None:
            return False  # never a wait: the period goes on until the previous merge is adopted
        if not self.timed:
            return self.steps_since_send >= self.local.sync_every
        elapsed = self.groups.reduce(time.monotonic() - self.period_start, self.shards.device,
                                     op=tdist.ReduceOp.MAX)
        return elapsed >= self.local.sync_every_s

    @torch.no_grad()
    def _adopt(self, msg: wire.Message) -> None:
        """θ_g of ``msg.version``: anchor ← θ_g; masters ← θ_g (overlap: θ_g + the progress since the send)."""
        f, theta = self.inflight, msg.tensor
        keep = self.overlap and self.steps_since_send
        offset = 0
        for master, anchor in zip(self.shards.masters, self.anchor):  # in place, tensor by tensor
            n = master.numel()
            piece = theta[offset:offset + n].view_as(master).to(master.device)
            anchor.copy_(piece)
            if keep:  # (θ − sent) + θ_g, elementwise as the simulator's θ_g + (θ − sent)
                master.sub_(f["sent"][offset:offset + n].view_as(master).to(master.device)).add_(piece)
            else:
                master.copy_(piece)
            offset += n
        self._install(self.shards.masters)
        self.staleness.append(max(0, msg.version - 1 - f["base"]))
        self.version = msg.version
        self.merges += 1
        self.adopted_after = self.steps_since_send
        self.link.retained, self.link.adopted = f["msg"], msg.version  # a shard that lost this merge redoes it
        self.inflight = None
        self.link.waiting_base = None

    def _install(self, shards) -> None:
        """As ``LocalSGD``'s; a learner of one rank copies its masters into the bit16 flats without a
        collective (a gloo call on a group of one still hands off to gloo's thread and back: on a busy CPU
        that costs scheduler latency, inside the learner's pause)."""
        if self.groups.k > 1 or self.shards.flats is None or self.shards.has_experts:
            return super()._install(shards)
        for master, shard, flat in zip(self.shards.masters, shards, self.shards.flats):
            if master is not shard:
                master.copy_(shard)
            flat.narrow(0, 0, master.numel()).copy_(master)

    # ------------------------------------------------------------------ hooks
    def after_inner_step(self) -> None:
        t0, c0, before = time.perf_counter(), time.process_time(), dict(self.phase_s)
        self.steps_since_send += 1
        if self.overlap and self.inflight is not None:
            self._poll()
        super().after_inner_step()
        seconds = time.perf_counter() - t0
        if seconds > self.max_wait_s:
            self.max_wait_s = seconds
            self.longest = {k: v - before[k] for k, v in self.phase_s.items()}
            self.longest["cpu"] = time.process_time() - c0  # the rest of the pause: this process was not running
        self.wire_s += seconds
        self.outer_comm_s += seconds
        self.outer_wait_s += seconds

    @torch.no_grad()
    def _sync(self, sync) -> None:
        """Send this period's Δ (after adopting the previous merge, if it is still in flight); adopt "wait":
        wait for the merge that holds it and adopt it."""
        if self.inflight is not None:
            self._await()
        delta = torch.cat([(a - m).reshape(-1).float() for a, m in zip(self.anchor, self.shards.masters)])
        fields = dict(learner=self.learner, incarnation=self.incarnation, version=self.adopted_after,
                      base=self.version, tokens=sync.steps * self.tokens_per_step, steps=sync.steps)
        self.inflight = {"msg": self.uplink.message(delta, **fields), "base": self.version, "steps": sync.steps,
                         "sent": self._flat(self.shards.masters) if self.overlap else None, "params": None}
        self.steps_since_send = 0
        self.unsent_steps = 0
        self._post()
        if not self.overlap:
            self._await()
        self.period_start = time.monotonic()

    def settle(self) -> None:
        """Adopt the merge in flight (before a save, a load or a restart)."""
        if self.inflight is not None and self.link.sock is not None:
            self._await()

    @property
    def syncs(self) -> int:
        """The version of θ_g this learner stands on (learners differ: each adopts the merges it took part in)."""
        return self.version

    def finalize(self) -> None:
        """Send the unfinished period (if any) and take its merge; the learner then stands on θ_g."""
        if self.link.sock is None:
            return
        t0 = time.perf_counter()
        sync = self.schedule.final_sync()
        if sync is not None:
            self._sync(sync)
        self.settle()
        self.wire_s += time.perf_counter() - t0

    def period_words(self):
        ls = self.local
        more = " or more, once the last merge is adopted" if self.overlap else ""
        if self.timed:
            return f"sync_every_s={ls.sync_every_s:g}", f"a merge request every {ls.sync_every_s:g} s{more}"
        if self.overlap:
            return f"sync_every={ls.sync_every}", f"a merge request every {ls.sync_every} inner steps{more}"
        return super().period_words()

    def banner(self) -> str:
        ls = self.local
        return (f"decoupled learner {self.learner} of {self.slots} rank(s), syncer shard "
                f"{self.address[0]}:{self.address[1]} {self.period_words()[0]} min_quorum={ls.min_quorum} "
                f"grace_s={ls.grace_s} merge={ls.merge} staleness={ls.staleness} adopt={ls.adopt} "
                f"up-link={self.uplink}")

    def stats(self) -> dict:
        s = super().stats()
        s.update({"decoupled": True, "learner": self.learner,
                  "sync_every": None if self.timed else self.local.sync_every, "version": self.version,
                  "merges": self.merges,
                  "staleness": list(self.staleness), "wire_s": self.wire_s, "max_wait_s": self.max_wait_s,
                  "phase_s": dict(self.phase_s), "longest_pause_phases_s": dict(self.longest),
                  "reconnects": self.link.reconnects, "outer_bytes": self.link.bytes_sent,
                  "delta_bytes": self.link.delta_bytes, "uplink": str(self.uplink), "adopt": self.local.adopt,
                  "syncer": f"{self.address[0]}:{self.address[1]}"})
        return s

    def report(self):
        s = self.stats()
        return [("decoupled", f"learner {s['learner']}: {s['merges']} merges, now on θ_g version {s['version']}, "
                              f"{s['wire_s']:.2f} s sending and waiting for its merges (longest pause "
                              f"{s['max_wait_s']:.3f} s), staleness {max(s['staleness'], default=0)} at most")]

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["decoupled"] = {"version": self.version, "merges": self.merges}
        return sd

    def load_state_dict(self, sd) -> None:
        super().load_state_dict(sd)
        if sd is not None and "decoupled" in sd:
            self.version = int(sd["decoupled"]["version"])

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.link.sock is not None:
            self.link.done()
        super().close()


__all__ = ["DecoupledLearner"]
