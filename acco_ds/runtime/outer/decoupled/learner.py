"""The learner side of ``"mode": "decoupled"``: a replica group that never waits for another.

Every rank of a learner holds its ZeRO-1 partition of the model (the fp32 master shards of every parameter
group, end to end, its own experts' among them). The syncer holds the global model cut into parts, one per shard
(``layout``: the partitions of a learner of as many ranks as the syncer has shards per model-parallel position),
so learners of any data-parallel size share it, and learners of any tensor-parallel and pipeline size that map onto
the unsplit model (``canonical``: the syncer's parts then cut that model); the syncer refuses a learner of another
model or expert-parallel size, or of another tensor-parallel or pipeline size that does not map (``layout_name``).
Rank j of the learner's ``k`` data-parallel ranks at model-parallel position m (a tensor-parallel slice or a
pipeline stage, ``groups.model_main``) holds the links to the shards of the parts ``i ≡ j (mod k)`` of position m (``connect``): a learner of the syncer's size, rank
``m k + j`` to shard ``m k + j``, its partition as it is; another moves its Δ into the syncer's parts, and θ_g
back, with one all-to-all inside the learner. A period (``sync_every`` inner steps, or ``sync_every_s``
seconds) ends with::

    every rank:  Δ = anchor − master, in the syncer's parts  → their shards (DELTA: fp32, or block-quantized with
                 error feedback)
    one shard:   READY to shard 0 right after the DELTA (the shard reads them in order)
    else:        each link waits for its shard's ACK, the ranks agree that every slice is held, rank 0 says READY
    every rank:  PARAMS from its shards: θ_g parts of the merge that took this Δ, version v
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

import time
from typing import List, Optional

import torch
import torch.distributed as tdist

from ..base import LocalSGD
from . import wire
from .connect import Connect
from .exchange import Exchange
from .layout import Parts
from .link import Heartbeat
from .own_shards import shard_address


def group_sizes(shards) -> List[int]:
    """The elements of each parameter group (its flat buffer up to the end of its last parameter)."""
    return [max((offset + p.numel() for p, offset in group), default=0) for group in shards.params]


class DecoupledLearner(Connect, Exchange, LocalSGD):
    """The outer loop of mode ``decoupled`` (see the module docstring). Args: as ``LocalSGD``."""

    schedule_mode = "diloco"

    def __init__(self, acco, shards, groups):
        super().__init__(acco, shards, groups)
        mp = self.mp = 1 if groups.model_main is None else tdist.get_world_size(group=groups.model_main)
        self.position = 0 if mp == 1 else tdist.get_rank(group=groups.model_main)
        self.slots = groups.k * mp  # the ranks of this learner; ``slot``: this rank's place in it
        self.slot = groups.shard + groups.k * self.position
        from ....algorithms.periods import PeriodSchedule
        ls = self.local
        self.timed = ls.sync_every_s is not None
        self.overlap = ls.adopt == "overlap"
        # adopt "overlap": a period ends once it is long enough and its previous merge is adopted (``time_up``)
        own = self.timed or self.overlap
        self.schedule = PeriodSchedule("edit" if own else "diloco", None if own else ls.sync_every)
        self.syncer_config = ls.syncer
        self.timeout_s = ls.syncer.timeout_s if ls.syncer is not None else 120.0
        self.max_bytes = int((ls.syncer.max_message_mb if ls.syncer is not None else 4096.0) * (1 << 20))
        if acco.compression.apply_to is None:  # "auto" judges groups that span nodes; a syncer may be anywhere
            self.compression = None
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
        self.mine = Parts(tuple(group_sizes(shards)), tuple(m.numel() for m in shards.masters), groups.k)
        self.where = shard_address(self)
        self.address = self.where(0)
        self.tokens_per_step = ls.tokens_per_step or 1
        self._name(groups, shards)  # ``layout``, said at HELLO; ``canon``: the unsplit model's specs, if it maps
        self.links, self.uplinks, self.relayout, self.part, self.one_shard = [], [], None, self.numel, self.slots == 1
        self.joined = False  # the links are open (``join``) and not closed yet
        self.heartbeat = None

    # ------------------------------------------------------------------ join
    @torch.no_grad()
    def join(self) -> None:
        """Connect to the shards; an empty syncer takes this learner's weights; take the current θ_g."""
        t0 = time.perf_counter()
        versions = self._connect()
        empty = self._learner_max(int(wire.NO_VERSION in versions))  # every rank moves its pieces, or none does
        slices = self.relayout.to_syncer(self._flat(self.shards.masters)) if empty else [None] * len(self.links)
        for link, version, piece in zip(self.links, versions, slices):
            if version == wire.NO_VERSION:
                link.send(link.mine("INIT", name="theta", tensor=piece))
            link.send(link.mine("GET"))
        self.joined = True
        if self.slot == 0 and self.heartbeat is None:
            self.heartbeat = Heartbeat(self.links[0])
            self.heartbeat.start()
        msgs = [link.recv("PARAMS", "theta", self.part) for link in self.links]
        msgs, self.version = self._get_agreed(msgs, time.monotonic() + self.timeout_s)
        theta = self._theta(msgs)
        self._unflat_into(theta, self.shards.masters)
        self._unflat_into(theta, self.anchor)
        self._install(self.shards.masters)
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
    def _adopt(self, version: int, msgs) -> None:
        """θ_g of ``version`` (``msgs``: its PARAMS, one per link): anchor ← θ_g; masters ← θ_g (overlap: θ_g +
        the progress since the send)."""
        f, theta = self.inflight, self._theta(msgs)
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
        self.staleness.append(max(0, version - 1 - f["base"]))
        self.version = version
        self.merges += 1
        self.adopted_after = self.steps_since_send
        for link, msg in zip(self.links, f["msgs"]):
            link.retained, link.adopted = msg, version  # a shard that lost this merge redoes it
            link.waiting_base = None
        self.inflight = None

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
        tokens = sync.steps * self.tokens_per_step
        fields = dict(learner=self.learner, incarnation=self.incarnation, version=self.adopted_after,
                      base=self.version, tokens=tokens, steps=sync.steps)
        msgs = [up.message(s, **fields) for up, s in zip(self.uplinks, self.relayout.to_syncer(delta))]
        self.inflight = {"msgs": msgs, "base": self.version, "steps": sync.steps, "tokens": tokens,
                         "adopted": self.adopted_after, "params": [None] * len(self.links), "broken": {},
                         "sent": self._flat(self.shards.masters) if self.overlap else None}
        self.steps_since_send = 0
        self.unsent_steps = 0
        self._post()
        if not self.overlap:
            self._await()
        self.period_start = time.monotonic()

    def settle(self) -> None:
        """Adopt the merge in flight (before a save, a load or a restart)."""
        if self.inflight is not None and self.joined:
            self._await()

    @property
    def syncs(self) -> int:
        """The version of θ_g this learner stands on (learners differ: each adopts the merges it took part in)."""
        return self.version

    def finalize(self) -> None:
        """Send the unfinished period (if any) and take its merge; the learner then stands on θ_g."""
        if not self.joined:
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
        return (f"decoupled learner {self.learner} of {self.slots} rank(s), syncer shard 0 at "
                f"{self.address[0]}:{self.address[1]} {self.period_words()[0]} min_quorum={ls.min_quorum} "
                f"grace_s={ls.grace_s} merge={ls.merge} staleness={ls.staleness} adopt={ls.adopt} "
                f"up-link={self.uplink_words}")

    @property
    def uplink_words(self) -> str:
        return "fp32" if self.compression is None else str(self.compression.codec)

    def stats(self) -> dict:
        s = super().stats()
        s.update({"decoupled": True, "learner": self.learner,
                  "sync_every": None if self.timed else self.local.sync_every, "version": self.version,
                  "merges": self.merges,
                  "staleness": list(self.staleness), "wire_s": self.wire_s, "max_wait_s": self.max_wait_s,
                  "phase_s": dict(self.phase_s), "longest_pause_phases_s": dict(self.longest),
                  "reconnects": sum(link.reconnects for link in self.links),
                  "outer_bytes": sum(link.bytes_sent for link in self.links),
                  "delta_bytes": sum(link.delta_bytes for link in self.links), "uplink": self.uplink_words,
                  "adopt": self.local.adopt, "syncer": f"{self.address[0]}:{self.address[1]}",
                  "syncer_shards": [link.shard for link in self.links]})
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
        for link in self.links:
            if link.sock is not None:
                link.done()
        self.joined = False
        super().close()


__all__ = ["DecoupledLearner"]
