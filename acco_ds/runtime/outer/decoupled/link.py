"""One learner rank's link to its syncer shard in ``"mode": "decoupled"``: the connection (connect, HELLO, send,
receive with a timeout, a look without blocking, connect again after a restart) and the up-link's encoding of a
pseudo-gradient slice, in fp32 or block-quantized with error feedback (``acco.compression`` with ``"outer"``).

The quantized up-link is ``diloco``'s outer compression applied to one send: ``v = Δ + e`` (``e``: this rank's
residual, ``compression.residual_dtype``, kept across periods and checkpointed with the loop), one fp32 scale per
``block_size`` values of ``v`` and one int8/fp8 byte per value (``ops`` ``quantize_pack``: the kernels the other
compressed collectives use), ``e ← v − dequantized``. Only the up-link is quantized: θ_g comes back in fp32."""

import select
import time
from typing import Optional

import torch

from ...comm.compression import OuterCompression
from ....ops.reference import num_blocks
from . import wire


class Uplink:
    """How a rank's Δ slice travels: fp32 (``compression`` None) or block-quantized with error feedback."""

    RESIDUAL = "uplink"  # the key of this rank's residual in ``compression.residuals`` (checkpointed there)

    def __init__(self, compression: Optional[OuterCompression]):
        self.compression = compression

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
            residual = c.residuals.get(self.RESIDUAL)
            if residual is None:
                residual = c.residuals[self.RESIDUAL] = torch.zeros(n, dtype=c.residual_dtype, device=delta.device)
        seg = torch.empty(4 * num_blocks(n, codec.block_size) + n, dtype=torch.uint8, device=delta.device)
        codec.pack(delta, residual, seg)  # scales, then values: the wire's block-quantized payload
        return wire.quantized("DELTA", seg.cpu(), codec.dtype, n, codec.block_size, name="delta", **fields)


class Link:
    """The connection of learner ``learner`` (incarnation ``incarnation``), rank ``shard``, to its shard."""

    def __init__(self, address, learner: int, incarnation: int, shard: int, timeout_s: float, max_bytes: int):
        self.address, self.learner, self.incarnation, self.shard = address, learner, incarnation, shard
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self.sock = None
        self.bytes_sent = 0  # what send() wrote (sendall returns once every byte is written)
        self.delta_bytes = 0  # of which DELTA messages (header, name, payload)
        self.reconnects = 0

    @property
    def where(self) -> str:
        return f"syncer shard {self.shard} at {self.address[0]}:{self.address[1]}"

    def mine(self, kind: str, **fields) -> wire.Message:
        return wire.Message(kind, learner=self.learner, incarnation=self.incarnation, **fields)

    def open(self, timeout_s: float) -> int:
        """Connect and say HELLO; returns the shard's version (``wire.NO_VERSION``: it has no model)."""
        self.sock = wire.connect(self.address, timeout_s, f"syncer shard {self.shard}")
        self.send(self.mine("HELLO"))
        return self.recv("STATE").version

    def reopen(self, deadline: float, err: Exception) -> None:
        """The shard went away (a restart): connect again, same incarnation, until ``deadline``."""
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
        n = wire.send(self.sock, msg)
        self.bytes_sent += n
        if msg.kind == "DELTA":
            self.delta_bytes += n

    def _next(self, what: str) -> wire.Message:
        """One message, within ``timeout_s``; a timeout or a closed connection is an error naming ``what``."""
        self.sock.settimeout(self.timeout_s)
        try:
            return wire.recv(self.sock, self.max_bytes)
        except TimeoutError as err:
            raise TimeoutError(f"acco decoupled: learner {self.learner} rank {self.shard} waited {self.timeout_s:g} s "
                               f"(local_sgd.syncer.timeout_s) for {what} from {self.where}") from err
        except wire.Closed as err:
            raise ConnectionError(f"acco decoupled: {self.where} closed the connection while learner {self.learner} "
                                  f"waited for {what}") from err
        finally:
            if self.sock is not None:
                self.sock.settimeout(None)

    def recv(self, kind: str, name: Optional[str] = None, numel: Optional[int] = None) -> wire.Message:
        return wire.expect(self._next(kind), kind, name, numel if name else None)

    def recv_params(self, numel: int) -> wire.Message:
        """The next PARAMS, past the ACKs of DELTAs that were not waited for."""
        while True:
            msg = self._next("its merge")
            if msg.kind != "ACK":
                return wire.expect(msg, "PARAMS", "theta", numel)

    def poll_params(self, numel: int) -> Optional[wire.Message]:
        """PARAMS if it has arrived (ACKs before it are read past), else None; waits only for a message that has
        begun to arrive."""
        while select.select([self.sock], [], [], 0)[0]:
            msg = self._next("its merge")
            if msg.kind != "ACK":
                return wire.expect(msg, "PARAMS", "theta", numel)
        return None

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


__all__ = ["Link", "Uplink"]
