"""The wire of ``"mode": "decoupled"``: one TCP connection per learner rank and syncer shard, one fixed header per
message, raw tensor bytes after it. Nothing received is unpickled.

Why plain sockets rather than torch.distributed or gloo groups: a learner comes and goes on its own, and a
gloo group has a fixed membership fixed at its rendezvous; a peer that dies poisons it (every later
collective fails until the whole group is rebuilt; torchrun cannot even re-create a gloo job in this stack),
so one group per learner-shard pair would need a store, a rendezvous and a rebuild per relaunch, and its
failures surface as timeouts. A socket per pair is what such a pair group is underneath, without the
rendezvous: a dead learner is an EOF at once, a relaunched one simply connects again, and the receiver sees
every byte before it believes it. The header is parsed with ``struct``; the payload becomes a tensor through
a tensor of the exact size the header announced (read straight into its memory), after every field was
checked.

Header (little-endian, ``HEADER.size`` = 76 bytes), then ``name_len`` bytes of name, then ``payload`` bytes::

    magic "ACDL" | protocol u16 | kind u16 | learner u32 | incarnation u64 | version u64 | base u64 |
    tokens u64 | steps u32 | dtype u8 | ndim u8 | name_len u16 | shape 2 x u64 | payload u64

A block-quantized tensor (dtype ``int8`` or ``fp8``: a compressed pseudo-gradient) travels as shape ``[n, B]``:
``n`` values in blocks of ``B`` elements, its payload the ``ceil(n / B)`` fp32 block scales and then the ``n``
one-byte values (``ops.reference.quantize_pack``'s format), exactly ``4 ceil(n / B) + n`` bytes.

A message that breaks a rule raises ``WireError`` naming the field and the rule; the receiver then drops the
connection and changes nothing.
"""

import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from ....ops.reference import dequantize_accumulate, num_blocks

MAGIC = b"ACDL"
PROTOCOL = 1
HEADER = struct.Struct("<4sHHIQQQQIBBH2QQ")
NO_VERSION = (1 << 64) - 1  # an empty syncer (no model yet)
MAX_NAME = 64
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")

KINDS = {
    1: "HELLO",  # learner -> shard: learner id, incarnation; the shard answers STATE
    2: "STATE",  # shard -> learner: version (NO_VERSION: no model yet)
    3: "INIT",  # learner -> shard: "theta", the starting weights of an empty syncer
    4: "GET",  # learner -> shard: send the current θ_g
    5: "PARAMS",  # shard -> learner: "theta" of ``version``
    6: "DELTA",  # learner -> shard: "delta" from version ``base``, with tokens and steps, and in ``version`` the
    #              period's inner steps taken before the learner adopted ``base`` (adopt "overlap"); answered ACK
    7: "ACK",  # shard -> learner: the Δ is held
    8: "READY",  # learner rank 0 -> shard 0: every rank's Δ is held, the learner is pending
    9: "DONE",  # learner -> shard: finished for good
    10: "FOLLOW",  # shard j -> shard 0: shard j takes merge decisions from here
    11: "MERGE",  # shard 0 -> shard j: "learners" (int64 pairs learner, incarnation) make ``version``
    12: "DROP",  # shard 0 -> shard j: forget the Δ of (learner, incarnation)
    13: "ERROR",  # either way: "text" (utf-8) saying why the connection is dropped
}
KIND = {name: code for code, name in KINDS.items()}

DTYPES = {0: None, 1: torch.float32, 2: torch.float64, 3: torch.int64, 4: torch.uint8, 5: torch.bfloat16,
          6: torch.float16}
DTYPE_CODE = {dt: code for code, dt in DTYPES.items() if dt is not None}
QUANTIZED = {7: "int8", 8: "fp8"}  # block-quantized: shape [n, B], payload 4 ceil(n / B) scale bytes + n values
QUANTIZED_CODE = {name: code for code, name in QUANTIZED.items()}
QUANT_WIRE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
MIN_BLOCK, MAX_BLOCK = 8, 1 << 20  # compression.block_size's bounds


class WireError(ValueError):
    """A message broke a rule of the wire: ``field`` names what, ``str()`` says why."""

    def __init__(self, field_name: str, why: str):
        super().__init__(f"refused message: {field_name}: {why}")
        self.field = field_name


class Refused(ConnectionError):
    """The peer answered ERROR: it refused what this side sent (``str()`` holds its reason)."""


class Closed(ConnectionError):
    """The peer closed the connection (at a message boundary or inside one)."""


@dataclass
class Message:
    kind: str
    learner: int = 0
    incarnation: int = 0
    version: int = 0
    base: int = 0
    tokens: int = 0
    steps: int = 0
    name: str = ""
    tensor: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return bytes(self.tensor.numpy()).decode("utf-8", "replace") if self.tensor is not None else ""


