"""The plan's model against published figures, its layouts against Megatron-LM's, and its projections for H100
sites (docs/plan.md).

    python benchmarks/plan_literature.py          # prints the tables (markdown)

Nothing here is measured: it evaluates ``acco_ds.plan`` under stated inputs. The cases and their sources live in
``acco_ds.plan.literature``; tests/test_plan.py pins the figures printed here.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from acco_ds.plan.literature import (INTELLECT, INTELLECT_TABLE2, MEGATRON_SOURCE, SHOWN, UTILIZATIONS,  # noqa: E402
                                     intellect_bandwidth_step_product, intellect_reduction, intellect_share,
                                     megatron_layouts, projections, streaming_comparison)


def main():
    print("INTELLECT-1: per-step bytes, data parallel fp32 / DiLoCo H=100 int8: "
          f"{intellect_reduction():.1f}x (published: 400x)")
    for where, u in INTELLECT["utilization"].items():
        print(f"INTELLECT-1 {where}: utilization {u:.0%} needs bandwidth x inner-step time = "
              f"{intellect_bandwidth_step_product(u):.2f} Gbit/s x s")
    for name, (published, plan_u, gbit) in intellect_share().items():
        print(f"INTELLECT-1 {name}: compute utilization published {published:.1%}, the plan {plan_u:.1%} "
              f"(its int8 all-reduce takes the measured median at {gbit:.2f} Gbit/s per node; reported links: "
              f"{INTELLECT_TABLE2['bandwidth_gbit'][0]:g}-{INTELLECT_TABLE2['bandwidth_gbit'][1]:g} Gbit/s)")
    cells = streaming_comparison()
    errors = sorted(abs(plan_u - u) / u for _, _, u, _, plan_u, _ in cells)
    print("\nStreaming DiLoCo, Table 4: the plan's compute utilization at the published bandwidth "
          "(published: the first grid point that reaches the target), and the bandwidth the plan needs")
    print("| model | method | " + " | ".join(f"{u:.0%}" for u in UTILIZATIONS) + " |")
    print("|---|---|" + "---|" * len(UTILIZATIONS))
    for i in range(0, len(cells), len(UTILIZATIONS)):
        row = cells[i:i + len(UTILIZATIONS)]
        print(f"| {row[0][0] / 1e9:g}B | {row[0][1]} | " + " | ".join(
            f"{gbit:g} Gbit/s: {plan_u:.0%} (plan needs {need:.3g})" for _, _, _, gbit, plan_u, need in row) + " |")
    within = sum(e <= 0.10 for e in errors)
    print(f"|utilization error|: median {errors[len(errors) // 2]:.1%}, max {errors[-1]:.1%}; "
          f"within 10%: {within} of {len(errors)} cells")
    print(f"\nMegatron-LM's layouts ({MEGATRON_SOURCE}) against the plan's for stock data parallelism")
    print("| params (B) | theirs tp x pp | the plan's tp x pp | ratio |")
    print("|---|---|---|---|")
    for billions, tp, pp, ptp, ppp, fits in megatron_layouts():
        ratio = ptp * ppp / (tp * pp)
        print(f"| {billions:g} | {tp} x {pp} = {tp * pp} | " + (f"{ptp} x {ppp} = {ptp * ppp} | {ratio:.2g} |" if fits
              else "nothing fits (tp x pp must divide the GPUs; powers of two) | - |"))
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
