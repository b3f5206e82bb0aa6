"""How learners and syncer shards of ``"mode": "decoupled"`` reach each other: ZeroMQ sockets (a shard is a ROUTER,
each learner rank and each follower shard a DEALER), authenticated and encrypted with CURVE from one secret file.

Why ZeroMQ (docs/design/decoupled.md has the measurement): it brings what a syncer between sites needs and a
hand-framed socket server lacks: CurveZMQ encryption and authentication (Curve25519, libsodium), a ZAP hook that
admits or refuses each connection before any of its messages reaches the shard, heartbeats that close dead
connections, high-water marks (bounded queues), a size limit per frame enforced before the frame is allocated,
reconnection, and one I/O thread for any number of connections (no thread per peer, no ``select`` limit).

The secret: a file of at least 32 random bytes readable by its owner only (``acco-ds syncer --make-secret PATH``).
HKDF-SHA256 of its bytes gives two Curve25519 secret keys, the shard's and the peers'; their public keys follow.
So a peer must hold the file to know the shard's public key (its HELLO is sealed to it) and to own the one client
key the shard's ZAP handler admits: without the secret, or with another, the handshake fails and the peer is
refused before a message of it is read. Without a secret (loopback only) the NULL mechanism runs, in clear.
"""

import hashlib
import hmac
import os
import secrets
import stat
import threading
import time
from typing import Optional, Tuple

import zmq
import zmq.utils.monitor
import zmq.utils.z85

from . import wire

MIN_SECRET = 32
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 2000, 30_000  # ZMTP pings: a dead TCP peer is closed within 30 s
HANDSHAKE_MS = 10_000  # a connection that does not finish its handshake in time is closed
HWM = 64  # messages queued per connection, each way: a peer that does not read loses ours, never blocks us
ZAP_DOMAIN = "acco_ds"


class AuthError(ConnectionError):
    """This side's secret, or its lack of one, does not match the peer's."""


def check_secret_file(path: str, what: str = "--auth-file") -> bytes:
    """The secret in ``path``, or a ``ValueError`` naming the problem and the fix."""
    fix = f"make one with `acco-ds syncer --make-secret {path}`"
    try:
        st = os.stat(path)
    except OSError as err:
        raise ValueError(f"acco decoupled: {what} {path}: {err.strerror}; {fix}") from err
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"acco decoupled: {what} {path} is not a regular file; {fix}")
    if st.st_mode & 0o077:
        raise ValueError(f"acco decoupled: {what} {path} is readable by others (mode {oct(st.st_mode & 0o777)}): "
                         f"run `chmod 600 {path}`")
    if st.st_uid != os.geteuid():
        raise ValueError(f"acco decoupled: {what} {path} belongs to user {st.st_uid}, not to this one "
                         f"({os.geteuid()}): the secret must be the owner's own")
    with open(path, "rb") as f:
        secret = f.read(1 << 16)
    if len(secret) < MIN_SECRET:
        raise ValueError(f"acco decoupled: {what} {path} holds {len(secret)} bytes, at least {MIN_SECRET} random "
                         f"bytes are needed; {fix}")
    return secret


