"""Published cases the plan's model is checked against (docs/plan.md, "Checked against the literature"):
INTELLECT-1's bytes and utilization, Covenant-72B's bytes per round, the Streaming DiLoCo paper's Table 4,
Megatron-LM's Table 1 layouts, and
projections for H100 sites. ``benchmarks/plan_literature.py`` prints them; tests/test_plan.py pins them.

Nothing here is measured: it evaluates the plan's model under stated inputs.
"""

from dataclasses import replace

from . import model as pm
from .layouts import choose, evaluate, layouts
from .memory import memory

# INTELLECT-1 (Jaghouar et al. 2024, arXiv 2412.01152: abstract, the release post and the model card): 10B
# parameters, up to 14 nodes of 8 H100, DiLoCo with 100 inner steps, int8 all-reduce of the pseudo-gradient,
# "400x reduction in communication bandwidth compared to traditional data-parallel", compute utilization 96%
# (nodes within the US) and 83% (across continents).
INTELLECT = {"params": 10e9, "nodes": 14, "sync_every": 100, "utilization": {"US": 0.96, "global": 0.83}}
# The report's Table 2 (as quoted by a public summary of it; the report itself was not read here): 100 inner
# steps take 38 minutes in every setting; the median all-reduce takes 103 s (nodes in the USA), 382 s (USA and
# Europe), 469 s (global), and compute utilization is 95.7%, 85.6%, 83.0%; the bandwidth between nodes
# fluctuated between 500 Mbit/s and 4 Gbit/s.
INTELLECT_TABLE2 = {"inner_s": 38 * 60 / 100, "bandwidth_gbit": (0.5, 4.0),
                    "settings": {"USA": (103, 0.957), "USA + Europe": (382, 0.856), "Global": (469, 0.830)}}


def intellect_reduction() -> float:
    """Bytes a node sends per step: data parallel (fp32 gradient all-reduce every step) over DiLoCo H=100 int8."""
    inp = pm.Inputs(params=int(INTELLECT["params"]), tokens_per_step=1, nodes=INTELLECT["nodes"], ranks_per_node=1,
                    compute_s=1.0)
    dp = pm.outer_allreduce(inp, inp.params, compressed=False)[1]  # 2(R-1)/R N x 4 bytes, every step
    diloco = pm.evaluate(inp, pm.Mode("diloco int8", "diloco", compression="int8",
                                      sync_every=INTELLECT["sync_every"]))["inter_bytes_per_step"]
    return dp / diloco


def intellect_bandwidth_step_product(utilization: float) -> float:
    """Gbit/s x seconds per inner step at which the plan gives DiLoCo H=100 int8 on 14 nodes ``utilization``
    (blocking sync, latency left out): B·s = bits per sync / (H (1/U - 1))."""
    inp = pm.Inputs(params=int(INTELLECT["params"]), tokens_per_step=1, nodes=INTELLECT["nodes"], ranks_per_node=1,
                    compute_s=1.0, inter_latency_s=0.0)
    bits = 8 * pm.outer_allreduce(inp, inp.params, compressed=True)[1]
    return bits / (INTELLECT["sync_every"] * (1 / utilization - 1)) / 1e9


def intellect_share():
    """{setting: (published utilization, the plan's utilization with the measured all-reduce time, the per-node
    bandwidth at which the plan's int8 all-reduce takes that time (Gbit/s))}: the plan's blocking-sync rule
    (H·s / (H·s + t_sync)) and its byte count (2(R−1)/R·N·(1 + 4/256) bytes a node sends) against Table 2."""
    inp = pm.Inputs(params=int(INTELLECT["params"]), tokens_per_step=1, nodes=INTELLECT["nodes"], ranks_per_node=1,
                    compute_s=INTELLECT_TABLE2["inner_s"], inter_latency_s=0.0)
    bits = 8 * pm.outer_allreduce(inp, inp.params, compressed=True)[1]
    out = {}
    for name, (sync_s, published) in INTELLECT_TABLE2["settings"].items():
        gbit = bits / sync_s / 1e9
        out[name] = (published, intellect_utilization(gbit, INTELLECT_TABLE2["inner_s"]), gbit)
    return out


def intellect_utilization(gbit: float, step_s: float) -> float:
    """The plan's compute utilization of INTELLECT-1's setup at ``gbit`` between nodes and ``step_s`` per step."""
    inp = pm.Inputs(params=int(INTELLECT["params"]), tokens_per_step=1, nodes=INTELLECT["nodes"], ranks_per_node=1,
                    compute_s=step_s, inter_bps=gbit * 1e9, inter_latency_s=0.0)
    m = pm.Mode("diloco int8", "diloco", compression="int8", sync_every=INTELLECT["sync_every"])
    return pm.evaluate(inp, m)["compute_utilization"]


