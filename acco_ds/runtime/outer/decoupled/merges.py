"""What shard 0 of the syncer decides, and what every shard does with a decision: the merge rule of
``"mode": "decoupled"`` (docs/design/decoupled.md), the merge itself, its log and the checkpoint. A mixin of
``syncer.Shard``, which owns the connections and the state it reads here."""

import json
import os
import time
from typing import List, Optional

import torch

from . import wire

AUTO_FRACTION = 0.1  # grace_s "auto": this fraction of the learners' mean period
EWMA = 0.3  # weight of the newest period in that mean


class MergeRule:
    """Shard 0's decisions (``_maybe_merge``), every shard's merge (``_merge``) and checkpoints."""

    # ---------------------------------------------------------------- checkpoints
    def _path(self, name: str) -> str:
        return os.path.join(self.state_dir, name)

    def resume(self) -> None:
        if self.state_dir is None:
            return
        os.makedirs(self.state_dir, exist_ok=True)
        path = self._path(f"shard{self.index}.pt")
        if os.path.exists(path):
            sd = torch.load(path, weights_only=True)  # only tensors, numbers and dicts of them
            self.state.load_state_dict(sd)
            self.merged = {int(l): (int(v[0]), int(v[1])) for l, v in sd.get("merged", {}).items()}
            self.say(f"resumed version {self.state.version} from {path}")

    def checkpoint(self, record: Optional[dict]) -> None:
        if self.state_dir is None:
            return
        path = self._path(f"shard{self.index}.pt")
        merged = {str(l): [int(s), int(b)] for l, (s, b) in self.merged.items()}
        torch.save({**self.state.state_dict(), "merged": merged}, path + ".tmp")
        os.replace(path + ".tmp", path)
        if record is not None and self.index == 0:
            with open(self._path("merges.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    # ---------------------------------------------------------------- threads

    # ---------------------------------------------------------------- merges (shard 0 decides)
    def grace_s(self) -> float:
        if self.grace == "auto":
            return 0.0 if self.period_ewma is None else AUTO_FRACTION * self.period_ewma
        return float(self.grace)

    def _ready(self) -> List[int]:
        ready = [l for l, p in self.pending.items() if p["ready"] is not None and self.live.get(l) == p["incarnation"]]
        return sorted(ready, key=lambda l: (self.pending[l]["ready"], l))  # arrival order, then learner id

    def _merge_deadline(self) -> Optional[float]:
        if self.index != 0:
            return None
        ready = self._ready()
        need = max(1, min(self.K, len(self.live)))
        if len(ready) < need:
            return None
        return self.pending[ready[need - 1]]["ready"] + self.grace_s()

    def _maybe_merge(self) -> None:
        if self.index != 0:
            return
        ready = self._ready()
        deadline = self._merge_deadline()
        if deadline is None:
            return
        if not (set(self.live) <= set(ready) or time.monotonic() >= deadline):
            return
        members = [(l, self.pending[l]["incarnation"]) for l in ready]
        version = self.state.version + 1
        payload = wire.int64s(v for pair in members for v in pair)
        for f in list(self.followers):
            try:
                self._send(f, wire.Message("MERGE", version=version, name="learners", tensor=payload))
            except OSError:
                self.followers.remove(f)
        self._merge(members, version)

    def _merge(self, members, version: int) -> None:
        missing = [l for l, s in members if self.pending.get(l, {}).get("incarnation") != s]
        if missing:
            raise RuntimeError(f"syncer shard {self.index}: merge {version} names learners {missing} whose "
                               f"pseudo-gradient slice this shard does not hold")
        entries = [self.pending.pop(l) for l, _ in members]
        for (l, s), e in zip(members, entries):
            self.merged[l] = (s, e["base"])
        self.state.step(self.state.mean([e["delta"] for e in entries], [e["tokens"] for e in entries]))
        now = time.monotonic()
        record = {"version": self.state.version, "time": time.time(), "grace_s": self.grace_s(),
                  "held_s": [None if e["ready"] is None else now - e["ready"] for e in entries],  # READY to merge
                  "learners": [l for l, _ in members],
                  "tokens": [e["tokens"] for e in entries],
                  "staleness": [version - 1 - e["base"] for e in entries],
                  "contributions": [{"learner": l, "base": e["base"], "steps": e["steps"], "tokens": e["tokens"],
                                     "adopted_after": e["adopted"]} for (l, _), e in zip(members, entries)]}
        self.log.append(record)
        self.checkpoint(record)
        for (l, s), e in zip(members, entries):
            conn = e["conn"]
            if self.conns.get(conn, {}).get("incarnation") != s:
                continue  # gone since: nothing to send
            try:
                self._send(conn, wire.Message("PARAMS", learner=l, incarnation=s, version=self.state.version,
                                              name="theta", tensor=self.state.x))
            except OSError:
                pass

    # ---------------------------------------------------------------- from shard 0, and the end
    def _drop(self, learner: int, incarnation: int) -> None:
        p = self.pending.get(learner)
        if p is not None and p["incarnation"] == incarnation:
            del self.pending[learner]
        for f in self.followers:
            try:
                self._send(f, wire.Message("DROP", learner=learner, incarnation=incarnation))
            except OSError:
                pass

    def _from_leader(self, msg: wire.Message) -> None:
        if msg.kind == "DROP":
            p = self.pending.get(msg.learner)
            if p is not None and p["incarnation"] == msg.incarnation:
                del self.pending[msg.learner]
        elif msg.kind == "MERGE":
            pairs = wire.expect(msg, "MERGE").tensor.tolist()
            members = [(int(pairs[i]), int(pairs[i + 1])) for i in range(0, len(pairs), 2)]
            if msg.version != self.state.version + 1:
                raise wire.WireError("version", f"merge {msg.version} after this shard's {self.state.version}")
            self._merge(members, msg.version)
        else:
            raise wire.WireError("kind", f"{msg.kind} from shard 0")

    def _maybe_exit(self) -> None:
        n = self.learners_expected
        if n is not None and len(self.done) >= n and not self.conns:
            self.say(f"every learner is done ({len(self.done)}), version {self.state.version}: stopping")
            self.stopped.set()
        if self.idle_exit_s is None or self.conns or not self.seen:
            self.empty_since = None
            return
        now = time.monotonic()
        self.empty_since = self.empty_since or now
        if now - self.empty_since >= self.idle_exit_s:
            self.say(f"no learner connected for {self.idle_exit_s:g} s ({len(self.done)} done, "
                     f"{len(self.seen - self.done)} gone), version {self.state.version}: stopping")
            self.stopped.set()


__all__ = ["MergeRule", "AUTO_FRACTION", "EWMA"]
