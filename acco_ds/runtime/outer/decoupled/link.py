"""One learner rank's link to its syncer shard in ``"mode": "decoupled"``: the connection (a ZeroMQ DEALER:
connect, prove the secret, HELLO, send, receive, a look without blocking, connect again after a restart), the
heartbeat that keeps a learner in shard 0's quorum while it trains, and the up-link's encoding of a
pseudo-gradient slice, in fp32 or block-quantized with error feedback (``acco.compression`` with ``"outer"``).

While a rank waits for its merge it pings its shard every second: the PONG says whether the shard still holds its
Δ (HELD), merged it (MERGED: its θ_g was lost on the way) or lost it (LOST: the shard restarted, or dropped the
learner while it was silent); the last two make the learner's ranks send their slices again. A rank waits as
long as its shard answers: only a shard silent for ``syncer.timeout_s`` ends the wait with an error.

The quantized up-link is ``diloco``'s outer compression applied to one send: ``v = Δ + e`` (``e``: this rank's
residual, ``compression.residual_dtype``, kept across periods and checkpointed with the loop), one fp32 scale per
``block_size`` values of ``v`` and one int8/fp8 byte per value (``ops`` ``quantize_pack``: the kernels the other
compressed collectives use), ``e ← v − dequantized``. Only the up-link is quantized: θ_g comes back in fp32."""

import secrets
import struct
import sys
import threading
import time
from typing import Optional

import torch
import zmq

from ...comm.compression import OuterCompression
from ....ops.reference import num_blocks
from . import transport, wire
from .identity import DATA, HEARTBEAT, HELD


class Uplink:
    """How a rank's Δ slice travels: fp32 (``compression`` None) or block-quantized with error feedback."""

    def __init__(self, compression: Optional[OuterCompression], key: str = "uplink"):
        self.compression = compression
        self.key = key  # of this slice's residual in ``compression.residuals`` (checkpointed there)

    def __str__(self) -> str:
        return "fp32" if self.compression is None else str(self.compression.codec)

    @torch.no_grad()
    def message(self, delta: torch.Tensor, **fields) -> wire.Message:
        """The DELTA message of the flat fp32 ``delta`` (on the rank's device); updates the residual."""
        c = self.compression
        if c is None:
            return wire.Message("DELTA", name="delta", tensor=delta.cpu(), **fields)
        codec, n = c.codec, delta.numel()
        residual = None
        if c.residual_dtype is not None:
            residual = c.residuals.get(self.key)
            if residual is None:
                residual = c.residuals[self.key] = torch.zeros(n, dtype=c.residual_dtype, device=delta.device)
        seg = torch.empty(4 * num_blocks(n, codec.block_size) + n, dtype=torch.uint8, device=delta.device)
        codec.pack(delta, residual, seg)  # scales, then values: the wire's block-quantized payload
        return wire.quantized("DELTA", seg.cpu(), codec.dtype, n, codec.block_size, name="delta", **fields)


PING_EVERY_S = 1.0  # a waiting rank's PING to its shard


