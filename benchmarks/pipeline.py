"""Pipeline benchmark (issue 39, item 4): pipeline stages inside a node, replicas across a slow link, and the
price of acco's second pipeline flush.

    python benchmarks/pipeline.py                       # both parts, about 12 minutes on 2 cores
    python benchmarks/pipeline.py --only bubble --bubble_steps 12

Four CPU ranks train the GPT of examples/gpt.py as a DeepSpeed PipelineModule of 2 stages
(benchmarks/pipeline_worker.py): pipeline parallel 2 x data parallel 2. DeepSpeed's topology makes
data-parallel rank d the ranks d (stage 0) and d + 2 (stage 1).

1. ``twonode`` (DiLoCoX's arrangement): two network namespaces joined by a veth pair limited by tbf to
   ``--bandwidth`` (harness.Network), one per data-parallel rank, each holding its rank's 2 stages (their
   activations and gradients cross the namespace's loopback); gloo bound to the veth. Rows, the same steps and
   data: stock ZeRO-1 (data-parallel across the link every step) and diloco (``replica_group_size 1``: a
   replica is one node's 2 stages; each stage's outer all-reduce crosses the link every ``--sync_every`` inner
   steps). Bytes across the cut: each node's veth tx counter, read by its ranks at the training loop's start
   and end (evaluations taken out), and from outside over the whole run. Time to target: training time (no
   start-up, no evaluations) at the first validation of the committed model (diloco: the global model) at or
   below the target.
2. ``bubble``: PP 2 on one node (loopback, no limit), at DP 1 (2 ranks, one per core: the cleanest timing) and
   DP 2 (the 4 ranks of part 1; a stage's 2 ranks share its core), stock ZeRO-1, acco_ds sync and acco with
   ``--bubble_gas`` micro-batches (m) per train_batch: acco runs two flushes of m/2. Every pipeline instruction
   is timed on every rank: compute = forward + backward; schedule = train_batch minus the reductions and the
   optimizer step; the measured bubble = 1 - compute / schedule, beside the formula (p-1)/(m+p-1) (one flush)
   and (p-1)/(m/2+p-1) (two).

Stage s runs on core s (taskset; its 2 data-parallel ranks share it), so a stage waiting in the pipeline
leaves its core idle, as a device would. Each rank also gets its own cgroup (harness.CpuCap) of weight
``--shares`` against other work on the machine, with a quota of ``--cores`` (1: never binding, two ranks
share a core; a quota below that throttles in 100 ms periods, which the pipeline turns into waits).
Ports 29900-29999. Everything started is killed and the namespaces and cgroups removed at the end.
Results: benchmarks/results/pipeline.{md,json,png}.
"""

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

ROOT = harness.ROOT
RESULTS = ROOT / "benchmarks" / "results"
WORKER = str(ROOT / "benchmarks" / "pipeline_worker.py")
PORTS = iter(range(29900, 30000))
PP, DP = 2, 2
STOCK = "stock ZeRO-1"
TWONODE = {STOCK: ["--mode", "zero1"], "diloco": ["--mode", "diloco"]}
BUBBLE = {STOCK: ["--mode", "zero1"], "acco_ds sync": ["--mode", "sync"], "acco": ["--mode", "acco"]}


# ------------------------------------------------------------------------- runs
def rank_commands(args, flags, out_json, port, net, caps, dp):
    """(env, argv) of each rank: rank r is stage r // dp of data-parallel rank (node) r % dp."""
    world = PP * dp
    base = [sys.executable, WORKER, "--pp", str(PP), "--results", str(out_json), "--n_layer", str(args.n_layer),
            "--n_embd", str(args.n_embd), "--micro_batch", str(args.micro_batch)] + flags
    out = []
    for r in range(world):
        stage, node = r // dp, r % dp
        env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(stage), "LOCAL_WORLD_SIZE": str(PP), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
        argv = ["taskset", "-c", str(stage % (os.cpu_count() or 1))] + base
        if net is not None:
            env.update(net.rank_env(node))
            argv = net.wrap(node, argv)
        if caps:  # into the cgroup first: `ip netns exec` remounts /sys, where the cgroup is not seen
            argv = caps[r].wrap(argv)
        out.append((env, argv))
    return out


