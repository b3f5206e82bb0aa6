"""Float64 reference simulator of ``sparseloco`` (docs/sparseloco.md): the test oracle.

R replicas, each a ZeRO-1 group whose inner step equals one full-batch step of its own optimizer on the
``k * gas`` micro-batches its ranks draw (as ``simulator.simulate_local_sgd``). Every ``sync_every`` inner
steps, for each replica r, in replica order::

    δ_r = x − θ_r;   e_r = β e_r + δ_r                                  (float64)
    per chunk (each parameter tensor, registration order, cut into ``chunk`` elements): keep the top
    ``topk`` of |e_r|, q_r = their levels (``value_bits``) or their values (null)
    e_r[kept] −= q_r
    x −= outer_lr · (Σ_r scatter(q_r)) / R;   θ_r = x   (the inner optimizer state carries on)

With ``overlap`` = N > 0 (docs/design/outer-loops.md, "sparseloco overlapped") the sync above computes the
sends and the residuals at once, but the anchor step and the replicas' move wait N inner steps; then::

    x −= outer_lr · avg;   θ_r += x − θ_r(sync)     (θ_r(sync): the replica's weights at the sync)

so each replica keeps what it learned in those N steps. N = 0 is the blocking sync above.

Bit-compatibility with the wire format: the selection and the levels are the wire format's own
(``ops.reference.sparse_pack``), run on ``e_r`` rounded to fp32, so q_r is exactly what an fp32 engine
would send for that buffer; q_r (fp32 numbers) then enters the float64 buffers and sums exactly. The
only place the simulator and an fp32 engine can part is a near-tie: two entries whose |e| order (or a
value whose nearest level) differs between the engine's fp32 buffer and this float64 one rounded to
fp32. Tests allow for such a "flip" as the compressed tests do.
"""

from typing import Callable, List, Optional

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..ops import reference
from .simulator import make_replicas, replica_inner_step


def kept_positions(offsets: torch.Tensor, indices: torch.Tensor, topk: int) -> torch.Tensor:
    """Flat positions (int64) of one payload's kept entries, from its 16-bit in-chunk indices."""
    kept = (offsets[1:] - offsets[:-1]).clamp(max=topk)
    chunk_of = torch.repeat_interleave(torch.arange(kept.numel()), kept)
    return offsets[:-1][chunk_of] + (indices.to(torch.int64) & 0xFFFF)


def sparse_send(e: torch.Tensor, offsets: torch.Tensor, topk: int, value_bits: Optional[int]) -> torch.Tensor:
    """One replica's send: q (float64, zero where nothing was kept); ``e[kept] -= q`` in place (float64)."""
    bits = value_bits or 0
    e32 = e.float()
    indices, values, scales = reference.sparse_pack(e32, offsets, topk=topk, value_bits=bits)
    q = torch.zeros_like(e32)
    reference.sparse_unpack_accumulate(q, offsets, indices, values, scales, topk=topk, value_bits=bits)
    pos = kept_positions(offsets, indices, topk)
    e[pos] -= q[pos].double()
    return q.double()


def simulate_sparseloco(model: torch.nn.Module, loss_fn: Callable, micro_batch: Callable, *, world_size: int,
                        group_size: int, gradient_accumulation_steps: int, steps: int, sync_every: int,
                        optimizer_fn: Callable, outer_lr: float = 1.0, chunk: int = 4096, topk: int = 64,
                        error_decay: float = 0.95, value_bits: Optional[int] = 2, clip: float = 0.0,
                        lr_lambda: Optional[Callable] = None, dtype: torch.dtype = torch.float64,
                        overlap: int = 0) -> dict:
    """``steps`` inner steps of ``sparseloco`` with ``R = world_size / group_size`` replicas (rank r's i-th
    micro-batch is ``micro_batch(r, i)``; replica g is ranks g*k .. g*k+k-1).

    Returns ``{"replicas": [[θ_g after inner step t]] per replica, "anchor": [x after step t],
    "errors": [[e_g after each sync]] per replica}`` as flat vectors in ``dtype``.
    """
    k, R = group_size, world_size // group_size
    replicas, opts, scheds, params = make_replicas(model, R, optimizer_fn, lr_lambda, dtype)
    theta = lambda g: parameters_to_vector([p.detach() for p in params[g]]).clone()  # noqa: E731
    offsets = reference.chunk_offsets([p.numel() for p in params[0]], chunk)
    x = theta(0)
    errors = [torch.zeros_like(x) for _ in range(R)]
    nxt = [0] * world_size
    out: dict = {"replicas": [[] for _ in range(R)], "anchor": [], "errors": [[] for _ in range(R)]}

    def inner_step(g):
        replica_inner_step(replicas[g], params[g], range(g * k, (g + 1) * k), gradient_accumulation_steps, nxt,
                           loss_fn, micro_batch, opts[g], clip, scheds[g])

    def move(g, new):
        with torch.no_grad():  # a copy: vector_to_parameters makes the parameters views of its input
            vector_to_parameters(new.clone(), params[g])

    flight = None  # overlap: (the step it lands at, the average, each replica's weights at the sync)
    for step in range(1, steps + 1):
        for g in range(R):
            inner_step(g)
        if flight is not None and step == flight[0]:
            x -= outer_lr * flight[1]
            for g in range(R):
                move(g, theta(g) + (x - flight[2][g]))
            flight = None
        if step % sync_every == 0:
            total = torch.zeros_like(x)
            for g in range(R):
                errors[g].mul_(error_decay).add_(x - theta(g))
                total += sparse_send(errors[g], offsets, topk, value_bits)
                out["errors"][g].append(errors[g].clone())
            if overlap:
                flight = (step + overlap, total / R, [theta(g) for g in range(R)])
            else:
                x -= outer_lr * (total / R)
                for g in range(R):
                    move(g, x)
        for g in range(R):
            out["replicas"][g].append(theta(g))
        out["anchor"].append(x.clone())
    return out


__all__: List[str] = ["simulate_sparseloco", "sparse_send", "kept_positions"]
