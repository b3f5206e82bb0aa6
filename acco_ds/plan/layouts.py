"""Tensor, pipeline and expert layouts: what each costs beside the data-parallel part, and the search.

Sources (docs/plan.md writes every formula out): Megatron-LM's tensor parallelism (Shoeybi et al. 2019,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", arXiv 1909.08053)
all-reduces a micro-batch's activations (b·s·h elements) twice in the forward and twice in the backward of
every layer; its pipeline (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", arXiv 2104.04473) idles (p − 1)/m of the ideal time under the 1F1B schedule and sends b·s·h
activations between consecutive stages per micro-batch (b·s·h/t per tensor rank with its scatter/gather).
A layout of tp × pp ranks per model copy leaves W = nodes × ranks per node / (tp × pp) data-parallel ranks,
whose collectives ``acco_ds.plan.model`` evaluates on the shard one model-parallel rank holds.
"""

import math
from dataclasses import replace
from typing import Callable, List, Optional

from . import model as pm

TPS = (1, 2, 4, 8)
TIE = 0.05  # layouts within 5% of the fastest: the smaller tp x pp wins


def shape(inp: pm.Inputs) -> dict:
    """Hidden size h, layers L, sequence s, micro-batch b: the given ones, else assumed for the time model only
    (N ≈ 12·L·h², h/L = 128 as GPT-3's; s = 2048, b = 1); ``assumed`` names what was."""
    n = inp.active_params or inp.params
    h, layers, assumed = inp.hidden, inp.layers, []
    if h is None and layers is None:
        h = (128 * n / 12) ** (1 / 3)
        assumed.append("hidden")
    elif h is None:
        h = math.sqrt(n / (12 * layers))
        assumed.append("hidden")
    if layers is None:
        layers = max(1, round(n / (12 * h * h)))
        assumed.append("layers")
    s, b = inp.seq_len or 2048, inp.micro_batch or 1
    assumed += [name for name, v in (("seq_len", inp.seq_len), ("micro_batch", inp.micro_batch)) if v is None]
    return {"hidden": h, "layers": layers, "seq_len": s, "micro_batch": b, "assumed": assumed}


def micro_batches(inp: pm.Inputs, sh: dict) -> int:
    """m: micro-batches per step of one pipeline, T / (W·s·b)."""
    return max(1, round(inp.tokens_per_step / (inp.dp_world * sh["seq_len"] * sh["micro_batch"])))


def _allreduce(inp: pm.Inputs, nbytes: float, ranks: int) -> float:
    """A ring all-reduce of ``nbytes`` over ``ranks`` ranks of one node: 2(t−1)/t of it per rank."""
    return 2 * (ranks - 1) / ranks * nbytes / (inp.intra_bps / 8) + 2 * (ranks - 1) * inp.intra_latency_s


def layout_costs(inp: pm.Inputs, m: pm.Mode) -> dict:
    """Seconds per step of the layout's compute: the model's (6·N_active·T over all ranks), tensor-parallel
    all-reduces, MoE all-to-alls, the pipeline bubble and its exposed point-to-point sends."""
    c0 = pm.compute_seconds(inp)
    t, p, g = inp.tp, inp.pp, inp.ranks_per_node
    sh = shape(inp)
    mb = micro_batches(inp, sh)
    mb += mb % 2 if m.mode == "acco" else 0  # acco: two rounds of half the micro-batches each
    b = pm.DTYPE_BYTES[inp.dtype]
    act = sh["micro_batch"] * sh["seq_len"] * sh["hidden"] * b  # one micro-batch's activations, bytes
    per_stage = sh["layers"] / p
    tp_s = mb * per_stage * 4 * _allreduce(inp, act, t) if t > 1 else 0.0
    a2a = 0.0
    e = expert_parallel(inp)
    if e > 1:
        one = (e - 1) / e * act * inp.moe_top_k / (inp.intra_bps / 8) + (e - 1) * inp.intra_latency_s
        a2a = mb * per_stage * 4 * one  # dispatch and combine, forward and backward, every layer (upper bound)
    busy = c0 + tp_s + a2a
    bubble = p2p = 0.0
    if p > 1:
        flushes = 2 if m.mode == "acco" else 1  # acco: two flushes of m/2 micro-batches per step
        bubble = busy * (p - 1) / max(1.0, mb / flushes)
        if t * p <= g:  # the whole pipeline inside a node
            x = act / t / (inp.intra_bps / 8) + inp.intra_latency_s
        else:  # stages on several nodes: a boundary's t slices share the node's link
            x = act / (inp.inter_bps / 8) + inp.inter_latency_s
        # fill and drain wait for each send; in the steady state a send hides behind the next micro-batch
        p2p = flushes * 2 * (p - 1) * x + mb * max(0.0, x - busy / mb)
    return {"compute_s": c0, "tp_s": tp_s, "all_to_all_s": a2a, "bubble_s": bubble, "p2p_s": p2p,
            "layout_s": busy + bubble + p2p, "micro_batches": mb}


