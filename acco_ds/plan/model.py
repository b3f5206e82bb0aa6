"""The time model behind ``acco-ds plan``: seconds and bytes of each mode of the data-parallel part of a layout.

No torch, no DeepSpeed: plain arithmetic on the inputs, so that the literature check and the tests run in
milliseconds. ``docs/plan.md`` writes every formula out with its source; in short, for R nodes of k ranks
(W = R·k), N parameters, b bytes per communicated element, a node's link of B bytes/s and latency L:

- compute per step C = 6·N·T / (W·F·mfu) (T tokens per step), unless measured;
- node-aware reduce-scatter or all-gather (acco_ds's collectives): a node sends (R−1)/R·N·b across its link,
  (R−1) latency hops, after an intra-node step of (k−1)/k·N·b on the intra link;
- stock ZeRO-1: a flat ring all-reduce of the gradients and all-gather of the parameters over all W ranks:
  3·(W−1)/W·N·b across each node's link (measured on the two-node testbed: 9N bytes of fp32 at W = 4, R = 2);
- compressed (int8/fp8): 1 + 4/block bytes per element instead of b (one fp32 scale per block);
- the overlap rule of each mode (``evaluate``), slowed by contention (``exposed``: κ, λ), and its token factor
  (``acco_ds.plan.factors``).

Tensor and pipeline layouts and MoE (``acco_ds.plan.layouts``) evaluate their data-parallel part here, on the
shard one model-parallel rank holds.
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional

from .factors import REFERENCE_H, token_factor  # noqa: F401 (REFERENCE_H: the period of given factors)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
EXACT = ("zero1", "sync")  # uncompressed, the same update as stock ZeRO-1: they win ties within 5%
TIE = 0.05
SPARSE_DEFAULTS = {"chunk": 4096, "topk": 64, "value_bits": 2}

@dataclass
class Inputs:
    """What the model needs; bandwidths in bits per second, as the flags give them."""
    params: int
    tokens_per_step: float
    nodes: int
    ranks_per_node: int
    rank_flops: float = 0.0
    mfu: float = 0.4
    inter_bps: float = 10e9
    inter_latency_s: float = 0.03
    intra_bps: float = 400e9
    intra_latency_s: float = 1e-5
    dtype: str = "bf16"
    compute_s: Optional[float] = None  # measured seconds of compute per step (replaces 6NT/(WF mfu))
    tokens: Optional[float] = None  # tokens to train (default 20 N)
    micro_batches: int = 1  # per rank per step (gradient_accumulation_steps)
    block_size: int = 256
    tensor_sizes: Optional[List[int]] = None  # parameter tensors (SparseLoCo chunks); default one of N
    token_factors: dict = field(default_factory=dict)  # overrides: family -> factor (at H = 8 for local SGD)
    factor_source: str = "auto"  # token factors: "literature", "measured", "auto" (the papers from 100M up)
    tp: int = 1  # tensor-parallel ranks (inside a node)
    pp: int = 1  # pipeline stages
    active_params: Optional[int] = None  # MoE: parameters a token passes through (compute); default params
    moe_top_k: int = 2  # MoE: experts per token (the all-to-all's payload)
    seq_len: Optional[int] = None  # model shape (activations, tensor- and pipeline-parallel traffic)
    hidden: Optional[int] = None
    layers: Optional[int] = None
    heads: Optional[int] = None
    micro_batch: Optional[int] = None  # sequences per micro-batch
    recompute: str = "full"  # activation recomputation: none, selective, full
    gpu_memory: Optional[float] = None  # bytes per rank (None: not checked)
    zero_stage: int = 1  # the user's config's (acco_ds runs on stage 1; the stock row models stage 1)
    overlap_compute: float = 1.0  # kappa: compute slows by this while communication runs beside it (CPU: > 1)
    overlap_comm: float = 1.0  # lambda: communication slows by this while compute runs beside it
    overlap_outer_compute: Optional[float] = None  # kappa beside local SGD's outer syncs (default overlap_compute)
    # A what-if for comparing with simulators that release every reduction bucket by bucket during the
    # backward pass (the Streaming DiLoCo paper's): the fraction of a step's compute that the reduction issued
    # in that step may run behind (backward = 2/3 of forward + backward). acco_ds's rounds and outer syncs
    # start after the step, so the plan's own rows keep 0. Applies to stock's gradient reduction, sync's round,
    # and diloco's and Streaming DiLoCo's outer syncs.
    backward_overlap: float = 0.0
    outer_bytes: Optional[float] = None  # bytes per element of an uncompressed outer sync (acco_ds: fp32, 4)

    def __post_init__(self):
        if not 0.0 <= self.backward_overlap < 1.0:
            raise ValueError(f"backward_overlap {self.backward_overlap!r} must be in [0, 1): the fraction of a "
                             f"step's compute that a reduction issued in it can hide behind (backward: about 2/3)")
        if self.outer_bytes is not None and self.outer_bytes <= 0:
            raise ValueError(f"outer_bytes {self.outer_bytes!r} must be positive (bytes per element of an outer sync)")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def dp_world(self) -> int:
        """W: data-parallel ranks, nodes x ranks per node / (tp x pp)."""
        return self.world // (self.tp * self.pp)

    @property
    def dp_per_node(self) -> int:
        """Data-parallel ranks of one position (tensor rank, stage) per node: 1 when a replica spans nodes."""
        return max(1, self.ranks_per_node // (self.tp * self.pp))

    @property
    def dp_nodes(self) -> int:
        """Nodes one data-parallel group spans; local SGD's replicas M (a replica: a node, or the nodes one model
        copy spans)."""
        return self.dp_world // self.dp_per_node

    @property
    def total_tokens(self) -> float:
        return self.tokens if self.tokens else 20.0 * self.params


@dataclass
class Mode:
    """One candidate: ``mode`` is the ``acco.mode`` (``zero1`` for stock), ``compression`` int8/fp8/None."""
    name: str
    mode: str
    accumulation: str = "fixed"
    compression: Optional[str] = None
    sync_every: Optional[int] = None
    fragments: int = 1
    delay: int = 0
    timed: bool = False  # A-EDiT: sync_time_s instead of sync_every
    sparse: dict = field(default_factory=lambda: dict(SPARSE_DEFAULTS))

    @property
    def family(self) -> str:
        base = "a-edit" if self.timed else "streaming" if self.fragments > 1 else self.mode
        if self.accumulation == "adaptive":
            base = "acco adaptive"
        return base + (" int8" if self.compression else "")


def compute_seconds(inp: Inputs) -> float:
    """6·N·T / (W·F·mfu): forward and backward of N parameters (MoE: the active ones) on T tokens, spread over
    all W ranks."""
    if inp.compute_s is not None:
        return inp.compute_s
    return 6.0 * (inp.active_params or inp.params) * inp.tokens_per_step / (inp.world * inp.rank_flops * inp.mfu)


def element_bytes(inp: Inputs, compressed: bool) -> float:
    return 1.0 + 4.0 / inp.block_size if compressed else DTYPE_BYTES[inp.dtype]


def node_aware(inp: Inputs, numel: float, compressed: bool, inter_b: Optional[float] = None):
    """(seconds, bytes a node sends across its link) of one node-aware reduce-scatter or all-gather of
    ``numel`` elements: intra-node step at full precision, then the rails across nodes."""
    r, k = inp.nodes, inp.ranks_per_node
    b = element_bytes(inp, compressed) if inter_b is None else inter_b
    cut = (r - 1) / r * numel * b
    t = 0.0
    if k > 1:
        t += (k - 1) / k * numel * DTYPE_BYTES[inp.dtype] / (inp.intra_bps / 8) + (k - 1) * inp.intra_latency_s
    if r > 1:
        t += cut / (inp.inter_bps / 8) + (r - 1) * inp.inter_latency_s
    return t, cut


def stock_comm(inp: Inputs):
    """Stock ZeRO-1: flat ring all-reduce (2(W−1)/W) and all-gather ((W−1)/W) over all W ranks; the slowest
    edge is a node's link, and every ring step waits one latency of it."""
    w, n, b = inp.world, inp.params, DTYPE_BYTES[inp.dtype]
    cut = 3 * (w - 1) / w * n * b if inp.nodes > 1 else 0.0
    bw, lat = (inp.inter_bps, inp.inter_latency_s) if inp.nodes > 1 else (inp.intra_bps, inp.intra_latency_s)
    if w == 1:
        return 0.0, 0.0
    return (3 * (w - 1) / w * n * b) / (bw / 8) + 3 * (w - 1) * lat, cut


