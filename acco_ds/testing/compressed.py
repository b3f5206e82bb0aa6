"""Float64 reference simulator of compressed communication (``acco.compression``): the test oracle.

It writes the compressed algorithm of docs/design/kernels.md ("Compressed communication") on plain vectors, with
no threads, shards, buffers or process groups, so the engine matching it means the engine computes the
algorithm. The quantizer is the wire format itself (fp32 block scales, int8/fp8 values:
``ops.reference.quantize_pack``); everything else is float64.

Layout (as ZeRO-1's): the flat parameter vector is padded to ``padded_numel(N, W)`` and split into W
partitions; rank c owns partition c. Quantization blocks start at each partition's start. (The FSDP2
host's outer all-reduce instead quantizes each parameter's dim-0 chunk on its own:
``simulate_compressed_diloco(..., layout="fsdp2")``.)

* reduce-scatter: partition c of the sum is, in rank order, rank c's own gradient sum plus every other
  rank w's *delivered* send ``deq(Q(g_w[c] + e_wc))``, with ``e_wc ← (g_w[c] + e_wc) − deq(...)`` (error
  feedback; e = 0 without it). Node-aware: the same over the node sums (full precision inside a node),
  the owner's node's sum unquantized;
* all-gather: every rank's copy ``held`` becomes ``held + deq(Q(target − held))`` partition by partition
  (``target``: the owner's new parameters). Gradients are taken at ``held``, the optimizer steps its own
  float64 ``master``;
* the outer all-reduce (diloco): in each of the k shards, part p of R (owned by replica p) is summed as
  above, divided by R, and sent back as ``deq(Q(mean_p + e_p))`` with the owner's residual e_p.

The schedules are the uncompressed ones (``simulator.simulate`` and ``simulate_local_sgd``): in acco and
dpu the job of round i runs during round i + 1, so its all-gather starts from the parameters round i + 1
computes at, and its result is what round i + 2 computes at.
"""

import copy
from typing import Callable, Dict, List, Optional

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..runtime.rounds.buffers import padded_numel
from ..ops import reference
from .simulator import optimizer_update


class Quantizer:
    """What a compressed send delivers: ``deq(Q(v + e))`` in float64, ``e`` updated (error feedback)."""

    def __init__(self, dtype: str, block_size: int, error_feedback: bool = True):
        self.wire, self.block_size, self.error_feedback = reference.WIRE_DTYPES[dtype], block_size, error_feedback
        self.residuals: Dict[tuple, torch.Tensor] = {}

    def send(self, v: torch.Tensor, key=None) -> torch.Tensor:
        """``key``: whose residual (None: a send without error feedback, as the all-gather's)."""
        use = key is not None and self.error_feedback
        if use:
            v = v + self.residuals.setdefault(key, torch.zeros_like(v))
        n = v.numel()
        q = torch.empty(n, dtype=self.wire)
        scales = torch.empty(reference.num_blocks(n, self.block_size))
        reference.quantize_pack(v.float(), None, q, scales, block_size=self.block_size)
        out = torch.zeros(n)
        reference.dequantize_accumulate(q, scales, out, block_size=self.block_size)
        out = out.double()
        if use:
            self.residuals[key] = v - out
        return out


