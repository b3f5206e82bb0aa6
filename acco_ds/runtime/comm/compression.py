"""Compressed collectives: block-quantized reduce-scatter, all-gather and all-reduce.

Off by default (``acco.compression.dtype = null``): the engine then never
calls this module and every result is bit-identical to uncompressed runs.

Wire format of one *segment* (``m`` elements of one destination): the
``ceil(m / B)`` fp32 block scales, then ``m`` one-byte values (int8 or fp8
e4m3), padded to a multiple of 4 bytes. At B = 256: ``m (1 + 4/256)`` bytes
instead of ``4m`` (fp32) or ``2m`` (bf16), 0.254x and 0.508x.

* :func:`reduce_scatter` -- each rank quantizes the chunks the other ranks own
  (adding its error-feedback residual first), one ``all_to_all_single`` per
  chunk of the partition moves them, and the receiver sums in fp32 in rank
  order, its own chunk unquantized. Partial sums are never re-quantized (a
  ring would quantize at every hop).
* :func:`all_gather` -- for parameters. The owner quantizes its *update*,
  ``target - current`` (``current``: the copy every rank holds), and every
  rank, the owner included, writes ``current + dequantized update``: all
  copies stay bitwise equal, and the owner's fp32 master stays exact. This
  needs no residual: the next update is taken against the copy actually
  held, so one round's quantization error is part of the next round's update.
* :func:`all_reduce` -- for the local-SGD pseudo-gradient: the quantized
  reduce-scatter, the mean, then a quantized all-gather of the mean (with its
  own residual); every rank reads the same dequantized bytes.

Error feedback: a residual buffer per send keeps ``sent - true`` (the part
quantization left out) and adds it to the next send of the same region.
Residuals are rank state (checkpointed by the host). A node-aware layout
(``collectives.NodeLayout``) quantizes only the step across nodes; the steps
inside a node stay at full precision.
"""

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as tdist

from ...ops.reference import WIRE_DTYPES, num_blocks
from . import collectives
from ..dtypes import as_dtype

logger = logging.getLogger("acco_ds")

__all__ = ["Codec", "OuterCompression", "describe", "round_codec", "residual_dtype", "residuals_to_load",
           "load_outer_residuals", "reduce_scatter", "all_gather", "all_reduce",
           "rs_residual_elems", "all_reduce_residual_elems"]


