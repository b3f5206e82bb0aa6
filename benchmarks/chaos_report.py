"""What ``benchmarks/chaos.py`` prints and draws from its runs' summaries: the markdown table, the goals in
words, and the plot (loss against time and committed tokens)."""

import statistics

import chaos_phases

RUNS = ("ft_free", "plain_free", "ft_chaos", "plain_chaos", "edit_tokens", "edit_mean")  # chaos.py's runs

def at_time(curve, t):
    """The committed model's validation loss at wall time t (the last one measured by then)."""
    seen = [v for (s, _, v) in curve if s <= t]
    return seen[-1] if seen else None


# ------------------------------------------------------------------------------- outputs
def fmt_list(xs, digits=1):
    xs = [x for x in xs if x is not None]
    return "/".join(f"{x:.{digits}f}" if isinstance(x, float) else str(x) for x in xs) or "-"


def one_model(r):
    """Whether every replica ended on the same committed weights (one SHA-256), and the run's troubles."""
    ok = "yes" if len(r["digests"]) == 1 and r["replicas_ended"] == 3 else \
        f"NO ({len(r['digests'])} digests from {r['replicas_ended']} replicas)"
    return ok, (f" ERROR: {r['error'][:200]}" if r.get("error") else "") + (f" ({r['note']})" if r.get("note") else "")


def markdown(res, goals, meta):
    head = (f"Machine: {meta['machine']}. {meta['settings']} Command: `{meta['command']}` ({meta['minutes']} min, "
            f"{meta['date']}, code {meta['code']}). The machine was shared with other jobs (load {meta['load']}): absolute times are "
            f"noisy; ratios are between runs of this one invocation.\n\nFailure schedule (seed {meta['seed']}): "
            f"{meta['schedule_words']}.\n")
    lines = ["| run | wall s | syncs | committed tokens | goodput tok/s | vs failure-free | kills | recovery s "
             "(kill to trained-again) | syncs discarded (per process) | heals (total s) | participants min/mean/max | quorum wait "
             "(share of run) | final val loss | replicas ending on one model |", "|" + "---|" * 14]
    for name in RUNS[:4]:
        r = res.get(name)
        if r is None:
            continue
        arm = name.split("_")[0]
        rel = "1.000" if name.endswith("free") else str(goals.get(f"{arm}_goodput_ratio"))
        kills = sum(1 for e in r["events"] if e["event"] == "kill")
        if r.get("heals") is not None:
            heal = f"{sum(h or 0 for h in r['heals'])} ({sum(h or 0 for h in r['heal_s']):.2f} s)"
            part = (f"{min(x for x in r['participants_min'] if x)}/"
                    f"{statistics.mean(x for x in r['participants_mean'] if x):.2f}/{max(x for x in r['participants_max'] if x)}")
            qw = f"{fmt_list(r['quorum_wait_s'])} s ({100 * (r['quorum_wait_fraction'] or 0):.1f}%)"
        else:
            heal, part, qw = "n/a (restart from checkpoint)", "3 (fixed)", "n/a"
        one, err = one_model(r)
        label = {"ft": "fault-tolerant diloco (3 launches)", "plain": "single-launch diloco + restart-all"}[arm] + \
            (" — failure-free" if name.endswith("free") else " — chaos")
        lines.append(f"| {label}{err} | {r['wall_s']} | {r['syncs']} | {r['committed_tokens']:,} | "
                     f"{r['goodput_tokens_per_s']:,.0f} | {rel} | {kills} | {fmt_list(r['recovery_s'])} | "
                     f"{fmt_list(r['syncs_discarded'], 0)} | {heal} | {part} | {qw} | {r['final_val']} | {one} |")
    out = head + "\n" + "\n".join(lines) + "\n"
    edits = [res.get("edit_tokens"), res.get("edit_mean")]
    if all(edits):
        t = min(e["curve"][-1][0] for e in edits if e["curve"])
        out += (f"\nStraggler: A-EDiT (mode edit, sync_time_s {meta['sync_time_s']}) with fault tolerance, 3 replicas, "
                f"replica 0 at half speed (acco.emulation slow_rank 0, slow_factor 2.0, in replica 0's config only: "
                f"emulation is per launch), no failures, {meta['edit_syncs']} syncs.\n\n| merge | wall s | committed tokens "
                f"| val loss at {t:.0f} s (equal wall time) | final val loss | replicas ending on one model |\n"
                f"|---|---|---|---|---|---|\n")
        for e in edits:
            one, err = one_model(e)
            out += (f"| {e['run'].split('_')[1]}{err} | {e['wall_s']} | {e['committed_tokens']:,} | "
                    f"{at_time(e['curve'], t)} | {e['final_val']} | {one} |\n")
    out += chaos_phases.markdown((res.get("ft_chaos") or {}).get("relaunch_phases"))
    out += "\nGoals:\n\n" + "\n".join(f"- {line}" for line in goal_words(goals, res)) + "\n"
    return out