def _reduce(sends: List[torch.Tensor], P: int, quant: Optional[Quantizer], tag, nodes: int = 0) -> torch.Tensor:
    """Reduce-scatter then concatenation of the W partitions: ``sends[w]`` is rank w's vector (W*P).
    ``nodes`` (node-aware layout, W = nodes x k): each node first sums its k ranks at full precision, then
    the node sums are reduced across nodes as above (only that step quantized)."""
    if nodes:
        k = len(sends) // nodes
        sends = [sum(sends[n * k + j] for j in range(k)) for n in range(nodes)]  # the node sums
    W = len(sends)
    total = torch.zeros(len(sends[0]), dtype=torch.float64)
    for c in range(len(sends[0]) // P):
        sl = slice(c * P, (c + 1) * P)
        owner = c // (len(sends[0]) // P // W) if nodes else c  # the owner's node, or the owner
        part = torch.zeros(P, dtype=torch.float64)
        for w in range(W):
            own = w == owner or quant is None
            part = part + (sends[w][sl] if own else quant.send(sends[w][sl], (tag, w, c)))
        total[sl] = part
    return total


def _gather(held: torch.Tensor, target: torch.Tensor, P: int, quant: Optional[Quantizer]) -> None:
    if quant is None:
        held.copy_(target)
        return
    for c in range(held.numel() // P):
        sl = slice(c * P, (c + 1) * P)
        held[sl] += quant.send(target[sl] - held[sl])


class _Replica:
    """A model copy trained by ``ranks``: a float64 master with its optimizer, the copy ``held`` the ranks
    compute at (padded to ``padded`` elements), and the rounds' quantizer (None: full precision)."""

    def __init__(self, model, optimizer_fn, lr_lambda, ranks, quant, nodes=0):
        self.model = copy.deepcopy(model).to(torch.float64)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = optimizer_fn(self.model)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda) if lr_lambda is not None else None
        self.ranks, self.quant, self.nodes = list(ranks), quant, nodes
        self.N = sum(p.numel() for p in self.params)
        padded = padded_numel(self.N, len(self.ranks))
        self.P = padded // len(self.ranks)
        self.held = torch.zeros(padded, dtype=torch.float64)
        self.held[:self.N] = self.theta()
        self.worker = copy.deepcopy(self.model)
        self.worker_params = [p for p in self.worker.parameters() if p.requires_grad]

    def theta(self) -> torch.Tensor:
        return parameters_to_vector([p.detach() for p in self.params]).clone()

    def set_theta(self, value: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(value[:self.N].clone(), self.params)
        self.held.zero_()
        self.held[:self.N] = value[:self.N]

    def grads(self, loss_fn, micro_batch, nxt, count):
        """Each rank's gradient sum over its next ``count`` micro-batches at ``held`` (padded vectors)."""
        with torch.no_grad():
            vector_to_parameters(self.held[:self.N].clone(), self.worker_params)
        sends = []
        for r in self.ranks:
            for p in self.worker_params:
                p.grad = None
            for _ in range(count):
                loss_fn(self.worker, micro_batch(r, nxt[r])).backward()
                nxt[r] += 1
            g = torch.zeros_like(self.held)
            g[:self.N] = parameters_to_vector([p.grad if p.grad is not None else torch.zeros_like(p)
                                               for p in self.worker_params])
            sends.append(g)
        return sends, count * len(self.ranks)

    def update(self, gsum: torch.Tensor, n: int, commit: bool, clip: float, norms: list) -> torch.Tensor:
        """``simulator.optimizer_update`` on the unpadded part; returns the new parameters, padded."""
        target = torch.zeros_like(self.held)
        target[:self.N] = optimizer_update(self.opt, self.params, gsum[:self.N], n, commit=commit, clip=clip,
                                           sched=self.sched, norms=norms)
        return target

    def job(self, sends, n, commit, clip, norms, kept=None) -> torch.Tensor:
        """One round's communication job: reduce-scatter, update, all-gather into ``held``; returns the
        reduced sum (what an estimate round keeps)."""
        total = _reduce(sends, self.P, self.quant, ("rounds", self.ranks[0]), self.nodes)  # residuals per replica
        g, count = (total, n) if kept is None else (kept[0] + total, kept[1] + n)
        _gather(self.held, self.update(g, count, commit, clip, norms), self.P, self.quant)
        return total


def simulate_compressed(mode: str, model: torch.nn.Module, loss_fn: Callable, micro_batch: Callable, *,
                        world_size: int, gradient_accumulation_steps: int, steps: int, optimizer_fn: Callable,
                        dtype: str = "int8", block_size: int = 256, error_feedback: bool = True,
                        clip: float = 0.0, lr_lambda: Optional[Callable] = None, nodes: int = 0) -> dict:
    """``acco`` / ``dpu`` / ``sync`` with compressed rounds on ``world_size`` ranks (``nodes``: a node-aware
    layout of that many nodes; 0: flat). Returns ``{"params": [held after commit t], "grad_norms": [...]}``
    (what every rank reads after each step)."""
    rep = _Replica(model, optimizer_fn, lr_lambda, range(world_size), Quantizer(dtype, block_size, error_feedback),
                   nodes)
    nxt = [0] * world_size
    gas = gradient_accumulation_steps
    out = {"params": [], "grad_norms": []}

    def grads(count):
        return rep.grads(loss_fn, micro_batch, nxt, count)

    def record():
        out["params"].append(rep.held[:rep.N].clone())

    if mode == "sync":
        for _ in range(steps):
            sends, n = grads(gas)
            rep.job(sends, n, True, clip, out["grad_norms"])
            record()
    elif mode in ("dpu", "acco"):
        per_round = gas // 2 if mode == "acco" else gas
        jobs = steps * (2 if mode == "acco" else 1)
        prev, kept = grads(per_round), None
        for j in range(jobs):
            nxt_round = grads(per_round)  # round j + 1 computes at what round j + 1 holds ...
            if mode == "acco" and j % 2 == 0:  # ... while job j runs: an estimate round, kept for the commit
                kept = (rep.job(*prev, commit=False, clip=clip, norms=[]), prev[1])
            else:
                rep.job(*prev, commit=True, clip=clip, norms=out["grad_norms"], kept=kept)
                kept = None
                record()
            prev = nxt_round
    else:
        raise ValueError(f"simulate_compressed: mode {mode!r} (acco, dpu or sync; diloco: simulate_compressed_diloco)")
    return out


def simulate_compressed_diloco(model: torch.nn.Module, loss_fn: Callable, micro_batch: Callable, *, world_size: int,
                               group_size: int, gradient_accumulation_steps: int, steps: int, sync_every: int,
                               optimizer_fn: Callable, outer_lr: float, outer_momentum: float, nesterov: bool,
                               dtype: str = "int8", block_size: int = 256, error_feedback: bool = True,
                               apply_to=("rounds", "outer"), clip: float = 0.0, layout: str = "zero") -> dict:
    """``diloco`` with R = world_size / group_size replicas of k ranks, compressed inner rounds (k > 1,
    ``"rounds"`` in ``apply_to``) and a compressed outer all-reduce (``"outer"``). ``layout``: how a
    replica's k ranks hold the model, so which pieces the outer all-reduce quantizes: ``"zero"`` (ZeRO-1's
    k flat partitions) or ``"fsdp2"`` (each parameter's k dim-0 chunks, one all-reduce per parameter and
    chunk: the FSDP2 host's local shards; its inner rounds are FSDP2's own, never compressed). Returns
    ``{"replicas": [[held of replica g after inner step t]], "anchor": [x after step t]}``."""
    k, R = group_size, world_size // group_size
    quant = Quantizer(dtype, block_size, error_feedback)
    inner = quant if "rounds" in apply_to and k > 1 and layout == "zero" else None
    reps = [_Replica(model, optimizer_fn, None, range(g * k, (g + 1) * k), inner) for g in range(R)]
    P = reps[0].P
    pieces = ([(("outer", s), torch.arange(s * P, (s + 1) * P)) for s in range(k)] if layout == "zero" else
              fsdp2_pieces(reps[0].params, k))
    x = reps[0].held.clone()
    m = torch.zeros_like(x)
    nxt = [0] * world_size
    out = {"replicas": [[] for _ in range(R)], "anchor": []}

    def mean_delta(deltas):
        if "outer" not in apply_to:
            return torch.stack(deltas).mean(0)
        mean = torch.zeros_like(x)
        for tag, idx in pieces:  # a piece: the outer group of the ranks holding it, one per replica
            n = idx.numel()
            P2 = -(-n // R)
            summed = _reduce([torch.cat([d[idx], d.new_zeros(R * P2 - n)]) for d in deltas], P2, quant, tag=tag) / R
            for p in range(R):
                summed[p * P2:(p + 1) * P2] = quant.send(summed[p * P2:(p + 1) * P2], ("outer-mean", tag, p))
            mean[idx] = summed[:n]
        return mean

    for step in range(1, steps + 1):
        for rep in reps:
            sends, n = rep.grads(loss_fn, micro_batch, nxt, gradient_accumulation_steps)
            rep.job(sends, n, True, clip, [])
        if step % sync_every == 0:
            thetas = [torch.cat([rep.theta(), rep.held.new_zeros(rep.held.numel() - rep.N)]) for rep in reps]
            d = mean_delta([x - t for t in thetas])
            m.mul_(outer_momentum).add_(d)
            x.sub_(d + outer_momentum * m if nesterov else m, alpha=outer_lr)
            for rep in reps:
                rep.set_theta(x)
        for g, rep in enumerate(reps):
            out["replicas"][g].append(rep.held[:rep.N].clone())
        out["anchor"].append(x[:reps[0].N].clone())
    return out


def fsdp2_pieces(params, k: int):
    """``(tag, flat indices)`` of each parameter's k dim-0 chunks, as FSDP2's ``Shard(0)`` places them on a
    replica's k ranks (ceil(rows / k) rows each, the last ones shorter or empty; empty ones left out)."""
    pieces, offset = [], 0
    for j, p in enumerate(params):
        rows = p.shape[0] if p.dim() else 1
        width, per = p.numel() // rows, -(-rows // k)
        for s in range(k):
            lo, hi = min(s * per, rows) * width, min((s + 1) * per, rows) * width
            if hi > lo:
                pieces.append((("outer", j, s), torch.arange(offset + lo, offset + hi)))
        offset += p.numel()
    return pieces


__all__ = ["simulate_compressed", "simulate_compressed_diloco", "fsdp2_pieces", "Quantizer"]
