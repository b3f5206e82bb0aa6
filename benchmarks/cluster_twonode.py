"""The ``twonode`` command of the cluster benchmark: 4 ranks as 2 nodes of 2, every mode, table and plot
(see ``cluster.py``'s docstring for the setup)."""

import math

import cluster_runs as crun
from cluster_runs import (BLOCK, ROOT, STOCK, TWONODE_GAS, TWONODE_MICRO_BS, first_reach,
                          ideal_internode_bytes_per_step, param_count)


def run_row(h, bw, mode, spec, tag, runs, failed):
    """One run into ``runs``; a failure goes into ``failed`` (reported below the table), not lost."""
    try:
        runs[(bw, mode)] = h.run(bw, mode, spec, tag=tag)
    except RuntimeError as err:
        failed[(bw, mode)] = str(err)[-3000:]
        print(f"  {tag} {bw} {mode} FAILED:\n{failed[(bw, mode)]}", flush=True)


def cmd_twonode(h, name="twonode"):
    a = h.args
    spec = {"steps": a.steps, "warmup": a.warmup, "eval_interval": a.eval_interval, "eval_batches": a.eval_batches,
            "tokens": a.tokens, "extra": a.extra.split() if a.extra else []}
    runs, failed = {}, {}
    for bw in a.bandwidths:
        for mode in a.modes:
            run_row(h, bw, mode, spec, "twonode", runs, failed)
    a.modes = [m for m in a.modes if any((bw, m) in runs for bw in a.bandwidths)]
    n = param_count()
    finals = [r["final_val_loss"] for r in runs.values()]
    target_a = a.target if a.target else math.ceil(max(finals) * 100) / 100
    lines = [twonode_text(n, a, target_a), "",
             "| bandwidth | mode | samples/s | speedup vs ZeRO-1 | s/step | inter-node MB/step measured | ideal | "
             "measured / ideal | intra-node (lo) MB/step | val loss at equal tokens (committed) | after finalize | "
             f"time to {target_a:.2f} (s) | time to 1.02× ZeRO-1's final (s) | outer comm s / waited s (waited %) | "
             "syncs |", "|---" * 15 + "|"]
    table = []
    for bw in a.bandwidths:
        stock = runs.get((bw, STOCK))
        target_b = 1.02 * stock["final_val_loss"] if stock else None
        for mode in a.modes:
            r = runs.get((bw, mode))
            if r is None:
                lines.append(f"| {bw} | {mode} | failed (below) |" + " |" * 13)
                continue
            row = r["_record"]["row"]
            ideal = ideal_internode_bytes_per_step(n, mode)
            ideal = (ideal if ideal is not None else 4 * n * (row.get("syncs") or 0) / max(row["steps"], 1)) / 1e6
            reach_a = first_reach(r["history"], target_a)
            reach_b = first_reach(r["history"], target_b) if target_b else None
            speed = r["measured_samples_per_s"] / stock["measured_samples_per_s"] if stock else None
            outer = "–"
            if row.get("outer_comm_s"):
                outer = (f"{row['outer_comm_s']:.2f} / {row['outer_wait_s']:.2f} "
                         f"({100 * row['outer_wait_s'] / row['outer_comm_s']:.1f}%)")
            fin = row.get("final_val_loss_finalized")
            lines.append(
                f"| {bw} | {mode} | {row['samples_per_s']:.1f} | {'–' if speed is None else f'{speed:.2f}x'} | "
                f"{row['step_time_s']:.3f} | {row.get('inter_mb_per_step', float('nan')):.3f} | {ideal:.3f} | "
                f"{row.get('inter_mb_per_step', float('nan')) / ideal:.2f}x | "
                f"{row.get('intra_mb_per_step', float('nan')):.2f} | {row['final_val_loss']:.3f} | "
                f"{'–' if fin is None else f'{fin:.3f}'} | "
                f"{'not reached' if reach_a is None else f'{reach_a[0]:.1f}'} | "
                f"{'not reached' if reach_b is None else f'{reach_b[0]:.1f}'} | {outer} | "
                f"{'–' if row.get('syncs') is None else row['syncs']} |")
            table.append({"bandwidth": bw, "mode": mode, "ideal_mb_per_step": ideal, "speedup": speed,
                          "time_to_target_a": reach_a, "target_a": target_a, "time_to_target_b": reach_b,
                          "target_b": target_b, **row, "command": r["_record"]["command"]})
    co2 = runs.get(("50mbit", "co2 H=32"))
    if co2 and co2["_record"]["row"].get("outer_comm_s"):
        row = co2["_record"]["row"]
        lines += ["", f"co2 H=32 at 50mbit: the compute side waited {row['outer_wait_s']:.3f} s for "
                      f"{row['outer_comm_s']:.3f} s of outer all-reduce on the communication thread = "
                      f"{100 * row['outer_wait_s'] / row['outer_comm_s']:.1f}% (before finalize)."]
    lines += ["", "Where the bytes went (MB over the training loop, first step to the end of finalize; node A / "
                  "node B; \"after destroy\": the veth counter once the engine's threads were closed):", "",
              "| bandwidth | mode | inter-node (veth) A / B | after destroy A / B | intra-node (lo) A / B | ranks of a "
              "node read the same veth counter |", "|---|---|---|---|---|---|"]
    for (bw, mode), r in runs.items():
        row = r["_record"]["row"]
        mb = lambda v: "–" if not v else " / ".join(f"{x / 1e6:.2f}" for x in v)  # noqa: E731
        lines.append(f"| {bw} | {mode} | {mb(row.get('inter_node_bytes'))} | "
                     f"{mb(row.get('inter_node_bytes_after_destroy'))} | {mb(row.get('intra_node_bytes'))} | "
                     f"{row.get('same_node_readings_agree')} |")
    for (bw, mode), err in failed.items():
        lines += ["", f"**{mode} at {bw} failed**:", "", "```", err, "```"]
    cmds = [r["_record"]["command"] for r in runs.values()]
    text = "\n".join(lines) + "\n\nEach row (one run):\n\n" + "\n".join(f"    {c}" for c in cmds)
    pngs = plot_twonode(runs, a.bandwidths, a.modes, target_a, name)
    text += "".join(f"\n\n![{p.stem}]({p.relative_to(ROOT) if p.is_relative_to(ROOT) else p})" for p in pngs)
    print("\n" + text)
    h.tables["twonode"] = table
    return "### Two nodes: local-SGD vs ACCO\n\n" + text