def encode(msg: Message) -> Tuple[bytes, memoryview]:
    """The header (with the name) and the payload of ``msg``."""
    t = msg.tensor
    name = msg.name.encode("ascii")
    quant = msg.extra.get("quantized")
    if quant is not None:  # raw scales + values: the shape says how many values in blocks of how many
        payload = memoryview(t.contiguous().numpy()).cast("B")
        head = HEADER.pack(MAGIC, PROTOCOL, KIND[msg.kind], msg.learner, msg.incarnation, msg.version, msg.base,
                           msg.tokens, msg.steps, QUANTIZED_CODE[quant], 2, len(name), msg.extra["numel"],
                           msg.extra["block"], payload.nbytes)
        return head + name, payload
    if t is None:
        dtype, shape, payload = 0, (), memoryview(b"")
    else:
        if t.dim() > 2:
            raise WireError("shape", f"{t.dim()} dimensions, at most 2 travel")
        t = t.detach().contiguous().cpu()
        dtype, shape = DTYPE_CODE[t.dtype], tuple(t.shape)
        payload = memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
    dims = list(shape) + [0] * (2 - len(shape))
    head = HEADER.pack(MAGIC, PROTOCOL, KIND[msg.kind], msg.learner, msg.incarnation, msg.version, msg.base, msg.tokens,
                       msg.steps, dtype, len(shape), len(name), *dims, payload.nbytes)
    return head + name, payload


def send(sock: socket.socket, msg: Message) -> int:
    """Send ``msg``; returns the bytes written."""
    head, payload = encode(msg)
    sock.sendall(head)
    if payload.nbytes:
        sock.sendall(payload)
    return len(head) + payload.nbytes


