"""One shard of the syncer of ``"mode": "decoupled"``: a CPU process that owns slice j of θ_g (the j-th ZeRO-1
partition of every learner, all parameter groups end to end) and its outer momentum.

Learner rank j talks to shard j only (the rails). Shard 0 also decides the merges: a learner is pending once
its rank 0 said READY there (after every rank's Δ slice was acknowledged by its own shard), and shard 0 merges
by the rule of docs/design/decoupled.md, then sends the decision (version, learners) to every other shard, which
merges the same learners' slices in the same order. So every shard makes the same versions of the same
merges, and a learner's ranks all receive slices of one version.

State changes only on the main thread, from a queue that the connection threads fill with checked messages; a
connection whose message breaks a rule of the wire (``wire.WireError``) is answered ERROR and dropped, and
nothing it sent changes the state. ``python -m acco_ds.runtime.outer.decoupled.syncer`` runs one shard;
``acco-ds syncer`` runs them all.
"""

import argparse
import json
import math
import os
import queue
import socket
import sys
import threading
import time
from typing import Dict, List, Optional

import torch

from . import wire
from .merges import EWMA, MergeRule
from .state import ShardState


class Shard(MergeRule):
    """The server of shard ``index`` (see the module docstring).

    Args:
        index: j. ``leader``: ``(host, port)`` of shard 0 (None: this is shard 0).
        settings: outer_lr, outer_momentum, nesterov, merge, staleness, nesterov_delay.
        min_quorum, grace_s: K and the grace window (seconds or "auto").
        learners: exit once this many learners said DONE and none is connected (None: run until stopped).
        idle_exit_s: also exit once no learner has been connected for this long, after one was (None: never).
        state_dir: checkpoint folder (None: none).
    """

    def __init__(self, index: int, host: str, port: int, settings: dict, *, min_quorum: int = 1, grace_s=0.0,
                 learners: Optional[int] = None, state_dir: Optional[str] = None, leader=None,
                 max_message_mb: float = 4096.0, timeout_s: float = 120.0, idle_exit_s: Optional[float] = None,
                 say=None):
        self.index, self.leader_address = index, leader
        self.K, self.grace = int(min_quorum), grace_s
        self.learners_expected, self.state_dir = learners, state_dir
        self.max_bytes = int(max_message_mb * (1 << 20))
        self.timeout_s = timeout_s
        self.idle_exit_s, self.empty_since = idle_exit_s, None  # stop after this long without a learner
        self.state = ShardState(**settings)
        self.say = say or (lambda line: print(f"[acco_ds syncer {index}] {line}", flush=True))
        self.events: "queue.Queue" = queue.Queue()
        self.server = socket.create_server((host, port), reuse_port=False)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.port = self.server.getsockname()[1]
        self.conns: Dict[socket.socket, dict] = {}  # conn -> {"learner", "incarnation", "follower"}
        self.followers: List[socket.socket] = []
        self.leader: Optional[socket.socket] = None
        self.live: Dict[int, int] = {}  # shard 0: learner -> incarnation of its rank-0 connection
        self.live_conn: Dict[int, socket.socket] = {}  # shard 0: learner -> that connection
        self.pending: Dict[int, dict] = {}  # learner -> {"incarnation", "base", "tokens", "steps", "delta", "ready"}
        self.done: set = set()
        self.seen: set = set()
        self.last_arrival: Dict[int, float] = {}
        self.period_ewma: Optional[float] = None
        self.log: List[dict] = []
        self.refused = 0
        self.resent = 0  # re-sent Δs recognised as merged already
        self.merged: Dict[int, tuple] = {}  # learner -> (incarnation, base) of its last merged Δ
        self.bytes_in = self.bytes_out = 0
        self.stopped = threading.Event()
        self.resume()

    # ---------------------------------------------------------------- checkpoints
    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                msg = wire.recv(conn, self.max_bytes)
            except wire.WireError as err:
                self.events.put(("refused", conn, str(err)))
                return
            except (OSError, wire.Closed):
                self.events.put(("closed", conn, None))
                return
            self.events.put(("msg", conn, msg))

    def start(self) -> "Shard":
        threading.Thread(target=self._accept, daemon=True).start()
        if self.leader_address is not None:
            self.leader = wire.connect(self.leader_address, self.timeout_s, "syncer shard 0")
            wire.send(self.leader, wire.Message("FOLLOW", learner=self.index))
            threading.Thread(target=self._read, args=(self.leader,), daemon=True).start()
        return self

    # ---------------------------------------------------------------- main loop
    def serve(self) -> None:
        """Handle events until every expected learner is done (or ``stop``)."""
        while not self.stopped.is_set():
            deadline = self._merge_deadline()
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                kind, conn, data = self.events.get(timeout=0.5 if wait is None else min(wait, 0.5))
            except queue.Empty:
                self._maybe_merge()
                self._maybe_exit()
                continue
            try:
                if kind == "msg":
                    self._handle(conn, data)
                elif kind == "refused":
                    self._refuse(conn, data)
                else:
                    self._closed(conn)
            except wire.WireError as err:
                self._refuse(conn, str(err))
            except OSError:
                self._closed(conn)
            self._maybe_merge()
            self._maybe_exit()
        self.close()

    def stop(self) -> None:
        self.stopped.set()

    def close(self) -> None:
        for conn in list(self.conns) + self.followers + ([self.leader] if self.leader else []):
            try:
                conn.close()
            except OSError:
                pass
        self.server.close()

    def _send(self, conn: socket.socket, msg: wire.Message) -> None:
        self.bytes_out += wire.send(conn, msg)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Answer ERROR and drop the connection; nothing it sent changed the state."""
        self.refused += 1
        self.say(f"dropped a connection: {why}")
        try:
            self._send(conn, wire.text("ERROR", why))
        except OSError:
            pass
        self._closed(conn)
        try:
            conn.close()
        except OSError:
            pass

    def _closed(self, conn: socket.socket) -> None:
        if conn is self.leader:
            self.say("shard 0 is gone: stopping")
            self.stopped.set()
            return
        if conn in self.followers:
            self.followers.remove(conn)
        info = self.conns.pop(conn, None)
        if info is None or self.index != 0:
            return
        learner, incarnation = info["learner"], info["incarnation"]
        if self.live.get(learner) == incarnation and self.live_conn.get(learner) is conn:  # rank 0 left before DONE
            del self.live[learner], self.live_conn[learner]
            if learner not in self.done:
                self.say(f"learner {learner} left before it was done: its pseudo-gradient in flight is dropped")
            self._drop(learner, incarnation)

    def _check_slice(self, msg: wire.Message, name: str) -> None:
        numel = None if self.state.empty else self.state.x.numel()
        wire.expect(msg, msg.kind, name=name, numel=numel)

    def _handle(self, conn: socket.socket, msg: wire.Message) -> None:
        kind = msg.kind
        if conn is self.leader:
            return self._from_leader(msg)
        info = self.conns.get(conn)
        if kind == "FOLLOW":
            if self.index != 0:
                raise wire.WireError("kind", f"FOLLOW sent to shard {self.index}, only shard 0 leads")
            self.followers.append(conn)
            return
        if kind == "HELLO":
            self.conns[conn] = {"learner": msg.learner, "incarnation": msg.incarnation}
            self.seen.add(msg.learner)
            self.done.discard(msg.learner)
            if self.index == 0:
                old = self.live.get(msg.learner)
                if old is not None and old != msg.incarnation:  # relaunched: the old incarnation's Δ is void
                    self._drop(msg.learner, old)
                self.live[msg.learner] = msg.incarnation
                self.live_conn[msg.learner] = conn
            self._send(conn, wire.Message("STATE", version=self.state.version))
            return
        if info is None:
            raise wire.WireError("kind", f"{kind} before HELLO")
        if (msg.learner, msg.incarnation) != (info["learner"], info["incarnation"]):
            raise wire.WireError("learner", f"learner {msg.learner} incarnation {msg.incarnation} on the connection of "
                                            f"learner {info['learner']} incarnation {info['incarnation']}")
        if kind == "INIT":
            self._check_slice(msg, "theta")
            if self.state.empty:
                self.state.adopt(msg.tensor)
                self.say(f"took the starting weights ({msg.tensor.numel()} elements) from learner {msg.learner}")
                self.checkpoint(None)
            return
        if self.state.empty:
            raise wire.WireError("kind", f"{kind} before the syncer has a model (INIT first)")
        if kind == "GET":
            self._send(conn, wire.Message("PARAMS", version=self.state.version, name="theta", tensor=self.state.x))
        elif kind == "DELTA":
            received = msg.tensor.numel() * msg.tensor.element_size() if msg.tensor is not None else 0
            n = msg.extra.get("numel")
            if n is not None and n != self.state.x.numel():  # before a byte of fp32 is allocated for it
                raise wire.WireError("shape", f"a quantized delta of {n} values, this shard holds "
                                              f"{self.state.x.numel()}")
            msg = wire.dequantize(msg)  # a block-quantized Δ is merged as the fp32 values it stands for
            self._check_slice(msg, "delta")
            if msg.base > self.state.version:
                raise wire.WireError("base", f"version {msg.base} is ahead of this shard's {self.state.version} (a "
                                             f"syncer restarted from an older checkpoint): relaunch the learner")
            lo, hi = torch.aminmax(msg.tensor) if msg.tensor.numel() else (torch.zeros(()), torch.zeros(()))
            if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):  # NaN propagates, ±inf shows
                raise wire.WireError("delta", "holds inf or NaN")
            if self.merged.get(msg.learner) == (msg.incarnation, msg.base):  # re-sent after a restart: merged already
                self._send(conn, wire.Message("ACK", learner=msg.learner, version=self.state.version, base=msg.base))
                self._send(conn, wire.Message("PARAMS", learner=msg.learner, incarnation=msg.incarnation,
                                              version=self.state.version, name="theta", tensor=self.state.x))
                self.resent += 1
                return
            self.bytes_in += received
            self.pending[msg.learner] = {"incarnation": msg.incarnation, "base": msg.base, "tokens": msg.tokens,
                                         "steps": msg.steps, "adopted": msg.version, "delta": msg.tensor,
                                         "ready": None, "conn": conn}
            self._send(conn, wire.Message("ACK", learner=msg.learner, version=self.state.version, base=msg.base))
        elif kind == "READY":
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
        elif kind == "DONE":
            self.done.add(msg.learner)
            if self.index == 0 and self.live.get(msg.learner) == msg.incarnation:
                del self.live[msg.learner], self.live_conn[msg.learner]
        else:
            raise wire.WireError("kind", f"{kind} is not sent to a syncer shard")

    # ---------------------------------------------------------------- merges (shard 0 decides)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one shard of the syncer of acco's decoupled mode")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--leader", default=None, help="host:port of shard 0 (shards above 0)")
    p.add_argument("--settings", required=True, help="JSON: outer_lr, outer_momentum, nesterov, merge, staleness, "
                                                     "nesterov_delay")
    p.add_argument("--min-quorum", type=int, default=1)
    p.add_argument("--grace-s", default="0")
    p.add_argument("--learners", type=int, default=None)
    p.add_argument("--state-dir", default=None)
    p.add_argument("--port-file", default=None, help="write the port here once listening")
    p.add_argument("--max-message-mb", type=float, default=4096.0)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--idle-exit-s", type=float, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    grace = args.grace_s if args.grace_s == "auto" else float(args.grace_s)
    leader = wire.split_address(args.leader) if args.leader else None
    shard = Shard(args.index, args.host, args.port, json.loads(args.settings), min_quorum=args.min_quorum,
                  grace_s=grace, learners=args.learners, state_dir=args.state_dir, leader=leader,
                  max_message_mb=args.max_message_mb, timeout_s=args.timeout_s, idle_exit_s=args.idle_exit_s)
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(shard.port))
        os.replace(args.port_file + ".tmp", args.port_file)
    shard.say(f"listening on {args.host}:{shard.port}" + (f", following {args.leader}" if leader else ""))
    shard.start().serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