def outer_allreduce(inp: Inputs, numel: float, compressed: bool):
    """(seconds, bytes across a node's link) of the local-SGD outer all-reduce of ``numel`` elements between
    the R replicas, one rail per rank (each rank all-reduces its 1/k shard): a reduce-scatter and an all-gather
    over R, fp32 (the pseudo-gradient is computed from fp32 shards) unless compressed."""
    r = inp.nodes
    b = 1.0 + 4.0 / inp.block_size if compressed else (inp.outer_bytes or 4.0)
    cut = 2 * (r - 1) / r * numel * b
    return cut / (inp.inter_bps / 8) + 2 * (r - 1) * inp.inter_latency_s, cut


def sparse_payload(inp: Inputs, sparse: dict) -> int:
    """Bytes of one replica's SparseLoCo payload on the wire (``ops/sparse_codec.py``): a tag byte, then per chunk
    of ``chunk`` elements of each tensor (L elements, k = min(topk, L) kept) an fp32 scale, k codes of value_bits
    (fp32 values when 0) and the k indices. Packed, an index takes ⌈log2 L⌉ bits (none when k = L); with
    ``entropy_coding`` "zlib" (the default) the indices count at their information bound, log2 C(L, k) bits,
    which the zlib coding of the sorted gaps reaches within 4% (docs/benchmarks/sparse.md), the codes and
    scales as packed (zlib takes a little off them too)."""
    chunk, topk, bits = sparse["chunk"], sparse["topk"], sparse["value_bits"] or 0
    coded = sparse.get("entropy_coding", "zlib") is not None

    def chunk_bytes(length: int) -> float:
        k = min(topk, length)
        if k == length:
            index = 0.0
        elif coded:
            index = (math.lgamma(length + 1) - math.lgamma(k + 1) - math.lgamma(length - k + 1)) / math.log(2) / 8
        else:
            index = math.ceil(k * (length - 1).bit_length() / 8)
        return index + (math.ceil(k * bits / 8) + 4 if bits else 4 * k)

    total = 1.0
    for size in inp.tensor_sizes or [inp.params]:
        full, rest = divmod(int(size), chunk)
        total += full * chunk_bytes(chunk) + (chunk_bytes(rest) if rest else 0.0)
    return int(math.ceil(total))