@dataclass
class Codec:
    """Block quantization ``dtype`` ("int8" | "fp8") with one fp32 scale per ``block_size`` elements, run by
    ``kernels`` (``ops.Kernels``: native or the torch reference). ``chunk_elems``: elements of a partition
    exchanged per collective (rounded to whole blocks), which bounds the staging buffers."""
    dtype: str
    block_size: int
    kernels: object
    chunk_elems: int = collectives.DEFAULT_CHUNK_ELEMS
    sent_bytes: int = 0  # bytes this rank handed to compressed collectives (payload of its sends)

    def __post_init__(self):
        self.wire = WIRE_DTYPES[self.dtype]
        self.chunk_elems = max(self.block_size, self.chunk_elems // self.block_size * self.block_size)

    def segment_bytes(self, m: int) -> int:
        raw = 4 * num_blocks(m, self.block_size) + m
        return -(-raw // 4) * 4

    def _views(self, seg: torch.Tensor, m: int):
        nb = num_blocks(m, self.block_size)
        return seg[4 * nb:4 * nb + m].view(self.wire), seg[:4 * nb].view(torch.float32)

    def pack(self, x: torch.Tensor, residual: Optional[torch.Tensor], seg: torch.Tensor) -> None:
        """Quantize ``x`` (+ ``residual``, which becomes the new residual) into the uint8 segment ``seg``."""
        q, scales = self._views(seg, x.numel())
        self.kernels.quantize_pack(x, residual, q, scales, block_size=self.block_size)

    def unpack_add(self, seg: torch.Tensor, out: torch.Tensor) -> None:
        """``out += dequantized segment`` (rounded to ``out``'s dtype)."""
        q, scales = self._views(seg, out.numel())
        self.kernels.dequantize_accumulate(q, scales, out, block_size=self.block_size)

    def __str__(self):
        return f"{self.dtype} blocks of {self.block_size}"


def residual_dtype(c) -> Optional[torch.dtype]:
    """The dtype of a ``CompressionConfig``'s error-feedback residuals (None: no error feedback)."""
    return as_dtype(c.residual_dtype) if c.error_feedback else None


def round_codec(acco, kernels, layout, world_size: int, crosses_nodes: bool = True):
    """The codec of the rounds and the buffers' ``RoundCompression`` for an ``ACCOConfig``, or (None, None)
    when rounds are not compressed. ``layout``: the node-aware layout (its rail is the quantized step);
    ``crosses_nodes``: the group spans nodes (``apply_to`` auto compresses only such groups)."""
    from ..rounds.buffers import RoundCompression
    c = acco.compression
    if not c.applies_to("rounds", crosses_nodes):
        return None, None
    peers = layout.nodes if layout is not None else world_size
    if peers == 1:  # a group of one rank sends nothing
        return None, None
    return Codec(c.dtype, c.block_size, kernels), RoundCompression(peers, residual_dtype(c))


def describe(c, local: bool, rounds: Optional[bool] = None, outer: Optional[bool] = None,
             decoupled: bool = False) -> str:
    """What a ``CompressionConfig`` compresses, in words (the banner and ``acco-ds report --config``);
    ``rounds``/``outer``: whether the run compresses them (None: as configured, before groups exist);
    ``decoupled``: the outer exchange is the up-link to the syncer, not an all-reduce."""
    if not c.enabled:
        return "off (full precision)"
    auto = c.apply_to is None
    rounds = c.applies_to("rounds") if rounds is None else rounds
    outer = (local and c.applies_to("outer")) if outer is None else outer
    what = []
    if rounds:
        what.append("round reduce-scatter + all-gather (node-aware: the step across nodes)")
    if outer:
        what.append("the up-link to the syncer (each learner's pseudo-gradient)" if decoupled else "outer all-reduce")
    if auto:
        what.append("auto: only groups that span nodes")
    ef = f"error feedback in {c.residual_dtype}" if c.error_feedback else "no error feedback"
    return f"{c.dtype}, one fp32 scale per {c.block_size} values, {ef}, on: {'; '.join(what) or 'nothing'}"


def rs_residual_elems(world: int, partition: int) -> int:
    """Residual elements of :func:`reduce_scatter` on a group of ``world`` ranks (one row per other rank)."""
    return (world - 1) * partition


def all_reduce_residual_elems(world: int, numel: int) -> int:
    """Residual elements of :func:`all_reduce` of ``numel`` elements on ``world`` ranks."""
    return world * -(-numel // world)


def _chunks(total: int, n: int):
    for start in range(0, total, n):
        yield start, min(n, total - start)


def _flat_reduce_scatter(output, rows, group, codec: Codec, residual: Optional[torch.Tensor]) -> None:
    """``output`` (fp32, P) = sum over ranks of ``rows[rank]`` (``rows``: W x P), quantized sends."""
    world, rank = tdist.get_world_size(group), tdist.get_rank(group)
    P = output.numel()
    out = output.view(-1)
    if world == 1 or P == 0:
        out.copy_(rows[rank])
        return
    others = [r for r in range(world) if r != rank]
    res = None if residual is None else residual.view(world - 1, P)
    n = min(codec.chunk_elems, P)
    send = torch.empty((world - 1) * codec.segment_bytes(n), dtype=torch.uint8, device=output.device)
    recv = torch.empty_like(send)
    for start, m in _chunks(P, n):
        sb = codec.segment_bytes(m)
        for j, r in enumerate(others):
            codec.pack(rows[r, start:start + m], None if res is None else res[j, start:start + m],
                       send[j * sb:(j + 1) * sb])
        splits = [0 if r == rank else sb for r in range(world)]
        tdist.all_to_all_single(recv[:(world - 1) * sb], send[:(world - 1) * sb], splits, splits, group=group)
        codec.sent_bytes += (world - 1) * sb
        o = out[start:start + m]
        o.zero_()
        for r in range(world):  # rank order; this rank's own chunk is never quantized
            if r == rank:
                o.add_(rows[rank, start:start + m])
            else:
                j = r if r < rank else r - 1
                codec.unpack_add(recv[j * sb:(j + 1) * sb], o)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, codec: Codec,
                   residual: Optional[torch.Tensor]) -> None:
    """``output`` (fp32, P elements) = this rank's partition of the sum of every rank's ``input`` (W x P
    elements, any float dtype), the sends quantized with error feedback in ``residual`` (None: no error
    feedback; else ``rs_residual_elems`` elements of the rail (node-aware) or the group)."""
    if isinstance(group, collectives.NodeLayout):
        P, R, k = output.numel(), group.nodes, group.per_node
        rows = input.view(R, k * P)
        node_sums = input.new_empty(R * P)  # the node's sums of this rank's rail chunks: full precision
        for n in range(R):
            collectives.reduce_scatter(node_sums[n * P:(n + 1) * P], rows[n], group.node)
        _flat_reduce_scatter(output, node_sums.view(R, P), group.rail, codec, residual)
        return
    world = tdist.get_world_size(group)
    _flat_reduce_scatter(output, input.view(world, -1), group, codec, residual)


def _flat_all_gather(out, current, target, offsets: Sequence[int], group, codec: Codec,
                     residual: Optional[torch.Tensor] = None) -> None:
    """For each group rank r: ``out[offsets[r]:+P] = current[...] + deq(Q(target_r - current[...]))``
    (``residual``: error feedback on this rank's sends, P elements, or None)."""
    world, rank = tdist.get_world_size(group), tdist.get_rank(group)
    P = target.numel()
    n = min(codec.chunk_elems, max(P, 1))
    sb_max = codec.segment_bytes(n)
    gathered = torch.empty(world * sb_max, dtype=torch.uint8, device=out.device)
    delta = torch.empty(n, dtype=torch.float32, device=out.device)
    for start, m in _chunks(P, n):
        sb = codec.segment_bytes(m)
        mine = offsets[rank] + start
        d = delta[:m]
        torch.sub(target[start:start + m], current[mine:mine + m], out=d)  # before ``out`` overwrites target
        segs = gathered[:world * sb]
        codec.pack(d, None if residual is None else residual[start:start + m], segs[rank * sb:(rank + 1) * sb])
        collectives.all_gather(segs, segs[rank * sb:(rank + 1) * sb], group)
        codec.sent_bytes += sb
        for r in range(world):
            lo = offsets[r] + start
            o = out[lo:lo + m]
            if out is not current:
                o.copy_(current[lo:lo + m])
            codec.unpack_add(segs[r * sb:(r + 1) * sb], o)


def all_gather(out: torch.Tensor, current: torch.Tensor, target: torch.Tensor, group, codec: Codec) -> None:
    """Every rank r's part of the flat ``out`` becomes ``current``'s part plus rank r's quantized update
    ``target_r - current_r`` (``target``: this rank's new part, P elements; ``out`` may be ``current``,
    and ``target`` may be this rank's part of ``out``). All ranks end with the same bits."""
    P = target.numel()
    if isinstance(group, collectives.NodeLayout):
        R, k = group.nodes, group.per_node
        i = tdist.get_rank(group.node)
        _flat_all_gather(out, current, target, [(n * k + i) * P for n in range(R)], group.rail, codec)
        for n in range(R):  # inside each node at full precision: every rank computed the same values
            block = out[n * k * P:(n + 1) * k * P]
            collectives.all_gather(block, block[i * P:(i + 1) * P], group.node)
        return
    world = tdist.get_world_size(group)
    _flat_all_gather(out, current, target, [r * P for r in range(world)], group, codec)


def all_reduce(tensors: List[torch.Tensor], group, codec: Codec, residuals: Optional[List[torch.Tensor]],
               divide_by: float = 1.0) -> None:
    """``t ← (sum over ranks of t) / divide_by`` in place for each fp32 tensor, quantized both ways:
    a reduce-scatter of the ``W`` parts, then an all-gather of each owner's result (every rank, the owner
    included, takes the dequantized bytes). ``residuals``: per tensor ``all_reduce_residual_elems``
    elements (the reduce-scatter's rows, then the all-gather's), or None."""
    world = tdist.get_world_size(group)
    for i, t in enumerate(tensors):
        n = t.numel()
        P = -(-n // world)
        padded = t.new_zeros(world * P)
        padded[:n] = t.view(-1)
        res = None if residuals is None else residuals[i].view(-1)
        part = torch.empty(P, dtype=torch.float32, device=t.device)
        _flat_reduce_scatter(part, padded.view(world, P), group, codec,
                             None if res is None else res[:(world - 1) * P])
        if divide_by != 1.0:
            part.div_(divide_by)
        # All-gather of the result onto zeros: the "update" is the value itself; everyone, this rank too,
        # takes the dequantized bytes.
        padded.zero_()
        _flat_all_gather(padded, padded, part, [r * P for r in range(world)], group, codec,
                         None if res is None else res[(world - 1) * P:])
        t.view(-1).copy_(padded[:n])


def residuals_to_load(have: bool, had: bool, what: str) -> bool:
    """Whether saved residuals of ``what`` are to be copied in: a run that turned compression (or its error
    feedback) on or off since the save is told what happens to them instead."""
    if had and not have:
        logger.warning(f"ACCO: the checkpoint holds error-feedback residuals of {what} but this run does not "
                       f"compress it (or has error_feedback off): they are dropped (what quantization left out "
                       f"of the last sends is not sent)")
    elif have and not had:
        logger.warning(f"ACCO: compression of {what} starts here: its error-feedback residuals start at zero")
    return have and had


class OuterCompression:
    """The local-SGD outer all-reduce, compressed: the codec and one residual per region of the
    pseudo-gradient (``key``: which tensor and where, e.g. ``(i, offset)``), allocated at first use."""

    def __init__(self, codec: Codec, residual_dtype: Optional[torch.dtype]):
        self.codec, self.residual_dtype = codec, residual_dtype
        self.residuals = {}

    @classmethod
    def from_config(cls, acco, kernels, crosses_nodes: bool = True) -> Optional["OuterCompression"]:
        c = acco.compression
        if not c.applies_to("outer", crosses_nodes):
            return None
        return cls(Codec(c.dtype, c.block_size, kernels), residual_dtype(c))

    def all_reduce(self, t: torch.Tensor, key, group, divide_by: float = 1.0) -> int:
        """``t ← sum over the group / divide_by`` (``all_reduce``); returns the bytes this rank sent."""
        res = None
        if self.residual_dtype is not None:
            res = self.residuals.get(key)
            if res is None:
                res = torch.zeros(all_reduce_residual_elems(tdist.get_world_size(group), t.numel()),
                                  dtype=self.residual_dtype, device=t.device)
                self.residuals[key] = res
        before = self.codec.sent_bytes
        all_reduce([t], group, self.codec, None if res is None else [res], divide_by)
        return self.codec.sent_bytes - before

    def state_dict(self) -> dict:
        return {key: r.clone() for key, r in self.residuals.items()}

    def load_state_dict(self, saved: Optional[dict]) -> None:
        self.residuals = {key: r.clone() for key, r in (saved or {}).items()} if self.residual_dtype else {}

    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.residuals.values())


def load_outer_residuals(compression: Optional[OuterCompression], saved: Optional[dict]) -> None:
    """Restore the outer all-reduce's residuals (``OuterLoop.load_state_dict``)."""
    have = compression is not None and compression.residual_dtype is not None
    residuals_to_load(have, (saved is not None) if have else bool(saved), "the outer all-reduce")
    if have:
        compression.load_state_dict(saved)