def make_secret(path: str) -> None:
    """Write 32 new random bytes to ``path`` (created, owner-only; an existing file is refused)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(MIN_SECRET))
        f.flush()
        os.fsync(f.fileno())


def _hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869) with a fixed salt."""
    prk = hmac.new(b"acco_ds decoupled syncer", secret, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out, i = out + block, i + 1
    return out[:length]


class Keys:
    """The CURVE key pairs of a secret: the shards' and the peers' (z85 text, as ZeroMQ takes them)."""

    def __init__(self, secret: bytes):
        self.server_secret = zmq.utils.z85.encode(_hkdf(secret, b"server"))
        self.client_secret = zmq.utils.z85.encode(_hkdf(secret, b"client"))
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_public = zmq.curve_public(self.client_secret)

    def __repr__(self) -> str:  # never the secret keys
        return f"Keys(server {self.server_public[:8].decode()}…)"


def load_keys(path: Optional[str], what: str = "--auth-file") -> Optional[Keys]:
    return None if path is None else Keys(check_secret_file(path, what))


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _common(sock: zmq.Socket, host: str, max_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    # One frame: a header, or a piece of a payload (at most wire.CHUNK): a larger one closes the connection before
    # it is allocated.
    sock.setsockopt(zmq.MAXMSGSIZE, min(max_bytes, wire.CHUNK) + 4096)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)


def server(ctx: zmq.Context, keys: Optional[Keys], host: str, port: int, max_bytes: int) -> Tuple[zmq.Socket, int]:
    """A shard's ROUTER bound to ``host:port`` (0: any free port); returns it and its port."""
    sock = ctx.socket(zmq.ROUTER)
    _common(sock, host, max_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer that is gone or full raises, never blocks
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer that reconnects under its routing id takes its place
    sock.setsockopt(zmq.SNDTIMEO, 0)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)  # every connection passes the guard, NULL included
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    if port:
        sock.bind(endpoint(host, port))
    else:
        port = sock.bind_to_random_port(endpoint(host, 0).rsplit(":", 1)[0])
    return sock, port


def client(ctx: zmq.Context, keys: Optional[Keys], host: str, port: int, max_bytes: int,
           timeout_s: float) -> zmq.Socket:
    """A DEALER connecting to a shard (it reconnects on its own); sends wait at most ``timeout_s``."""
    sock = ctx.socket(zmq.DEALER)
    _common(sock, host, max_bytes)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    return sock


FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the syncer refused this side's key (or its connection cap is reached)",
          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the security handshake failed",
          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the security handshake failed"}


def handshake(sock: zmq.Socket, address: str, timeout_s: float, what: str, has_secret: bool) -> None:
    """Connect ``sock`` to ``address`` and wait until the security handshake succeeded. A refused or failed one
    raises ``AuthError`` naming auth; none within ``timeout_s`` (the shard is not up) a ``ConnectionError``."""
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(address)
        deadline, drops = time.monotonic() + timeout_s, 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not monitor.poll(int(min(left, 1.0) * 1000) + 1):
                if left <= 0:
                    raise ConnectionError(f"could not reach {what} at {address[6:]} within {timeout_s:g} s "
                                          f"(local_sgd.syncer.timeout_s)")
                continue
            event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if event == zmq.EVENT_CONNECTED:
                drops += 1
            if event in FAILED or (event == zmq.EVENT_DISCONNECTED and drops >= 3):
                why = FAILED.get(event, "the syncer closed every connection during the security handshake")
                mine = "this side has local_sgd.syncer.auth_file" if has_secret else "this side has no auth_file"
                raise AuthError(f"acco decoupled: auth failed with {what} at {address[6:]}: {why} ({mine}). Give "
                                f"the learners and `acco-ds syncer --auth-file` the same secret file")
    finally:
        sock.disable_monitor()
        monitor.close(0)


class Guard(threading.Thread):
    """The shard's ZAP handler: admits a connection if it proves the secret (its CURVE key is the one the secret
    gives; without a secret: any, loopback only) and fewer than ``max_connections`` are open (counted from the
    ROUTER's monitor events); every refusal is counted, nothing about it reaches the shard."""

    def __init__(self, ctx: zmq.Context, keys: Optional[Keys], router: zmq.Socket, max_connections: int):
        super().__init__(daemon=True)
        self.allowed = None if keys is None else zmq.utils.z85.decode(keys.client_public)
        self.max_connections, self.open, self.refused = max_connections, 0, 0
        self.zap = ctx.socket(zmq.REP)
        self.zap.bind("inproc://zeromq.zap.01")
        self.monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.stopping = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.zap, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while not self.stopping.is_set():
            for sock, _ in poller.poll(200):
                if sock is self.monitor:
                    event = zmq.utils.monitor.recv_monitor_message(self.monitor)["event"]
                    self.open += 1 if event == zmq.EVENT_ACCEPTED else -1
                else:
                    self._answer(self.zap.recv_multipart())

    def _answer(self, req) -> None:
        version, request_id, mechanism = req[0], req[1], req[5]
        ok = self.open <= self.max_connections
        if self.allowed is not None:
            ok = ok and mechanism == b"CURVE" and len(req) > 6 and hmac.compare_digest(req[6], self.allowed)
        self.refused += not ok
        self.zap.send_multipart([version, request_id, b"200" if ok else b"400", b"OK" if ok else b"refused",
                                 b"peer" if ok else b"", b""])

    def close(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(2)
        self.zap.close(0)
        self.monitor.close(0)


__all__ = ["Keys", "AuthError", "Guard", "check_secret_file", "make_secret", "load_keys", "is_loopback", "server",
           "client", "handshake", "endpoint", "HWM"]
