"""Check ``acco-ds plan`` against measurement on the emulated two-node cluster (issue 47, item 3).

    flock /tmp/acco_heavy.lock python benchmarks/plan_check.py                 # 4 modes x 4 links, ~10 min
    flock /tmp/acco_heavy.lock python benchmarks/plan_check.py --bandwidths 50mbit --modes "acco fixed"

The layout of ``benchmarks/cluster.py twonode``: 4 CPU ranks as 2 nodes of 2 (one network namespace and one
core per node, a veth pair with a ``tbf`` limit between them), the 0.84M GPT, micro-batch 4 x 128 tokens, 2
micro-batches per rank per step (4,096 tokens per step), fp32, gloo. At each link:
1. ``python -m acco_ds.plan --measure`` runs on the 4 ranks in the namespaces: it times the model's forward and
   backward (2 micro-batches, the 4 ranks at once, as training runs them) and all-reduces of growing size on the
   rails between the nodes and inside each node, and fits bandwidth and latency (``acco_ds.plan.measure``);
2. the plan's model (``acco_ds.plan.model.evaluate``) predicts each mode's seconds per step from those figures;
3. each mode trains ``--steps`` steps (``benchmarks/train_worker.py``, the rows of ``cluster_runs.MODES``) and its
   measured seconds per step (after ``--warmup`` steps) is compared with the prediction.
The recommended mode (least predicted step time x token factor, an exact mode winning ties within 5%) is
compared with the measured fastest by the same rule with measured step times. Results:
``benchmarks/results/plan_check.json`` (and ``.png`` when matplotlib is installed).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
N_LAYOUT = (2, 2)  # nodes, ranks per node
MICRO_BS, GAS, BLOCK = 4, 2, 128
MODES = {  # cluster_runs.MODES label -> the plan model's Mode
    "ZeRO-1 (stock)": dict(name="zero1", mode="zero1"),
    "acco fixed": dict(name="acco", mode="acco"),
    "diloco H=8 int8": dict(name="diloco int8", mode="diloco", compression="int8", sync_every=8),
    "diloco H=8 F=4 τ=1": dict(name="streaming", mode="diloco", sync_every=8, fragments=4, delay=1),
}


def gpt():
    """``--measure``'s factory: the benchmark's GPT and one micro-batch of 4 x 128 tokens."""
    import torch
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT
    torch.manual_seed(0)
    x = torch.randint(0, 256, (MICRO_BS, BLOCK))
    return GPT(), (x, torch.roll(x, -1, 1))


def measure(net, port, out_json, timeout):
    """Run ``acco-ds plan --measure`` on the 4 ranks of the two namespaces; return its JSON."""
    import harness
    nodes, k = N_LAYOUT
    cmds = []
    for r in range(nodes * k):
        node = r // k
        env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": str(nodes * k),
               "LOCAL_RANK": str(r % k), "LOCAL_WORLD_SIZE": str(k), "MASTER_PORT": str(port),
               "PYTHONPATH": f"{ROOT}:{HERE}", "PYTHONUNBUFFERED": "1", **net.rank_env(node)}
        argv = ["taskset", "-c", str(node), sys.executable, "-m", "acco_ds.plan", "--measure", "--model",
                "plan_check:gpt", "--micro-batches", str(GAS), "--tokens-per-step", str(MICRO_BS * BLOCK * GAS * 4),
                "--max-s", "1.5", "--json", "--out", str(out_json)]
        cmds.append((env, net.wrap(node, argv)))
    with harness.RankSet(cmds, Path(tempfile.mkdtemp(prefix="acco_plan_measure_")), "plan --measure") as ranks:
        ranks.finish(timeout)
    return json.loads(Path(out_json).read_text()), harness.shell_line(*cmds[0])


def predict(measured: dict) -> dict:
    """Seconds per step of each checked mode, from the measured compute and links."""
    from acco_ds.plan import model as pm
    inp = pm.Inputs(params=measured["params"], tokens_per_step=MICRO_BS * BLOCK * GAS * 4, nodes=N_LAYOUT[0],
                    ranks_per_node=N_LAYOUT[1], dtype="fp32", compute_s=measured["compute_s"],
                    inter_bps=measured["inter_bps"], inter_latency_s=measured["inter_latency_s"],
                    intra_bps=measured["intra_bps"], intra_latency_s=measured["intra_latency_s"],
                    micro_batches=GAS, overlap_compute=measured.get("overlap_compute_factor", 1.0),
                    overlap_comm=measured.get("overlap_comm_factor", 1.0),
                    overlap_outer_compute=measured.get("overlap_outer_compute_factor"))
    out = {}
    for label, spec in MODES.items():
        m = pm.Mode(**spec)
        fig = pm.evaluate(inp, m)
        out[label] = {"step_s": fig["step_s"], "token_factor": fig["token_factor"], "exact": m.mode in pm.EXACT}
    return out


def pick(rows: dict, key: str) -> str:
    """The plan's rule on ``rows``: least step x token factor; an exact mode within 5% wins."""
    t = {m: r[key] * r["token_factor"] for m, r in rows.items() if r.get(key)}
    best = min(t.values())
    exact = [m for m in t if rows[m]["exact"] and t[m] <= best * 1.05]
    return exact[0] if exact else min(t, key=t.get)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidths", type=lambda s: s.split(","), default=["unlimited", "200mbit", "50mbit", "10mbit"])
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    p.add_argument("--steps", type=int, default=19, help="steps per run (H=8: 2 syncs after 3 warm-up steps)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--run_timeout", type=float, default=400)
    p.add_argument("--out", default=str(RESULTS / "plan_check.json"))
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="only combine the links of earlier results (a later file's link replaces the same link)")
    args = p.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    sys.path.insert(0, str(HERE))
    import harness
    from cluster_runs import Bench
    harness.interrupt_on_signals()  # a timeout's SIGTERM still kills the ranks and removes the namespaces
    bench_args = argparse.Namespace(command="plan_check", run_timeout=args.run_timeout, layout="twonode",
                                    steps=args.steps, warmup=args.warmup)
    spec = {"steps": args.steps, "warmup": args.warmup, "eval_interval": 1000000, "eval_batches": 2}
    record = {"machine": harness.cpu_name(), "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "steps": args.steps, "warmup": args.warmup, "links": []}
    with Bench(bench_args) as bench:
        for bw in args.bandwidths:
            net = bench.network(bw)
            measured, cmd = measure(net, harness.free_port(), Path(tempfile.mkdtemp()) / "m.json", args.run_timeout)
            figs = measured["measured"]
            pred = predict(figs)
            print(f"{bw}: measured compute {figs['compute_s']:.3f} s/step, link {figs['inter_bps'] / 1e6:.1f} Mbit/s "
                  f"+ {1e3 * figs['inter_latency_s']:.2f} ms, intra {figs['intra_bps'] / 1e6:.0f} Mbit/s", flush=True)
            rows = {}
            for mode in args.modes:
                result = bench.run(bw, mode, spec, tag="plan_check")
                row = result["_record"]["row"]
                got = row["step_time_s"]
                rows[mode] = {**pred[mode], "measured_step_s": got, "error": pred[mode]["step_s"] / got - 1,
                              "inter_mb_per_step": row.get("inter_mb_per_step"),
                              "command": result["_record"]["command"]}
                print(f"  {mode:<22} predicted {pred[mode]['step_s']:.3f} s/step, measured {got:.3f} "
                      f"({100 * rows[mode]['error']:+.0f}%)", flush=True)
            link = {"bandwidth": bw, "measured": {k: v for k, v in figs.items() if k != "tensor_sizes"},
                    "measure_command": cmd, "rows": rows}
            if len(rows) > 1:
                link["recommended"] = pick(rows, "step_s")
                link["measured_fastest"] = pick(rows, "measured_step_s")
            record["links"].append(link)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(record, indent=1))  # kept link by link
    summarize(record)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(table(record))
    plot(record, Path(args.out).with_suffix(".png"))


