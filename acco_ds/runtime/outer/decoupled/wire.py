"""The messages of ``"mode": "decoupled"``: what a learner rank and a syncer shard say to each other, as ZeroMQ
frames (``transport`` carries them: CURVE encryption, heartbeats, high-water marks, a size limit per frame).
Nothing received is unpickled, and no float travels inside a structure: a message is one header frame and, when
it carries a tensor, the tensor's raw bytes in frames of ``CHUNK`` bytes (sent without a copy in Python; received
into a buffer of the receiver's, allocated only once the header passed the receiver's checks).

Header frame (little-endian, ``HEADER.size`` = 84 bytes), then ``name_len`` bytes of name in the same frame::

    magic "ACDZ" | protocol u16 | kind u16 | learner u32 | incarnation u64 | version u64 | base u64 |
    tokens u64 | steps u32 | dtype u8 | ndim u8 | name_len u16 | shape 2 x u64 | payload u64 | boot u64

``boot`` is the sending shard's start (a random number per process): a learner that sees it change knows the
shard restarted. From a learner, ``boot`` is its connection's token (``identity``). A block-quantized tensor (dtype ``int8`` or ``fp8``: a compressed pseudo-gradient) travels as
shape ``[n, B]``: ``n`` values in blocks of ``B`` elements, its payload the ``ceil(n / B)`` fp32 block scales then
the ``n`` one-byte values (``ops.reference.quantize_pack``'s format), exactly ``4 ceil(n / B) + n`` bytes.

Every field is checked before the payload is looked at; the payload frame must be exactly as long as the header
says. ZeroMQ itself refuses a frame above ``ZMQ_MAXMSGSIZE`` before it allocates it (``transport``). A message that
breaks a rule raises ``WireError`` naming the field and the rule; the receiver answers ERROR and changes nothing.
"""

import struct
import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ....ops.reference import dequantize_accumulate, num_blocks

MAGIC = b"ACDZ"
PROTOCOL = 2
HEADER = struct.Struct("<4sHHIQQQQIBBH2QQQ")
NO_VERSION = (1 << 64) - 1  # an empty syncer (no model yet)
MAX_NAME = 64
NAME_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")

KINDS = {
    1: "HELLO",  # learner -> shard: learner id, incarnation, tokens per inner step (``tokens``), the link's role
    #              (``steps``: 0 data, 1 heartbeat), the token its connection held before (``boot``); answered STATE
    2: "STATE",  # shard -> learner: version (NO_VERSION: no model yet), liveness_s in ms (``tokens``), the
    #              connection's token (``incarnation``), which every later message of it carries in ``boot``, the
    #              syncer's number of shards (``steps``; 0: not said)
    3: "INIT",  # learner -> shard: "theta", the starting weights of an empty syncer
    4: "GET",  # learner -> shard: send the current θ_g
    5: "PARAMS",  # shard -> learner: "theta" of ``version``
    6: "DELTA",  # learner -> shard: "delta" from version ``base``, with tokens and steps, and in ``version`` the
    #              period's inner steps taken before the learner adopted ``base`` (adopt "overlap"); answered ACK
    7: "ACK",  # shard -> learner: the Δ is held
    8: "READY",  # learner rank 0 -> shard 0: every rank's Δ is held, the learner is pending
    9: "DONE",  # learner -> shard: finished for good
    10: "FOLLOW",  # shard j -> shard 0: shard j takes merge decisions from version ``version`` + 1 on
    11: "MERGE",  # shard 0 -> shard j: "learners" (int64 pairs learner, incarnation) make ``version``
    12: "DROP",  # shard 0 -> shard j: forget the Δ of (learner, incarnation)
    13: "ERROR",  # either way: "text" (utf-8) saying why the message was refused
    14: "PING",  # learner -> shard: alive; ``base``: the base of its Δ in flight (or NO_VERSION)
    15: "PONG",  # shard -> learner: ``version``; ``steps``: that Δ is HELD (0), MERGED (1) or LOST (2)
}
KIND = {name: code for code, name in KINDS.items()}
HELD, MERGED, LOST = 0, 1, 2

DTYPES = {0: None, 1: torch.float32, 2: torch.float64, 3: torch.int64, 4: torch.uint8, 5: torch.bfloat16,
          6: torch.float16}
