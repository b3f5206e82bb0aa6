"""Pure-torch implementation of the acco_ds op: the reference the native
kernels are tested against, and the fallback when they cannot be built.

They follow torch.optim.Adam(W)'s single-tensor step operation by operation,
so they agree with it (the tests check) and show plainly what the fused
kernels compute in one pass.
"""

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
# int8 (qmax 127) or fp8 e4m3 (torch.float8_e4m3fn, qmax 448). See docs/design.md, "Compressed communication".
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
