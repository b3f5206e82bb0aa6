"""The plan's model against published figures, and its projections for H100 sites (docs/plan.md).

    python benchmarks/plan_literature.py          # prints both tables (markdown)

Nothing here is measured: it evaluates ``acco_ds.plan_model`` under stated inputs. tests/test_plan.py pins the
figures it prints.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from acco_ds import plan_model as pm  # noqa: E402

# INTELLECT-1 (Jaghouar et al. 2024, arXiv 2412.01152: abstract, the release post and the model card): 10B
# parameters, up to 14 nodes of 8 H100, DiLoCo with 100 inner steps, int8 all-reduce of the pseudo-gradient,
# "400x reduction in communication bandwidth compared to traditional data-parallel", compute utilization 96%
# (nodes within the US) and 83% (across continents).
INTELLECT = {"params": 10e9, "nodes": 14, "sync_every": 100, "utilization": {"US": 0.96, "global": 0.83}}


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


def intellect_utilization(gbit: float, step_s: float) -> float:
    """The plan's compute utilization of INTELLECT-1's setup at ``gbit`` between nodes and ``step_s`` per step."""
    inp = pm.Inputs(params=int(INTELLECT["params"]), tokens_per_step=1, nodes=INTELLECT["nodes"], ranks_per_node=1,
                    compute_s=step_s, inter_bps=gbit * 1e9, inter_latency_s=0.0)
    m = pm.Mode("diloco int8", "diloco", compression="int8", sync_every=INTELLECT["sync_every"])
    return pm.evaluate(inp, m)["compute_utilization"]


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


def main():
    print("INTELLECT-1: per-step bytes, data parallel fp32 / DiLoCo H=100 int8: "
          f"{intellect_reduction():.1f}x (published: 400x)")
    for where, u in INTELLECT["utilization"].items():
        print(f"INTELLECT-1 {where}: utilization {u:.0%} needs bandwidth x inner-step time = "
              f"{intellect_bandwidth_step_product(u):.2f} Gbit/s x s")
    print("\n| model | link | " + " | ".join(SHOWN) + " | recommended |")
    print("|---|---|" + "---|" * len(SHOWN) + "---|")
    for (n, gbit), (rec, rows) in projections().items():
        cells = []
        for name in SHOWN:
            u, h, _ = rows[name]
            cells.append(f"{100 * u:.0f}%" + (f" (H={h})" if h else ""))
        print(f"| {n / 1e9:g}B | {gbit} Gbit/s | " + " | ".join(cells) + f" | {rec} |")


if __name__ == "__main__":
    main()
