"""ACCO vs stock DeepSpeed ZeRO-1 on an emulated slow cluster, side by side in one run.

Each of the 2 ranks runs in its own network namespace; a veth pair joins them
and a ``tbf`` qdisc on both ends limits the bandwidth (a real slow link, not a
sleep). gloo is bound to those addresses, each rank is pinned to one core.
The "unlimited" rows use plain loopback, no namespaces. The namespaces are
always removed (errors, Ctrl-C, SIGTERM; ``--cleanup`` removes the leftovers
of a run that was killed with SIGKILL).

    python benchmarks/cluster.py all          # everything below, the docs/benchmarks/ tables
    python benchmarks/cluster.py netcheck     # measure what the tbf link really carries
    python benchmarks/cluster.py throughput   # bandwidth x mode table
    python benchmarks/cluster.py hetero       # one rank slowed x1.5 and x2
    python benchmarks/cluster.py convergence  # validation loss vs tokens / wall-clock at 200 Mbit
    python benchmarks/cluster.py twonode      # 4 ranks as 2 nodes of 2: ZeRO-1, ACCO, DiLoCo, CO2
    python benchmarks/cluster.py race         # 2 nodes: every mode trains to 1.01 x stock's final loss
    python benchmarks/cluster.py compression  # 2 nodes at 50 Mbit: int8/fp8 rows beside uncompressed and stock
    python benchmarks/cluster.py streaming    # 2 nodes at 200 and 50 Mbit: Streaming DiLoCo, F x τ
    python benchmarks/cluster.py one --bandwidth 200mbit --mode dpu   # one row again
    python benchmarks/cluster.py smoke        # a few steps on loopback (tests/test_cluster_smoke.py)
    python benchmarks/cluster.py --cleanup    # remove namespaces left by a killed run

Each rank runs benchmarks/train_worker.py: the quickstart GPT of
examples/train_gpt.py (0.84M-parameter byte-level GPT on the stdlib source,
configs/acco_cpu*.json) with the measurement added (veth byte counters, warm-up
exclusion, slowed rank, JSON results). Namespaces, ports and rank processes come
from benchmarks/harness.py. Results: benchmarks/results/
cluster_<command>.{md,json,csv}, one record per run (with the exact rank
command lines) in cluster_runs_<command>.jsonl, plots cluster_convergence*.png.

``twonode`` (``--layout twonode``): 4 ranks as 2 "nodes" of 2. Ranks 0, 1 share
node A's namespace, ranks 2, 3 node B's; gloo binds every rank to its
namespace's veth address, so traffic between the two ranks of a node goes over
that namespace's loopback (unshaped, counted apart) and only traffic between
nodes crosses the tbf-limited veth pair. Each node is pinned to one core (its 2
ranks share it: 4 single-threaded ranks on 2 cores). "unlimited" there is the
same veth pair with no qdisc. diloco/co2 use replica_group_size 2 (= ranks per
node): ZeRO-1 inside a node, the outer all-reduce between nodes.
"""

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cluster_runs as crun
import harness
from cluster_convergence import cmd_convergence
from cluster_runs import (BANDWIDTHS, BLOCK, COMPUTE_STEP_S, GAS, LAYOUTS, MICRO_BS, MODES, PAIR_MODES, RUN_OVERHEAD_S,
                          STOCK, TWONODE_GAS, TWONODE_MICRO_BS, TWONODE_MODES, Bench, fmt3, ideal_step_s,
                          optimal_bytes_per_step, param_count, stats3)
from cluster_twonode import COMPRESSION_MODES, RACE_MODES, cmd_compression, cmd_race, cmd_streaming, cmd_twonode
from harness import rate_bits


