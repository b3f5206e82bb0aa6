"""One shard of the syncer of ``"mode": "decoupled"``: a CPU process that owns slice j of θ_g (the j-th ZeRO-1
partition of every learner, all parameter groups end to end) and its outer momentum.

Learner rank j talks to shard j only (the rails). Shard 0 also decides the merges: a learner is pending once
its rank 0 said READY there (after every rank's Δ slice was acknowledged by its own shard), and shard 0 merges
by the rule of docs/design/decoupled.md, logs the decision durably, then sends it to every other shard, which
merges the same learners' slices in the same order. So every shard makes the same versions of the same merges,
and a learner's ranks all receive slices of one version.

One thread owns the state: it reads the ROUTER socket (``transport``: CURVE, heartbeats, bounded queues) and
answers each message in turn; it never blocks on a peer (a send to a peer that is gone or does not read is
dropped). A message that breaks a rule of the wire or of the protocol is answered ERROR and changes nothing.
Shard 0 keeps its quorum live: a learner not heard from for ``liveness_s`` leaves it (its Δ in flight is dropped)
and is re-admitted when it speaks again. ``python -m acco_ds.runtime.outer.decoupled.syncer`` runs one shard;
``acco-ds syncer`` runs them all.
"""

import math
import random
import struct
import threading
import time
from typing import Dict, Optional

import torch
import zmq

from . import transport, wire
from .handlers import Handlers
from .identity import Identity
from .merges import MergeRule
from .state import ShardState

DEFAULT_LIVENESS_S = 10.0
SMALL_PAYLOAD = 1 << 16  # bytes: the payload of a message that is not a slice of θ_g (MERGE's learners, a text)


