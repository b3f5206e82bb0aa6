"""Pure-torch implementation of the acco_ds op: the reference the native
kernels are tested against, and the fallback when they cannot be built.

They follow torch.optim.Adam(W)'s single-tensor step operation by operation,
so they agree with it (the tests check) and show plainly what the fused
kernels compute in one pass.
"""

import math
from typing import Optional

import torch


@torch.no_grad()
def adamw_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 out: Optional[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, grad_scale: float, commit: bool, adamw: bool = True) -> None:
    """Adam(W) update of a flat fp32 shard from a gradient *sum*.

    The gradient is ``grad * grad_scale``; ``step`` is the 1-based step the
    update corresponds to. ``commit=True`` advances ``master``, ``exp_avg`` and
    ``exp_avg_sq``; ``commit=False`` (a Peek) leaves them untouched and only
    writes the would-be parameters into ``out`` (cast to ``out.dtype``).
    """
    if not commit:
        # The naive Peek: work on copies (the fused kernel needs none).
        master, exp_avg, exp_avg_sq = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    g = grad * grad_scale
    if weight_decay != 0:
        if adamw:
            master.mul_(1 - lr * weight_decay)  # decoupled (AdamW)
        else:
            g = g.add(master, alpha=weight_decay)  # L2 (Adam)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if out is not None:
        out.copy_(master)


# ------------------------------------------------------------------ block quantization (compressed communication)
# Wire formats: one fp32 scale per block of ``block_size`` elements (the last block may be shorter), values
# int8 (qmax 127) or fp8 e4m3 (torch.float8_e4m3fn, qmax 448). See docs/design/kernels.md, "Compressed communication".
QMAX = {"int8": 127.0, "fp8": 448.0}
WIRE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def wire_format(dtype: torch.dtype) -> str:
    """``"int8"`` or ``"fp8"`` for a quantized tensor's dtype."""
    for name, wire in WIRE_DTYPES.items():
        if wire == dtype:
            return name
    raise ValueError(f"quantized values must be int8 or float8_e4m3fn, got {dtype}")


def num_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _blocks(v: torch.Tensor, block_size: int) -> torch.Tensor:
    """``v`` (fp32, n elements) as rows of ``block_size``, the last row padded with zeros."""
    n = v.numel()
    nb = num_blocks(n, block_size)
    if nb * block_size == n:
        return v.view(nb, block_size)
    padded = v.new_zeros(nb * block_size)
    padded[:n] = v
    return padded.view(nb, block_size)


@torch.no_grad()
def quantize_pack(x: torch.Tensor, residual: Optional[torch.Tensor], q: torch.Tensor, scales: torch.Tensor, *,
                  block_size: int) -> None:
    """Quantize ``x`` (+ ``residual``) per block into ``q`` and ``scales``; store the new residual.

    ``v = x.float() + residual.float()`` (no residual: ``v = x.float()``). Per block: ``amax = max|v|``
    (NaN if any element of the block is not finite), ``scale = amax / qmax`` (fp32 division); each value
    ``v / scale`` (0 where ``scale == 0``) is clamped to ``[-qmax, qmax]`` and rounded to nearest, ties to
    even (int8) or cast to float8_e4m3fn (round to nearest even). ``residual`` (if given) becomes
    ``v - q.float() * scale`` in its own dtype: what this send left out, added to the next send.
    A non-finite block gives scale NaN and values 0, so the receiver sees a non-finite gradient (and
    skips the step); its residual is NaN (the engine zeroes residuals after a skipped step).

    ``x``: fp32/bf16/fp16, n elements; ``residual``: fp32/bf16, n elements, read and overwritten;
    ``q``: int8 or float8_e4m3fn, n elements (written); ``scales``: fp32, ceil(n / block_size) (written).
    """
    n = x.numel()
    qmax = QMAX[wire_format(q.dtype)]
    v = x.reshape(-1).float()
    if residual is not None:
        v = v + residual.reshape(-1).float()
    rows = _blocks(v, block_size)
    amax = rows.abs().amax(dim=1)
    finite = rows.isfinite().all(dim=1)
    amax = torch.where(finite, amax, torch.full_like(amax, float("nan")))
    scale = amax / qmax
    safe = torch.where((scale == 0) | ~finite, torch.ones_like(scale), scale)
    y = torch.where(((scale == 0) | ~finite)[:, None], torch.zeros_like(rows), rows / safe[:, None])
    y = y.clamp(-qmax, qmax)
    y = torch.round(y) if q.dtype == torch.int8 else y
    qv = y.reshape(-1)[:n].to(q.dtype)
    q.view(-1).copy_(qv)
    scales.view(-1).copy_(scale)
    if residual is not None:
        deq = (qv.float().view(-1) if n == rows.numel() else _pad(qv.float(), rows.numel())).view_as(rows)
        sent = (deq * scale[:, None]).reshape(-1)[:n]
        residual.view(-1).copy_(v - sent)


