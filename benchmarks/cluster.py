"""ACCO vs stock DeepSpeed ZeRO-1 on an emulated slow cluster, side by side in one run.

Each of the 2 ranks runs in its own network namespace; a veth pair joins them
and a ``tbf`` qdisc on both ends limits the bandwidth (a real slow link, not a
sleep). gloo is bound to those addresses, each rank is pinned to one core.
The "unlimited" rows use plain loopback, no namespaces. The namespaces are
always removed (errors, Ctrl-C, SIGTERM; ``--cleanup`` removes the leftovers
of a run that was killed with SIGKILL).

    python benchmarks/cluster.py all          # everything below, the BENCHMARKS.md tables
    python benchmarks/cluster.py netcheck     # measure what the tbf link really carries
    python benchmarks/cluster.py throughput   # bandwidth x mode table
    python benchmarks/cluster.py hetero       # one rank slowed x1.5 and x2
    python benchmarks/cluster.py convergence  # validation loss vs tokens / wall-clock at 200 Mbit
    python benchmarks/cluster.py twonode      # 4 ranks as 2 nodes of 2: ZeRO-1, ACCO, DiLoCo, CO2
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
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness import rate_bits

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRAIN = ROOT / "benchmarks" / "train_worker.py"
CONFIGS = {"fixed": "configs/acco_cpu.json", "adaptive": "configs/acco_cpu_adaptive.json"}
STOCK = "ZeRO-1 (stock)"
MODES = {  # label -> train_worker.py flags
    STOCK: ["--mode", "zero1"],
    "acco_ds sync": ["--mode", "sync"],
    "dpu": ["--mode", "dpu"],
    "acco fixed": ["--mode", "acco", "--accumulation", "fixed"],
    "acco adaptive": ["--mode", "acco", "--accumulation", "adaptive"],
}
PAIR_MODES = list(MODES)  # the 2-rank tables
# The local-SGD family: replica groups of the ranks of one node (added by rank_commands: 1 in the 2-rank
# layout, 2 in twonode), sync every H inner steps.
for _m in ("diloco", "co2", "edit"):
    for _h in (8, 32):
        MODES[f"{_m} H={_h}"] = ["--mode", _m, "--sync_every", str(_h)]
# EDiT's penalty (the spike table): anomaly elimination alone; all three parts (+ norm weighting, clip 1.0).
MODES["edit H=8 +anomaly"] = MODES["edit H=8"] + ["--penalty", "anomaly"]
MODES["edit H=8 +penalty"] = MODES["edit H=8"] + ["--penalty", "all"]
# A-EDiT: a replica group syncs every 5 s of wall time (about 8 inner steps at 200 Mbit here).
MODES["a-edit T=5s"] = ["--mode", "edit", "--sync_time_s", "5"]
TWONODE_MODES = [STOCK, "acco fixed", "acco adaptive", "diloco H=8", "diloco H=32", "co2 H=8", "co2 H=32",
                 "edit H=8", "edit H=32", "a-edit T=5s"]
LAYOUTS = {"pair": (2, 1), "twonode": (4, 2)}  # layout -> (world size, ranks per node)
# twonode: a smaller step (4 ranks share 2 cores): micro-batch 4 x 128 tokens, 2 micro-batches per rank per step.
TWONODE_MICRO_BS, TWONODE_GAS = 4, 2
BANDWIDTHS = ["unlimited", "1gbit", "200mbit", "50mbit"]
GAS, MICRO_BS, BLOCK = 4, 8, 128  # configs/acco_cpu.json: 4 micro-batches of 8 x 128 tokens per rank per step
# Duration model for the printed estimate (measured on the 2-core AMD EPYC of BENCHMARKS.md).
RUN_OVERHEAD_S = 9.0  # interpreter + DeepSpeed start-up + first evaluation, per run
COMPUTE_STEP_S = 0.40  # 4 micro-batches on one core

# ------------------------------------------------------------------------- runs


def one_command(bandwidth, mode, steps, warmup, eval_interval, eval_batches, extra=(), tokens=0, layout="pair"):
    """The harness command that reruns one row (it prints the row's figures)."""
    cmd = (f"python benchmarks/cluster.py one --bandwidth {bandwidth} --mode {shlex.quote(mode)} --steps {steps} "
           f"--warmup {warmup} --eval_interval {eval_interval} --eval_batches {eval_batches}")
    if layout != "pair":
        cmd += f" --layout {layout}"
    if tokens:
        cmd += f" --tokens {tokens}"
    if extra:
        cmd += f" --extra {shlex.quote(' '.join(extra))}"
    return cmd


def rank_commands(net, mode_flags, spec, out_json, port, layout="pair"):
    """(env, argv) of each rank; ``spec`` holds steps/warmup/eval/extra."""
    config = CONFIGS["adaptive" if "adaptive" in mode_flags else "fixed"]
    world, per_node = LAYOUTS[layout]
    base = [sys.executable, str(TRAIN), "--deepspeed_config", str(ROOT / config), "--steps", str(spec["steps"]),
            "--warmup_steps", str(spec["warmup"]), "--eval_interval", str(spec["eval_interval"]), "--eval_batches",
            str(spec["eval_batches"]), "--results", str(out_json)] + mode_flags + list(spec.get("extra", []))
    if "--sync_every" in mode_flags or "--sync_time_s" in mode_flags:
        base += ["--replica_group_size", str(per_node)]
    if layout == "twonode":
        base += ["--micro_batch", str(TWONODE_MICRO_BS), "--gas", str(TWONODE_GAS)]
    if spec.get("tokens"):
        base += ["--tokens", str(spec["tokens"])]
    cores = os.cpu_count() or 1
    if layout == "twonode":
        # Node n = ranks n*2, n*2+1 in namespace n, pinned to core n; gloo on that namespace's veth address
        # (MASTER_ADDR: node A's). Two ranks of one node reach each other over the namespace's loopback.
        out = []
        for r in range(world):
            node = r // per_node
            env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": str(world),
                   "LOCAL_RANK": str(r % per_node), "LOCAL_WORLD_SIZE": str(per_node), "MASTER_PORT": str(port),
                   "PYTHONUNBUFFERED": "1", **net.rank_env(node)}
            out.append((env, net.wrap(node, ["taskset", "-c", str(node % cores)] + base)))
        return out
    out = []
    for r in range(2):
        # In a namespace each rank is alone on its "node" (LOCAL_RANK 0); on loopback they share one.
        env = harness.rank_env(r, 2, port, net, local_rank=r if net is None else 0)
        argv = ["taskset", "-c", str(r % cores)] + base
        out.append((env, argv if net is None else net.wrap(r, argv)))
    return out