def sparse_allgather(inp: Inputs, sparse: dict):
    """A ring all-gather of the replicas' payloads: each node sends (R−1) payloads across its link."""
    r = inp.nodes
    cut = (r - 1) * sparse_payload(inp, sparse)
    return cut / (inp.inter_bps / 8) + (r - 1) * inp.inter_latency_s, cut


def syncer_exchange(inp: Inputs, numel: float):
    """(seconds, bytes a node sends across its link) of a decoupled learner's exchange: its fp32 pseudo-gradient
    up to the syncer shards, their merge, the global model back, each rank over its own rail; the learner waits
    for it, nobody else does."""
    b = inp.outer_bytes or 4.0
    return 2 * numel * b / (inp.inter_bps / 8) + 2 * inp.inter_latency_s, numel * b


def exposed(inp: Inputs, c: float, r: float, outer: bool = False) -> float:
    """Seconds that a communication of ``r`` seconds (alone) adds to ``c`` seconds of compute it overlaps: it
    takes lambda·r beside compute, and compute runs at 1/kappa speed while both run, so the two take
    max(lambda·r, c + lambda·r·(1 − 1/kappa)); kappa = lambda = 1 gives max(c, r), kappa → ∞ gives c + r.
    ``outer``: an outer sync between replica groups (only the rails between nodes), whose kappa may differ from
    a round's (which also moves data inside each node: on CPU hosts that is memory copies on the compute's cores)."""
    r *= inp.overlap_comm
    kappa = inp.overlap_outer_compute if outer and inp.overlap_outer_compute else inp.overlap_compute
    return max(r, c + r * (1 - 1 / kappa)) - c