def _pad(v: torch.Tensor, total: int) -> torch.Tensor:
    out = v.new_zeros(total)
    out[:v.numel()] = v
    return out


@torch.no_grad()
def dequantize_accumulate(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block_size: int) -> None:
    """``out = (out.float() + q.float() * scale).to(out.dtype)`` per block (``out``: fp32/bf16/fp16, the
    product rounded to fp32 before the addition: no fused multiply-add)."""
    n = q.numel()
    nb = num_blocks(n, block_size)
    deq = _pad(q.reshape(-1).float(), nb * block_size).view(nb, block_size) * scales.view(-1)[:, None]
    total = out.view(-1).float() + deq.reshape(-1)[:n]
    out.view(-1).copy_(total)


# ------------------------------------------------------------------ sparse outer communication (sparseloco)
# Chunks: chunk c is ``e[offsets[c]:offsets[c+1]]`` of a flat fp32 tensor (1 <= length <= MAX_CHUNK); a
# parameter tensor is cut into chunks of ``chunk`` elements (its last one may be shorter), never spanning two
# tensors (``chunk_offsets``). In each chunk the ``min(topk, length)`` entries of largest ``|e|`` are kept
# (ties: the lower index), listed in ascending index order. One replica's payload, as ``sparse_pack`` hands
# it over (``sparse_codec`` turns it into the bytes that travel: indices at the bits their chunk needs, and a
# zlib coding where it pays):
# * ``indices``: int16, one per kept entry: its index inside its chunk, as the 16 bits of an unsigned number
#   (``int(i) & 0xFFFF``), chunk after chunk;
# * ``values``: with ``value_bits`` b in {2, 4, 8}: uint8, each chunk's level codes packed little-endian
#   (entry j of a chunk at bit j*b of that chunk's bytes), each chunk starting on a byte; with b = 0 (no
#   quantization): the kept values themselves, fp32;
# * ``scales``: fp32, one per chunk: ``m = max |v|`` over the chunk's kept values (b = 0: empty).
# Code i of a value v is the nearest of the 2^b levels ``m * (2i / (2^b - 1) - 1)``, computed in fp32 as
# ``i = clamp(rint((v / m + 1) * (0.5 * (2^b - 1))), 0, 2^b - 1)`` (rint: ties to even) and
# ``q = m * ((float)(2 i) / (float)(2^b - 1) - 1)``; ``m == 0`` gives i = 0 and q = 0. Non-finite input is
# not defined: the engine refuses a non-finite pseudo-gradient before it packs one.
MAX_CHUNK = 65536
SPARSE_VALUE_BITS = (0, 2, 4, 8)


def chunk_offsets(numels, chunk: int) -> torch.Tensor:
    """int64 offsets (C + 1) of the chunks of tensors of ``numels`` elements laid end to end."""
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be in [1, {MAX_CHUNK}] (an index is held in 16 bits), got {chunk}")
    bounds, start = [0], 0
    for n in numels:
        bounds.extend(range(start + chunk, start + n, chunk))
        start += n
        if n:
            bounds.append(start)
    return torch.tensor(bounds, dtype=torch.int64)