def view(inp: pm.Inputs, layout_s: float, mb: int) -> pm.Inputs:
    """The data-parallel part as ``model.evaluate`` sees it: the shard of one model-parallel rank over W ranks
    on the nodes one data-parallel group spans; the node's link shared by the groups on it; ``mb`` micro-batches
    per step when the shape gives them or a pipeline runs them (else the config's)."""
    groups = inp.ranks_per_node // inp.dp_per_node
    split = inp.tp * inp.pp > 1
    known = inp.pp > 1 or (inp.seq_len and inp.micro_batch)
    return replace(inp, params=-(-inp.params // (inp.tp * inp.pp)), nodes=inp.dp_nodes,
                   ranks_per_node=inp.dp_per_node, inter_bps=inp.inter_bps / groups, compute_s=layout_s,
                   tp=1, pp=1, active_params=None, tokens=inp.total_tokens,
                   micro_batches=mb if known else inp.micro_batches,
                   tensor_sizes=None if split else inp.tensor_sizes)


def evaluate(inp: pm.Inputs, m: pm.Mode) -> dict:
    """``model.evaluate`` of the layout ``inp.tp`` × ``inp.pp``: bytes are a node's, compute_s the model's."""
    costs = layout_costs(inp, m)
    fig = pm.evaluate(view(inp, costs["layout_s"], costs["micro_batches"]), m, factor_inp=inp)
    groups = inp.ranks_per_node // inp.dp_per_node
    for key in ("inter_bytes_per_step", "inter_bytes_per_sync", "peak_burst_bytes"):
        fig[key] *= groups
    c0 = costs["compute_s"]
    fig.update(compute_s=c0, compute_utilization=c0 / fig["step_s"], exposed_comm_s=max(0.0, fig["step_s"] - c0),
               layout_s=costs["layout_s"] - c0, tp=inp.tp, pp=inp.pp,
               micro_batches=costs["micro_batches"] if inp.pp > 1 or (inp.seq_len and inp.micro_batch) else None)
    return fig


def is_moe(inp: pm.Inputs) -> bool:
    return bool(inp.active_params and inp.active_params < inp.params)


def expert_parallel(inp: pm.Inputs) -> int:
    """ep_size of an MoE model as the engine runs it: experts over the data-parallel ranks of a node (never
    across nodes, never beside tensor or pipeline parallelism, which the rulebook refuses); 1 when dense."""
    return inp.dp_per_node if is_moe(inp) and inp.tp * inp.pp == 1 else 1


def layouts(inp: pm.Inputs, tp: Optional[int] = None, pp: Optional[int] = None) -> List[tuple]:
    """(tp, pp) to try: the given ones, else tp in {1, 2, 4, 8} up to the ranks per node and pp in
    {1, 2, 4, ...}, tp x pp dividing the ranks and either dividing a node or made of whole nodes."""
    g, world = inp.ranks_per_node, inp.world
    out = []
    for t in [tp] if tp else [t for t in TPS if t <= g and g % t == 0]:
        for p in [pp] if pp else [2 ** i for i in range(world.bit_length()) if t * 2 ** i <= world]:
            if inp.layers and p > inp.layers:
                continue
            mp = t * p
            if world % mp == 0 and (g % mp == 0 or mp % g == 0):
                out.append((t, p))
    return out


def search(inp: pm.Inputs, memory: Callable, judge: Callable, sparse: bool = True, sync_every: Optional[int] = None,
           tp: Optional[int] = None, pp: Optional[int] = None) -> List[dict]:
    """One entry per row name: {"mode", "fig", "memory", "refused", "inputs"} at its layout: of the layouts where
    acco_ds runs it and it fits, the fastest (ties within 5%: the smaller tp × pp); see ``choose``.
    ``memory(mode, inputs)`` gives {"total", "fits", ...}; ``judge(mode, inputs, fig)`` the rulebook's refusal
    of the row's block at that layout (None: it runs)."""
    per_name = {}
    for t, p in layouts(inp, tp, pp):
        li = replace(inp, tp=t, pp=p)
        best = {}
        for m in pm.candidates(li, sparse, sync_every):
            fig = evaluate(li, m)
            old = best.get(m.name)  # the period (fragments, delay) with the least time; ties within 1%: shorter
            if old is None or fig["time_to_tokens_s"] < old[1]["time_to_tokens_s"] * 0.99:
                best[m.name] = (m, fig)
        for name, (m, fig) in best.items():
            per_name.setdefault(name, []).append({"mode": m, "fig": fig, "memory": memory(m, li),
                                                  "refused": judge(m, li, fig), "inputs": li})
    return sorted((choose(entries) for entries in per_name.values()), key=lambda e: e["fig"]["time_to_tokens_s"])


def choose(entries: List[dict]) -> dict:
    """Of one row's layouts ({"fig", "memory", "refused" (None or absent: it runs), ...}): those where acco_ds runs
    it and it fits, else those where it fits (the row then says why it is refused), the fastest of them, ties
    within 5% to the smaller tp × pp; if it fits nowhere, the layout needing the least memory."""
    fits = [e for e in entries if e["memory"]["fits"]]
    fits = [e for e in fits if e.get("refused") is None] or fits
    if not fits:
        return min(entries, key=lambda e: (e["memory"]["total"], e["fig"]["time_to_tokens_s"]))
    fastest = min(e["fig"]["time_to_tokens_s"] for e in fits)
    near = [e for e in fits if e["fig"]["time_to_tokens_s"] <= fastest * (1 + TIE)]
    return min(near, key=lambda e: (e["fig"]["tp"] * e["fig"]["pp"], e["fig"]["time_to_tokens_s"]))