def evaluate(inp: Inputs, m: Mode, factor_inp: Optional[Inputs] = None) -> dict:
    """Seconds per step (compute, exposed communication), bytes across a node's link and the token factor of
    one candidate (``factor_inp``: the inputs the factor is read for, when ``inp`` is a layout's shard)."""
    c = compute_seconds(inp)
    n = inp.params
    comp = m.compression is not None
    multiplier, per_sync, peak = 1.0, None, None
    behind = inp.backward_overlap * c  # compute a reduction released during the backward can hide behind
    if m.mode == "zero1":
        comm, cut = stock_comm(inp)
        # the gradient all-reduce is 2/3 of stock's bytes; the parameter all-gather follows the step
        step = c + (exposed(inp, behind, comm * 2 / 3) + comm / 3 if behind else comm)
    elif m.mode in ("sync", "dpu", "acco"):
        rs, cut_rs = node_aware(inp, n, comp)
        ag, cut_ag = node_aware(inp, n, comp)
        rnd, cut = rs + ag, cut_rs + cut_ag
        if m.mode == "sync":
            step = c + (exposed(inp, behind, rnd) if behind else rnd)  # nothing overlaps (what-if: backward)
        elif m.mode == "dpu":
            step = c + exposed(inp, c, rnd)  # the round of step t runs beside the compute of step t+1
        else:
            cut *= 2  # two rounds per step, each behind half the micro-batches
            step = c + exposed(inp, c, 2 * rnd)
            if m.accumulation == "adaptive":  # more micro-batches per round until compute covers the round,
                # up to max_micro_batches_per_round (4x); compute beside the round runs at 1/kappa speed
                multiplier = min(4.0, max(1.0, 2 * rnd * inp.overlap_comm / (c * inp.overlap_compute)))
                step = (c * multiplier + exposed(inp, c * multiplier, 2 * rnd)) / multiplier  # per T tokens
        peak = cut
    else:
        h = m.sync_every
        k = inp.ranks_per_node
        inner = 0.0
        if k > 1:  # ZeRO-1 inside the replica group: a reduce-scatter and an all-gather on the intra link
            inner = 2 * ((k - 1) / k * n * DTYPE_BYTES[inp.dtype] / (inp.intra_bps / 8) + (k - 1) * inp.intra_latency_s)
        s_in = c + inner
        if m.mode == "sparseloco":
            t_sync, per_sync = sparse_allgather(inp, m.sparse)
            # blocking, like diloco; "overlap": N (m.delay) hides it behind the next N inner steps
            exposed_sync = exposed(inp, m.delay * s_in, t_sync, outer=True) if m.delay else t_sync
        elif m.mode == "decoupled":  # equal learners: no one waits for another, each for its own exchange
            t_sync, per_sync = syncer_exchange(inp, n)
            exposed_sync = t_sync
        else:
            t_sync, per_sync = outer_allreduce(inp, n, comp)
            if m.fragments > 1 or m.delay:  # Streaming DiLoCo: one fragment per window, hidden behind τ steps
                t_frag = t_sync / m.fragments + (1 - 1 / m.fragments) * 2 * (inp.nodes - 1) * inp.inter_latency_s
                exposed_sync = m.fragments * exposed(inp, m.delay * s_in + behind, t_frag, outer=True)
                peak = per_sync / m.fragments
            elif m.mode == "co2":  # the all-reduce runs during the whole next period
                exposed_sync = exposed(inp, h * s_in, t_sync, outer=True)
            elif m.mode == "edit":  # layer-wise: hidden behind the first forward pass of the next step
                exposed_sync = exposed(inp, c / (3 * inp.micro_batches), t_sync, outer=True)
            else:
                exposed_sync = exposed(inp, behind, t_sync, outer=True) if behind else t_sync
        peak = per_sync if peak is None else peak
        step = s_in + exposed_sync / h
        cut = per_sync / h
    f, src = token_factor(factor_inp or inp, m, multiplier)
    steps = inp.total_tokens / inp.tokens_per_step
    return {"compute_s": c, "step_s": step, "exposed_comm_s": max(0.0, step - c), "compute_utilization": c / step,
            "inter_bytes_per_step": cut, "inter_bytes_per_sync": per_sync if per_sync is not None else cut,
            "peak_burst_bytes": peak if peak is not None else cut, "token_factor": f, "token_factor_source": src,
            "time_to_tokens_s": step * f * steps, "micro_batch_multiplier": multiplier}