def _read_exact(sock: socket.socket, n: int, into: Optional[memoryview] = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise Closed("the peer closed the connection" + (" inside a message" if got or into is not None else ""))
        got += k
    return buf


def parse_header(raw: bytes, max_bytes: int) -> dict:
    """Check every field of a header; returns them. Raises ``WireError`` naming the first bad field."""
    (magic, protocol, kind, learner, incarnation, version, base, tokens, steps, dtype, ndim, name_len, d0, d1,
     payload) = HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError("magic", f"{magic!r} is not {MAGIC!r}: not an acco_ds decoupled message")
    if protocol != PROTOCOL:
        raise WireError("protocol", f"version {protocol}, this side speaks {PROTOCOL}: run the same acco_ds on both")
    if kind not in KINDS:
        raise WireError("kind", f"{kind} is not a message kind")
    if dtype in QUANTIZED:
        if ndim != 2 or not MIN_BLOCK <= d1 <= MAX_BLOCK:
            raise WireError("shape", f"a block-quantized tensor travels as [values, block size] with a block size "
                                     f"of {MIN_BLOCK} to {MAX_BLOCK}, got ndim={ndim} shape {[d0, d1]}")
        want = 4 * num_blocks(d0, d1) + d0
        if payload != want:
            raise WireError("payload", f"{payload} bytes announced, but {d0} {QUANTIZED[dtype]} values in blocks of "
                                       f"{d1} are {want} bytes (fp32 scales, then one byte per value)")
        if payload > max_bytes:
            raise WireError("payload", f"{payload} bytes, above the limit of {max_bytes} bytes "
                                       f"(syncer.max_message_mb)")
        if name_len > MAX_NAME:
            raise WireError("name", f"{name_len} bytes, at most {MAX_NAME}")
        return dict(kind=KINDS[kind], learner=learner, incarnation=incarnation, version=version, base=base,
                    tokens=tokens, steps=steps, dtype=torch.uint8, shape=(payload,), name_len=name_len,
                    payload=payload, quantized=QUANTIZED[dtype], numel=d0, block=d1)
    if dtype not in DTYPES:
        raise WireError("dtype", f"code {dtype} is not a known dtype")
    if ndim > 2:
        raise WireError("ndim", f"{ndim} dimensions, at most 2 travel")
    if name_len > MAX_NAME:
        raise WireError("name", f"{name_len} bytes, at most {MAX_NAME}")
    dims = (d0, d1)[:ndim]
    if any(d for d in (d0, d1)[ndim:]):
        raise WireError("shape", f"dimensions beyond ndim={ndim} are not zero")
    if DTYPES[dtype] is None:
        if ndim or payload:
            raise WireError("payload", "a message without a tensor carries no shape and no payload")
    else:
        numel = 1
        for d in dims:
            numel *= d
        itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
        if numel * itemsize != payload:
            raise WireError("payload", f"{payload} bytes announced, but shape {list(dims)} of "
                                       f"{DTYPES[dtype]} is {numel * itemsize} bytes")
    if payload > max_bytes:
        raise WireError("payload", f"{payload} bytes, above the limit of {max_bytes} bytes (syncer.max_message_mb)")
    return dict(kind=KINDS[kind], learner=learner, incarnation=incarnation, version=version, base=base, tokens=tokens,
                steps=steps, dtype=DTYPES[dtype], shape=dims, name_len=name_len, payload=payload)


def recv(sock: socket.socket, max_bytes: int) -> Message:
    """Read one message: the header is checked before a byte of payload is read or allocated."""
    raw = bytes(_read_exact(sock, HEADER.size))
    h = parse_header(raw, max_bytes)
    name_raw = bytes(_read_exact(sock, h["name_len"])) if h["name_len"] else b""
    if any(chr(c) not in NAME_CHARS for c in name_raw):
        raise WireError("name", f"{name_raw[:MAX_NAME]!r} holds characters outside [A-Za-z0-9_.]")
    tensor = None
    if h["dtype"] is not None:
        # Read straight into the tensor's memory (no zero-filled staging buffer): its size was checked above.
        tensor = torch.empty(h["shape"], dtype=h["dtype"])
        if h["payload"]:
            _read_exact(sock, h["payload"], memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B"))
    extra = {k: h[k] for k in ("quantized", "numel", "block") if k in h}
    return Message(h["kind"], h["learner"], h["incarnation"], h["version"], h["base"], h["tokens"], h["steps"],
                   name_raw.decode("ascii"), tensor, extra)


def quantized(kind: str, raw: torch.Tensor, wire_dtype: str, numel: int, block: int, **fields) -> Message:
    """A message carrying ``raw`` (uint8: fp32 block scales, then ``numel`` values of ``wire_dtype``)."""
    return Message(kind, tensor=raw, extra={"quantized": wire_dtype, "numel": numel, "block": block}, **fields)


def dequantize(msg: Message) -> Message:
    """``msg`` with its block-quantized payload turned into the fp32 tensor it stands for (others unchanged)."""
    if "quantized" not in msg.extra:
        return msg
    n, block = msg.extra["numel"], msg.extra["block"]
    nb = num_blocks(n, block)
    raw = msg.tensor
    out = torch.zeros(n)
    dequantize_accumulate(raw[4 * nb:].view(QUANT_WIRE[msg.extra["quantized"]]), raw[:4 * nb].view(torch.float32),
                          out, block_size=block)
    return Message(msg.kind, msg.learner, msg.incarnation, msg.version, msg.base, msg.tokens, msg.steps, msg.name,
                   out)


def expect(msg: Message, kind: str, name: Optional[str] = None, numel: Optional[int] = None,
           dtype: torch.dtype = torch.float32) -> Message:
    """Check that ``msg`` is the ``kind`` this side waits for, with tensor ``name`` of ``numel`` ``dtype``
    elements (an ERROR from the peer is raised with its text)."""
    if msg.kind == "ERROR":
        raise Refused(f"the peer refused: {msg.text}")
    if msg.kind != kind:
        raise WireError("kind", f"{msg.kind} where {kind} was expected")
    if name is not None:
        if msg.name != name:
            raise WireError("name", f"{msg.name!r} where {name!r} was expected")
        t = msg.tensor
        if t is None or t.dtype != dtype or t.dim() != 1 or (numel is not None and t.numel() != numel):
            got = None if t is None else (t.dtype, list(t.shape))
            raise WireError("shape", f"tensor {name!r} is {got}, expected {dtype} of [{numel}]")
    return msg


def text(kind: str, words: str, **fields) -> Message:
    return Message(kind, tensor=torch.frombuffer(bytearray(words.encode("utf-8")), dtype=torch.uint8), name="text",
                   **fields)


def int64s(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def connect(address: Tuple[str, int], timeout_s: float, what: str) -> socket.socket:
    """Connect to ``address``, retrying until ``timeout_s``; the error names ``what`` and the address."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(1.0, min(10.0, timeout_s)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)
            return sock
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            raise ConnectionError(f"acco decoupled: could not reach {what} at {address[0]}:{address[1]} within "
                                  f"{timeout_s:g} s (local_sgd.syncer.timeout_s): {last}. Start it (acco-ds "
                                  f"syncer) or check local_sgd.syncer.address")
        time.sleep(0.2)


def split_address(address: str) -> Tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"acco.local_sgd.syncer.address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


__all__ = ["Message", "WireError", "Closed", "Refused", "send", "recv", "expect", "encode", "parse_header", "connect",
           "quantized", "dequantize", "QUANTIZED",
           "split_address", "text", "int64s", "HEADER", "MAGIC", "PROTOCOL", "NO_VERSION", "KINDS"]
