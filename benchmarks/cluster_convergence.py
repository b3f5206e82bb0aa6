"""The ``convergence`` command of the cluster benchmark: validation loss against tokens and wall-clock time
(see ``cluster.py``'s docstring for the setup)."""

import json

import cluster_runs as crun
from cluster_runs import ROOT, STOCK, param_count


def interpolate_to(history, target, key):
    """First ``key`` (time or tokens) at which the validation loss reaches ``target``, linear between evaluations."""
    prev = None
    for p in history:
        if p["val_loss"] <= target:
            if prev is None:
                return p[key]
            f = (prev["val_loss"] - target) / (prev["val_loss"] - p["val_loss"])
            return prev[key] + f * (p[key] - prev[key])
        prev = p
    return None


def loss_at(history, step):
    return min(history, key=lambda p: abs(p["step"] - step))


def cmd_convergence(h):
    a = h.args
    bw = a.convergence_bandwidth
    spec = {"steps": 0, "warmup": 0, "eval_interval": a.convergence_eval_interval,
            "eval_batches": a.convergence_eval_batches, "tokens": a.tokens}
    results = {mode: h.run(bw, mode, spec, tag="convergence") for mode in a.convergence_modes}
    json.dump({m: r["history"] for m, r in results.items()}, open(crun.RESULTS / "cluster_convergence.json", "w"), indent=1)
    base = results.get(STOCK) or next(iter(results.values()))
    target = base["final_val_loss"] * a.target_ratio
    steps = base["steps"]
    early = [max(a.convergence_eval_interval, round(steps * f / a.convergence_eval_interval) *
                 a.convergence_eval_interval) for f in (0.1, 0.25)]
    lines = [f"Bandwidth {bw}; token budget {base['tokens']:,} ({steps} steps of {base['tokens'] // steps:,} tokens); "
             f"validation every {a.convergence_eval_interval} steps on {a.convergence_eval_batches} held-out batches "
             f"(the last 10% of the corpus); one run per mode. Wall-clock = training time without start-up and "
             f"without the evaluations. Target loss = {a.target_ratio} × ZeRO-1's final validation loss = "
             f"{target:.3f}.", "",
             f"| mode | final val loss | vs ZeRO-1 | val loss at step {early[0]} / {early[1]} | train time (s) | "
             f"time to target (s) | tokens to target |", "|---|---|---|---|---|---|---|"]
    table = []
    for mode, r in results.items():
        ttt = interpolate_to(r["history"], target, "time")
        tok = interpolate_to(r["history"], target, "tokens")
        e = [loss_at(r["history"], s) for s in early]
        lines.append(f"| {mode} | {r['final_val_loss']:.3f} | "
                     f"{100 * (r['final_val_loss'] / base['final_val_loss'] - 1):+.1f}% | "
                     f"{e[0]['val_loss']:.3f} / {e[1]['val_loss']:.3f} | {r['train_time_s']:.1f} | "
                     f"{'not reached' if ttt is None else f'{ttt:.1f}'} | "
                     f"{'not reached' if tok is None else f'{tok / 1e6:.2f}M'} |")
        table.append({"mode": mode, "final_val_loss": r["final_val_loss"], "train_time_s": r["train_time_s"],
                      "time_to_target_s": ttt, "tokens_to_target": tok, "target": target,
                      "command": r["_record"]["command"]})
    pngs = plot(results, bw, target)
    text = "\n".join(lines) + "\n\n" + "\n".join(f"![{p.stem}]({p.relative_to(ROOT) if p.is_relative_to(ROOT) else p})"
                                                for p in pngs)
    text += "\n\nEach row:\n\n" + "\n".join(f"    {t['command']}" for t in table)
    print("\n" + text)
    h.tables["convergence"] = table
    return "### Convergence\n\n" + text


def plot(results, bw, target):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plots")
        return []
    n = param_count()
    paths = []
    for key, xlabel, name in (("tokens", "training tokens (M)", "tokens"),
                              ("time", "wall-clock training time (s, without evaluation)", "time")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for mode, r in results.items():
            xs = [p[key] / (1e6 if key == "tokens" else 1) for p in r["history"]]
            ax.plot(xs, [p["val_loss"] for p in r["history"]], marker=".", label=mode)
        ax.axhline(target, color="grey", lw=0.8, ls="--", label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (held-out stdlib source)")
        ax.set_ylim(top=min(ax.get_ylim()[1], 4.5))
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"GPT {n / 1e6:.2f}M, 2 CPU ranks, {bw} link (tbf)")
        fig.tight_layout()
        path = crun.RESULTS / f"cluster_convergence_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
