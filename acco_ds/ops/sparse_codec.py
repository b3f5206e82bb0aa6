"""The wire format of one replica's sparseloco payload: indices packed at the bits their chunk needs, and an
optional entropy coding (zlib) of the sorted index gaps, the value codes and the scales.

``sparse_pack`` (``reference.py`` and the native kernels) selects, quantizes and leaves the residual; it hands
over ``(indices, values, scales)`` with each kept entry's index inside its chunk as an int16 (the 16 bits of
an unsigned number), chunk after chunk, ascending inside a chunk. Sixteen bits are more than a chunk needs, and
the indices of a chunk are sorted, so their gaps are small. This module turns that payload into the bytes that
travel (``encode``) and back (``decode``), losslessly: the receiver gets the same int16 indices, the same codes
and the same scales, so every rule downstream is unchanged, bit for bit.

Packed (always): the indices of chunk c (length L, k = min(topk, L) kept) take ``w = index_bits(L)`` =
⌈log2 L⌉ bits each (12 for chunks of 4096), and none when k == L (every entry kept: the indices are 0 … L−1).
Entry j sits at bit j·w of its chunk's index bytes, little-endian, each chunk starting on a byte, as the value
codes do. Bytes per chunk: ``ceil(k·w/8) + ceil(k·b/8) + 4`` with b-bit values (``4k`` without quantization,
and no scale) — 116 for the defaults (4096, 64, 2 bits) against 148 with 16-bit indices.

Entropy coding (``coding="zlib"``): the index gaps (per chunk the first index, then each index minus the
previous one minus 1; uint16) as two byte planes (low bytes, then high bytes: the high plane is nearly all
zeros), then the values' bytes and the scales' bytes, through one ``zlib.compress`` stream. A random 64 of
4096 has log2 C(4096, 64) ≈ 471 bits (59 bytes) of information; zlib codes its gap planes in 61 bytes. zlib
ships with Python (no new dependency) and, measured on these streams (``benchmarks/sparse_wire.py``), comes
within 2% of a hand-written Rice coder and of zstandard at level 19, and beats lzma and bz2
(docs/benchmarks/sparse.md). The encoder keeps whichever of
packed and zlib is smaller for that payload, so coding never costs more than one tag byte.

Wire layout: one tag byte (0 packed, 1 zlib), then the body.
"""

import zlib
from typing import Optional, Tuple

import torch

from .reference import index_bits, index_layout, sparse_layout, sparse_payload_bytes

CODINGS = (None, "zlib")  # acco.local_sgd.entropy_coding: null = packed indices only
TAG_PACKED, TAG_ZLIB = 0, 1
ZLIB_LEVEL = 6  # zlib's default: levels 1 and 9 are within 1% of its size on these streams


def _entry_bits(offsets: torch.Tensor, topk: int):
    """Per kept entry: (its chunk's width, its first bit in the packed index bytes); and the total bytes."""
    kept, widths, entry_starts, byte_starts = index_layout(offsets, topk)
    chunk_of = torch.repeat_interleave(torch.arange(kept.numel()), kept)
    j = torch.arange(int(entry_starts[-1])) - entry_starts[:-1][chunk_of]
    w = widths[chunk_of]
    return w, byte_starts[:-1][chunk_of] * 8 + j * w, int(byte_starts[-1])


def pack_indices(indices: torch.Tensor, offsets: torch.Tensor, topk: int) -> torch.Tensor:
    """The int16 indices of ``sparse_pack`` at their chunk's width (uint8, on ``indices``' device)."""
    w, bit, total = _entry_bits(offsets, topk)
    if indices.numel() != w.numel():
        raise ValueError(f"pack_indices: {indices.numel()} indices, but these offsets and topk={topk} keep "
                         f"{w.numel()}: the payload does not belong to these offsets")
    dev = indices.device
    w, bit = w.to(dev), bit.to(dev)
    v = (indices.to(torch.int64) & 0xFFFF) << (bit % 8)  # at most 16 + 7 bits: three bytes
    v = torch.where(w > 0, v, torch.zeros_like(v))  # width 0: the index is implied, nothing travels
    out = torch.zeros(total + 3, dtype=torch.int64, device=dev)
    at = bit // 8
    for s in range(3):  # the fields do not overlap, so adding is OR-ing
        out.index_add_(0, at + s, (v >> (8 * s)) & 0xFF)
    return out[:total].to(torch.uint8)


def unpack_indices(packed: torch.Tensor, offsets: torch.Tensor, topk: int) -> torch.Tensor:
    """``pack_indices``' inverse: the int16 indices (0 … L−1 for a chunk whose entries are all kept)."""
    w, bit, total = _entry_bits(offsets, topk)
    if packed.numel() != total:
        raise ValueError(f"unpack_indices: {packed.numel()} bytes of packed indices, these offsets and topk={topk} "
                         f"need {total}: the payload does not belong to these offsets")
    dev = packed.device
    w, bit = w.to(dev), bit.to(dev)
    b = torch.cat([packed.to(torch.int64), packed.new_zeros(3, dtype=torch.int64)])
    at = bit // 8
    v = b[at] | (b[at + 1] << 8) | (b[at + 2] << 16)
    i = (v >> (bit % 8)) & ((1 << w) - 1)
    every = w == 0  # every entry kept (or a chunk of one element): the entry's number is its index
    if bool(every.any()):
        kept, _, entry_starts, _ = index_layout(offsets, topk)
        chunk_of = torch.repeat_interleave(torch.arange(kept.numel()), kept).to(dev)
        j = torch.arange(w.numel(), device=dev) - entry_starts.to(dev)[:-1][chunk_of]
        i = torch.where(every, j, i)
    return i.to(torch.int16)  # the 16 bits of an unsigned number, as sparse_pack writes them