def workload_text(compute_step):
    n = param_count()
    lines = [f"Workload: GPT {n / 1e6:.2f}M parameters (fp32), micro-batch {MICRO_BS} x {BLOCK} tokens, {GAS} "
             f"micro-batches per rank per step, 2 ranks. Compute per step with no communication (P): "
             f"{compute_step:.3f} s. Fewest bytes one rank must send per committed step "
             f"(`optimal_bytes_per_step`): stock ZeRO-1 6N = {6 * n / 1e6:.2f} MB, ACCO 8N = {8 * n / 1e6:.2f} MB, "
             f"DPU and sync 4N = {4 * n / 1e6:.2f} MB. The table's \"sent\" column is measured: each rank's veth "
             f"`tx_bytes` over the measured steps (TCP/IP headers included)."]
    return "\n".join(lines)


def cmd_netcheck(h):
    if h.args.skip_netcheck:
        return None
    lines = ["| tbf rate (both ends) | measured TCP goodput rank 0 → rank 1 (3 s) |", "|---|---|"]
    limited = [b for b in h.args.bandwidths if b != "unlimited"]
    if limited and (h.net is None or h.net.rate is None):
        got = h.raw_network().goodput()
        lines.append(f"| none (same veth pair, no qdisc) | {got / 1e6:.0f} Mbit/s |")
        print(f"  link check, no tbf: {got / 1e6:.0f} Mbit/s", flush=True)
    for bw in limited:
        got = h.network(bw).goodput()
        lines.append(f"| {bw} | {got / 1e6:.1f} Mbit/s ({100 * got / rate_bits(bw):.0f}% of the rate) |")
        print(f"  link check {bw}: {got / 1e6:.1f} Mbit/s", flush=True)
    if len(lines) == 2:
        return None
    text = ("The limit is real: a TCP stream between the two namespaces, over the veth pair that gloo uses, "
            "measured with `python benchmarks/cluster.py netcheck`:\n\n" + "\n".join(lines))
    print("\n" + text)
    return "### Link check\n\n" + text


def throughput_spec(args):
    return {"steps": args.steps, "warmup": args.warmup, "eval_interval": args.eval_interval,
            "eval_batches": args.eval_batches}


def cmd_throughput(h):
    spec = throughput_spec(h.args)
    runs = {}
    for repeat in range(h.args.repeats):  # repeats outermost: drift of the machine hits every mode alike
        for bw in h.args.bandwidths:
            for mode in h.args.modes:
                runs.setdefault((bw, mode), []).append(h.run(bw, mode, spec, repeat=repeat, tag="throughput"))
    compute_step = h.calibrate() * GAS
    head = ("| bandwidth | mode | samples/s median (min–max) | s/step | ideal s/step | ideal / measured | "
            "micro-batches /rank/step | compute waited s/step (ACCO) | comm hidden | sent MB /rank/step | "
            "sent / optimum | stats all-reduce ms/round | speedup vs ZeRO-1 median (min–max) |")
    n_params = param_count()
    lines = [workload_text(compute_step), "", head, "|---" * (head.count("|") - 1) + "|"]
    table = []
    for bw in h.args.bandwidths:
        stock = runs.get((bw, STOCK))
        for mode in h.args.modes:
            rs = runs[(bw, mode)]
            rows = [r["_record"]["row"] for r in rs]
            sps = stats3([r["samples_per_s"] for r in rows])
            med = {k: stats3([r.get(k) for r in rows]) for k in ("step_time_s", "micro_per_step", "compute_s",
                                                                  "exposed_comm_s", "wait_s", "hidden",
                                                                  "link_mb_per_step",
                                                                  "stats_allreduce_ms_per_round")}
            rate = rate_bits(bw) / 8 if bw != "unlimited" else None
            ideal = [ideal_step_s(mode, r["compute_s"], r["link_mb_per_step"] * 1e6 / rate
                                  if rate and r.get("link_mb_per_step") else None) for r in rows]
            med["ideal_s"] = stats3(ideal)
            med["efficiency"] = stats3([i / r["step_time_s"] for i, r in zip(ideal, rows)])
            med["vs_optimum"] = stats3([r["link_mb_per_step"] * 1e6 / optimal_bytes_per_step(n_params, mode)
                                        for r in rows if r.get("link_mb_per_step")])
            speed = stats3([a["measured_samples_per_s"] / b["measured_samples_per_s"] for a, b in zip(rs, stock)]) \
                if stock else None

            def cell(key, digits=3):
                return "–" if med[key] is None else f"{med[key][0]:.{digits}f}"

            hidden = "– (no overlap)" if mode == STOCK else \
                ("–" if med["hidden"] is None else f"{100 * med['hidden'][0]:.0f}%")
            lines.append(f"| {bw} | {mode} | {fmt3(sps)} | {cell('step_time_s')} | {cell('ideal_s')} | "
                         f"{fmt3(med['efficiency'], 2)} | {cell('micro_per_step', 1)} | {cell('wait_s')} | {hidden} | "
                         f"{cell('link_mb_per_step', 2)} | {fmt3(med['vs_optimum'], 2, 'x')} | "
                         f"{cell('stats_allreduce_ms_per_round', 2)} | {fmt3(speed, 2, 'x')} |")
            table.append({"bandwidth": bw, "mode": mode, "samples_per_s": sps, "speedup": speed,
                          **{k: v for k, v in med.items()}, "command": rs[0]["_record"]["command"]})
    cmds = sorted({r["_record"]["command"] for rs in runs.values() for r in rs})
    text = "\n".join(lines) + "\n\nEach row (one run; the table is the median of the repeats):\n\n" + "\n".join(
        f"    {c}" for c in cmds)
    text += "\n\n" + profile_text([r["_record"] for rs in runs.values() for r in rs])
    print("\n" + text)
    h.tables["throughput"] = table
    return "### Throughput\n\n" + text