PERIODS = (2, 4, 8, 16, 32, 64, 128, 256, 512)


def candidates(inp: Inputs, sparse: bool = True, sync_every: Optional[int] = None) -> List[Mode]:
    """Every mode of the plan, local SGD at every period of ``PERIODS`` or at ``sync_every`` alone (``best``
    keeps the best period); local SGD needs two replicas."""
    out = [Mode("zero1", "zero1")]
    for comp in (None, "int8"):
        tag = f" {comp}" if comp else ""
        out += [Mode("sync" + tag, "sync", compression=comp), Mode("dpu" + tag, "dpu", compression=comp),
                Mode("acco" + tag, "acco", compression=comp),
                Mode("acco adaptive" + tag, "acco", "adaptive", compression=comp)]
    if inp.dp_nodes < 2:  # one replica: nothing crosses a slow link, and local SGD needs two replicas
        return out
    for h in (sync_every,) if sync_every else PERIODS:
        for comp in (None, "int8"):
            tag = f" {comp}" if comp else ""
            out += [Mode(f"diloco{tag}", "diloco", compression=comp, sync_every=h),
                    Mode(f"co2{tag}", "co2", compression=comp, sync_every=h),
                    Mode(f"edit{tag}", "edit", compression=comp, sync_every=h),
                    Mode(f"a-edit{tag}", "edit", compression=comp, sync_every=h, timed=True)]
            for f in (2, 4, 8):
                for tau in (1, 2):
                    if h % f == 0 and tau < h // f:
                        out.append(Mode(f"streaming{tag}", "diloco", compression=comp, sync_every=h, fragments=f,
                                        delay=tau))
        if sparse:
            out.append(Mode("sparseloco", "sparseloco", sync_every=h))
            out += [Mode("sparseloco overlap", "sparseloco", sync_every=h, delay=n) for n in (1, 2) if n < h]
        out.append(Mode("decoupled", "decoupled", sync_every=h))
    return out


def best(inp: Inputs, modes: List[Mode]) -> List[tuple]:
    """(mode, figures) per row name, the period (and fragments, delay) with the least time to the tokens;
    ties within 1% go to the shorter period, then the fewer fragments."""
    rows = {}
    for m in modes:
        fig = evaluate(inp, m)
        old = rows.get(m.name)
        if old is None or fig["time_to_tokens_s"] < old[1]["time_to_tokens_s"] * 0.99:
            rows[m.name] = (m, fig)
    return sorted(rows.values(), key=lambda mf: mf[1]["time_to_tokens_s"])


def recommend(rows: List[tuple]) -> str:
    """The least time to the tokens; an exact round mode (stock ZeRO-1, sync) wins if within 5% of it."""
    fastest = rows[0][1]["time_to_tokens_s"]
    exact = [m.name for m, f in rows if m.mode in EXACT and m.compression is None
             and f["time_to_tokens_s"] <= fastest * (1 + TIE)]
    return exact[0] if exact else rows[0][0].name