def _gaps(indices: torch.Tensor, offsets: torch.Tensor, topk: int) -> torch.Tensor:
    """Per entry the gap to the previous index of its chunk minus 1 (the first: its index), int64, CPU."""
    kept, _, entry_starts, _ = index_layout(offsets, topk)
    i = indices.cpu().to(torch.int64) & 0xFFFF
    prev = torch.cat([i.new_full((1,), -1), i[:-1]])
    prev[entry_starts[:-1][kept > 0]] = -1  # a chunk's first entry: the gap from -1
    return i - prev - 1


def _ungap(gaps: torch.Tensor, offsets: torch.Tensor, topk: int) -> torch.Tensor:
    """``_gaps``' inverse: the int16 indices."""
    kept, _, entry_starts, _ = index_layout(offsets, topk)
    run = (gaps + 1).cumsum(0)
    chunk_of = torch.repeat_interleave(torch.arange(kept.numel()), kept)
    before = torch.cat([run.new_zeros(1), run])[entry_starts[:-1]][chunk_of]  # the cumsum up to the chunk
    return (run - before - 1).to(torch.int16)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode(payload, offsets: torch.Tensor, *, topk: int, value_bits: int, coding: Optional[str]) -> torch.Tensor:
    """The bytes one replica sends (uint8, on the payload's device): a tag, then the packed payload, or its
    zlib coding when ``coding == "zlib"`` and that is smaller."""
    if coding not in CODINGS:
        raise ValueError(f"entropy_coding must be null or \"zlib\", got {coding!r}")
    indices, values, scales = payload
    if coding == "zlib":  # first: when it pays (nearly always on real payloads) the packing is not needed
        g = _gaps(indices, offsets, topk)
        planes = torch.cat([g & 0xFF, g >> 8]).to(torch.uint8)
        z = zlib.compress(_raw(planes) + _raw(values) + _raw(scales), ZLIB_LEVEL)
        if len(z) < sparse_payload_bytes(offsets, topk, value_bits) - 1:
            body = torch.frombuffer(bytearray(z), dtype=torch.uint8).to(indices.device)
            return torch.cat([body.new_full((1,), TAG_ZLIB), body])
    packed = [pack_indices(indices, offsets, topk), values.contiguous().view(torch.uint8),
              scales.contiguous().view(torch.uint8)]
    body = torch.cat([t.reshape(-1) for t in packed])
    return torch.cat([body.new_full((1,), TAG_PACKED), body])


def decode(wire: torch.Tensor, offsets: torch.Tensor, *, topk: int, value_bits: int, device=None
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``encode``'s inverse: ``(indices int16, values, scales)`` as ``sparse_pack`` returned them (on
    ``device``, default the wire's). ``wire`` may carry padding after its body (the all-gather pads every
    replica's bytes to the longest)."""
    device = wire.device if device is None else device
    kept, entry_starts, byte_starts = sparse_layout(offsets.cpu(), topk, value_bits)
    _, _, _, index_starts = index_layout(offsets, topk)
    n_idx, n_val = int(index_starts[-1]), int(byte_starts[-1])
    n_sc = 4 * kept.numel() if value_bits else 0
    entries = int(entry_starts[-1])
    tag = int(wire[0])
    if tag == TAG_PACKED:
        body = wire[1:1 + n_idx + n_val + n_sc]
        if body.numel() != n_idx + n_val + n_sc:
            raise ValueError(f"sparse payload: {wire.numel() - 1} bytes after the tag, these offsets, topk={topk} "
                             f"and value_bits={value_bits} need {n_idx + n_val + n_sc}")
        body = body.to(device)
        indices = unpack_indices(body[:n_idx], offsets, topk)
        rest = body[n_idx:]
    elif tag == TAG_ZLIB:
        need = 2 * entries + n_val + n_sc
        raw = zlib.decompressobj().decompress(_raw(wire[1:]), need + 1)  # at most one byte more than it needs
        if len(raw) != need:
            raise ValueError(f"sparse payload: the zlib body holds {len(raw)}{'+' if len(raw) > need else ''} bytes, "
                             f"these offsets, topk={topk} and value_bits={value_bits} need {need}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        gaps = flat[:entries].to(torch.int64) | (flat[entries:2 * entries].to(torch.int64) << 8)
        indices = _ungap(gaps, offsets, topk).to(device)
        rest = flat[2 * entries:].to(device)
    else:
        raise ValueError(f"sparse payload: unknown coding tag {tag} (0: packed, 1: zlib); a payload of another "
                         f"acco_ds version, or bytes that are not a payload")
    values = rest[:n_val].clone()  # copies: each aligned for its dtype
    values = values if value_bits else values.view(torch.float32)
    scales = rest[n_val:n_val + n_sc].clone().view(torch.float32)
    return indices, values, scales


def packed_bytes(offsets: torch.Tensor, topk: int, value_bits: int) -> int:
    """Bytes of one replica's packed payload on the wire, the tag included (the most ``encode`` sends)."""
    return sparse_payload_bytes(offsets, topk, value_bits)


__all__ = ["CODINGS", "index_bits", "index_layout", "pack_indices", "unpack_indices", "encode", "decode",
           "packed_bytes"]