# Covenant-72B (arXiv 2603.08163; SparseLoCo, arXiv 2508.15706): 72B parameters, SparseLoCo with H = 30 and
# 1.56% density (64 of every 4096 entries), 2-bit values, error feedback; "more than 146x" compression against
# fp32 DiLoCo, 94.5% compute utilization, about 70 s of communication a round. Its bytes per round follow from
# the published ratio: a replica sends at most 4 N / 146 bytes a round (1.97 GB at N = 72e9).
COVENANT = {"params": 72e9, "sync_every": 30, "chunk": 4096, "topk": 64, "value_bits": 2, "compression": 146,
            "utilization": 0.945, "comm_s": 70}


def covenant_bytes() -> dict:
    """Bytes one replica sends per round in Covenant-72B's setting: as published (4 N / 146) and as the plan
    counts acco_ds's payload (``model.sparse_payload``: indices packed at 12 bits, or zlib-coded at their
    information bound), each with its ratio to the fp32 pseudo-gradient (4 N bytes)."""
    inp = pm.Inputs(params=int(COVENANT["params"]), tokens_per_step=1, nodes=2, ranks_per_node=1)
    sparse = {k: COVENANT[k] for k in ("chunk", "topk", "value_bits")}
    fp32 = 4 * COVENANT["params"]
    out = {"published": fp32 / COVENANT["compression"],
           "packed": pm.sparse_payload(inp, dict(sparse, entropy_coding=None)),
           "zlib": pm.sparse_payload(inp, dict(sparse, entropy_coding="zlib"))}
    return {k: (v, fp32 / v) for k, v in out.items()}


# Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512), Table 4: the Gbit/s each method needs to reach a
# compute utilization (the first point of the paper's log grid that reaches it). Stated there: step time from
# the Kaplan FLOP rule at 60% MFU, H = 100, fragments of 3 layers (1B: 24 layers, 10B: 48, 100B: 108). Stated by
# the first author's public simulator of that figure: 2 workers, bf16 values (FP4: half a byte), gradients and
# outer gradients released bucket by bucket over the backward pass (2/3 of a step), no latency, and a sync
# must finish within its step (data parallel, DiLoCo) or within tau more steps (overlapped: tau = 1).
UTILIZATIONS = (0.50, 0.80, 0.90, 0.95, 0.99)
TABLE4 = {  # (params, step seconds, fragments): {method: Gbit/s for each of UTILIZATIONS}
    (1e9, 0.1, 8): {"data-parallel": (86.8, 152.6, 184.2, 222.3, 569.0), "DiLoCo": (1.4, 6.2, 13.3, 23.3, 86.8),
                    "Streaming DiLoCo": (1.4, 5.2, 9.1, 16.0, 28.1), "overlapped": (1.4, 4.3, 6.2, 9.1, 11.0),
                    "overlapped FP4": (0.4, 0.9, 1.7, 2.0, 3.0)},
    (10e9, 0.8, 16): {"data-parallel": (104.8, 222.3, 222.3, 268.3, 471.5), "DiLoCo": (1.7, 7.5, 16.0, 33.9, 104.8),
                      "Streaming DiLoCo": (1.7, 5.2, 9.1, 13.3, 19.3), "overlapped": (1.7, 3.6, 5.2, 6.2, 7.5),
                      "overlapped FP4": (0.4, 0.9, 1.4, 1.4, 1.7)},
    (100e9, 4.9, 36): {"data-parallel": (184.2, 323.8, 390.7, 390.7, 471.5), "DiLoCo": (3.0, 11.0, 23.3, 49.4, 184.2),
                       "Streaming DiLoCo": (2.4, 6.2, 9.1, 11.0, 19.3), "overlapped": (1.7, 3.6, 4.3, 5.2, 5.2),
                       "overlapped FP4": (0.5, 0.9, 1.1, 1.1, 1.4)},
}
STREAMING_H, BACKWARD = 100, 2 / 3


def streaming_row(method: str, fragments: int):
    """The plan's row for one of Table 4's methods, and the bytes per value its outer sync sends."""
    if method == "data-parallel":
        return pm.Mode("sync", "sync"), 2.0  # one all-reduce of bf16 gradients per step
    if method == "DiLoCo":
        return pm.Mode("diloco", "diloco", sync_every=STREAMING_H), 2.0
    delay = 0 if method == "Streaming DiLoCo" else 1
    return (pm.Mode("streaming", "diloco", sync_every=STREAMING_H, fragments=fragments, delay=delay),
            0.5 if method.endswith("FP4") else 2.0)


def streaming_utilization(params: float, step_s: float, fragments: int, method: str, gbit: float) -> float:
    """The plan's compute utilization for one method of Table 4 at ``gbit`` between the two workers."""
    mode, value_bytes = streaming_row(method, fragments)
    inp = pm.Inputs(params=int(params), tokens_per_step=1, nodes=2, ranks_per_node=1, compute_s=step_s,
                    inter_bps=gbit * 1e9, inter_latency_s=0.0, dtype="bf16", outer_bytes=value_bytes,
                    backward_overlap=BACKWARD)
    return pm.evaluate(inp, mode)["compute_utilization"]