def merge(paths, out):
    records = [json.loads(Path(f).read_text()) for f in paths]
    links = {}
    for rec in records:
        for link in rec["links"]:
            links[link["bandwidth"]] = dict(link, command=rec["command"], date=rec["date"])
    order = ["unlimited", "200mbit", "50mbit", "10mbit"]
    record = dict(records[0], command="merged: " + " + ".join(r["command"] for r in records),
                  links=sorted(links.values(), key=lambda l: order.index(l["bandwidth"])
                               if l["bandwidth"] in order else 99))
    summarize(record)
    Path(out).write_text(json.dumps(record, indent=1))
    print(table(record))
    plot(record, Path(out).with_suffix(".png"))


def summarize(record):
    """Median and largest |error|, and on how many links the recommended mode is the measured fastest."""
    errors = [abs(r["error"]) for link in record["links"] for r in link["rows"].values()]
    agree = [link.get("recommended") == link.get("measured_fastest")
             for link in record["links"] if "recommended" in link]
    record.update(median_abs_error=statistics.median(errors), max_abs_error=max(errors),
                  recommended_is_fastest=f"{sum(agree)} of {len(agree)}")


def table(record) -> str:
    lines = ["| link | measured link (Mbit/s) | compute s/step (measured) | κ, λ, outer κ (measured) | mode | predicted s/step "
             "| measured s/step | error | recommended | measured fastest |", "|---|---|---|---|---|---|---|---|---|---|"]
    for link in record["links"]:
        m = link["measured"]
        for mode, r in link["rows"].items():
            lines.append(f"| {link['bandwidth']} | {m['inter_bps'] / 1e6:.1f} | {m['compute_s']:.3f} | "
                         f"{m.get('overlap_compute_factor', 1.0):.2f}, {m.get('overlap_comm_factor', 1.0):.2f}, "
                         f"{m.get('overlap_outer_compute_factor') or m.get('overlap_compute_factor', 1.0):.2f} | {mode} | "
                         f"{r['step_s']:.3f} | {r['measured_step_s']:.3f} | {100 * r['error']:+.0f}% | "
                         f"{'**yes**' if mode == link.get('recommended') else ''} | "
                         f"{'**yes**' if mode == link.get('measured_fastest') else ''} |")
    lines.append(f"\nmedian |error| {100 * record['median_abs_error']:.0f}%, max {100 * record['max_abs_error']:.0f}%; "
                 f"recommended = measured fastest on {record['recommended_is_fastest']} links")
    return "\n".join(lines)


def plot(record, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(5, 5))
    for link in record["links"]:
        xs = [r["measured_step_s"] for r in link["rows"].values()]
        ys = [r["step_s"] for r in link["rows"].values()]
        ax.scatter(xs, ys, label=link["bandwidth"])
    lim = [min(min(r["measured_step_s"], r["step_s"]) for link in record["links"] for r in link["rows"].values()) * 0.8,
           max(max(r["measured_step_s"], r["step_s"]) for link in record["links"] for r in link["rows"].values()) * 1.2]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured s/step", ylabel="predicted s/step (acco-ds plan --measure)",
           title="plan against measurement, 2 nodes of 2 CPU ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