def twonode_text(n, a, target_a):
    per_step = TWONODE_MICRO_BS * TWONODE_GAS * 4 * BLOCK
    return (f"Workload: GPT {n / 1e6:.2f}M parameters (fp32), micro-batch {TWONODE_MICRO_BS} x {BLOCK} tokens, "
            f"{TWONODE_GAS} micro-batches per rank per inner step (acco adaptive: as many as the link allows, up to "
            f"8 per round), 4 ranks as 2 nodes of 2 (one core per node, shared by its 2 ranks), token budget "
            f"{a.tokens:,} ({a.tokens // per_step} inner steps of {per_step:,} tokens), "
            f"validation every {a.eval_interval} inner steps on {a.eval_batches} held-out batches (the committed "
            f"model: for diloco/co2 the last global model, which moves only at a sync). samples/s: after {a.warmup} "
            f"warm-up steps, evaluations excluded. Bytes: each node's veth tx counter over the training loop (first "
            f"step to the end of finalize, TCP/IP headers included) / inner steps, the larger node; ideal "
            f"(`ideal_internode_bytes_per_step`, node-aware collectives, fp32): ZeRO-1 6N = {6 * n / 1e6:.2f} MB, "
            f"ACCO 8N = {8 * n / 1e6:.2f} MB, diloco/co2 4N/H = {4 * n / 8e6:.3f} MB (H=8), {4 * n / 32e6:.3f} MB "
            f"(H=32). Time to target: training time (no start-up, no evaluations) at the first validation at or "
            f"below it. Target {target_a:.2f}: the highest validation loss any row ends at (so every row reaches "
            f"it); the second target: 1.02 × stock ZeRO-1's final validation loss at the same bandwidth.")


def plot_twonode(runs, bandwidths, modes, target, name="twonode"):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plots")
        return []
    fig, axes = plt.subplots(1, len(bandwidths), figsize=(5.2 * len(bandwidths), 4.2), sharey=True, squeeze=False)
    for ax, bw in zip(axes[0], bandwidths):
        for mode in modes:
            r = runs.get((bw, mode))
            if r is None:
                continue
            hist = r["history"]
            ax.plot([p["time"] for p in hist], [p["val_loss"] for p in hist], marker=".",
                    drawstyle="steps-post" if "H=" in mode else "default", label=mode)
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{bw} between nodes")
        ax.set_xlabel("training time (s, no evaluations)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (committed model)")
    axes[0][0].set_ylim(top=min(axes[0][0].get_ylim()[1], 5.6))
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path = crun.RESULTS / f"cluster_{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


COMPRESSION_MODES = [STOCK, "acco fixed", "acco fixed int8", "acco fixed int8 no-EF", "acco fixed fp8", "diloco H=8",
                     "diloco H=8 int8", "diloco H=8 int8 no-EF"]