def streaming_needed(params, step_s, fragments, method, utilization) -> float:
    """The Gbit/s at which the plan's utilization reaches ``utilization`` (bisection on a log scale)."""
    lo, hi = 1e-3, 1e5
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        reached = streaming_utilization(params, step_s, fragments, method, mid) >= utilization
        lo, hi = (lo, mid) if reached else (mid, hi)
    return hi


def streaming_comparison():
    """[(model, method, target utilization, published Gbit/s, the plan's utilization there, the plan's Gbit/s)]."""
    out = []
    for (params, step_s, fragments), methods in TABLE4.items():
        for method, gbits in methods.items():
            for u, gbit in zip(UTILIZATIONS, gbits):
                out.append((params, method, u, gbit, streaming_utilization(params, step_s, fragments, method, gbit),
                            streaming_needed(params, step_s, fragments, method, u)))
    return out


# Projections: 2 sites of 64 H100 (989 TFLOP/s bf16 dense each), MFU 0.4, bf16, 4M tokens per step, 20 N
# tokens, 30 ms between sites, 400 Gbit/s per rank inside a site.
SITE = {"nodes": 2, "ranks_per_node": 64, "rank_flops": 989e12, "mfu": 0.4, "tokens_per_step": 4e6,
        "inter_latency_s": 0.03, "intra_bps": 400e9, "dtype": "bf16"}
SHOWN = ("zero1", "sync", "dpu", "acco", "acco int8", "diloco", "diloco int8", "streaming", "co2", "edit", "sparseloco")


def projections():
    """{(params, gbit): (recommended, {row name: (utilization, sync_every)})}."""
    out = {}
    for n in (1e9, 7e9, 70e9):
        for gbit in (1, 10, 100):
            inp = pm.Inputs(params=int(n), inter_bps=gbit * 1e9, **SITE)
            rows = pm.best(inp, pm.candidates(inp))
            out[(n, gbit)] = (pm.recommend(rows), {m.name: (f["compute_utilization"], m.sync_every, f["step_s"])
                                                   for m, f in rows})
    return out


# Megatron-LM, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (arXiv 2104.04473), Table 1: GPT models on Selene (nodes of 8 A100 80GB, NVLink/NVSwitch inside,
# 8 x 200 Gbit/s HDR InfiniBand per node), mixed precision, sequence 2048, vocabulary 51,200.
# (billions of parameters, attention heads, hidden size, layers, tensor-parallel size, pipeline-parallel size,
# GPUs, batch size in sequences)
MEGATRON_SOURCE = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
                   "Megatron-LM', arXiv 2104.04473, Table 1")
MEGATRON_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512),
    (3.6, 32, 3072, 30, 2, 1, 64, 512),
    (7.5, 32, 4096, 36, 4, 1, 128, 512),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
)
# Their machine as the plan's inputs: A100 312 TFLOP/s (fp16 dense), MFU 0.45 (Table 1: 43-52% of peak), NVLink
# 300 GB/s per direction per GPU, 1.6 Tbit/s per node between nodes. Assumed (the table does not say):
# micro-batch 1, full activation recomputation. Memory: an A100 80GB holds 80 GiB; Megatron-LM of 2021 keeps
# every optimizer state on each data-parallel rank (no ZeRO), so the check counts model states at ZeRO stage 0.
SELENE = {"ranks_per_node": 8, "rank_flops": 312e12, "mfu": 0.45, "intra_bps": 2400e9, "inter_bps": 1600e9,
          "inter_latency_s": 5e-6, "intra_latency_s": 5e-6, "dtype": "fp16", "seq_len": 2048, "micro_batch": 1,
          "recompute": "full", "gpu_memory": 80 * 2 ** 30}


def megatron_layouts():
    """[(billions, their tp, their pp, the plan's tp, the plan's pp, fits)]: stock data parallelism's layout
    as the plan searches it (fastest that fits, ties within 5% to the smaller tp x pp) for each row."""
    out = []
    for billions, heads, hidden, layers, tp, pp, gpus, batch in MEGATRON_TABLE1:
        inp = pm.Inputs(params=int(billions * 1e9), tokens_per_step=batch * 2048, nodes=gpus // 8, hidden=hidden,
                        layers=layers, heads=heads, **SELENE)
        m = pm.Mode("zero1", "zero1")
        entries = []
        for t, p in layouts(inp):
            li = replace(inp, tp=t, pp=p)
            entries.append({"fig": evaluate(li, m), "memory": memory(li, m, zero_stage=0)})
        best = choose(entries)
        out.append((billions, tp, pp, best["fig"]["tp"], best["fig"]["pp"], best["memory"]["fits"]))
    return out
