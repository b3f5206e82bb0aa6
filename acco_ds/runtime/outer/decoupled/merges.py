"""What shard 0 of the syncer decides, and what every shard does with a decision: the merge rule of
``"mode": "decoupled"`` (docs/design/decoupled.md), the merge itself, its logs and the checkpoint. A mixin of
``syncer.Shard``, which owns the socket and the state read here.

A decision (version, and the learners merged: learner, incarnation, base version) is appended to shard 0's
``decisions.jsonl`` and fsynced before anyone hears of it. Every shard, shard 0 included, keeps the decisions it
has not applied yet in ``decided`` and applies them in version order once it holds the named pseudo-gradient
slices: a shard that restarted gets them again from the learners (who re-send after a restart), and a follower
that restarted gets the decisions again from shard 0's log (FOLLOW names the version it stands on)."""

import json
import os
import threading
import time
from typing import Dict, List, Optional

import torch

from . import wire
from .held import HeldDeltas, append_line, durable_write

AUTO_FRACTION = 0.1  # grace_s "auto": this fraction of the learners' mean period
EWMA = 0.3  # weight of the newest period in that mean


class MergeRule(HeldDeltas):
    """Shard 0's decisions (``_maybe_merge``), every shard's merge (``_apply``) and checkpoints."""

    # ---------------------------------------------------------------- checkpoints
    def _path(self, name: str) -> str:
        return os.path.join(self.state_dir, name)

    def resume(self) -> None:
        self.decided: Dict[int, list] = {}  # version -> [(learner, incarnation, base)], not applied yet
        self.early: Dict[tuple, "wire.Message"] = {}  # (peer, kind) -> a DELTA or READY from a version to come
        self.writers: Dict[tuple, threading.Thread] = {}  # (learner, incarnation, base) -> the write of its Δ slice
        self.orphans, self.dropped_orphans = {}, []  # shard 0: held.py
        if self.state_dir is None:
            return
        os.makedirs(self.state_dir, exist_ok=True)
        path = self._path(f"shard{self.index}.pt")
        if os.path.exists(path):
            sd = torch.load(path, weights_only=True)  # only tensors, numbers and dicts of them
            self.state.load_state_dict(sd)
            self.merged = {int(l): (int(v[0]), int(v[1])) for l, v in sd.get("merged", {}).items()}
            self.say(f"resumed version {self.state.version} from {path}")
        if self.index == 0:
            for rec in self.decisions(after=self.state.version):
                self.decided[rec["version"]] = [tuple(m) for m in rec["members"]]
            if self.decided:
                self.say(f"decisions {sorted(self.decided)} are logged and not merged yet: taking their "
                         f"pseudo-gradients from {self.state_dir} or from the learners that send them again")
                self._apply()
            self._orphans()

    def decisions(self, after: int) -> List[dict]:
        """Shard 0's logged decisions of versions above ``after``."""
        if self.state_dir is None or not os.path.exists(self._path("decisions.jsonl")):
            return []
        out = []
        with open(self._path("decisions.jsonl")) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:  # a line torn by a crash is the last one, never announced
                    break
                if after == wire.NO_VERSION or rec["version"] > after:
                    out.append(rec)
        return out

    def checkpoint(self, record: Optional[dict], theta=None, members=()) -> None:
        """Save θ_g, momentum and version of this shard, and append the merge to the log, on a thread of its own
        (after the merged learners received θ_g: the save is not in their pause, nor in anyone's while it runs).
        At most one save is in flight, and the next merge waits for it (``_saved``): the learners then stand at most
        one merge ahead of the disk, and they keep that merge's Δ (a restart replays it)."""
        if self.state_dir is None:
            return
        self._saved()
        st = self.state
        merged = {str(l): [int(s), int(b)] for l, (s, b) in self.merged.items()}
        state = {"x": st.x.clone() if theta is None else theta, "m": st.m.clone(),
                 "buffer": None if st.buffer is None else st.buffer.clone(), "since": st.since,
                 "version": st.version, "merged": merged}
        self.saver = threading.Thread(target=self._save, args=(state, record, list(members)), daemon=True)
        self.saver.start()

    def _save(self, state: dict, record: Optional[dict], members) -> None:
        durable_write(self._path(f"shard{self.index}.pt"), lambda f: torch.save(state, f))
        if record is not None and self.index == 0:
            append_line(self._path("merges.jsonl"), record)
        for member in members:  # merged and saved: a restart no longer replays them
            self._forget(*member)

    def _saved(self) -> None:
        """Wait for the save in flight, if any."""
        saver = getattr(self, "saver", None)
        if saver is not None:
            saver.join()
            self.saver = None

    # ---------------------------------------------------------------- merges (shard 0 decides)
    def grace_s(self) -> float:
        if self.grace == "auto":
            return 0.0 if self.period_ewma is None else AUTO_FRACTION * self.period_ewma
        return float(self.grace)

    def _ready(self) -> List[int]:
        ready = [l for l, p in self.pending.items() if p["ready"] is not None and self.live.get(l) == p["incarnation"]]
        return sorted(ready, key=lambda l: (self.pending[l]["ready"], l))  # arrival order, then learner id

    def _merge_deadline(self) -> Optional[float]:
        if self.index != 0 or self.decided or len(self.seen) < (self.learners_expected or 0):
            return None  # replaying logged decisions first; or the fleet has not joined yet (--learners M)
        ready = self._ready()
        need = max(1, min(self.K, len(self.live)))
        if len(ready) < need:
            return None
        return self.pending[ready[need - 1]]["ready"] + self.grace_s()

    def _maybe_merge(self) -> None:
        deadline = self._merge_deadline()
        if deadline is None:
            return
        ready = self._ready()
        if not (set(self.live) <= set(ready) or time.monotonic() >= deadline):
            return
        members = [(l, self.pending[l]["incarnation"], self.pending[l]["base"]) for l in ready]
        version = self.state.version + 1
        if self.state_dir is not None:  # durable before anyone hears of it, with the Δ slices it names
            for member in members:
                self._kept(*member)
            append_line(self._path("decisions.jsonl"), {"version": version, "members": [list(m) for m in members]})
        self._announce(version, members)
        self._drill("decided", version)
        self.decided[version] = members
        self._apply()

    def _announce(self, version: int, members) -> None:
        payload = wire.int64s(v for triple in members for v in triple)
        for f in list(self.followers):
            self._send(f, wire.Message("MERGE", version=version, name="learners", tensor=payload))

    def _apply(self) -> None:
        """Merge the next decided version while this shard holds every slice it names; then take the messages
        that waited for those versions."""
        self._replay_decided()
        if not self.decided and self.early:
            early, self.early = self.early, {}
            for (peer, kind), msg in sorted(early.items(), key=lambda item: item[0][1]):  # DELTA before READY
                try:
                    self._handle(peer, msg)
                except wire.WireError as err:
                    self._refuse(peer, str(err))

    def _replay_decided(self) -> None:
        while self.decided:
            version = min(self.decided)
            if version <= self.state.version and self.state.version != wire.NO_VERSION:
                del self.decided[version]  # merged before a restart
                continue
            members = self.decided[version]
            for member in members:
                self._recall(*member)
            if version != self.state.version + 1 or not all(
                    (self.pending.get(l, {}).get("incarnation"), self.pending.get(l, {}).get("base")) == (s, b)
                    for l, s, b in members):
                return  # an earlier decision, or a slice, is still to come
            del self.decided[version]
            self._merge(members, version)

    def _merge(self, members, version: int) -> None:
        self._saved()  # the disk at most one merge behind what the learners adopt
        entries = [self.pending.pop(l) for l, _, _ in members]
        for (l, s, _), e in zip(members, entries):
            self.merged[l] = (s, e["base"])
        self._own_theta()
        self.state.step(self.state.mean([e["delta"] for e in entries], [e["tokens"] for e in entries]))
        now = time.monotonic()
        record = {"version": self.state.version, "time": time.time(), "grace_s": self.grace_s(),
                  "held_s": [None if e["ready"] is None else now - e["ready"] for e in entries],  # READY to merge
                  "learners": [l for l, _, _ in members],
                  "tokens": [e["tokens"] for e in entries],
                  "staleness": [version - 1 - e["base"] for e in entries],
                  "contributions": [{"learner": l, "base": e["base"], "steps": e["steps"], "tokens": e["tokens"],
                                     "adopted_after": e["adopted"]} for (l, _, _), e in zip(members, entries)]}
        self.log.append(record)
        for (l, s, _), e in zip(members, entries):
            if e["conn"] is not None:  # None: a Δ taken from the disk; its learner asks again if it lives
                self._send_theta(e["conn"], learner=l, incarnation=s)
        self._drill("sent", version)
        self.checkpoint(record, self.state.x, members)  # after the learners have θ_g, on a thread

    def _drill(self, point: str, version: int) -> None:
        """A fault drill: ``ACCO_SYNCER_CRASH="j:point:v"`` ends shard j at once (as SIGKILL would) at ``point``
        of merge v: "decided" (the decision logged and announced, nothing merged), "sent" (θ_g sent, not saved)."""
        if os.environ.get("ACCO_SYNCER_CRASH") == f"{self.index}:{point}:{version}":
            os._exit(137)

    # ---------------------------------------------------------------- from shard 0, and the end
    def _drop(self, learner: int, incarnation: int) -> None:
        p = self.pending.get(learner)
        if p is not None and p["incarnation"] == incarnation:
            del self.pending[learner]
            self._forget(learner, incarnation, p["base"])
        self._forget_all(learner, incarnation)
        for f in list(self.followers):
            self._send(f, wire.Message("DROP", learner=learner, incarnation=incarnation))

    def _from_leader(self, msg: wire.Message) -> None:
        if msg.kind == "DROP":
            p = self.pending.get(msg.learner)
            if p is not None and p["incarnation"] == msg.incarnation and not self._named(msg.learner):
                del self.pending[msg.learner]
                self._forget(msg.learner, msg.incarnation, p["base"])
            self._forget_all(msg.learner, msg.incarnation)
        elif msg.kind == "MERGE":
            t = wire.expect(msg, "MERGE").tensor
            if t is None or t.dtype != torch.int64 or t.numel() % 3:
                raise wire.WireError("learners", "a MERGE names (learner, incarnation, base) triples of int64")
            v = t.tolist()
            self.decided[msg.version] = [(int(v[i]), int(v[i + 1]), int(v[i + 2])) for i in range(0, len(v), 3)]
            self._apply()
        elif msg.kind == "PONG":
            if self.leader_boot not in (None, msg.boot):  # shard 0 restarted: follow it again from this version
                self.say("shard 0 restarted: following it again")
                self._follow()
            self.leader_boot = msg.boot
        elif msg.kind == "ERROR":
            self.say(f"shard 0 refused this shard: {msg.text}")
        else:
            raise wire.WireError("kind", f"{msg.kind} from shard 0")

    def _named(self, learner: int) -> bool:
        return any(l == learner for members in self.decided.values() for l, _, _ in members)

    def _maybe_exit(self) -> None:
        if self.index != 0:  # a follower stops with shard 0 (or once it has not heard from it for idle_exit_s)
            quiet = time.monotonic() - self.leader_seen
            if self.leader_done or (self.idle_exit_s is not None and quiet >= self.idle_exit_s):
                self.say(f"shard 0 {'is done' if self.leader_done else 'is silent'}, version {self.state.version}: "
                         f"stopping")
                self.stopped.set()
            return
        n = self.learners_expected
        if n is not None and len(self.done) >= n and not self.live:
            self.say(f"every learner is done ({len(self.done)}), version {self.state.version}: stopping")
            self._end()
        if self.idle_exit_s is None or self.live or not self.seen:
            self.empty_since = None
            return
        now = time.monotonic()
        self.empty_since = self.empty_since or now
        if now - self.empty_since >= self.idle_exit_s:
            self.say(f"no learner heard from for {self.idle_exit_s:g} s ({len(self.done)} done, "
                     f"{len(self.seen - self.done)} gone), version {self.state.version}: stopping")
            self._end()

    def _end(self) -> None:
        """The run is over: the followers stop with shard 0 (a shard 0 that crashes or is stopped tells no one)."""
        for f in list(self.followers):
            self._send(f, wire.Message("DONE"))
        self.stopped.set()


__all__ = ["MergeRule", "AUTO_FRACTION", "EWMA", "durable_write", "append_line"]
