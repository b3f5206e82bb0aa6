"""Who holds a learner id on a syncer shard of ``"mode": "decoupled"`` (a mixin of ``syncer.Shard``).

Every peer that passes the handshake holds the one shared secret, so the secret alone cannot tell learners apart.
A learner id is therefore bound to the connection that first said HELLO under it: the shard draws a random token
for that connection, returns it in STATE (its ``incarnation`` field), and every later message of the connection
carries it (its ``boot`` field). A learner has two roles on shard 0 (its rank 0's data link and its heartbeat) and
one on the other shards; each (learner, role) is held by one connection at a time.

A HELLO under an id that another connection holds is refused, naming the id, while that holder is live: its
connection still open (ZeroMQ says at once when it is not) and heard from within ``liveness_s``. The holder itself
reconnecting (same process, its token in the HELLO) takes its id back at once; a relaunched learner (a new process:
no token) is admitted once the old connection is gone or silent for ``liveness_s``, and the old connection's later
messages are refused. So a peer with the secret cannot take a live learner's place, nor void its pending Δ by
saying HELLO as a new incarnation of it. What it still can do, holding the secret: say HELLO under any id no live
connection holds (a learner that has not joined, or one dead for ``liveness_s``), and send that learner's Δ."""

import secrets
import time

import zmq

from . import wire

DATA, HEARTBEAT = 0, 1  # a HELLO's ``steps``: the role of the link that says it
HELD = "is held by another live connection"


class Identity:
    """``_admit`` at HELLO, ``_holds`` on every other message, ``_release`` at DONE."""

    def _admit(self, peer: bytes, msg: wire.Message) -> int:
        """Bind ``(msg.learner, msg.steps)`` to ``peer``; returns the connection's new token. Raises
        ``wire.WireError`` naming the learner while another live connection holds it."""
        if msg.steps not in (DATA, HEARTBEAT):
            raise wire.WireError("steps", f"a HELLO names its link's role in steps: {DATA} (data) or {HEARTBEAT} "
                                          f"(heartbeat), got {msg.steps}")
        key = (msg.learner, msg.steps)
        h = self.holders.get(key)
        if h is not None and msg.boot != h["token"]:
            quiet = time.monotonic() - h["seen"]
            if quiet < self.liveness_s and self._present(h["peer"]):
                raise wire.WireError("learner", f"learner {msg.learner} {HELD} (incarnation {h['incarnation']}, heard "
                                                f"{quiet:.1f} s ago): a relaunched learner is admitted once the old "
                                                f"one's connection is gone or silent for {self.liveness_s:g} s "
                                                f"(syncer.liveness_s)")
            why = "gone" if quiet < self.liveness_s else f"silent for {quiet:.0f} s"
            self.say(f"learner {msg.learner} (incarnation {msg.incarnation}) said HELLO on a new connection; the one "
                     f"that held the id (incarnation {h['incarnation']}) is {why}")
        if h is not None and h["peer"] != peer:
            self.peers.pop(h["peer"], None)
        token = secrets.randbits(63) | 1
        self.holders[key] = {"peer": peer, "incarnation": msg.incarnation, "token": token, "seen": time.monotonic()}
        return token

    def _holds(self, peer: bytes, info: dict, msg: wire.Message) -> bool:
        """Does ``peer`` (which said HELLO as ``info``) still hold its learner id, with ``msg`` carrying its token?"""
        h = self.holders.get((info["learner"], info["role"]))
        if h is None or h["peer"] != peer or msg.boot != h["token"]:
            return False
        h["seen"] = time.monotonic()
        return True

    def _present(self, peer: bytes) -> bool:
        """Is the connection of ``peer`` still open? (A harmless PONG to it: ZeroMQ says at once if it is gone.)"""
        try:
            self.sock.send_multipart([peer] + wire.encode(wire.Message("PONG", version=self.state.version,
                                                                        steps=wire.HELD, boot=self.boot)), copy=False)
        except zmq.ZMQError as err:
            return err.errno != zmq.EHOSTUNREACH
        return True

    def _release(self, peer: bytes, learner: int) -> None:
        """``peer`` said DONE: it holds ``learner`` no more."""
        for role in (DATA, HEARTBEAT):
            if self.holders.get((learner, role), {}).get("peer") == peer:
                del self.holders[(learner, role)]


__all__ = ["Identity", "DATA", "HEARTBEAT", "HELD"]