def uncompressed_of(mode):
    """The uncompressed row a compressed one is compared with ("acco fixed int8 no-EF" -> "acco fixed")."""
    for suffix in (" no-EF", " B=64K", " int8", " fp8"):
        mode = mode.replace(suffix, "")
    return mode


def cmd_compression(h):
    """The twonode table for compressed modes beside their uncompressed rows and stock ZeRO-1 (same tokens,
    same link), then per compressed row: inter-node bytes / uncompressed, loss at equal tokens vs
    uncompressed, samples/s vs stock."""
    text = cmd_twonode(h, "compression")
    table = h.tables["twonode"]
    lines = ["", "Compressed rows against their uncompressed row (same run, same link, same tokens):", "",
             "| bandwidth | mode | inter-node MB/step | / uncompressed | val loss | vs uncompressed | samples/s vs "
             "stock ZeRO-1 |", "|---|---|---|---|---|---|---|"]
    rows = {(r["bandwidth"], r["mode"]): r for r in table}
    for (bw, mode), r in rows.items():
        base = rows.get((bw, uncompressed_of(mode)))
        if base is None or base is r:
            continue
        ratio = r["inter_mb_per_step"] / base["inter_mb_per_step"]
        dloss = 100 * (r["final_val_loss"] / base["final_val_loss"] - 1)
        lines.append(f"| {bw} | {mode} | {r['inter_mb_per_step']:.3f} | {ratio:.3f}x | {r['final_val_loss']:.3f} | "
                     f"{dloss:+.2f}% | {'–' if r['speedup'] is None else format(r['speedup'], '.2f') + 'x'} |")
        r.update(bytes_vs_uncompressed=ratio, loss_vs_uncompressed_pct=dloss)
    section = "\n".join(lines)
    print(section)
    return text.replace("### Two nodes: local-SGD vs ACCO", "### Two nodes: compressed communication") + "\n" + section


def cmd_streaming(h):
    """The twonode table for Streaming DiLoCo beside diloco and stock ZeRO-1 (same tokens, same links), then
    per row: peak and mean bytes per inner step across the cut, the share of outer communication hidden."""
    text = cmd_twonode(h, "streaming")
    lines = ["", "Streaming DiLoCo (F fragments, τ steps of overlap) beside diloco H=8 (F=1, τ=0):", "",
             "| bandwidth | mode | inter-node MB/step mean | peak (one step) | outer comm s | waited s | hidden | "
             "val loss at equal tokens | samples/s vs stock |", "|---|---|---|---|---|---|---|---|---|"]
    for r in h.tables["twonode"]:
        if "H=" not in r["mode"]:
            continue
        comm, wait = r.get("outer_comm_s") or 0.0, r.get("outer_wait_s") or 0.0
        hidden = f"{100 * (1 - wait / comm):.0f}%" if comm > 0 else "–"
        lines.append(f"| {r['bandwidth']} | {r['mode']} | {r['inter_mb_per_step']:.3f} | "
                     f"{r.get('peak_inter_mb_per_step', float('nan')):.3f} | {comm:.2f} | {wait:.2f} | {hidden} | "
                     f"{r['final_val_loss']:.3f} | {'–' if r['speedup'] is None else format(r['speedup'], '.2f')}x |")
    section = "\n".join(lines)
    print(section)
    return text.replace("### Two nodes: local-SGD vs ACCO", "### Two nodes: Streaming DiLoCo") + "\n" + section


RACE_MODES = [STOCK, "acco fixed", "acco adaptive", "diloco H=8", "co2 H=8", "edit H=8", "a-edit T=5s"]