def run(args, workdir, name, flags, net=None, dp=DP):
    """One run of PP x dp ranks; its rank-0 record plus the counters read from outside."""
    port = next(PORTS)
    tag = name.replace(" ", "_").replace("/", "_")
    out_json = workdir / f"{tag}.json"
    caps = [harness.CpuCap(args.cores, tag="pipe", shares=args.shares) for _ in range(PP * dp)] if args.cores else []
    cmds = rank_commands(args, flags, out_json, port, net, caps, dp)
    before = net.tx_bytes() if net else None
    t0 = time.time()
    try:
        with harness.RankSet(cmds, workdir / tag, name, deadline=harness.Deadline(args.run_limit_s)) as rs:
            rs.finish(timeout=args.run_limit_s)
        throttled = [c.throttled() for c in caps]
    finally:
        for c in caps:
            c.close()
    rec = json.loads(out_json.read_text())
    rec["wall_s"] = round(time.time() - t0, 1)
    rec["whole_run_tx_bytes"] = [b - a for a, b in zip(before, net.tx_bytes())] if net else None
    rec["cap_throttled"] = throttled
    rec["command"] = harness.shell_line(cmds[0][0], [a for a in cmds[0][1] if a != str(out_json)])
    print(f"   {name}: {rec['wall_s']} s wall, final val {rec['ranks'][0]['history'][-1]['val_loss']:.4f}", flush=True)
    return rec


# -------------------------------------------------------------------- part 1
def first_reach(history, target):
    for h in history:
        if h["val_loss"] <= target:
            return h
    return None


def twonode(args, workdir):
    net = harness.Network("pipe")
    try:
        net.limit(args.bandwidth)
        goodput = net.goodput(3.0)
        print(f"== twonode: {net.describe()}, tbf {args.bandwidth}, TCP goodput {goodput / 1e6:.1f} Mbit/s", flush=True)
        common = ["--gas", str(args.gas), "--eval_interval", str(args.eval_interval),
                  "--eval_batches", str(args.eval_batches), "--sync_every", str(args.sync_every), "--warmup", "2"]
        steps = {STOCK: args.steps, "diloco": args.diloco_steps}
        runs = {name: run(args, workdir, f"twonode {name}", flags + common + ["--steps", str(steps[name])], net)
                for name, flags in TWONODE.items()}
    finally:
        net.close()
    rows = {}
    for name, rec in runs.items():
        ranks = rec["ranks"]
        nodes = [next(r for r in ranks if r["dp"] == d and r["stage"] == 0)["loop_tx_bytes"] for d in range(DP)]
        other = [next(r for r in ranks if r["dp"] == d and r["stage"] == 1)["loop_tx_bytes"] for d in range(DP)]
        hist = ranks[0]["history"]
        rows[name] = {"steps": ranks[0]["steps"], "train_s": max(r["train_s"] for r in ranks),
                      "loop_tx_bytes_per_node": nodes, "loop_tx_bytes_second_reader": other,
                      "whole_run_tx_bytes_per_node": rec["whole_run_tx_bytes"], "final_val_loss": hist[-1]["val_loss"],
                      "history": hist, "syncs": ranks[0]["syncs"], "wall_s": rec["wall_s"],
                      "params": sum(r["stage_params"] for r in ranks if r["dp"] == 0), "command": rec["command"],
                      "cap_throttled": rec["cap_throttled"]}
    # a: a loss both reach (the higher loss each row ends with, or holds at stock's step count, rounded up);
    # b: stock's final loss
    at_stock_end = [min(h["val_loss"] for h in r["history"] if h["step"] <= rows[STOCK]["steps"]) for r in rows.values()]
    target_a = math.ceil(max(at_stock_end) * 100) / 100
    target_b = rows[STOCK]["final_val_loss"]
    for r in rows.values():
        r["mb_per_step"] = max(r["loop_tx_bytes_per_node"]) / r["steps"] / 1e6
        r["reach_a"], r["reach_b"] = first_reach(r["history"], target_a), first_reach(r["history"], target_b)
    return {"bandwidth": args.bandwidth, "goodput_mbit": goodput / 1e6, "target_a": target_a, "target_b": target_b,
            "rows": rows}