def goal_words(g, res):
    out = []
    if "ft_goodput_ratio" in g:
        out.append(f"goodput >= 0.90 of failure-free under one kill per ~10 syncs, well above the restart-all "
                   f"baseline: {'MET' if g['goodput_goal_met'] else 'NOT MET'} (fault-tolerant "
                   f"{g['ft_goodput_ratio']}, restart-all {g.get('plain_goodput_ratio')})")
    if "quorum_share_of_period" in g:
        free = res["ft_free"]
        vs = g.get("period_vs_single_launch")
        out.append(f"failure-free quorum overhead <= 5% of a sync period: {'MET' if g['quorum_goal_met'] else 'NOT MET'}"
                   f" ({100 * g['quorum_share_of_period']:.1f}%). Measured as quorum_wait_s / sync period in the "
                   f"failure-free fault-tolerant run, taking at each full sync (from sync 3) the quorum wait of the "
                   f"replica that arrived last (it waits for no one, so its wait is the quorum's own cost): median "
                   f"{free['quorum_last_arriver_s']} s against a median sync period of {free['median_sync_period_s']} s."
                   f" Averaged over all replicas, quorum_wait_s (which also holds the wait for the last replica to "
                   f"arrive, a wait the single launch spends in its all-reduce) is {100 * g['quorum_wait_fraction']:.1f}%"
                   f" of a replica's run" + ("" if vs is None else
                   f"; the median sync period is {100 * vs:+.1f}% against the failure-free single launch (separate "
                   f"runs on a shared machine: noisy)"))
    return out


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {"ft": "tab:blue", "plain": "tab:red"}
    for name in RUNS[:4]:
        r = res.get(name)
        if not r or not r["curve"]:
            continue
        arm = name.split("_")[0]
        t, _, v = zip(*r["curve"])
        axes[0].plot(t, v, color=colors[arm], ls="-" if name.endswith("chaos") else ":", marker=".", ms=3,
                     label=f"{'fault-tolerant' if arm == 'ft' else 'restart-all'}, {name.split('_')[1]}")
        for e in r["events"]:
            if e["event"] == "kill":
                axes[0].axvline(e["t"], color=colors[arm], alpha=0.35, lw=1)
    axes[0].set(title="diloco, 3 replicas: validation loss of the committed model\n(vertical lines: kills)",
                xlabel="wall time (s)", ylabel="val loss")
    for name, c in (("edit_tokens", "tab:green"), ("edit_mean", "tab:orange")):
        r = res.get(name)
        if r and r["curve"]:
            t, _, v = zip(*r["curve"])
            axes[1].plot(t, v, color=c, marker=".", ms=3, label=f"merge {name.split('_')[1]}")
    axes[1].set(title="A-EDiT + fault tolerance, replica 0 at half speed", xlabel="wall time (s)", ylabel="val loss")
    for ax in axes:
        if ax.lines:
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