def summarize(result, compute_micro_s):
    """Per-step figures of one run, over the steps after warm-up."""
    steps = max(result["measured_steps"], 1)
    step = result["measured_step_time_s"]
    acco = result.get("acco") or {}
    m = acco.get("measured")
    # Micro-batches one rank computes per committed step (rank 0; adaptive rounds take more than 4).
    micro = m["micro_batches"] / steps if m else GAS
    compute = compute_micro_s * micro
    row = {"samples_per_s": result["measured_samples_per_s"], "step_time_s": step, "micro_per_step": micro,
           "compute_s": compute, "exposed_comm_s": max(step - compute, 0.0),
           "final_val_loss": result["final_val_loss"], "first_val_loss": result["first_loss"],
           "wait_s": None, "comm_busy_s": None, "hidden": None}
    if m:
        row["wait_s"] = m["wait_s"] / steps
        row["comm_busy_s"] = m["comm_s"] / steps
        row["hidden"] = max(0.0, 1 - m["wait_s"] / m["comm_s"]) if m["comm_s"] > 0 else None
    if "micro_batches_per_rank" in acco:
        row["micro_per_rank"] = acco["micro_batches_per_rank"]
    else:
        row["micro_per_rank"] = [result["micro_batches"]] * result["world_size"]
    if result.get("measured_tx_bytes_per_rank"):
        # Each rank's veth tx_bytes over the measured steps (read by train_worker.py inside its namespace):
        # start-up broadcasts and the warm-up steps are not in it.
        row["link_mb_per_step"] = max(result["measured_tx_bytes_per_rank"]) / steps / 1e6
    elif result.get("link_tx_bytes"):
        row["link_mb_per_step"] = max(result["link_tx_bytes"]) / max(result["steps"], 1) / 1e6
    if m and m.get("rounds"):
        for phase in ("reduce_scatter", "stats_allreduce", "update", "all_gather"):
            row[f"{phase}_ms_per_round"] = 1e3 * m.get(f"{phase}_s", 0.0) / m["rounds"]
        row["compute_ms_per_round"] = 1e3 * m["compute_s"] / m["rounds"]
        row["comm_ms_per_round"] = 1e3 * m["comm_s"] / m["rounds"]
    return row