DTYPE_CODE = {dt: code for code, dt in DTYPES.items() if dt is not None}
ITEMSIZE = {code: torch.empty((), dtype=dt).element_size() for code, dt in DTYPES.items() if dt is not None}
QUANTIZED = {7: "int8", 8: "fp8"}  # block-quantized: shape [n, B], payload 4 ceil(n / B) scale bytes + n values
QUANTIZED_CODE = {name: code for code, name in QUANTIZED.items()}
QUANT_WIRE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
MIN_BLOCK, MAX_BLOCK = 8, 1 << 20  # compression.block_size's bounds
# A payload travels in frames of this many bytes: with CURVE each frame is encrypted and authenticated on its
# own, so the receiver decrypts frame k while the sender encrypts frame k + 1 (a single frame could only be opened
# once all of it had arrived). 1 MiB: 64 MiB there and back over CURVE took 0.22 s in frames of 0.5 or 1 MiB, 0.5 s
# in frames of 8 MiB (libzmq allocates and copies each frame to encrypt it; docs/benchmarks/decoupled.md).
CHUNK = 1 << 20


class WireError(ValueError):
    """A message broke a rule of the wire: ``field`` names what, ``str()`` says why."""

    def __init__(self, field_name: str, why: str):
        super().__init__(f"refused message: {field_name}: {why}")
        self.field = field_name


class Refused(ConnectionError):
    """The peer answered ERROR: it refused what this side sent (``str()`` holds its reason)."""


class Closed(ConnectionError):
    """The peer is gone or restarted (no answer in time, or a new ``boot``)."""


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
    boot: int = 0

    @property
    def text(self) -> str:
        return bytes(self.tensor.numpy()).decode("utf-8", "replace") if self.tensor is not None else ""


def _payload(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def encode(msg: Message) -> List:
    """The frames of ``msg``: the header (with the name) and, if it carries a tensor, its raw bytes."""
    t, name = msg.tensor, msg.name.encode("ascii")
    quant = msg.extra.get("quantized")
    if quant is not None:  # raw scales + values: the shape says how many values in blocks of how many
        payload = _payload(t.contiguous())
        dtype, ndim, dims = QUANTIZED_CODE[quant], 2, (msg.extra["numel"], msg.extra["block"])
    elif t is None:
        dtype, ndim, dims, payload = 0, 0, (0, 0), None
    else:
        if t.dim() > 2:
            raise WireError("shape", f"{t.dim()} dimensions, at most 2 travel")
        t = t.detach().contiguous().cpu()
        dtype, ndim = DTYPE_CODE[t.dtype], t.dim()
        dims = tuple(t.shape) + (0,) * (2 - t.dim())
        payload = _payload(t)
    nbytes = 0 if payload is None else payload.nbytes
    head = HEADER.pack(MAGIC, PROTOCOL, KIND[msg.kind], msg.learner, msg.incarnation, msg.version, msg.base,
                       msg.tokens, msg.steps, dtype, ndim, len(name), *dims, nbytes, msg.boot) + name
    if payload is None:
        return [head]
    return [head] + [payload[i:i + CHUNK] for i in range(0, nbytes, CHUNK)] if nbytes else [head, payload]


def size(frames) -> int:
    return sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)


def _check_quantized(ndim, d0, d1, payload, dtype) -> None:
    if ndim != 2 or not MIN_BLOCK <= d1 <= MAX_BLOCK:
        raise WireError("shape", f"a block-quantized tensor travels as [values, block size] with a block size of "
                                 f"{MIN_BLOCK} to {MAX_BLOCK}, got ndim={ndim} shape {[d0, d1]}")
    want = 4 * num_blocks(d0, d1) + d0
    if payload != want:
        raise WireError("payload", f"{payload} bytes announced, but {d0} {QUANTIZED[dtype]} values in blocks of "
                                   f"{d1} are {want} bytes (fp32 scales, then one byte per value)")