def _uses(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s memory (views of it included)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def routing_id(tag: bytes, learner: int, incarnation: int, rank: int) -> bytes:
    """The same on every reconnection of one socket, so the shard knows it as the peer that said HELLO."""
    return tag + struct.pack("<IQI", learner, incarnation, rank)


class Link:
    """The connection of learner ``learner`` (incarnation ``incarnation``) to syncer shard ``shard``."""

    def __init__(self, address, learner: int, incarnation: int, shard: int, timeout_s: float, max_bytes: int,
                 keys: Optional[transport.Keys] = None, tokens_per_step: int = 1, layout: str = ""):
        self.address, self.learner, self.incarnation, self.shard = address, learner, incarnation, shard
        self.layout = layout  # the learner's shape, said at HELLO: a shard refuses a learner of another
        self.timeout_s, self.max_bytes, self.keys, self.tokens_per_step = timeout_s, max_bytes, keys, tokens_per_step
        self.ctx = zmq.Context.instance()
        self.sock = None
        self.boot, self.liveness_s = None, None
        self.syncer_shards = 0  # how many shards the syncer has, as STATE said (0: not said)
        self.waiting_base = None  # the base version of the Δ whose merge this rank waits for
        self.retained = None  # the DELTA of the last merge adopted: a shard that lost that merge asks for it
        self.adopted = None  # the version adopted with it: a θ_g of it or older, from a merge redone, is dropped
        self.last_ping = 0.0
        self.bytes_sent = 0  # header and payload frames sent
        self.delta_bytes = 0  # of which DELTA messages
        self.reconnects = 0
        self.inbox, self.inbox_uses = None, 0  # the receive buffer of large payloads (``_inbox``)
        self.token = 0  # given by the shard at HELLO (in STATE), sent in every message (``identity``)
        self.nonce = secrets.token_bytes(8)  # in the routing id: another peer cannot guess it and take it over
        self.tag = b"L"

    @property
    def where(self) -> str:
        return f"syncer shard {self.shard} at {self.address[0]}:{self.address[1]}"

    def mine(self, kind: str, **fields) -> wire.Message:
        return wire.Message(kind, learner=self.learner, incarnation=self.incarnation, **fields)

    def open(self, timeout_s: float) -> int:
        """Connect, prove the secret, say HELLO; returns the shard's version (``wire.NO_VERSION``: no model). While
        the shard says another live connection holds this learner id (a relaunch before the old process's
        connection closed), HELLO again each second until ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._open(max(0.1, deadline - time.monotonic()))
            except wire.Refused as err:
                if HELD not in str(err) or time.monotonic() + PING_EVERY_S > deadline:
                    raise
                self.close()
                time.sleep(PING_EVERY_S)

    def _open(self, timeout_s: float) -> int:
        host, port = self.address
        self.sock = transport.client(self.ctx, self.keys, host, port, self.max_bytes, self.timeout_s)
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id(self.tag, self.learner, self.incarnation, self.shard)
                             + self.nonce)
        try:
            transport.handshake(self.sock, transport.endpoint(host, port), timeout_s, f"syncer shard {self.shard}",
                                self.keys is not None)
        except transport.AuthError:
            raise
        except ConnectionError as err:
            raise ConnectionError(f"acco decoupled: {err}. Start it (acco-ds syncer) or check "
                                  f"local_sgd.syncer.address") from None
        self.boot = None
        role = HEARTBEAT if self.tag == b"P" else DATA
        self.send(self.mine("HELLO", tokens=self.tokens_per_step, name=self.layout, steps=role))
        state = self._next("STATE")
        while state.kind in ("ACK", "PARAMS", "PONG"):  # answers to the socket this one replaced (same identity)
            state = self._next("STATE")
        wire.expect(state, "STATE")
        self.boot, self.liveness_s, self.token = state.boot, state.tokens / 1000.0, state.incarnation
        self.syncer_shards = state.steps
        if self.retained is not None and state.base == self.retained.base:  # a merge the shard must redo
            self.send(self.retained)
            self.recv("ACK")
        return state.version

    def reopen(self, deadline: float, err: Exception) -> None:
        """The shard went away or lost this Δ: connect again, same incarnation, until ``deadline``."""
        self.close()
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectionError(f"acco decoupled: learner {self.learner} lost {self.where} and could not finish "
                                  f"its merge within local_sgd.syncer.timeout_s: {err}") from err
        self.reconnects += 1
        if self.open(left) == wire.NO_VERSION:
            raise ConnectionError(f"acco decoupled: {self.where} came back without a model (no state_dir, or "
                                  f"another one): restart it on the folder it checkpointed to")

    def send(self, msg: wire.Message) -> None:
        msg.boot = self.token  # proves to the shard that this connection holds the learner id (STATE gave it)
        frames = wire.encode(msg)
        try:
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again as err:
            raise TimeoutError(f"acco decoupled: {self.where} took nothing for {self.timeout_s:g} s") from err
        n = wire.size(frames)
        self.bytes_sent += n
        if msg.kind == "DELTA":
            self.delta_bytes += n

    def _inbox(self, nbytes: int) -> torch.Tensor:
        """The buffer a payload of ``nbytes`` is received into: the last one again when nothing holds it any more
        (θ_g is copied into the masters at adoption), so a 64 MiB θ_g does not fault in fresh pages every merge."""
        buf = self.inbox
        if buf is None or buf.numel() != nbytes or sys.getrefcount(buf) > 3 or _uses(buf) > self.inbox_uses:
            buf = self.inbox = torch.empty(nbytes, dtype=torch.uint8)
            self.inbox_uses = _uses(buf)
        return buf

    def _ping(self) -> None:
        base = wire.NO_VERSION if self.waiting_base is None else self.waiting_base
        self.send(self.mine("PING", base=base))
        self.last_ping = time.monotonic()

    def _read(self) -> Optional[wire.Message]:
        """The next message if one is queued (a PONG is checked here and answered None)."""
        try:
            frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        msg = wire.decode(frames, self.max_bytes, into=self._inbox)
        if self.boot is not None and msg.boot != self.boot:
            raise wire.Closed(f"{self.where} restarted")
        if msg.kind == "PARAMS" and self.adopted is not None and msg.version <= self.adopted:
            return None  # the θ_g of a merge redone after a restart from the retained Δ: this rank has it
        if msg.kind == "PARAMS":
            self.waiting_base = None  # its merge came: a PONG of a PING sent before it says MERGED, rightly
        if msg.kind != "PONG":
            return msg
        # before STATE (boot None) a PONG answers a PING of the socket this one replaced: it says nothing of this Δ
        if self.waiting_base is not None and msg.steps != wire.HELD and self.boot is not None:
            why = "merged it but its θ_g did not arrive" if msg.steps == wire.MERGED else "does not hold it"
            raise wire.Closed(f"{self.where} {why} (learner {self.learner}, base {self.waiting_base})")
        return None

    def _next(self, what: str) -> wire.Message:
        """The next message; while none comes, a PING each second. A shard silent for ``timeout_s`` is an error
        naming ``what``; one that answers is waited for as long as it takes (it is merging)."""
        heard = time.monotonic()
        while True:
            if self.sock.poll(int(PING_EVERY_S * 1000)):
                heard = time.monotonic()
                msg = self._read()
                if msg is not None:
                    return msg
                continue
            if time.monotonic() - heard > self.timeout_s:
                raise TimeoutError(f"acco decoupled: learner {self.learner} rank {self.shard} heard nothing from "
                                   f"{self.where} for {self.timeout_s:g} s (local_sgd.syncer.timeout_s) while "
                                   f"waiting for {what}")
            if self.boot is not None:
                self._ping()

    def recv(self, kind: str, name: Optional[str] = None, numel: Optional[int] = None) -> wire.Message:
        return wire.expect(self._next(kind), kind, name, numel if name else None)

    def recv_params(self, numel: int) -> wire.Message:
        """The next PARAMS, past the ACKs of DELTAs that were not waited for."""
        while True:
            msg = self._next("its merge")
            if msg.kind != "ACK":
                return wire.expect(msg, "PARAMS", "theta", numel)

    def poll_params(self, numel: int) -> Optional[wire.Message]:
        """PARAMS if it has arrived (ACKs before it are read past), else None; never waits."""
        if time.monotonic() - self.last_ping >= PING_EVERY_S:
            self._ping()
        while self.sock.poll(0):
            msg = self._read()
            if msg is not None and msg.kind != "ACK":
                return wire.expect(msg, "PARAMS", "theta", numel)
        return None

    def done(self, wait_s: float = 2.0) -> None:
        """Say DONE and wait (at most ``wait_s``) until the shard answered it, then close."""
        try:
            self.send(self.mine("DONE"))
            self.sock.poll(int(wait_s * 1000))
        except (OSError, zmq.ZMQError):
            pass
        self.close(linger_ms=int(wait_s * 1000))

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; ``linger_ms``: how long what is still queued (a DONE) may take to leave."""
        if self.sock is not None:
            self.sock.close(linger_ms)
            self.sock = None


class Heartbeat(threading.Thread):
    """Rank 0's PINGs to shard 0 while the learner trains, on a socket of their own: shard 0 keeps a learner in
    its quorum while it hears them (``syncer.liveness_s``). A stopped or hung process stops them."""

    def __init__(self, link: Link):
        super().__init__(daemon=True)
        self.link = Link(link.address, link.learner, link.incarnation, link.shard, link.timeout_s, 1 << 16, link.keys,
                         link.tokens_per_step)
        self.link.tag = b"P"
        self.every = max(0.05, (link.liveness_s or 10.0) / 4)
        self.stopping = threading.Event()

    def run(self) -> None:
        link = self.link
        while not self.stopping.wait(self.every):
            try:
                if link.sock is None:
                    link.open(max(1.0, self.every))  # short: stop() must not wait behind it
                link._ping()
                while link.sock.poll(0):
                    link._read()
            except (OSError, wire.WireError, zmq.ZMQError):
                link.close()  # shard 0 restarted or is away: say HELLO again next time

    def stop(self) -> None:
        self.stopping.set()
        self.join(5)
        if not self.is_alive():  # (a socket belongs to one thread)
            self.link.close()


__all__ = ["Link", "Uplink", "Heartbeat", "routing_id"]