def twonode_md(t, args):
    s, d = t["rows"][STOCK], t["rows"]["diloco"]
    n = s["params"]
    head = (f"PP {PP} x DP {DP} on 4 ranks as 2 nodes (each node: one data-parallel rank's {PP} stages), "
            f"{t['bandwidth']} between the nodes (tbf; TCP goodput measured {t['goodput_mbit']:.1f} Mbit/s). GPT "
            f"{n / 1e6:.2f}M parameters (n_layer {args.n_layer}, n_embd {args.n_embd}; the tied token embedding "
            f"counted on both stages), micro-batch {args.micro_batch} x 128 tokens, {args.gas} micro-batches per "
            f"train_batch per data-parallel rank, stock {args.steps} steps, diloco {args.diloco_steps} (it is the "
            f"faster per step: time to a loss is the comparison); diloco replica_group_size 1, "
            f"sync_every {args.sync_every}, outer SGD lr 0.7 Nesterov 0.9 (defaults), inner AdamW lr 2e-3 "
            f"(configs/acco_cpu.json). Validation of the committed model every {args.eval_interval} steps on "
            f"{args.eval_batches} held-out micro-batches. Targets: {t['target_a']:.2f} (the higher of the two best "
            f"losses within stock's {args.steps} steps, rounded up) and stock's final validation loss "
            f"{t['target_b']:.4f}.")
    lines = [head, "", "| run | steps | s/step | bytes across the cut per step (MB, larger node) | node A / node B over the "
             "loop (MB) | whole run incl. start-up (MB) | syncs | final val loss | time to "
             f"{t['target_a']:.2f} (s) | time to {t['target_b']:.4f} (s) | train s |", "|---" * 11 + "|"]
    for name, r in t["rows"].items():
        reach = [("not reached" if x is None else f"{x['time']:.1f} (step {x['step']})") for x in (r["reach_a"],
                                                                                                  r["reach_b"])]
        whole = r["whole_run_tx_bytes_per_node"]
        lines.append(f"| {name} | {r['steps']} | {r['train_s'] / r['steps']:.3f} | {r['mb_per_step']:.3f} | "
                     f"{' / '.join(f'{b / 1e6:.2f}' for b in r['loop_tx_bytes_per_node'])} | "
                     f"{' / '.join(f'{b / 1e6:.2f}' for b in whole)} | {r['syncs'] if r['syncs'] is not None else '–'} | "
                     f"{r['final_val_loss']:.4f} | {reach[0]} | {reach[1]} | {r['train_s']:.1f} |")
    ratio = lambda key: (d[key]["time"] / s[key]["time"]) if d[key] and s[key] else None  # noqa: E731
    ra, rb = ratio("reach_a"), ratio("reach_b")
    lines += ["", f"diloco / stock, same run: bytes across the cut {d['mb_per_step'] / s['mb_per_step']:.3f}x, time per "
                  f"step {d['train_s'] / d['steps'] / (s['train_s'] / s['steps']):.2f}x, time to {t['target_a']:.2f} "
                  f"{'–' if ra is None else f'{ra:.2f}x'}, time to stock's final loss "
                  f"{'– (diloco did not reach it)' if rb is None else f'{rb:.2f}x'}."]
    return "\n".join(lines)


# -------------------------------------------------------------------- part 2
def bubble(args, workdir):
    m, p, out = args.bubble_gas, PP, {}
    common = ["--steps", str(args.bubble_steps), "--warmup", str(args.bubble_warmup), "--gas", str(m)]
    for dp in args.bubble_dp:
        print(f"== bubble: PP {PP} x DP {dp} on one node (loopback), m = {m}", flush=True)
        rows = {}
        for name, flags in BUBBLE.items():
            rec = run(args, workdir, f"bubble dp{dp} {name}", flags + common, dp=dp)
            w, per_stage = args.bubble_warmup, {}
            for st in range(PP):
                ranks = [r for r in rec["ranks"] if r["stage"] == st]
                get = lambda *keys: statistics.mean(sum(r["instr_s_per_batch"].get(k, 0.0) for k in keys)  # noqa
                                                    for r in ranks)
                mean_batch = statistics.mean(statistics.mean(r["batch_s"][w:]) for r in ranks)
                compute, reduce, opt = get("ForwardPass", "BackwardPass"), get("ReduceGrads", "ReduceTiedGrads"), \
                    get("OptimizerStep")
                schedule = mean_batch - reduce - opt
                per_stage[st] = {"batch_mean_s": mean_batch, "compute_s": compute, "reduce_s": reduce,
                                 "p2p_s": get("SendActivation", "RecvActivation", "SendGrad", "RecvGrad"),
                                 "optimizer_s": opt, "schedule_s": schedule, "bubble_measured": 1 - compute / schedule}
            batch = statistics.mean(statistics.median(r["batch_s"][args.bubble_warmup:]) for r in rec["ranks"])
            t = sorted(v["compute_s"] / m for v in per_stage.values())  # per micro-batch: t_min, t_max
            flushes = 2 if name == "acco" else 1
            # 1F1B with two stages of unequal time: m x the slower stage, plus one pass of the other to fill and drain.
            predicted = flushes * (m / flushes * t[-1] + t[0])
            rows[name] = {"per_stage": per_stage, "batch_s": batch, "compute_s": t[-1] * m, "flushes": flushes,
                          "schedule_predicted_s": predicted, "command": rec["command"],
                          "cap_throttled": rec["cap_throttled"]}
        out[dp] = rows
    return {"m": m, "p": p, "by_dp": out, "formula": {"one_flush": (p - 1) / (m + p - 1),
                                                     "two_flushes": (p - 1) / (m / 2 + p - 1)}}


