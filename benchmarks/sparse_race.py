"""Issue 46's race table from ``cluster.py race`` run records: sparseloco against diloco int8 and Streaming
DiLoCo int8, judged against the compute-only limit (stock ZeRO-1 on an unlimited link, same invocation).

    python benchmarks/sparse_race.py benchmarks/results/sparseloco_race/10mbit/cluster_runs_race.jsonl ...

Per run: time to the target (1.01 x stock's final validation loss, rounded as the workers got it), that time
over stock's own time to it on the unlimited link, tokens, bytes per sync across the cut (the larger node's
veth tx counter per inner step, times H), and the validation loss at equal tokens against diloco int8 at
the same H (the largest token count both runs validated at). Writes a markdown table and a loss-vs-tokens
plot beside the first record file.
"""

import json
import re
import sys
from pathlib import Path

STOCK = "ZeRO-1 (stock)"
GOALS = {"10mbit": 1.3, "50mbit": 1.15}


def first_reach(history, target):
    return next(((p["time"], p["tokens"]) for p in history if p["val_loss"] <= target), None)


def sync_every(mode):
    m = re.search(r"H=(\d+)", mode)
    return int(m.group(1)) if m else 1


def loss_at(history, tokens):
    """Validation loss of the last evaluation at or below ``tokens``."""
    seen = [p for p in history if p["tokens"] <= tokens]
    return seen[-1]["val_loss"] if seen else None


def table(records):
    stock = next(r for r in records if r["mode"] == STOCK)
    target = round(stock["row"]["final_val_loss"] * 1.01, 4)
    limit = first_reach(stock["history"], target)
    out = [f"Target {target:.4f} (1.01 x stock's final validation loss {stock['row']['final_val_loss']:.4f} after "
           f"{stock['row']['tokens']:,} tokens on an unlimited link); compute-only limit: stock reaches it in "
           f"{limit[0]:.1f} s there.", "",
           "| link | mode | time to target (s) | vs compute-only limit | tokens to target | bytes per sync across "
           "the cut (MB) | vs diloco int8 same H | val loss at equal tokens (tokens) | diloco int8 same H | "
           "final val loss |", "|---" * 10 + "|"]
    by_key = {(r["bandwidth"], r["mode"]): r for r in records}
    rows = []
    for r in records:
        if r["mode"] == STOCK:
            continue
        bw, mode, row = r["bandwidth"], r["mode"], r["row"]
        reach = first_reach(r["history"], target)
        H = sync_every(mode)
        per_sync = row["inter_mb_per_step"] * H
        dil = by_key.get((bw, f"diloco H={H} int8")) if mode.startswith("sparseloco") else None
        ratio = eq = None
        if dil is not None:
            ratio = per_sync / (dil["row"]["inter_mb_per_step"] * H)
            tokens = min(r["history"][-1]["tokens"], dil["history"][-1]["tokens"])
            eq = (loss_at(r["history"], tokens), loss_at(dil["history"], tokens), tokens)
        vs = reach[0] / limit[0] if reach else None
        rows.append({"bandwidth": bw, "mode": mode, "reach": reach, "vs_limit": vs, "bytes_per_sync_mb": per_sync,
                     "bytes_vs_diloco": ratio, "equal_tokens": eq, "final_val_loss": row["final_val_loss"]})
        out.append(f"| {bw} | {mode} | {'not reached' if not reach else f'{reach[0]:.1f}'} | "
                   f"{'–' if vs is None else f'{vs:.2f}x'} | {'–' if not reach else f'{int(reach[1]):,}'} | "
                   f"{per_sync:.4f} | {'–' if ratio is None else f'{ratio:.3f}x'} | "
                   f"{'–' if eq is None else f'{eq[0]:.4f} ({eq[2]:,})'} | {'–' if eq is None else f'{eq[1]:.4f}'} | "
                   f"{row['final_val_loss']:.4f} |")
    return out, rows, target, limit


def plot(records, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in records:
        label = f"{r['mode']} ({r['bandwidth']})"
        ax[0].plot([p["tokens"] for p in r["history"]], [p["val_loss"] for p in r["history"]], marker=".", label=label)
        ax[1].plot([p["time"] for p in r["history"]], [p["val_loss"] for p in r["history"]], marker=".", label=label)
    ax[0].set_xlabel("tokens")
    ax[1].set_xlabel("training time (s, evaluations excluded)")
    for a in ax:
        a.set_ylabel("validation loss (committed model)")
        a.grid(alpha=0.3)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(paths):
    records = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]
    lines, rows, target, limit = table(records)
    best = {}
    for r in rows:
        if r["vs_limit"] is not None and r["vs_limit"] < best.get(r["bandwidth"], (9e9,))[0]:
            best[r["bandwidth"]] = (r["vs_limit"], r["mode"])
    lines += ["", "Goals:"]
    for bw, (vs, mode) in best.items():
        goal = GOALS.get(bw)
        lines.append(f"- best mode at {bw}: {mode}, {vs:.2f}x the compute-only limit (goal {goal}x: "
                     f"{'met' if goal and vs <= goal else 'missed'})")
    for r in rows:
        if r["bytes_vs_diloco"] is not None:
            eq = r["equal_tokens"]
            lines.append(f"- {r['mode']} at {r['bandwidth']}: bytes per sync {r['bytes_vs_diloco']:.3f}x diloco int8's "
                         f"(goal <= 0.05x: {'met' if r['bytes_vs_diloco'] <= 0.05 else 'missed'}); loss at "
                         f"{eq[2]:,} tokens {eq[0]:.4f} vs diloco int8's {eq[1]:.4f} (goal <=: "
                         f"{'met' if eq[0] <= eq[1] else 'missed'})")
    png = plot(records, Path(paths[0]).with_name("sparse_race.png"))
    if png:
        lines += ["", f"Plot: `{png}`"]
    text = "\n".join(lines)
    Path(paths[0]).with_name("sparse_race.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