def profile_text(records):
    """Where a round's time goes (medians over repeats), from the engine's own timers: compute on the main
    thread, and on the communication thread the reduce-scatter, the all-reduce of counts and norms, the
    optimizer update with the shard arithmetic, the all-gather; beside them the link time of the round's
    measured bytes at the configured rate."""
    groups = {}
    for rec in records:
        row = rec["row"]
        if row.get("comm_ms_per_round") is None:
            continue
        groups.setdefault((rec["bandwidth"], rec["mode"]), []).append(row)
    lines = ["Where a round's time goes (ms per round, medians; main thread: compute; communication thread: "
             "the rest; link = measured bytes of one round at the configured rate):", "",
             "| bandwidth | mode | compute | waited | reduce-scatter | all-reduce of counts, norms | update | "
             "all-gather | comm total | link time of the bytes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (bw, mode), rows in groups.items():
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        rounds_per_step = 2 if mode.startswith("acco ") else 1
        link = "–"
        if bw != "unlimited" and rows[0].get("link_mb_per_step"):
            link = f"{1e3 * med('link_mb_per_step') * 1e6 / rounds_per_step / (rate_bits(bw) / 8):.0f}"
        waited = 1e3 * med("wait_s") / rounds_per_step if rows[0].get("wait_s") is not None else 0.0
        lines.append(f"| {bw} | {mode} | {med('compute_ms_per_round'):.0f} | {waited:.0f} | "
                     f"{med('reduce_scatter_ms_per_round'):.0f} | {med('stats_allreduce_ms_per_round'):.1f} | "
                     f"{med('update_ms_per_round'):.1f} | {med('all_gather_ms_per_round'):.0f} | "
                     f"{med('comm_ms_per_round'):.0f} | {link} |")
    return "\n".join(lines)


def cmd_hetero(h):
    bw = h.args.hetero_bandwidth
    spec = throughput_spec(h.args)
    lines = [f"Bandwidth {bw}. Rank 1 is slowed by the factor (benchmark-only): after each micro-batch's backward "
             f"it sleeps (factor − 1) × the time of that micro-batch — stock ZeRO-1: `train_worker.py "
             f"--slow_rank 1 --slow_factor F` sleeps in the training loop (no ACCO block); ACCO: the engine's "
             f"`acco.emulation` block, set by the same flags. Every row below is slowed that way.", "",
             "| rank 1 slowed | mode | samples/s median (min–max) | s/step | speedup vs ZeRO-1 median (min–max) | "
             "micro-batches rank 0 / rank 1 (share of rank 1) |", "|---|---|---|---|---|---|"]
    table, cmds = [], []
    for factor in h.args.factors:
        extra = ["--slow_rank", "1", "--slow_factor", str(factor)] if factor > 1 else []
        res = {m: [] for m in (STOCK, "acco adaptive")}
        for i in range(h.args.repeats):
            for mode in res:
                res[mode].append(h.run(bw, mode, dict(spec, extra=extra), repeat=i, tag="hetero"))
        for mode, rs in res.items():
            rows = [r["_record"]["row"] for r in rs]
            sps = stats3([r["samples_per_s"] for r in rows])
            step = stats3([r["step_time_s"] for r in rows])
            speed = stats3([a["measured_samples_per_s"] / b["measured_samples_per_s"] for a, b in
                            zip(rs, res[STOCK])])
            shares = [r["micro_per_rank"] for r in rows]
            share = statistics.median(s[1] / sum(s) for s in shares)
            mid = sorted(shares, key=lambda s: s[1] / sum(s))[len(shares) // 2]
            lines.append(f"| ×{factor:g}{' (none)' if factor == 1 else ''} | {mode} | {fmt3(sps)} | "
                         f"{step[0]:.3f} | {fmt3(speed, 2, 'x')} | {mid[0]} / {mid[1]} ({100 * share:.0f}%) |")
            table.append({"factor": factor, "mode": mode, "samples_per_s": sps, "step_time_s": step, "speedup": speed,
                          "micro_per_rank": shares, "command": rs[0]["_record"]["command"]})
            cmds.append(rs[0]["_record"]["command"])
    text = "\n".join(lines) + "\n\nEach row (one run):\n\n" + "\n".join(f"    {c}" for c in cmds)
    print("\n" + text)
    h.tables["hetero"] = table
    return "### Heterogeneous workers\n\n" + text


def cmd_one(h):
    a = h.args
    extra = a.extra.split() if a.extra else []
    spec = {"steps": a.steps, "warmup": a.warmup, "eval_interval": a.eval_interval, "eval_batches": a.eval_batches,
            "tokens": a.tokens, "extra": extra}
    r = h.run(a.bandwidth, a.mode, spec, tag="one")
    print("rank commands:\n" + "\n".join("    " + c for c in r["_record"]["rank_commands"]))
    print(json.dumps(r["_record"]["row"], indent=1))


# ------------------------------------------------------------------------- main


def estimate_s(args, parts):
    """Rough duration on the machine of docs/benchmarks/ (2 cores), for the printed estimate."""
    n = 0.84e6

    def run_s(bw, mode, steps, factor=1.0):
        if bw == "unlimited":
            comm = 0.03
        else:
            vol = optimal_bytes_per_step(n, mode)
            comm = vol / (rate_bits(bw) / 8)
        compute = COMPUTE_STEP_S * factor
        if mode == STOCK or mode == "acco_ds sync":
            step = compute + comm
        elif mode == "acco adaptive":
            step = max(compute, comm)
        else:
            step = max(compute, comm / (2 if mode == "dpu" else 1)) + 0.02
        return RUN_OVERHEAD_S + steps * step

    total = RUN_OVERHEAD_S
    if {"twonode", "race", "compression", "streaming"} & set(parts):  # 4 ranks on 2 cores: a slower start
        for bw in args.bandwidths:
            for m in args.modes:
                rate = None if bw == "unlimited" else rate_bits(bw) / 8
                if "H=" in m:
                    comm = 0 if rate is None else 4 * n / int(m.split("H=")[1].split()[0]) / rate
                    step = 0.5 * COMPUTE_STEP_S + (comm if m.startswith("diloco") else 0)
                elif m == STOCK:
                    step = 0.5 * COMPUTE_STEP_S + (0 if rate is None else 9 * n / rate)
                else:
                    step = max(0.5 * COMPUTE_STEP_S, 0 if rate is None else 14 * n / rate)
                total += 2 * RUN_OVERHEAD_S + args.steps * step
    if "netcheck" in parts:
        total += 4 * sum(1 for b in args.bandwidths if b != "unlimited")
    if "throughput" in parts:
        total += args.repeats * sum(run_s(bw, m, args.steps) for bw in args.bandwidths for m in args.modes)
    if "hetero" in parts:
        total += args.repeats * sum(run_s(args.hetero_bandwidth, m, args.steps, f)
                                    for f in args.factors for m in (STOCK, "acco adaptive"))
    if "convergence" in parts:
        steps = args.tokens / (MICRO_BS * GAS * 2 * BLOCK)
        evals = steps / args.convergence_eval_interval * args.convergence_eval_batches / 2 * 0.05
        total += sum(run_s(args.convergence_bandwidth, m, steps) + evals for m in args.convergence_modes)
    return total


def machine_line(layout="pair"):
    try:
        model = next((line.split(":", 1)[1].strip() for line in harness.sh("lscpu", timeout=10).stdout.splitlines()
                      if line.startswith("Model name")), "unknown CPU")
    except (OSError, subprocess.SubprocessError):
        model = "unknown CPU"
    import torch
    try:
        from importlib.metadata import version
        ds = version("deepspeed")
    except Exception:  # noqa: BLE001
        ds = "?"
    cores = ("one per node, shared by its 2 ranks (4 ranks on 2 cores: oversubscribed)" if layout == "twonode"
             else "one per rank")
    return (f"{model}, {os.cpu_count()} cores ({cores}, `taskset`; the ACCO communication thread shares its "
            f"rank's core), gloo, Python {sys.version.split()[0]}, torch {torch.__version__}, deepspeed {ds}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("command", nargs="?", default="all",
                   choices=["all", "netcheck", "throughput", "hetero", "convergence", "one", "smoke", "twonode",
                            "race", "compression", "streaming"])
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by a killed run, and exit")
    p.add_argument("--bandwidths", type=lambda s: s.split(","), default=BANDWIDTHS,
                   help="comma-separated: unlimited (loopback), or a tbf rate such as 1gbit, 200mbit, 50mbit")
    p.add_argument("--modes", type=lambda s: s.split(","), default=None,
                   help=", ".join(MODES) + f" (default: {', '.join(PAIR_MODES)}; twonode: {', '.join(TWONODE_MODES)})")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="committed steps per throughput run")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timings")
    p.add_argument("--eval_interval", type=int, default=1000000, help="throughput runs: no evaluation but the last")
    p.add_argument("--eval_batches", type=int, default=2)
    p.add_argument("--factors", type=lambda s: [float(x) for x in s.split(",")], default=[1.5, 2.0],
                   help="hetero: slow-down factors of rank 1 (1 = none)")
    p.add_argument("--hetero_bandwidth", default="unlimited")
    p.add_argument("--convergence_bandwidth", default="200mbit")
    p.add_argument("--convergence_modes", type=lambda s: s.split(","), default=[STOCK, "dpu", "acco fixed"])
    p.add_argument("--tokens", type=int, default=1_638_400, help="convergence token budget (200 steps)")
    p.add_argument("--convergence_eval_interval", type=int, default=10)
    p.add_argument("--convergence_eval_batches", type=int, default=16)
    p.add_argument("--target_ratio", type=float, default=1.05, help="target loss = ratio x ZeRO-1's final loss")
    p.add_argument("--skip_netcheck", action="store_true")
    p.add_argument("--bandwidth", default="unlimited", help="`one`: the link")
    p.add_argument("--mode", default="acco fixed", choices=list(MODES), help="`one`: the mode")
    p.add_argument("--layout", default="pair", choices=list(LAYOUTS),
                   help="pair: 2 ranks, one namespace each; twonode: 4 ranks as 2 nodes of 2 (the twonode command)")
    p.add_argument("--target", type=float, default=None,
                   help="twonode: target validation loss (default: the highest final loss of any row)")
    p.add_argument("--extra", default="", help="`one`, `twonode`: extra train_worker.py flags for every run "
                   "(e.g. \"--slow_rank 3 --slow_factor 2\": the heterogeneous table)")
    p.add_argument("--race_ratio", type=float, default=1.01, help="race: target = ratio x stock's final loss")
    p.add_argument("--race_cap", type=float, default=3.0, help="race: time cap = this x stock's training time")
    p.add_argument("--race_reference", type=lambda s: s.split(","), default=None,
                   help="race: links where only stock runs (list them first in --bandwidths): the first one's stock "
                        "run gives every other link its target, time cap and 'vs stock' (e.g. unlimited: the "
                        "compute-only limit); the other modes run on the other links only")
    p.add_argument("--race_eval_interval", type=int, default=4, help="race: inner steps between validations")
    p.add_argument("--run_timeout", type=float, default=600, help="seconds before a run is killed")
    p.add_argument("--results_dir", "--out", default=None,
                   help="where tables, run records and plots go (default benchmarks/results)")
    args = p.parse_args()
    if args.results_dir:
        crun.RESULTS = Path(args.results_dir).resolve()
    if args.cleanup:
        if harness.namespaces_unavailable():
            raise SystemExit(f"--cleanup: {harness.namespaces_unavailable()}")
        print("removed:", ", ".join(harness.cleanup_leftovers()) or "nothing to remove")
        return
    if args.command == "smoke":
        args.bandwidths, args.repeats, args.steps, args.warmup = ["unlimited"], 1, 2, 1
    if args.command == "race":  # the twonode layout at 200 and 50 Mbit, every mode to stock's loss
        args.layout = "twonode"
        if args.bandwidths == p.get_default("bandwidths"):
            args.bandwidths = ["200mbit", "50mbit"]
        args.modes = args.modes or list(RACE_MODES)
        args.steps = 64 if args.steps == p.get_default("steps") else args.steps
        if args.eval_batches == p.get_default("eval_batches"):
            args.eval_batches = 16
        if args.tokens == p.get_default("tokens"):
            args.tokens = args.steps * TWONODE_MICRO_BS * TWONODE_GAS * LAYOUTS["twonode"][0] * BLOCK
    if args.command == "compression":  # twonode at 50 Mbit: compressed rows beside their uncompressed ones
        if args.bandwidths == p.get_default("bandwidths"):
            args.bandwidths = ["50mbit"]
        args.modes = args.modes or list(COMPRESSION_MODES)
    if args.command == "streaming":  # twonode at 200 and 50 Mbit: Streaming DiLoCo's F x τ table
        if args.bandwidths == p.get_default("bandwidths"):
            args.bandwidths = ["200mbit", "50mbit"]
        args.modes = args.modes or list(crun.STREAMING_MODES)
    if args.command in ("twonode", "compression", "streaming"):
        # 64 inner steps of 16,384 tokens (2 syncs at H=32), validation every 8, unlimited/200/50 Mbit.
        args.layout = "twonode"
        if args.bandwidths == p.get_default("bandwidths"):
            args.bandwidths = ["unlimited", "200mbit", "50mbit"]
        args.modes = args.modes or list(TWONODE_MODES)
        if args.steps == p.get_default("steps"):
            args.steps = 64
        if args.eval_interval == p.get_default("eval_interval"):
            args.eval_interval = 8
        if args.eval_batches == p.get_default("eval_batches"):
            args.eval_batches = 16
        if args.tokens == p.get_default("tokens"):
            args.tokens = args.steps * TWONODE_MICRO_BS * TWONODE_GAS * LAYOUTS["twonode"][0] * BLOCK
    args.modes = args.modes or list(PAIR_MODES)
    if args.command == "one":
        args.bandwidths = [args.bandwidth]
        if args.tokens == p.get_default("tokens"):
            args.tokens = 0
    for name in args.modes + args.convergence_modes:
        if name not in MODES:
            raise SystemExit(f"unknown mode {name!r}; known: {', '.join(MODES)}")
    parts = {"all": ["netcheck", "throughput", "hetero", "convergence"], "smoke": ["throughput"],
             "twonode": ["netcheck", "twonode"], "race": ["netcheck", "race"],
             "compression": ["netcheck", "compression"],
             "streaming": ["netcheck", "streaming"]}.get(args.command, [args.command])
    needs_ns = [b for b in args.bandwidths if (b != "unlimited" or args.layout == "twonode")
                and set(parts) & {"netcheck", "throughput", "one", "twonode", "race", "compression", "streaming"}]
    needs_ns += [b for part, b in (("hetero", args.hetero_bandwidth), ("convergence", args.convergence_bandwidth))
                 if part in parts and b != "unlimited"]
    reason = harness.namespaces_unavailable() if needs_ns else None
    if reason:
        raise SystemExit(f"cannot emulate {', '.join(sorted(set(needs_ns)))}: {reason}.\nThe plain loopback run "
                         f"(bandwidth 'unlimited', both ranks on localhost, no namespaces) works without root:\n"
                         f"    python benchmarks/cluster.py {args.command} --bandwidths unlimited "
                         f"--hetero_bandwidth unlimited --convergence_bandwidth unlimited")

    harness.interrupt_on_signals()
    est = estimate_s(args, parts)
    command = "python benchmarks/cluster.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(f"{command}\nestimated duration on a quiet 2-core machine: {est / 60:.0f} min", flush=True)
    started = time.time()
    sections = []
    with Bench(args) as h:
        h.tables = {}
        try:
            if args.command == "one":
                cmd_one(h)
                return
            if parts != ["netcheck"] and args.layout == "pair":
                print(workload_text(h.calibrate() * GAS), flush=True)
            for part in parts:
                section = {"netcheck": cmd_netcheck, "throughput": cmd_throughput, "hetero": cmd_hetero,
                           "convergence": cmd_convergence, "twonode": cmd_twonode, "race": cmd_race,
                           "compression": cmd_compression, "streaming": cmd_streaming}[part](h)
                if section:
                    sections.append(section)
        except KeyboardInterrupt as e:
            print(f"\ninterrupted ({e}): stopping the ranks and removing the namespaces", flush=True)
            h.close()
            raise SystemExit(130)
        took = time.time() - started
        header = (f"Machine: {machine_line(args.layout)}. {time.strftime('%Y-%m-%d %H:%M')}. Command: `{command}` "
                  f"(took {took / 60:.1f} min; estimate {est / 60:.0f} min). " + (
                      f"One run per row, {args.steps} inner steps, the first {args.warmup} left out of the timings "
                      f"(DeepSpeed start-up and evaluation never count)." if args.layout == "twonode" else
                      f"Throughput and heterogeneity runs: "
                      f"{args.repeats} repeat(s) of {args.steps} committed steps, the first {args.warmup} left out of "
                      f"the timings (and DeepSpeed start-up and evaluation never count).") + (
                      f" Compute without communication: `{h.calibration_cmd}`." if h.compute_micro_s else ""))
        text = header + "\n\n" + "\n\n".join(sections) + "\n"
        stem = crun.RESULTS / f"cluster_{args.command}"
        stem.with_suffix(".md").write_text(text)
        json.dump({"command": command, "machine": machine_line(args.layout), "took_s": took, "estimate_s": est,
                   "compute_micro_s": h.compute_micro_s, "tables": h.tables}, open(stem.with_suffix(".json"), "w"),
                  indent=1)
        with open(stem.with_suffix(".csv"), "w", newline="") as f:
            keys = sorted({k for r in h.rows for k in r})
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(h.rows)
        print(f"\ntook {took / 60:.1f} min; wrote {stem}.md, .json, .csv and cluster_runs_{args.command}.jsonl")


if __name__ == "__main__":
    main()