def bubble_md(b, args):
    m, p, f = b["m"], b["p"], b["formula"]
    pred = (m / 2 + p - 1) * 2 / (m + p - 1)
    lines = [f"PP {p}, one node (loopback, no limit), m = {m} micro-batches of {args.micro_batch} x 128 tokens per "
             f"train_batch per data-parallel rank (acco: 2 flushes of {m // 2}), {args.bubble_steps} train_batch "
             f"calls, the first {args.bubble_warmup} left out. train_batch: the median, mean over the ranks; the rest "
             f"per stage and train_batch, mean over the stage's ranks: compute = ForwardPass + BackwardPass; "
             f"reductions = ReduceTiedGrads + ReduceGrads (acco: handing the round over, and waiting for the last "
             f"one); schedule = train_batch (mean) - reductions - optimizer step; measured bubble = 1 - compute / "
             f"schedule. Formula (equal stages, free sends): (p-1)/(m+p-1) = {f['one_flush']:.3f} for one flush, "
             f"(p-1)/(m/2+p-1) = {f['two_flushes']:.3f} for two, so two flushes take 2(m/2+p-1)/(m+p-1) = "
             f"{pred:.3f}x one flush's schedule. With the measured per-micro-batch compute t of each stage (unequal "
             f"here: the last stage has the head and the loss), 1F1B takes m t_max + t_min per flush: the "
             f"\"predicted schedule\" column.", "",
             "| layout | run | train_batch s | vs stock | vs sync | stage | compute s | p2p (send/recv, incl. waiting) s "
             "| reductions s | optimizer step s | schedule s | predicted schedule s | measured bubble | formula |",
             "|---" * 14 + "|"]
    for dp, rows in b["by_dp"].items():
        sync, stock = rows["acco_ds sync"], rows[STOCK]
        for name, r in rows.items():
            formula = f["two_flushes"] if name == "acco" else f["one_flush"]
            for st, v in r["per_stage"].items():
                lead = (f"| PP {p} x DP {dp} | {name} | {r['batch_s']:.3f} | {r['batch_s'] / stock['batch_s']:.2f}x | "
                        f"{r['batch_s'] / sync['batch_s']:.2f}x" if st == 0 else "| | | | |")
                lines.append(f"{lead} | {st} | {v['compute_s']:.3f} | {v['p2p_s']:.3f} | {v['reduce_s']:.3f} | "
                             f"{v['optimizer_s']:.3f} | {v['schedule_s']:.3f} | "
                             f"{r['schedule_predicted_s'] if st == 0 else '':{'.3f' if st == 0 else ''}} | "
                             f"{v['bubble_measured']:.3f} | {formula:.3f} |")
    lines.append("")
    for dp, rows in b["by_dp"].items():
        acco, sync, stock = rows["acco"], rows["acco_ds sync"], rows[STOCK]
        lines.append(f"- PP {p} x DP {dp}: acco's train_batch {acco['batch_s'] / sync['batch_s']:.3f}x sync's and "
                     f"{acco['batch_s'] / stock['batch_s']:.3f}x stock's (formula: {pred:.3f}x; with the measured stage "
                     f"times {acco['schedule_predicted_s'] / sync['schedule_predicted_s']:.3f}x); compute alone "
                     f"(the slower stage, per train_batch) acco {acco['compute_s']:.3f} s, sync {sync['compute_s']:.3f}"
                     f" s, stock {stock['compute_s']:.3f} s.")
    return "\n".join(lines)


