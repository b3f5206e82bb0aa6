"""The summary rows of ``gpu_check.py``: one ``(check, result, target, verdict)`` per figure, from the
sections' results (targets are reported, not enforced)."""

from gpu_kernels import sparse_summary_rows


def verdict(ok):
    return "n/a" if ok is None else "met" if ok else "MISSED"


def summary_rows(S, CUDA):
    """Every row but the last (failed sections); ``S``: the sections' results, ``CUDA``: a GPU ran them."""
    rows = [("op build/load", f"{S['build'].get('kernels', 'FAILED')} in {S['build'].get('build_s', '-')} s",
             "loads", verdict(S["build"].get("loaded", False)))]
    c = S["correctness"]
    rows.append(("adamw_update vs reference", f"{sum(x['pass'] for x in c.get('cases', []))}/"
                 f"{len(c.get('cases', []))} cases pass", "all", verdict(c.get("all_pass", False))))
    t = S["pytest"]
    rows.append(("kernel tests (CPU + CUDA)", "skipped" if t.get("skipped") else str(t.get("last_line")),
                 "passed",
                 "n/a" if t.get("skipped") else verdict(t.get("returncode") == 0)))
    tm = S["timing"].get("rows", [])
    for r in tm:
        if r["numel"] == max(x["numel"] for x in tm):
            checked = r["kernel"] == "peek" and r["numel"] >= 2**26
            rows.append((f"fused {r['kernel']} @ {r['numel'] / 2**20:g}M", f"{r['fused_GBps']:.1f} GB/s = "
                         f"{r['fused_pct_copy']:.0f}% of copy, {r['torch_ms'] / r['fused_ms']:.1f}x torch",
                         ">= 80% of copy" if checked else "-", verdict(r["fused_pct_copy"] >= 80 if checked else None)))
    qz = S["quantization"]
    rows.append(("quantize/dequantize vs ref", f"{sum(x['bit_exact'] for x in qz.get('cases', []))}/"
                 f"{len(qz.get('cases', []))} bit-exact", "all", verdict(qz.get("all_pass", False))))
    for r in qz.get("rows", []):
        rows.append((f"{r['kernel'][:22]} @ {r['numel'] >> 20}M", f"{r['GBps']:.1f} GB/s = {r['pct_copy']:.0f}% of copy",
                     ">= 80% of copy", verdict(r["pct_copy"] >= 80 if CUDA else None)))
    if "peek_speed_vs_fused_pct" in qz:
        rows.append(("peek vs torch fused AdamW", f"{qz['peek_speed_vs_fused_pct']:.0f}% of its speed", ">= 80%",
                     verdict(qz["peek_speed_vs_fused_pct"] >= 80 if CUDA else None)))
    rows += sparse_summary_rows(S, verdict)
    tr = S["training"]
    runs = tr.get("runs") or {}
    for base in ("stock", "stock_fused"):  # stock with torch's AdamW, and with DeepSpeed's FusedAdam
        for mode, r in runs.items():
            if not mode.startswith("stock") and base in runs:
                rel = r["tokens_per_s"] / runs[base]["tokens_per_s"] - 1
                rows.append((f"{mode} vs {base} tokens/s", f"{100 * rel:+.1f}%", ">= -5%",
                             verdict(rel >= -0.05 if CUDA else None)))
    stock = runs.get("stock")
    if stock and len(stock.get("tokens_per_s_all", [])) >= 2:
        spread = max(stock["tokens_per_s_all"]) / min(stock["tokens_per_s_all"]) - 1
        rows.append(("stock's own runs (noise)", f"{100 * spread:.1f}% apart: "
                     + ", ".join(f"{x:,.0f}" for x in stock["tokens_per_s_all"]) + " tok/s", "-", "n/a"))
    for mode, r in runs.items():
        hidden = "" if r["hidden_comm_fraction"] is None else f", {100 * r['hidden_comm_fraction']:.0f}% comm hidden"
        rows.append((f"train {mode}", f"{r['tokens_per_s']:,.0f} tok/s, loss {r['losses'][0]:.3f} -> "
                     f"{r['losses'][-1]:.3f}, peak {r['peak_bytes'] / 2**20:,.0f} MiB{hidden}", "-", "n/a"))
    if stock and "sync" in runs:
        rel = runs["sync"]["tokens_per_s"] / stock["tokens_per_s"] - 1
        rows.append(("sync vs stock tokens/s", f"{100 * rel:+.1f}%", "within 3%", verdict(abs(rel) <= 0.03)))
        diff, noise = tr["sync_vs_stock_max_loss_diff"], tr.get("stock_vs_stock_max_loss_diff", 0.0)
        rows.append(("sync vs stock losses", f"max diff {diff:.2e} (stock vs stock {noise:.2e})",
                     "<= 1e-5 or stock's own noise", verdict(diff <= max(1e-5, noise))))
    for mode, r in runs.items():
        if stock and r.get("estimate"):  # on the CPU, RSS growth is no peak: reported, not checked
            bound = stock["peak_bytes"] + r["estimate"]["extra_bytes"]
            rows.append((f"memory {mode}", f"peak {r['peak_bytes'] / 2**20:,.1f} MiB, stock + estimate "
                         f"{bound / 2**20:,.1f}; buffers {r['buffer_bytes'] / 2**20:,.1f} MiB, estimated "
                         f"{r['estimate'].get('buffer_bytes', float('nan')) / 2**20:,.1f}", "<= +5%",
                         verdict(r["peak_bytes"] <= 1.05 * bound if CUDA else None)))
    rows.append(("local-SGD modes", S["local_sgd"].get("status", "FAILED"), "run, loss down, one model",
                 verdict(S["local_sgd"].get("ok"))))
    if "moe" in S:
        m = S["moe"]
        rows.append(("MoE ep_size 2", m.get("status", "FAILED") + (f"; sync vs stock max loss diff "
                     f"{m['sync_vs_stock_max_loss_diff']:.2e}" if "sync_vs_stock_max_loss_diff" in m else ""),
                     "run, loss down", verdict(m.get("ok"))))
    resume = S["local_sgd"].get("a_edit_resume") or {}
    rows.append(("A-EDiT save/resume", f"tag {resume.get('tag')}, loaded = saved: {resume.get('loaded_equals_saved')}",
                 "bit for bit", verdict(resume.get("loaded_equals_saved"))))
    return rows


__all__ = ["summary_rows", "verdict"]
