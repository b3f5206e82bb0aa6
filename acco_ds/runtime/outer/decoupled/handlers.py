"""How a syncer shard of ``"mode": "decoupled"`` answers each kind of message (a mixin of ``syncer.Shard``, which
owns the socket, the state and the peers). Every check runs before the state changes: a message that breaks a rule
raises ``wire.WireError`` naming it, and the shard answers ERROR."""

import time

from ....config.decoupled import shape_refusal
from . import wire
from .identity import DATA
from .merges import EWMA

MAX_TOKENS_PER_STEP = 1 << 40  # tokens one inner step may claim (a bound on the merge's weights)


class Handlers:
    """``_handle(peer, msg)``: the protocol of docs/design/decoupled.md, one method per kind."""

    shape = None  # (layout, learner): the shape of the first learner that said HELLO (``learner.layout_name``)

    def _handle(self, peer: bytes, msg: wire.Message) -> None:
        kind = msg.kind
        if kind == "FOLLOW":
            return self._on_follow(peer, msg)
        if kind == "HELLO":
            return self._on_hello(peer, msg)
        info = self.peers.get(peer)
        if info is not None and not self._holds(peer, info, msg):
            info = None  # another connection holds the learner id now, or the token is wrong
            if kind != "PING":
                raise wire.WireError("learner", f"learner {msg.learner}: this connection does not hold the id (another "
                                                f"said HELLO under it since, or the token is not the one STATE gave)")
        if kind == "PING":
            return self._on_ping(peer, msg, info)
        if info is None:
            raise wire.WireError("kind", f"{kind} before HELLO")
        if (msg.learner, msg.incarnation) != (info["learner"], info["incarnation"]):
            raise wire.WireError("learner", f"learner {msg.learner} incarnation {msg.incarnation} on the connection of "
                                            f"learner {info['learner']} incarnation {info['incarnation']}")
        if info["role"] != DATA:
            raise wire.WireError("kind", f"{kind} on the heartbeat connection of learner {msg.learner}")
        handler = {"INIT": self._on_init, "GET": self._on_get, "DELTA": self._on_delta, "READY": self._on_ready,
                   "DONE": self._on_done}.get(kind)
        if handler is None:
            raise wire.WireError("kind", f"{kind} is not sent to a syncer shard")
        if kind != "INIT" and kind != "DONE" and self.state.empty:
            raise wire.WireError("kind", f"{kind} before the syncer has a model (INIT first)")
        self._touch(msg.learner, msg.incarnation)
        if kind in ("DELTA", "READY") and self.decided and self.state.version < msg.base <= max(self.decided):
            self.early[(peer, kind)] = msg  # from a version a decision being replayed makes: handled after it
            return
        handler(peer, msg)

    def _on_follow(self, peer: bytes, msg: wire.Message) -> None:
        """A follower shard (it proved the secret at the handshake): send it every decision above its version."""
        if self.index != 0:
            raise wire.WireError("kind", f"FOLLOW sent to shard {self.index}, only shard 0 leads")
        self.followers.add(peer)
        for rec in self.decisions(after=msg.version):
            members = [v for m in rec["members"] for v in m]
            self._send(peer, wire.Message("MERGE", version=rec["version"], name="learners",
                                          tensor=wire.int64s(members)))
        for learner, incarnation in self.dropped_orphans:  # dropped before this follower came: its slices go too
            self._send(peer, wire.Message("DROP", learner=learner, incarnation=incarnation))
        self._send(peer, wire.Message("PONG", version=self.state.version))  # caught up

    def _on_hello(self, peer: bytes, msg: wire.Message) -> None:
        tps = msg.tokens or 1
        if tps > MAX_TOKENS_PER_STEP:
            raise wire.WireError("tokens", f"{tps} tokens per inner step, at most {MAX_TOKENS_PER_STEP}")
        if msg.name and self.shape is not None and msg.name != self.shape[0]:
            raise wire.WireError("layout", shape_refusal(msg.learner, msg.name, *self.shape))
        if msg.name and self.shape is None:
            self.shape = (msg.name, msg.learner)  # the first learner's shape: every other must have it
        known = msg.learner in self.seen
        if not known and self.max_learners is not None and len(self.seen) >= self.max_learners:
            raise wire.WireError("learner", f"learner {msg.learner} would be learner {len(self.seen) + 1}, this "
                                            f"syncer admits {self.max_learners} (--max-learners)")
        token = self._admit(peer, msg)  # refused while another live connection holds the id
        self.peers[peer] = {"learner": msg.learner, "incarnation": msg.incarnation, "role": msg.steps}
        self.tokens_per_step[(msg.learner, msg.incarnation)] = tps
        self.seen.add(msg.learner)
        self.done.discard(msg.learner)
        if self.index == 0:
            old = self.live.get(msg.learner)
            if old is not None and old != msg.incarnation:  # relaunched: the old incarnation's Δ is void
                self._drop(msg.learner, old)
            self._touch(msg.learner, msg.incarnation)
        self._send(peer, wire.Message("STATE", version=self.state.version, tokens=int(self.liveness_s * 1000),
                                      steps=self.shards, base=self._needed(msg.learner, msg.incarnation),
                                      incarnation=token))

    def _needed(self, learner: int, incarnation: int) -> int:
        """The base version of ``learner``'s Δ that a logged decision names and this shard lacks (it restarted
        after the decision and before its checkpoint), else ``NO_VERSION``: the learner sends it again."""
        for version in sorted(self.decided):
            for l, s, b in self.decided[version]:
                p = self.pending.get(l)
                if (l, s) == (learner, incarnation) and not (p and (p["incarnation"], p["base"]) == (s, b)):
                    return b
        return wire.NO_VERSION

    def _on_ping(self, peer: bytes, msg: wire.Message, info) -> None:
        """PONG: this shard's version, and whether the Δ of base ``msg.base`` is HELD, MERGED or LOST here."""
        status, key = wire.LOST, (msg.learner, msg.incarnation, msg.base)
        if info is not None and (msg.learner, msg.incarnation) == (info["learner"], info["incarnation"]):
            self._touch(msg.learner, msg.incarnation)
            p = self.pending.get(msg.learner)
            if msg.base == wire.NO_VERSION or (p is not None and (p["incarnation"], p["base"]) ==
                                               (msg.incarnation, msg.base)):
                status = wire.HELD
            elif self.merged.get(msg.learner) == (msg.incarnation, msg.base):
                status = wire.MERGED
            elif any(m.kind == "DELTA" and (m.learner, m.incarnation, m.base) == key for m in self.early.values()):
                status = wire.HELD
        self._send(peer, wire.Message("PONG", learner=msg.learner, version=self.state.version, steps=status))

    def _on_init(self, peer: bytes, msg: wire.Message) -> None:
        self._check_slice(msg, "theta")
        if self.state.empty:
            self.state.adopt(msg.tensor)
            self.say(f"took the starting weights ({msg.tensor.numel()} elements) from learner {msg.learner}")
            self.checkpoint(None)

    def _on_get(self, peer: bytes, msg: wire.Message) -> None:
        self._send_theta(peer)

    def _check_slice(self, msg: wire.Message, name: str) -> None:
        numel = None if self.state.empty else self.state.x.numel()
        wire.expect(msg, msg.kind, name=name, numel=numel)

    def _on_delta(self, peer: bytes, msg: wire.Message) -> None:
        n = msg.extra.get("numel")
        if n is not None and n != self.state.x.numel():  # before a byte of fp32 is allocated for it
            raise wire.WireError("shape", f"a quantized delta of {n} values, this shard holds {self.state.x.numel()}")
        tps = self.tokens_per_step.get((msg.learner, msg.incarnation), 1)
        if msg.steps < 1 or msg.tokens > msg.steps * tps:
            raise wire.WireError("tokens", f"{msg.tokens} tokens in {msg.steps} inner steps, but learner "
                                           f"{msg.learner} declared {tps} tokens per inner step at HELLO")
        if msg.base > self.state.version:
            raise wire.WireError("base", f"version {msg.base} is ahead of this shard's {self.state.version} (a "
                                         f"syncer restarted from an older checkpoint): relaunch the learner")
        msg = wire.dequantize(msg)  # a block-quantized Δ is merged as the fp32 values it stands for
        self._check_slice(msg, "delta")
        self._check_finite(msg.tensor)
        if self.merged.get(msg.learner) == (msg.incarnation, msg.base):  # re-sent after a restart: merged already
            self._send(peer, wire.Message("ACK", learner=msg.learner, version=self.state.version, base=msg.base))
            self._send_theta(peer, learner=msg.learner, incarnation=msg.incarnation)
            self.resent += 1
            return
        self.pending[msg.learner] = {"incarnation": msg.incarnation, "base": msg.base, "tokens": msg.tokens,
                                     "steps": msg.steps, "adopted": msg.version, "delta": msg.tensor,
                                     "ready": None, "conn": peer}
        self._keep(msg.learner, self.pending[msg.learner])  # to the disk, on a thread (a replay may need it)
        self._send(peer, wire.Message("ACK", learner=msg.learner, version=self.state.version, base=msg.base))
        self._apply()  # a decision logged before a restart may wait for this slice

    def _on_ready(self, peer: bytes, msg: wire.Message) -> None:
        if self.index != 0:
            raise wire.WireError("kind", f"READY sent to shard {self.index}, only shard 0 leads")
        p = self.pending.get(msg.learner)
        if self.merged.get(msg.learner) == (msg.incarnation, msg.base) and (p is None or p["base"] != msg.base):
            return  # the READY of a re-sent Δ this shard had merged: its PARAMS went with the ACK
        if p is None or p["incarnation"] != msg.incarnation or p["base"] != msg.base:
            raise wire.WireError("base", f"READY of learner {msg.learner} from version {msg.base} without its Δ")
        now = time.monotonic()
        p["ready"] = now
        last = self.last_arrival.get(msg.learner)
        if last is not None:
            span = now - last
            self.period_ewma = span if self.period_ewma is None else (1 - EWMA) * self.period_ewma + EWMA * span
        self.last_arrival[msg.learner] = now

    def _on_done(self, peer: bytes, msg: wire.Message) -> None:
        self._saved()  # a learner that is done finds the checkpoint and the merge log of its last merge on disk
        self._send(peer, wire.Message("PONG", learner=msg.learner, version=self.state.version))  # heard
        self.done.add(msg.learner)
        self.peers.pop(peer, None)
        self._release(peer, msg.learner)
        if self.index == 0 and self.live.get(msg.learner) == msg.incarnation:
            del self.live[msg.learner]


__all__ = ["Handlers", "MAX_TOKENS_PER_STEP"]