# ----------------------------------------------------------------- output
def plot(t, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in t["rows"].items():
        ax.plot([h["time"] for h in r["history"]], [h["val_loss"] for h in r["history"]], marker=".", label=name,
                drawstyle="steps-post" if name == "diloco" else "default")
    ax.axhline(t["target_a"], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training time (s, no evaluations)")
    ax.set_ylabel("validation loss (committed model)")
    ax.set_title(f"PP 2 per node, 2 nodes, {t['bandwidth']} between them")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="twonode,bubble", help="twonode, bubble or both (comma-separated)")
    ap.add_argument("--bandwidth", default="100mbit", help="tbf rate between the two nodes")
    ap.add_argument("--steps", type=int, default=96, help="twonode: stock's train_batch calls")
    ap.add_argument("--diloco_steps", type=int, default=192, help="twonode: diloco's train_batch calls")
    ap.add_argument("--gas", type=int, default=4, help="twonode: micro-batches per train_batch")
    ap.add_argument("--sync_every", type=int, default=8, help="twonode diloco: inner steps per outer sync")
    ap.add_argument("--eval_interval", type=int, default=8)
    ap.add_argument("--eval_batches", type=int, default=8)
    ap.add_argument("--bubble_gas", type=int, default=8, help="bubble: m, micro-batches per train_batch")
    ap.add_argument("--bubble_steps", type=int, default=24)
    ap.add_argument("--bubble_dp", default="1,2", help="bubble: data-parallel sizes (1: one rank per core)")
    ap.add_argument("--bubble_warmup", type=int, default=4)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=128)
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--cores", type=float, default=1.0, help="cgroup quota per rank in cores (0: no cgroup)")
    ap.add_argument("--shares", type=int, default=4096, help="cgroup CPU weight per rank (a process: 1024)")
    ap.add_argument("--run_limit_s", type=float, default=900.0)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, records)")
    ap.add_argument("--out", default=str(RESULTS / "pipeline"), help="results path without extension")
    args = ap.parse_args(argv)
    args.bubble_dp = [int(x) for x in args.bubble_dp.split(",") if x]
    parts = [p for p in args.only.split(",") if p]
    if set(parts) - {"twonode", "bubble"}:
        ap.error(f"--only: twonode, bubble (got {args.only})")
    why = harness.namespaces_unavailable() if "twonode" in parts else None
    if why or (args.cores and harness.CpuCap.unavailable()):
        ap.error(why or f"--cores {args.cores}: {harness.CpuCap.unavailable()} (--cores 0: no cgroup)")
    harness.interrupt_on_signals()
    left_before = harness.cleanup_leftovers() + harness.remove_leftover_caps()
    workdir = Path(tempfile.mkdtemp(prefix="acco_pipeline_"))
    t0, load0, res = time.time(), os.getloadavg(), {}
    try:
        if "twonode" in parts:
            res["twonode"] = twonode(args, workdir)
        if "bubble" in parts:
            res["bubble"] = bubble(args, workdir)
    finally:
        harness.kill_everything()
        left = harness.processes_naming([str(workdir)])
        namespaces = [n for n in harness.sh("ip", "netns", "list", check=False).stdout.split() if
                      n.startswith(f"acco-pipe-{os.getpid()}-")]
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    import deepspeed
    import torch
    meta = {"machine": f"{harness.cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; CPU "
                       f"ranks, gloo, DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1; Python {platform.python_version()}, "
                       f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}",
            "code": harness.sh("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD").stdout.strip() + (
                " + uncommitted changes" if harness.sh("git", "-C", str(ROOT), "status", "--porcelain", "-uno")
                .stdout.strip() else ""),
            "command": "python benchmarks/pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "minutes": round((time.time() - t0) / 60, 1),
            "load_start_end": [round(load0[0], 1), round(os.getloadavg()[0], 1)],
            "cpu": "stage s pinned to core s (taskset)" + (f", each rank in its own cgroup (quota {args.cores} core, "
                                                           f"cpu.shares {args.shares})" if args.cores else ""),
            "removed_leftovers_at_start": left_before, "leftover_processes": left, "leftover_namespaces": namespaces}
    text = [f"# Pipeline benchmark\n\n`{meta['command'].strip()}` — {meta['date']}, {meta['minutes']} min; "
            f"{meta['machine']}; code {meta['code']}; {meta['cpu']}; load average {meta['load_start_end'][0]} at the "
            f"start, {meta['load_start_end'][1]} at the end (the machine is shared: absolute times are noisy, the "
            f"ratios are between runs of this one invocation)."]
    if "twonode" in res:
        text += ["", "## Stages inside a node, replicas across the link", "", twonode_md(res["twonode"], args)]
    if "bubble" in res:
        text += ["", "## acco's second flush", "", bubble_md(res["bubble"], args)]
    text += ["", "Rank 0's command of each run:", ""] + [
        f"    {r['command']}" for part in res.values()
        for rows in (part["by_dp"].values() if "by_dp" in part else [part["rows"]]) for r in rows.values()]
    if left or namespaces:
        text += ["", f"LEFT BEHIND: {left} {namespaces}"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(text) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, **res}, indent=1, default=str))
    if "twonode" in res:
        plot(res["twonode"], out.with_suffix(".png"))
    print("\n".join(text))
    return 1 if left or namespaces else 0


if __name__ == "__main__":
    sys.exit(main())