def parse_header(raw: bytes, max_bytes: int) -> dict:
    """Check every field of a header frame (the struct and the name after it); returns them. Raises
    ``WireError`` naming the first bad field."""
    if len(raw) < HEADER.size:
        raise WireError("header", f"{len(raw)} bytes, a header is {HEADER.size}")
    (magic, protocol, kind, learner, incarnation, version, base, tokens, steps, dtype, ndim, name_len, d0, d1,
     payload, boot) = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise WireError("magic", f"{bytes(magic)!r} is not {MAGIC!r}: not an acco_ds decoupled message")
    if protocol != PROTOCOL:
        raise WireError("protocol", f"version {protocol}, this side speaks {PROTOCOL}: run the same acco_ds on both")
    if kind not in KINDS:
        raise WireError("kind", f"{kind} is not a message kind")
    if name_len > MAX_NAME or len(raw) != HEADER.size + name_len:
        raise WireError("name", f"{name_len} bytes announced (at most {MAX_NAME}), the frame holds "
                                f"{len(raw) - HEADER.size}")
    name = bytes(raw[HEADER.size:])
    if any(c not in NAME_CHARS for c in name):
        raise WireError("name", f"{name!r} holds characters outside [A-Za-z0-9_.]")
    out = dict(kind=KINDS[kind], learner=learner, incarnation=incarnation, version=version, base=base, tokens=tokens,
               steps=steps, name=name.decode("ascii"), payload=payload, boot=boot)
    if dtype in QUANTIZED:
        _check_quantized(ndim, d0, d1, payload, dtype)
        out.update(dtype=torch.uint8, shape=(payload,), quantized=QUANTIZED[dtype], numel=d0, block=d1)
    else:
        if dtype not in DTYPES:
            raise WireError("dtype", f"code {dtype} is not a known dtype")
        if ndim > 2:
            raise WireError("ndim", f"{ndim} dimensions, at most 2 travel")
        dims = (d0, d1)[:ndim]
        if any(d for d in (d0, d1)[ndim:]):
            raise WireError("shape", f"dimensions beyond ndim={ndim} are not zero")
        if DTYPES[dtype] is None:
            if ndim or payload:
                raise WireError("payload", "a message without a tensor carries no shape and no payload")
        elif (d0 if ndim else 1) * (d1 if ndim == 2 else 1) * ITEMSIZE[dtype] != payload:
            raise WireError("payload", f"{payload} bytes announced, but shape {list(dims)} of {DTYPES[dtype]} is "
                                       f"a different size")
        out.update(dtype=DTYPES[dtype], shape=dims)
    if payload > max_bytes:
        raise WireError("payload", f"{payload} bytes, above the limit of {max_bytes} bytes (syncer.max_message_mb)")
    return out


def decode(frames, max_bytes: int, check=None, into=None) -> Message:
    """One message from its frames (``bytes``, ``memoryview`` or ``zmq.Frame``): the header is checked first
    (``check(header)``, if given, may refuse it by the receiver's own layout before a byte of payload is copied),
    the payload frames must have exactly the announced lengths. One frame becomes a tensor over the frame's memory;
    several are copied into ``into(nbytes)`` (a uint8 tensor of the receiver's, or None: a new one)."""
    if not frames:
        raise WireError("frames", "an empty message")
    h = parse_header(_buffer(frames[0]), max_bytes)
    if check is not None:
        check(h)
    tensor = None
    if h["dtype"] is None:
        if len(frames) != 1:
            raise WireError("frames", f"{len(frames)} frames for a message without a tensor")
    else:
        tensor = _payload_tensor(frames[1:], h, into)
    extra = {k: h[k] for k in ("quantized", "numel", "block") if k in h}
    return Message(h["kind"], h["learner"], h["incarnation"], h["version"], h["base"], h["tokens"], h["steps"],
                   h["name"], tensor, extra, h["boot"])


def _payload_tensor(frames, h, into=None) -> torch.Tensor:
    """The tensor of payload frames that must be exactly ``ceil(payload / CHUNK)`` (at least one), each ``CHUNK``
    bytes but the last, summing to the announced size: one frame becomes a tensor over its memory, several are
    copied into ``into(payload)`` (or a new tensor), allocated only once their sizes were checked."""
    n = h["payload"]
    want = max(1, -(-n // CHUNK))
    if len(frames) != want:
        raise WireError("frames", f"{len(frames)} payload frames, {n} bytes travel in {want}")
    bufs = [_buffer(f) for f in frames]
    sizes = [len(b) for b in bufs]
    if sum(sizes) != n or any(size != CHUNK for size in sizes[:-1]):
        raise WireError("payload", f"{sum(sizes)} bytes arrived in frames of {sizes[:3]}..., the header announced "
                                   f"{n} in frames of {CHUNK}")
    if not n:
        return torch.empty(h["shape"], dtype=h["dtype"])
    if len(bufs) == 1:
        with warnings.catch_warnings():  # a received frame is read-only; nothing writes into it
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(bufs[0], dtype=h["dtype"]).view(h["shape"])
    raw = into(n) if into is not None else None
    out = (torch.empty(n, dtype=torch.uint8) if raw is None else raw).view(h["dtype"]).view(h["shape"])
    flat = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
    for i, b in enumerate(bufs):
        flat[i * CHUNK:i * CHUNK + len(b)] = b
    return out


def _buffer(frame) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame: its memory, without a copy
    return memoryview(buf).cast("B")


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
                   out, boot=msg.boot)


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


def split_address(address: str) -> Tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"acco.local_sgd.syncer.address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


__all__ = ["Message", "WireError", "Closed", "Refused", "encode", "decode", "expect", "parse_header", "size",
           "quantized", "dequantize", "QUANTIZED", "split_address", "text", "int64s", "HEADER", "MAGIC", "PROTOCOL",
           "NO_VERSION", "KINDS", "HELD", "MERGED", "LOST"]