class Shard(Handlers, Identity, MergeRule):
    """The server of shard ``index`` (see the module docstring).

    Args:
        index: j. ``leader``: ``(host, port)`` of shard 0 (None: this is shard 0).
        settings: outer_lr, outer_momentum, nesterov, merge, staleness, nesterov_delay.
        min_quorum, grace_s: K and the grace window (seconds or "auto").
        learners: M: no merge before M learners have joined; exit once M said DONE (None: run until stopped).
        max_learners: refuse a learner beyond this many (None: no cap). max_connections: the connection cap.
        shards: how many shards the syncer has (its learners cut their model into that many parts,
            ``layout``; 0: unknown, a learner then takes one part per rank).
        liveness_s: a learner silent this long leaves the quorum. keys: ``transport.Keys`` (None: no secret).
        idle_exit_s: also exit once no learner has been heard from for this long, after one was (None: never).
        state_dir: checkpoint folder (None: none).
    """

    def __init__(self, index: int, host: str, port: int, settings: dict, *, min_quorum: int = 1, grace_s=0.0,
                 learners: Optional[int] = None, state_dir: Optional[str] = None, leader=None,
                 max_message_mb: float = 4096.0, timeout_s: float = 120.0, idle_exit_s: Optional[float] = None,
                 liveness_s: float = DEFAULT_LIVENESS_S, keys: Optional[transport.Keys] = None,
                 max_learners: Optional[int] = None, max_connections: int = 1024, shards: int = 0, say=None):
        if keys is None and not transport.is_loopback(host):
            raise ValueError(f"acco decoupled: syncer shard {index} would listen on {host} without a secret: give "
                             f"it --auth-file (acco-ds syncer --make-secret PATH makes one), or bind 127.0.0.1")
        self.index, self.leader_address, self.keys, self.shards = index, leader, keys, int(shards)
        self.K, self.grace = int(min_quorum), grace_s
        self.learners_expected, self.max_learners, self.state_dir = learners, max_learners, state_dir
        self.max_bytes = int(max_message_mb * (1 << 20))
        self.timeout_s, self.liveness_s = timeout_s, float(liveness_s)
        self.idle_exit_s, self.empty_since = idle_exit_s, None  # stop after this long without a learner
        self.state = ShardState(**settings)
        self.say = say or (lambda line: print(f"[acco_ds syncer {index}] {line}", flush=True))
        self.boot = random.SystemRandom().getrandbits(63) | 1  # this process's start: learners see restarts
        self.ctx = zmq.Context()
        self.sock, self.port = transport.server(self.ctx, keys, host, port, self.max_bytes)
        self.guard = transport.Guard(self.ctx, keys, self.sock, max_connections)
        self.peers: Dict[bytes, dict] = {}  # routing id -> {"learner", "incarnation", "role"} after its HELLO
        self.holders: Dict[tuple, dict] = {}  # (learner, role) -> {"peer", "incarnation", "token", "seen"}
        self.followers: set = set()  # shard 0: routing ids of the shards that follow it
        self.leader: Optional[zmq.Socket] = None
        self.leader_boot, self.leader_seen, self.leader_done = None, time.monotonic(), False
        self.live: Dict[int, int] = {}  # shard 0: learner -> incarnation, heard from within liveness_s
        self.last_seen: Dict[int, float] = {}
        self.tokens_per_step: Dict[tuple, int] = {}  # (learner, incarnation) -> tokens per inner step (HELLO)
        self.pending: Dict[int, dict] = {}  # learner -> {"incarnation", "base", "tokens", "steps", "delta", ...}
        self.done: set = set()
        self.seen: set = set()
        self.silent: set = set()  # shard 0: learners out of the quorum for silence, until they speak
        self.last_arrival: Dict[int, float] = {}
        self.period_ewma: Optional[float] = None
        self.log = []
        self.refused = self.resent = self.dropped_sends = 0
        self.merged: Dict[int, tuple] = {}  # learner -> (incarnation, base) of its last merged Δ
        self.bytes_in = self.bytes_out = 0
        self.theta_sends = []  # ZeroMQ trackers of sends of θ_g's own memory (``_send_theta``)
        self.stopped = threading.Event()
        self.resume()

    # ---------------------------------------------------------------- the socket
    def start(self) -> "Shard":
        self.guard.start()
        if self.leader_address is not None:
            host, port = self.leader_address
            self.leader = transport.client(self.ctx, self.keys, host, port, self.max_bytes, self.timeout_s)
            self.leader.setsockopt(zmq.ROUTING_ID, b"F" + struct.pack("<I", self.index))
            self.leader.setsockopt(zmq.SNDTIMEO, 0)
            transport.handshake(self.leader, transport.endpoint(host, port), self.timeout_s, "syncer shard 0",
                                self.keys is not None)
            self._follow()
            self._catch_up()
        return self

    def _catch_up(self) -> None:
        """Take shard 0's decisions above this shard's version (its answer to FOLLOW ends with a PONG) before any
        learner is served: a learner then hears which Δ a lost merge needs (STATE)."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if not self.leader.poll(200):
                continue
            msg = wire.decode(self.leader.recv_multipart(copy=False), self.max_bytes)
            self.leader_seen = time.monotonic()
            self._from_leader(msg)
            if msg.kind == "PONG":
                return
        raise ConnectionError(f"syncer shard {self.index}: shard 0 did not answer FOLLOW within {self.timeout_s:g} s")

    def _follow(self) -> None:
        self._to_leader(wire.Message("FOLLOW", learner=self.index, version=self.state.version))

    def _to_leader(self, msg: wire.Message) -> None:
        try:
            self.leader.send_multipart(wire.encode(msg), copy=False)
        except zmq.Again:
            pass  # shard 0 is away: its PONG's new boot makes this shard follow again

    def _send(self, peer: bytes, msg: wire.Message, track: bool = False) -> None:
        """Send without blocking: a peer that is gone, or whose queue is full (it does not read), loses it.
        ``track``: the payload is θ_g itself, sent without a copy; the next change of θ_g copies it first if ZeroMQ
        still holds it (``_own_theta``)."""
        msg.boot = self.boot
        frames = wire.encode(msg)
        try:
            tracker = self.sock.send_multipart([peer] + frames, copy=False, track=track)
            self.bytes_out += wire.size(frames)
            if track:
                self.theta_sends = [t for t in self.theta_sends if not t.done] + [tracker]
        except zmq.ZMQError:
            self.dropped_sends += 1
            self.followers.discard(peer)

    def _send_theta(self, peer: bytes, **fields) -> None:
        """PARAMS: this shard's θ_g, without a copy."""
        self._send(peer, wire.Message("PARAMS", version=self.state.version, name="theta", tensor=self.state.x,
                                      **fields), track=True)

    def _own_theta(self) -> None:
        """Before θ_g changes in place: if a send of it is still under way, θ_g moves to a copy (the send keeps the
        old memory)."""
        if any(not t.done for t in self.theta_sends):
            self.state.x = self.state.x.clone()
        self.theta_sends = []

    # ---------------------------------------------------------------- main loop
    def serve(self) -> None:
        """Handle messages until every expected learner is done (or ``stop``)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.leader is not None:
            poller.register(self.leader, zmq.POLLIN)
        next_ping = 0.0
        try:
            while not self.stopped.is_set():
                deadline = self._merge_deadline()
                wait = 0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic()))
                for sock, _ in poller.poll(int(wait * 1000)):
                    for _ in range(256):  # drain what is queued, without starving the timers
                        try:
                            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._receive(sock, frames)
                        frames = None  # a refused message's frames go now, not when the next one is complete
                if self.leader is not None and time.monotonic() >= next_ping:
                    self._to_leader(wire.Message("PING", learner=self.index, base=wire.NO_VERSION))
                    next_ping = time.monotonic() + 1.0
                self._expire()
                self._maybe_merge()
                self._maybe_exit()
        finally:
            self.close()

    def _receive(self, sock: zmq.Socket, frames) -> None:
        peer = None if sock is self.leader else bytes(frames[0].bytes)
        try:
            msg = wire.decode(frames if peer is None else frames[1:], self.max_bytes, check=self._check_layout)
            if peer is None:
                self.leader_seen = time.monotonic()
                if msg.kind == "DONE":
                    self.leader_done = True
                    return
                return self._from_leader(msg)
            self.bytes_in += wire.size([f.buffer for f in frames[1:]])
            self._handle(peer, msg)
        except wire.WireError as err:
            if peer is None:
                self.say(f"refused a message from shard 0: {err}")
            else:
                self._refuse(peer, str(err))

    def _check_layout(self, h: dict) -> None:
        """A payload must be the size of this shard's slice (INIT, DELTA) or small (the others): checked on the
        header, before a byte of the payload is copied."""
        if h["dtype"] is None:
            return
        n, kind = h["payload"], h["kind"]
        if kind not in ("INIT", "DELTA"):
            if n > SMALL_PAYLOAD:
                raise wire.WireError("payload", f"{n} bytes in a {kind}, at most {SMALL_PAYLOAD} travel in one")
            return
        if self.state.empty:
            if kind == "DELTA":
                raise wire.WireError("kind", "DELTA before the syncer has a model (INIT first)")
            return
        numel = self.state.x.numel()
        if h.get("quantized") is not None:
            if h["numel"] != numel:
                raise wire.WireError("shape", f"a quantized {kind.lower()} of {h['numel']} values, this shard holds "
                                              f"{numel}")
        elif n != 4 * numel or h["dtype"] != torch.float32:
            raise wire.WireError("shape", f"{n} bytes of {h['dtype']} announced in a {kind}, this shard's slice is "
                                            f"{numel} fp32 values ({4 * numel} bytes)")

    def stop(self) -> None:
        self.stopped.set()

    def close(self) -> None:
        self._saved()  # the last checkpoint is on disk before the process ends
        self.guard.close()
        self.sock.close(500)  # a last DONE to the followers may still leave
        if self.leader is not None:
            self.leader.close(0)
        self.ctx.term()

    def _refuse(self, peer: bytes, why: str) -> None:
        """Answer ERROR; nothing the message said changed the state."""
        self.refused += 1
        self.say(f"refused a message: {why}")
        self._send(peer, wire.text("ERROR", why))

    # ---------------------------------------------------------------- liveness (shard 0)
    def _touch(self, learner: int, incarnation: int) -> None:
        """``learner`` spoke: it is live (re-admitted if it had gone silent)."""
        if self.index != 0 or learner in self.done:
            return
        if learner in self.silent:
            self.silent.discard(learner)
            self.say(f"learner {learner} speaks again: back in the quorum")
        self.live[learner] = incarnation
        self.last_seen[learner] = time.monotonic()

    def _expire(self) -> None:
        if self.index != 0:
            return
        now = time.monotonic()
        for learner, incarnation in list(self.live.items()):
            if now - self.last_seen.get(learner, now) > self.liveness_s:
                del self.live[learner]
                self.silent.add(learner)
                self.say(f"learner {learner} silent for {self.liveness_s:g} s (local_sgd.syncer.liveness_s): it "
                         f"leaves the quorum and its pseudo-gradient in flight is dropped")
                self._drop(learner, incarnation)
        self._expire_orphans()

    def _check_finite(self, t: torch.Tensor) -> None:
        lo, hi = torch.aminmax(t) if t.numel() else (torch.zeros(()), torch.zeros(()))
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):  # NaN propagates, ±inf shows
            raise wire.WireError("delta", "holds inf or NaN")


def main(argv=None) -> int:
    from .serve_main import main as run
    return run(Shard, argv)


if __name__ == "__main__":
    import sys
    sys.exit(main())
