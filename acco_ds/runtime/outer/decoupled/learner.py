"""The learner side of ``"mode": "decoupled"``: a replica group that never waits for another.

Every rank of a learner holds its ZeRO-1 partition j of the model (the fp32 master shards of every parameter
group, end to end: its *slice*) and talks to syncer shard j only. A period (``sync_every`` inner steps, or
``sync_every_s`` seconds) ends with::

    every rank:  Δ_j = anchor_j − master_j  → shard j (DELTA, with the base version, the period's tokens)
                 wait for the shard's ACK (the slice is held)
    the replica: one barrier (every rank's slice is held), then rank 0 says READY to shard 0
    every rank:  wait for PARAMS from shard j: θ_g slice of the merge that took this Δ, version v
                 masters ← θ_g; anchor ← θ_g; bit16 weights ← their all-gather inside the replica

So the only wait is for the learner's own merge; other learners are never waited for. ``join`` connects (an
empty syncer takes this learner's weights as θ_g version 0) and takes the current θ_g, retrying until every
rank holds the same version. The launch starts its own shards (``own_shards``) unless
``local_sgd.syncer.address`` names a syncer started with ``acco-ds syncer``.
"""

import os
import random
import time
from typing import List, Optional

import torch
import torch.distributed as tdist

from ....config.decoupled import check_decoupled_layout
from ..base import LocalSGD
from . import wire
from .own_shards import shard_address