def node_values(per_rank, per_node=2):
    """One value per node from per-rank readings: the ranks of a node read the same counters."""
    return [per_rank[i] for i in range(0, len(per_rank), per_node)] if per_rank else None


def summarize_twonode(result, mode):
    """Per-step figures of one twonode run. Bytes: each node's veth ``tx_bytes`` (what it sent to the other
    node) and loopback ``tx_bytes`` (what its two ranks sent each other), over the whole training loop: the
    first step to the end of finalize (the last synchronisation), divided by the inner steps."""
    steps = max(result["steps"], 1)
    acco = result.get("acco") or {}
    m = acco.get("measured")
    row = {"samples_per_s": result["measured_samples_per_s"], "step_time_s": result["measured_step_time_s"],
           "steps": result["steps"], "tokens": result["tokens"], "train_time_s": result["train_time_s"],
           "final_val_loss": result["final_val_loss"], "first_val_loss": result["first_loss"],
           "final_val_loss_finalized": result.get("final_val_loss_finalized"), "finalize_s": result.get("finalize_s"),
           "micro_per_step": m["micro_batches"] / max(result["measured_steps"], 1) if m else None,
           "wait_s": m["wait_s"] / max(result["measured_steps"], 1) if m else None,
           "hidden": (max(0.0, 1 - m["wait_s"] / m["comm_s"]) if m and m["comm_s"] > 0 else None)}
    for key in ("syncs", "outer_comm_s", "outer_wait_s", "outer_hidden_fraction"):
        row[key] = acco.get(key)
    nodes = node_values(result.get("run_tx_bytes_per_rank"))
    if nodes:
        row["inter_node_bytes"] = nodes
        row["inter_mb_per_step"] = max(nodes) / steps / 1e6
        row["same_node_readings_agree"] = all(
            abs(a - b) <= 0.01 * max(a, b, 1) for a, b in zip(result["run_tx_bytes_per_rank"][0::2],
                                                            result["run_tx_bytes_per_rank"][1::2]))
    lo = node_values(result.get("run_lo_tx_bytes_per_rank"))
    if lo:
        row["intra_node_bytes"] = lo
        row["intra_mb_per_step"] = max(lo) / steps / 1e6
    after = sorted(result.get("after_destroy") or [], key=lambda d: d["rank"])
    if after:
        row["inter_node_bytes_after_destroy"] = node_values([d["tx_bytes_after_destroy"] for d in after])
        row["inter_mb_per_step_after_destroy"] = max(row["inter_node_bytes_after_destroy"]) / steps / 1e6
    window = node_values(result.get("measured_tx_bytes_per_rank"))
    if window:
        row["inter_mb_per_step_window"] = max(window) / max(result["measured_steps"], 1) / 1e6
    row["history"] = [(p["step"], p["tokens"], round(p["time"], 3), p["val_loss"]) for p in result["history"]]
    return row


