"""Running rows of the cluster benchmark: the modes, rank command lines, per-run summaries, the ``Bench``
runner (namespaces, calibration, the runs log), and what a row is worth (ideal bytes and times).
Used by ``cluster.py`` (its docstring describes the setup); no command line of its own."""

import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

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
# Flat collectives, for comparison: in twonode the default ("auto") layout is node-aware (hierarchical).
MODES["acco fixed (flat)"] = MODES["acco fixed"] + ["--collectives", "flat"]
MODES["acco_ds sync (flat)"] = MODES["acco_ds sync"] + ["--collectives", "flat"]
# A-EDiT: a replica group syncs every 5 s of wall time (about 8 inner steps at 200 Mbit here).
MODES["a-edit T=5s"] = ["--mode", "edit", "--sync_time_s", "5"]
# Compressed communication (acco.compression, apply_to auto: what crosses nodes), and the ablation without
# error feedback.
for _m in ("acco fixed", "acco adaptive", "diloco H=8", "co2 H=8", "edit H=8"):
    MODES[f"{_m} int8"] = MODES[_m] + ["--compression", "int8"]
MODES["acco fixed int8 no-EF"] = MODES["acco fixed int8"] + ["--no_error_feedback"]
MODES["diloco H=8 int8 no-EF"] = MODES["diloco H=8 int8"] + ["--no_error_feedback"]
MODES["acco fixed fp8"] = MODES["acco fixed"] + ["--compression", "fp8"]
# The error-feedback ablation with coarse blocks (one scale per 64K values), where quantization error is large.
for _m in ("acco fixed int8", "acco fixed int8 no-EF", "diloco H=8 int8", "diloco H=8 int8 no-EF"):
    MODES[_m.replace("int8", "int8 B=64K")] = MODES[_m] + ["--compression_block", "65536"]
# Streaming DiLoCo: F fragments, τ steps of overlap, α = 0.5 when overlapped (torchft's test values).
for _f, _tau in ((1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (4, 0), (4, 1)):
    MODES[f"diloco H=8 F={_f} τ={_tau}"] = MODES["diloco H=8"] + [
        "--fragments", str(_f), "--fragment_sync_delay", str(_tau), "--fragment_update_alpha",
        "0.5" if _tau else "0"]
STREAMING_MODES = [STOCK, "diloco H=8"] + [m for m in MODES if " F=" in m]
# Issue 46's race: sparseloco (chunk 4096, top 64, 2-bit values, error decay 0.95: the defaults) beside diloco
# int8 at the same H, and Streaming DiLoCo int8 at its best F, τ of the 10 Mbit race (F=2 τ=2).
for _h in (2, 4, 8):
    MODES[f"sparseloco H={_h}"] = ["--mode", "sparseloco", "--sync_every", str(_h)]
    MODES[f"diloco H={_h} int8"] = ["--mode", "diloco", "--sync_every", str(_h), "--compression", "int8"]
MODES["diloco H=8 F=2 τ=2 int8"] = MODES["diloco H=8 F=2 τ=2"] + ["--compression", "int8"]
SPARSE_RACE_MODES = [STOCK, "diloco H=8 F=2 τ=2 int8"] + [f"{m} H={h}" + (" int8" if m == "diloco" else "")
                                                           for h in (2, 4, 8) for m in ("diloco", "sparseloco")]
# Issue 72's 1 Mbit race: sparseloco with its indices packed only (entropy_coding null), and with the default zlib
# coding and the all-gather behind the next N inner steps.
for _h in (2, 4, 8):
    MODES[f"sparseloco H={_h} packed"] = MODES[f"sparseloco H={_h}"] + ["--entropy_coding", "none"]
    for _n in range(1, _h):
        MODES[f"sparseloco H={_h} overlap={_n}"] = MODES[f"sparseloco H={_h}"] + ["--overlap", str(_n)]
TWONODE_MODES = [STOCK, "acco fixed", "acco adaptive", "diloco H=8", "diloco H=32", "co2 H=8", "co2 H=32",
                 "edit H=8", "edit H=32", "a-edit T=5s"]
LAYOUTS = {"pair": (2, 1), "twonode": (4, 2)}  # layout -> (world size, ranks per node)
# twonode: a smaller step (4 ranks share 2 cores): micro-batch 4 x 128 tokens, 2 micro-batches per rank per step.
TWONODE_MICRO_BS, TWONODE_GAS = 4, 2
BANDWIDTHS = ["unlimited", "1gbit", "200mbit", "50mbit"]
GAS, MICRO_BS, BLOCK = 4, 8, 128  # configs/acco_cpu.json: 4 micro-batches of 8 x 128 tokens per rank per step
# Duration model for the printed estimate (measured on the 2-core AMD EPYC of docs/benchmarks/).
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
        per_step = result.get("step_tx_bytes") or []
        if per_step:  # node A (rank 0's namespace), per inner step; the first step after start-up left out
            row["peak_inter_mb_per_step"] = max(per_step) / 1e6
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


# ---------------------------------------------------------------- what a row is worth


def param_count():
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import GPT
    return sum(p.numel() for p in GPT().parameters())


def optimal_bytes_per_step(n, mode):
    """The fewest bytes one rank must send per committed step, fp32 (4 bytes), W = 2: a bandwidth-optimal
    reduce-scatter or all-gather sends (W-1)/W of the buffer. Stock ZeRO-1 all-reduces the gradients (4N) and
    all-gathers the parameters (2N); each ACCO round reduce-scatters (2N) and all-gathers (2N), two rounds per
    step; DPU and sync one round. (The small all-reduce of counts and norms is not counted.)"""
    return {STOCK: 6 * n, "acco_ds sync": 4 * n, "dpu": 4 * n}.get(mode.replace(" (flat)", ""), 8 * n)


def ideal_internode_bytes_per_step(n, mode):
    """The fewest bytes one node must send to the other per inner step, fp32 (4 bytes a parameter), 2 nodes,
    whatever the ranks per node (node-aware collectives: only node sums cross). An all-reduce of the gradients
    between 2 nodes: each sends half of its node's sum (2N) and gets the reduced half back (2N), 4N; an
    all-gather of the parameters: the other node's half, 2N. Stock ZeRO-1: 4N + 2N = 6N; ACCO: 2 rounds of
    (reduce-scatter 2N + all-gather 2N) = 8N; sync and DPU 4N; diloco and co2: one all-reduce of the model
    (4N) per sync, every H inner steps: 4N / H; edit the same; A-EDiT (T=) 4N per sync it measured (None here).
    Compressed rows (int8, fp8): (1 + 4/256) / 4 of their uncompressed row."""
    if " int8" in mode or " fp8" in mode:  # one byte per value + one fp32 scale per 256, instead of 4 bytes
        base = mode.replace(" no-EF", "").replace(" B=64K", "").replace(" int8", "").replace(" fp8", "")
        ideal = ideal_internode_bytes_per_step(n, base)
        return None if ideal is None else ideal * (1 + 4 / 256) / 4
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