class DecoupledLearner(LocalSGD):
    """The outer loop of mode ``decoupled`` (see the module docstring). Args: as ``LocalSGD``."""

    schedule_mode = "diloco"

    def __init__(self, acco, shards, groups):
        check_decoupled_layout(groups)
        super().__init__(acco, shards, groups)
        from ....algorithms.periods import PeriodSchedule
        ls = self.local
        self.timed = ls.sync_every_s is not None
        self.schedule = PeriodSchedule("edit" if self.timed else "diloco", None if self.timed else ls.sync_every)
        self.syncer_config = ls.syncer
        self.timeout_s = ls.syncer.timeout_s if ls.syncer is not None else 120.0
        self.max_bytes = int((ls.syncer.max_message_mb if ls.syncer is not None else 4096.0) * (1 << 20))
        self.learner = self._learner_id()
        self.incarnation = self._incarnation()
        self.version = 0
        self.merges = 0  # merges this learner took part in
        self.staleness: List[int] = []  # versions between this learner's base and each of its merges
        self.sock = None
        self.procs: list = []  # the shards this rank started (own_shards)
        self.period_start = time.monotonic()
        self.wire_s = 0.0  # seconds in the exchange with the syncer (send, merge wait, receive)
        self.reconnects = 0
        self.max_wait_s = 0.0  # the longest exchange of one period (send, merge wait, receive)
        self.bytes_sent = 0
        self.numel = sum(m.numel() for m in shards.masters)
        self.address = shard_address(self)

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
        if self.groups.k > 1:
            t = torch.tensor([value if self.groups.shard == 0 else 0], dtype=torch.int64, device=self.shards.device)
            tdist.all_reduce(t, group=self.groups.replica_main)
            value = int(t.item())
        return value

    # ------------------------------------------------------------------ the wire
    def _flat(self, tensors) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])

    def _unflat_into(self, flat: torch.Tensor, targets) -> None:
        offset = 0
        for t in targets:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t).to(t.dtype))
            offset += n

    def _send(self, msg: wire.Message) -> None:
        self.bytes_sent += wire.send(self.sock, msg)

    def _recv(self, kind: str, name: Optional[str] = None) -> wire.Message:
        self.sock.settimeout(self.timeout_s)
        try:
            msg = wire.recv(self.sock, self.max_bytes)
        except TimeoutError as err:
            raise TimeoutError(f"acco decoupled: learner {self.learner} rank {self.groups.shard} waited "
                               f"{self.timeout_s:g} s (local_sgd.syncer.timeout_s) for {kind} from syncer shard "
                               f"{self.groups.shard} at {self.address[0]}:{self.address[1]}") from err
        except wire.Closed as err:
            raise ConnectionError(f"acco decoupled: syncer shard {self.groups.shard} at {self.address[0]}:"
                                  f"{self.address[1]} closed the connection while learner {self.learner} waited for "
                                  f"{kind}") from err
        finally:
            self.sock.settimeout(None)
        return wire.expect(msg, kind, name, self.numel if name else None)

    def _mine(self, kind: str, **fields) -> wire.Message:
        return wire.Message(kind, learner=self.learner, incarnation=self.incarnation, **fields)

    def _barrier(self) -> None:
        if self.groups.k > 1:
            self.groups.reduce(0.0, self.shards.device)

    def _agree(self, version: int) -> bool:
        """Do every rank of this learner hold ``version``?"""
        if self.groups.k == 1:
            return True
        lo = self.groups.reduce(float(version), self.shards.device, op=tdist.ReduceOp.MIN)
        hi = self.groups.reduce(float(version), self.shards.device, op=tdist.ReduceOp.MAX)
        return lo == hi

    @torch.no_grad()
    def _take(self, msg: wire.Message) -> None:
        """θ_g of ``msg.version``: masters, anchor and the replica's weights."""
        theta = msg.tensor
        self._unflat_into(theta, self.shards.masters)
        self._unflat_into(theta, self.anchor)
        self._install(self.shards.masters)
        self.version = msg.version

    # ------------------------------------------------------------------ hooks
    @torch.no_grad()
    def join(self) -> None:
        """Connect to shard j; an empty syncer takes this learner's weights; take the current θ_g."""
        t0 = time.perf_counter()
        self.sock = wire.connect(self.address, self.timeout_s, f"syncer shard {self.groups.shard}")
        self._send(self._mine("HELLO"))
        state = self._recv("STATE")
        if state.version == wire.NO_VERSION:
            self._send(self._mine("INIT", name="theta", tensor=self._flat(self.shards.masters)))
        while True:
            self._send(self._mine("GET"))
            msg = self._recv("PARAMS", "theta")
            if self._agree(msg.version):
                break
        self._take(msg)
        self.period_start = time.monotonic()
        self.wire_s += time.perf_counter() - t0

    def time_up(self) -> bool:
        if not self.timed:
            return False
        elapsed = self.groups.reduce(time.monotonic() - self.period_start, self.shards.device, op=tdist.ReduceOp.MAX)
        return elapsed >= self.local.sync_every_s

    def _exchange(self, delta: torch.Tensor, base: int, steps: int) -> wire.Message:
        """Δ to shard j, its ACK, the learner's barrier, READY (rank 0), then θ_g of the merge."""
        self._send(self._mine("DELTA", base=base, tokens=steps, steps=steps, name="delta", tensor=delta))
        self._recv("ACK")
        self._barrier()  # every rank's slice is held by its shard
        if self.groups.shard == 0:
            self._send(self._mine("READY", base=base, tokens=steps, steps=steps))
        return self._recv("PARAMS", "theta")

    def _reconnect(self, deadline: float, err: Exception) -> None:
        """The syncer went away (a restart): connect again (same incarnation) until ``deadline``."""
        try:
            self.sock.close()
        except OSError:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or self.groups.k > 1:
            why = ("within local_sgd.syncer.timeout_s" if self.groups.k == 1 else
                   "(a learner of several ranks does not re-send: relaunch it)")
            raise ConnectionError(f"acco decoupled: learner {self.learner} lost syncer shard {self.groups.shard} at "
                                  f"{self.address[0]}:{self.address[1]} and could not finish its merge {why}: "
                                  f"{err}") from err
        self.reconnects += 1
        self.sock = wire.connect(self.address, left, f"syncer shard {self.groups.shard}")
        self._send(self._mine("HELLO"))
        if self._recv("STATE").version == wire.NO_VERSION:
            raise ConnectionError(f"acco decoupled: syncer shard {self.groups.shard} at {self.address[0]}:"
                                  f"{self.address[1]} came back without a model (no state_dir, or another one): "
                                  f"restart it on the folder it checkpointed to")

    @torch.no_grad()
    def _sync(self, sync) -> None:
        """Send this period's Δ, wait for the merge that holds it, take its θ_g. A learner of one rank whose
        syncer restarts re-sends its Δ (the syncer recognises one it already merged) until
        ``syncer.timeout_s``."""
        t0 = time.perf_counter()
        steps = sync.steps
        delta = self._flat([x - m for x, m in zip(self.anchor, self.shards.masters)])
        base = self.version
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                msg = self._exchange(delta, base, steps)
                break
            except (ConnectionError, OSError) as err:
                self._reconnect(deadline, err)
        while not self._agree(msg.version):  # a re-sent Δ is answered with the current θ_g: take one version
            self._send(self._mine("GET"))
            msg = self._recv("PARAMS", "theta")
        self.staleness.append(max(0, msg.version - 1 - base))
        self._take(msg)
        self.merges += 1
        self.unsent_steps = 0
        seconds = time.perf_counter() - t0
        self.wire_s += seconds
        self.max_wait_s = max(self.max_wait_s, seconds)
        self.outer_comm_s += seconds
        self.outer_wait_s += seconds
        self.period_start = time.monotonic()

    @property
    def syncs(self) -> int:
        """The version of θ_g this learner stands on (learners differ: each adopts the merges it took part in)."""
        return self.version

    def finalize(self) -> None:
        """Send the unfinished period (if any) and take its merge; the learner then stands on θ_g."""
        sync = self.schedule.final_sync()
        if sync is not None and self.sock is not None:
            self._sync(sync)

    def period_words(self):
        ls = self.local
        if self.timed:
            return f"sync_every_s={ls.sync_every_s:g}", f"a merge request every {ls.sync_every_s:g} s"
        return super().period_words()

    def banner(self) -> str:
        ls = self.local
        return (f"decoupled learner {self.learner} of {self.groups.k} rank(s), syncer shard "
                f"{self.address[0]}:{self.address[1]} {self.period_words()[0]} min_quorum={ls.min_quorum} "
                f"grace_s={ls.grace_s} merge={ls.merge} staleness={ls.staleness}")

    def stats(self) -> dict:
        s = super().stats()
        s.update({"decoupled": True, "learner": self.learner, "version": self.version, "merges": self.merges,
                  "staleness": list(self.staleness), "wire_s": self.wire_s, "max_wait_s": self.max_wait_s,
                  "reconnects": self.reconnects, "outer_bytes": self.bytes_sent,
                  "syncer": f"{self.address[0]}:{self.address[1]}"})
        return s

    def report(self):
        s = self.stats()
        return [("decoupled", f"learner {s['learner']}: {s['merges']} merges, now on θ_g version {s['version']}, "
                              f"{s['wire_s']:.2f} s sending and waiting for its merges, staleness "
                              f"{max(s['staleness'], default=0)} at most")]

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["decoupled"] = {"version": self.version, "merges": self.merges}
        return sd

    def load_state_dict(self, sd) -> None:
        super().load_state_dict(sd)
        if sd is not None and "decoupled" in sd:
            self.version = int(sd["decoupled"]["version"])

    def close(self) -> None:
        if self.sock is not None:
            try:
                self._send(self._mine("DONE"))
            except OSError:
                pass
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None
        super().close()


__all__ = ["DecoupledLearner"]