def ideal_step_s(mode, compute_s, link_s):
    """What the schedule allows with a perfect overlap: ACCO and DPU hide the link time behind compute
    (max(P, 2C) for ACCO's two rounds of C each, max(P, C) for DPU), ZeRO-1 and sync add it (P + C).
    ``link_s`` is the measured bytes of one step at the configured rate."""
    if link_s is None:
        return compute_s
    if mode in (STOCK, "acco_ds sync"):
        return compute_s + link_s
    return max(compute_s, link_s)


def stats3(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def fmt3(s, digits=1, unit=""):
    if s is None:
        return "–"
    return f"{s[0]:.{digits}f}{unit} ({s[1]:.{digits}f}–{s[2]:.{digits}f})"


class Bench:
    """The runs of one command: the namespaces (created once, re-limited per bandwidth), the compute
    calibration, the run records (cluster_runs_<command>.jsonl) and the rows of the CSV."""

    def __init__(self, args):
        self.args = args
        self.net = None
        self.rows = []  # summarized runs, for the CSV
        RESULTS.mkdir(parents=True, exist_ok=True)
        mode = "a" if args.command == "one" else "w"
        self.log = open(RESULTS / f"cluster_runs_{args.command}.jsonl", mode)
        self.compute_micro_s = None
        self.link = {}
        self.layout = getattr(args, "layout", "pair")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.net is not None:
            net, self.net = self.net, None
            net.close()
            print(f"network: namespaces {net.ns[0]}, {net.ns[1]} removed", flush=True)
        if not self.log.closed:
            self.log.close()

    def network(self, bandwidth):
        if bandwidth == "unlimited" and self.layout == "pair":
            return None
        if self.net is None:
            self.raw_network()
        if bandwidth == "unlimited":  # twonode: the same veth pair, no qdisc (bytes still counted)
            if self.net.rate is not None:
                self.net.unlimit()
        elif self.net.rate != bandwidth:
            self.net.limit(bandwidth)
        return self.net

    def raw_network(self):
        """The namespaces before any tbf limit is set (for the link check)."""
        if self.net is None:
            self.net = harness.Network("bench" if self.layout == "pair" else "twonode")
            print(f"network: namespaces {self.net.describe()}, veth pair", flush=True)
        return self.net

    def run(self, bandwidth, mode, spec, repeat=0, tag=""):
        """One training run on 2 ranks; returns rank 0's results JSON (plus link byte counts)."""
        net = self.network(bandwidth)
        out_dir = Path(tempfile.mkdtemp(prefix="acco_cluster_"))
        cmds = rank_commands(net, MODES[mode], spec, out_dir / "result.json", harness.free_port(), self.layout)
        before = net.tx_bytes() if net else None
        before_lo = net.lo_tx_bytes() if net else None
        t0 = time.perf_counter()
        with harness.RankSet(cmds, out_dir, f"{mode} at {bandwidth}") as ranks:
            ranks.finish(self.args.run_timeout)
        wall = time.perf_counter() - t0
        result = json.loads((out_dir / "result.json").read_text())
        if net:
            # Whole run, from outside (start-up broadcasts and evaluations included).
            result["link_tx_bytes"] = [a - b for a, b in zip(net.tx_bytes(), before)]
            result["lo_tx_bytes"] = [a - b for a, b in zip(net.lo_tx_bytes(), before_lo)]
        result["after_destroy"] = [json.loads(f.read_text()) for f in sorted(out_dir.glob("result.json.rank*"))]
        shutil.rmtree(out_dir, ignore_errors=True)
        extra = list(spec.get("extra", []))
        row = summarize(result, self.calibrate()) if self.layout == "pair" else summarize_twonode(result, mode)
        record = {"tag": tag, "bandwidth": bandwidth, "mode": mode, "extra": extra, "repeat": repeat,
                  "wall_s": wall, "command": one_command(bandwidth, mode, spec["steps"], spec["warmup"],
                                                         spec["eval_interval"], spec["eval_batches"], extra,
                                                         spec.get("tokens", 0), self.layout),
                  "rank_commands": [harness.shell_line(env, argv) for env, argv in cmds], "row": row,
                  "result": {k: v for k, v in result.items() if k != "history"}, "history": result["history"]}
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
        self.rows.append({"tag": tag, "bandwidth": bandwidth, "mode": mode, "extra": " ".join(extra),
                          "repeat": repeat, "wall_s": round(wall, 2), **{k: v for k, v in row.items()}})
        print(f"  {tag:<11} {bandwidth:>9}  {mode:<15} {' '.join(extra):<30} {row['samples_per_s']:7.1f} samples/s "
              f"{row['step_time_s']:.3f} s/step  val {row['final_val_loss']:.3f}  ({wall:.0f} s)", flush=True)
        result["_record"] = record
        return result

    def calibrate(self):
        """Compute time per micro-batch with no communication at all: two world-size-1 runs at the same
        time, one per core (the same per-core load as the 2-rank runs), stock ZeRO-1, same micro-batches."""
        if self.compute_micro_s is None:
            out_dir = Path(tempfile.mkdtemp(prefix="acco_calib_"))
            cmds = []
            for r in range(2):
                env = harness.rank_env(0, 1, harness.free_port())
                argv = ["taskset", "-c", str(r % (os.cpu_count() or 1)), sys.executable, str(TRAIN),
                        "--deepspeed_config", str(ROOT / CONFIGS["fixed"]), "--mode", "zero1", "--steps",
                        str(self.args.steps), "--warmup_steps", str(self.args.warmup), "--eval_interval", "1000000",
                        "--eval_batches", "2", "--seed", str(1234 + r), "--results", str(out_dir / f"r{r}.json")]
                cmds.append((env, argv))
            with harness.RankSet(cmds, out_dir, "compute calibration") as ranks:
                ranks.finish(self.args.run_timeout)
            steps = [json.loads((out_dir / f"r{r}.json").read_text())["measured_step_time_s"] for r in range(2)]
            shutil.rmtree(out_dir, ignore_errors=True)
            self.compute_micro_s = statistics.mean(steps) / GAS
            self.calibration_cmd = harness.shell_line(*cmds[0]) + "  (and the same on core 1, concurrently)"
            print(f"compute, no communication (world size 1, both cores busy): {statistics.mean(steps):.3f} s per "
                  f"step of {GAS} micro-batches ({', '.join(f'{s:.3f}' for s in steps)})", flush=True)
        return self.compute_micro_s


# ----------------------------------------------------------------------- tables


def param_count():
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import GPT
    return sum(p.numel() for p in GPT().parameters())


def optimal_bytes_per_step(n, mode):
    """The fewest bytes one rank must send per committed step, fp32 (4 bytes), W = 2: a bandwidth-optimal
    reduce-scatter or all-gather sends (W-1)/W of the buffer. Stock ZeRO-1 all-reduces the gradients (4N) and
    all-gathers the parameters (2N); each ACCO round reduce-scatters (2N) and all-gathers (2N), two rounds per
    step; DPU and sync one round. (The small all-reduce of counts and norms is not counted.)"""
    return {STOCK: 6 * n, "acco_ds sync": 4 * n, "dpu": 4 * n}.get(mode, 8 * n)


def ideal_internode_bytes_per_step(n, mode):
    """The fewest bytes one node must send to the other per inner step, fp32 (4 bytes a parameter), 2 nodes,
    whatever the ranks per node (node-aware collectives: only node sums cross). An all-reduce of the gradients
    between 2 nodes: each sends half of its node's sum (2N) and gets the reduced half back (2N), 4N; an
    all-gather of the parameters: the other node's half, 2N. Stock ZeRO-1: 4N + 2N = 6N; ACCO: 2 rounds of
    (reduce-scatter 2N + all-gather 2N) = 8N; sync and DPU 4N; diloco and co2: one all-reduce of the model
    (4N) per sync, every H inner steps: 4N / H; edit the same; A-EDiT (T=) 4N per sync it measured (None here)."""
    if "H=" in mode:
        return 4 * n / int(mode.split("H=")[1].split()[0])
    if "T=" in mode:
        return None
    return optimal_bytes_per_step(n, mode)


def first_reach(history, target):
    """(training time, tokens) of the first validation at or below ``target`` (no interpolation: the
    local-SGD modes' committed model only moves at a sync), or None."""
    for p in history:
        if p["val_loss"] <= target:
            return p["time"], p["tokens"]
    return None


def cmd_twonode(h):
    a = h.args
    spec = {"steps": a.steps, "warmup": a.warmup, "eval_interval": a.eval_interval, "eval_batches": a.eval_batches,
            "tokens": a.tokens, "extra": a.extra.split() if a.extra else []}
    runs, failed = {}, {}
    for bw in a.bandwidths:
        for mode in a.modes:
            try:
                runs[(bw, mode)] = h.run(bw, mode, spec, tag="twonode")
            except RuntimeError as err:  # one failed row must not lose the others: reported below the table
                failed[(bw, mode)] = str(err)[-3000:]
                print(f"  twonode {bw} {mode} FAILED:\n{failed[(bw, mode)]}", flush=True)
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
    pngs = plot_twonode(runs, a.bandwidths, a.modes, target_a)
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


def plot_twonode(runs, bandwidths, modes, target):
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
    path = RESULTS / "cluster_twonode.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


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
    json.dump({m: r["history"] for m, r in results.items()}, open(RESULTS / "cluster_convergence.json", "w"), indent=1)
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
        path = RESULTS / f"cluster_convergence_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


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
    """Rough duration on the machine of BENCHMARKS.md (2 cores), for the printed estimate."""
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
    if "twonode" in parts:  # 4 ranks on 2 cores: twice the compute per step, a slower start
        for bw in args.bandwidths:
            for m in args.modes:
                rate = None if bw == "unlimited" else rate_bits(bw) / 8
                if "H=" in m:
                    comm = 0 if rate is None else 4 * n / int(m.split("H=")[1]) / rate
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
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("command", nargs="?", default="all",
                   choices=["all", "netcheck", "throughput", "hetero", "convergence", "one", "smoke", "twonode"])
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
    p.add_argument("--run_timeout", type=float, default=600, help="seconds before a run is killed")
    p.add_argument("--results_dir", "--out", default=None,
                   help="where tables, run records and plots go (default benchmarks/results)")
    args = p.parse_args()
    if args.results_dir:
        RESULTS = Path(args.results_dir).resolve()
    if args.cleanup:
        if harness.namespaces_unavailable():
            raise SystemExit(f"--cleanup: {harness.namespaces_unavailable()}")
        print("removed:", ", ".join(harness.cleanup_leftovers()) or "nothing to remove")
        return
    if args.command == "smoke":
        args.bandwidths, args.repeats, args.steps, args.warmup = ["unlimited"], 1, 2, 1
    if args.command == "twonode":
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
             "twonode": ["netcheck", "twonode"]}.get(args.command, [args.command])
    needs_ns = [b for b in args.bandwidths if (b != "unlimited" or args.layout == "twonode")
                and set(parts) & {"netcheck", "throughput", "one", "twonode"}]
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
                           "convergence": cmd_convergence, "twonode": cmd_twonode}[part](h)
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
        stem = RESULTS / f"cluster_{args.command}"
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