def cmd_race(h):
    """Which mode reaches a given loss first on this link: stock ZeRO-1 runs the standard token budget; its
    final validation loss x ``--race_ratio`` is the target (or ``--target``). Every other mode trains until
    its committed model's validation loss reaches the target, or until ``--race_cap`` x stock's training
    time (``train_worker.py --target_loss/--time_cap_s``), validating every ``--race_eval_interval`` inner
    steps (A-EDiT: every sync). Time to target excludes start-up and evaluations."""
    a = h.args
    base = {"steps": a.steps, "warmup": a.warmup, "eval_interval": a.race_eval_interval,
            "eval_batches": a.eval_batches, "tokens": a.tokens, "extra": []}
    runs, targets, caps, failed = {}, {}, {}, {}
    reference = {}  # --race_reference: the link where only stock runs; target, cap and "vs stock" come from it
    for bw in a.bandwidths:
        if a.race_reference and bw not in a.race_reference:
            if "run" not in reference:
                raise SystemExit(f"--race_reference {','.join(a.race_reference)}: list it first in --bandwidths")
            stock = reference["run"]
        else:
            stock = runs[(bw, STOCK)] = h.run(bw, STOCK, base, tag="race")
            reference.setdefault("run", stock)
        # Rounded as the workers get it (--target_loss): the table then judges with the number they stopped on.
        targets[bw] = round(a.target or stock["final_val_loss"] * a.race_ratio, 4)
        caps[bw] = a.race_cap * stock["train_time_s"]
        for mode in [m for m in a.modes if m != STOCK and not (a.race_reference and bw in a.race_reference)]:
            stop = ["--target_loss", f"{targets[bw]:.4f}", "--time_cap_s", f"{caps[bw]:.1f}"]
            spec = dict(base, tokens=50 * a.tokens, extra=stop + (["--eval_syncs", "1"] if "T=" in mode else []))
            run_row(h, bw, mode, spec, "race", runs, failed)
    n = param_count()
    lines = [f"Each mode trains until its committed model's validation loss reaches the target: 1.01 × stock "
             f"ZeRO-1's final validation loss after {a.tokens:,} tokens on the same link (stock's own row is that "
             f"run), or until {a.race_cap:g} × stock's training time. Validation every {a.race_eval_interval} "
             f"inner steps on {a.eval_batches} held-out batches (A-EDiT: every sync); time excludes start-up and "
             f"evaluations. Bytes: the larger node's veth tx counter per inner step.", "",
             "| bandwidth | mode | target | time to target (s) | vs stock | tokens to target | samples/s | "
             "inter-node MB/step | final val loss | stopped by |", "|---" * 10 + "|"]
    table = []
    for bw in a.bandwidths:
        stock_reach = first_reach((runs.get((bw, STOCK)) or reference["run"])["history"], targets[bw])
        for mode in a.modes:
            r = runs.get((bw, mode))
            if r is None and a.race_reference and (mode == STOCK or bw in a.race_reference):
                continue  # stock runs on the reference link only, the other modes elsewhere only
            if r is None:
                lines.append(f"| {bw} | {mode} | failed (below) |" + " |" * 7)
                continue
            row = r["_record"]["row"]
            reach = first_reach(r["history"], targets[bw])
            vs = reach[0] / stock_reach[0] if reach and stock_reach else None
            why = ("budget" if mode == STOCK else "target" if reach else f"time cap ({caps[bw]:.0f} s)")
            lines.append(f"| {bw} | {mode} | {targets[bw]:.3f} | {'not reached' if not reach else f'{reach[0]:.1f}'} | "
                         f"{'–' if vs is None else f'{vs:.2f}x'} | {'–' if not reach else f'{int(reach[1]):,}'} | "
                         f"{row['samples_per_s']:.1f} | {row.get('inter_mb_per_step', float('nan')):.3f} | "
                         f"{row['final_val_loss']:.3f} | {why} |")
            table.append({"bandwidth": bw, "mode": mode, "target": targets[bw], "time_cap_s": caps[bw],
                          "time_to_target": reach, "vs_stock": vs, **row, "command": r["_record"]["command"]})
    for (bw, mode), err in failed.items():
        lines += ["", f"**{mode} at {bw} failed**:", "", "```", err, "```"]
    text = "\n".join(lines) + "\n\nEach row (one run):\n\n" + "\n".join(
        f"    {r['_record']['command']}" for r in runs.values())
    path = plot_race(runs, a.bandwidths, a.modes, targets)
    if path:
        text += f"\n\n![{path.stem}]({path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})"
    print("\n" + text)
    h.tables["race"] = table
    return f"### Two nodes: time to a target loss ({n / 1e6:.2f}M parameters)\n\n" + text


def plot_race(runs, bandwidths, modes, targets):
    """Validation loss of the committed model against training time, one panel per bandwidth."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(bandwidths), figsize=(6 * len(bandwidths), 4.5), squeeze=False)
    for ax, bw in zip(axes[0], bandwidths):
        for mode in modes:
            r = runs.get((bw, mode))
            if r is not None:
                ax.plot([p["time"] for p in r["history"]], [p["val_loss"] for p in r["history"]], label=mode,
                        marker=".")
        ax.axhline(targets[bw], color="k", lw=0.8, ls="--")
        ax.set_title(f"4 ranks as 2 nodes, {bw} between nodes")
        ax.set_xlabel("training time (s, evaluations excluded)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (committed model)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path = crun.RESULTS / "cluster_race.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