def sparse_layout(offsets: torch.Tensor, topk: int, value_bits: int):
    """``(kept, entry_starts, byte_starts)``: entries kept per chunk (C), and the start of each chunk's
    entries in ``indices`` and of its codes in ``values`` (C + 1 each; the last is the total)."""
    if value_bits not in SPARSE_VALUE_BITS:
        raise ValueError(f"value_bits must be one of 2, 4, 8 or 0 (fp32 values), got {value_bits}")
    lengths = offsets[1:] - offsets[:-1]
    kept = lengths.clamp(max=topk)
    zero = torch.zeros(1, dtype=torch.int64)
    entry_starts = torch.cat([zero, kept.cumsum(0)])
    nbytes = (kept * value_bits + 7) // 8 if value_bits else kept * 4
    return kept, entry_starts, torch.cat([zero, nbytes.cumsum(0)])


def index_bits(lengths: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Bits per index on the wire for chunks of ``lengths`` elements keeping ``kept`` (``sparse_codec``):
    ⌈log2 L⌉ (0 for L = 1), and 0 when every entry is kept (k == L: the indices are 0 … L−1)."""
    span = (lengths - 1).clamp(min=0)
    bits = sum(((span >> t) > 0).to(torch.int64) for t in range(17))
    return torch.where(kept == lengths, torch.zeros_like(bits), bits)


def index_layout(offsets: torch.Tensor, topk: int):
    """``(kept, widths, entry_starts, byte_starts)`` of the packed indices: entries and bits per index of each
    chunk (C), the start of each chunk's entries and of its index bytes (C + 1; the last is the total)."""
    offsets = offsets.cpu()
    lengths = offsets[1:] - offsets[:-1]
    kept = lengths.clamp(max=topk)
    widths = index_bits(lengths, kept)
    zero = torch.zeros(1, dtype=torch.int64)
    nbytes = (kept * widths + 7) // 8
    return kept, widths, torch.cat([zero, kept.cumsum(0)]), torch.cat([zero, nbytes.cumsum(0)])


def sparse_payload_bytes(offsets: torch.Tensor, topk: int, value_bits: int) -> int:
    """Bytes of one replica's payload on the wire when packed (the most it takes; ``sparse_codec``): a tag byte,
    the indices at ⌈log2 L⌉ bits for a chunk of L elements (none when all are kept), the values, 4 per chunk
    scale (b > 0)."""
    kept, _, byte_starts = sparse_layout(offsets.cpu(), topk, value_bits)
    scales = 4 * kept.numel() if value_bits else 0
    return 1 + int(index_layout(offsets, topk)[3][-1]) + int(byte_starts[-1]) + scales


def _chunk_rows(e: torch.Tensor, offsets: torch.Tensor):
    """(rows [C, maxlen] of |e| padded with -1, positions [C, maxlen] in e (-1 where padded))."""
    lengths = offsets[1:] - offsets[:-1]
    width = int(lengths.max()) if lengths.numel() else 0
    col = torch.arange(width, dtype=torch.int64)
    pos = offsets[:-1, None] + col[None, :]
    valid = col[None, :] < lengths[:, None]
    pos = torch.where(valid, pos, torch.full_like(pos, -1))
    mags = torch.where(valid, e.abs()[pos.clamp(min=0)], torch.full(pos.shape, -1.0))
    return mags, pos


def _levels(v: torch.Tensor, m: torch.Tensor, value_bits: int):
    """(codes, dequantized values) of ``v`` with per-entry chunk maxima ``m`` (fp32; see the wire format)."""
    top = float(2**value_bits - 1)
    safe = torch.where(m > 0, m, torch.ones_like(m))
    t = (v / safe + 1.0) * (0.5 * top)
    codes = torch.where(m > 0, torch.round(t).clamp(0, top), torch.zeros_like(t))
    q = m * ((2.0 * codes) / top - 1.0)
    return codes.to(torch.int64), torch.where(m > 0, q, torch.zeros_like(q))


@torch.no_grad()
def sparse_pack(e: torch.Tensor, offsets: torch.Tensor, *, topk: int, value_bits: int):
    """Keep the top ``topk`` of each chunk of ``e`` (fp32, flat), quantize, pack; ``e[kept] -= q`` in place
    (the error-feedback residual stays). Returns ``(indices, values, scales)`` (see the wire format)."""
    kept, entry_starts, byte_starts = sparse_layout(offsets, topk, value_bits)
    mags, pos = _chunk_rows(e, offsets)
    order = torch.sort(mags, dim=1, descending=True, stable=True).indices[:, :topk]
    rank = torch.arange(order.shape[1])[None, :]
    valid = rank < kept[:, None]
    chosen = torch.sort(torch.where(valid, order, torch.full_like(order, 1 << 30)), dim=1).values
    where = chosen[valid]  # index inside the chunk, chunk after chunk, ascending
    chunk_of = torch.repeat_interleave(torch.arange(kept.numel()), kept)
    flat_pos = offsets[:-1][chunk_of] + where
    v = e[flat_pos]
    if value_bits == 0:
        q, values, scales = v.clone(), v.clone(), e.new_zeros(0)
    else:
        m = torch.zeros(kept.numel(), dtype=torch.float32).scatter_reduce(0, chunk_of, v.abs(), "amax")
        codes, q = _levels(v, m[chunk_of], value_bits)
        j = torch.arange(where.numel()) - entry_starts[:-1][chunk_of]  # entry number inside its chunk
        bit = j * value_bits
        byte = byte_starts[:-1][chunk_of] + bit // 8
        values = torch.zeros(int(byte_starts[-1]), dtype=torch.int64).index_add_(0, byte, codes << (bit % 8))
        values, scales = values.to(torch.uint8), m
    e[flat_pos] = e[flat_pos] - q
    return where.to(torch.int16), values, scales


@torch.no_grad()
def sparse_unpack_accumulate(out: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                             scales: torch.Tensor, *, topk: int, value_bits: int, weight: float = 1.0) -> None:
    """``out[kept] += q * weight`` (fp32 ``out``; the product rounded to fp32 before the addition) for one
    replica's payload from ``sparse_pack``."""
    kept, entry_starts, byte_starts = sparse_layout(offsets, topk, value_bits)
    chunk_of = torch.repeat_interleave(torch.arange(kept.numel()), kept)
    where = indices.to(torch.int64) & 0xFFFF
    flat_pos = offsets[:-1][chunk_of] + where
    if value_bits == 0:
        q = values.float()
    else:
        j = torch.arange(where.numel()) - entry_starts[:-1][chunk_of]
        bit = j * value_bits
        byte = values.to(torch.int64)[byte_starts[:-1][chunk_of] + bit // 8]
        codes = (byte >> (bit % 8)) & (2**value_bits - 1)
        m = scales[chunk_of]
        q = torch.where(m > 0, m * ((2.0 * codes.float()) / float(2**value_bits - 1) - 1.0), torch.zeros_like(m))
    out[flat_pos] = out[flat_pos] + q * weight


@torch.no_grad()
def sparse_average(out: torch.Tensor, offsets: torch.Tensor, payloads, weights, *, topk: int, value_bits: int,
                   unpack=sparse_unpack_accumulate) -> None:
    """``out`` ← ``(Σ_r weights[r] · scatter(q_r)) / Σ_r weights[r]`` over R replicas' payloads
    (``(indices, values, scales)`` each), added in replica order into a zeroed ``out``, then divided (no
    division when the weights sum to 0); a replica of weight 0 adds nothing. ``unpack``: the
    ``sparse_unpack_accumulate`` to compose it from."""
    payloads, weights = list(payloads), [float(w) for w in weights]
    if len(payloads) != len(weights):
        raise ValueError(f"sparse_average needs one weight per payload, got {len(payloads)} payloads and "
                         f"{len(weights)} weights")
    bad = [w for w in weights if not (math.isfinite(w) and w >= 0)]
    if bad:
        raise ValueError(f"sparse_average's weights must be finite and >= 0, got {bad[0]}")
    out.zero_()
    for (indices, values, scales), w in zip(payloads, weights):
        if w:
            unpack(out, offsets, indices, values, scales, topk=topk, value_bits=value_bits, weight=w)
    total = sum(weights)
    if total > 0:  # by a tensor: a Python scalar would become a multiplication by its reciprocal on CUDA
        out.div_(out.new_tensor(total))
