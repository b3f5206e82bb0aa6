"""ACCO vs stock DeepSpeed ZeRO-1 on an emulated slow cluster, side by side in one run.

Each of the 2 ranks runs in its own network namespace; a veth pair joins them
and a ``tbf`` qdisc on both ends limits the bandwidth (a real slow link, not a
sleep). gloo is bound to those addresses, each rank is pinned to one core.
The "unlimited" rows use plain loopback. The namespaces are always removed
(also on errors and Ctrl-C; ``--cleanup`` removes leftovers of a killed run).

    python benchmarks/cluster.py throughput     # bandwidth x mode table
    python benchmarks/cluster.py hetero         # one rank slowed x1.5 and x2
    python benchmarks/cluster.py convergence    # validation loss vs tokens / time at 200 Mbit
    python benchmarks/cluster.py all            # the three, as in BENCHMARKS.md
    python benchmarks/cluster.py smoke          # a few steps on loopback (the test suite runs this)

The workload is examples/train_gpt.py (0.84M-parameter byte-level GPT on the
stdlib source). Results go to benchmarks/results/cluster_*.json(l) and the
markdown tables to benchmarks/results/cluster_tables.md.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRAIN = ROOT / "examples" / "train_gpt.py"
CONFIG = ROOT / "configs" / "acco_cpu.json"
PREFIX = "accobench"
ADDRS = ["10.231.0.1", "10.231.0.2"]  # only inside the namespaces this script creates
MODES = {  # label -> train_gpt.py flags
    "ZeRO-1 (stock)": ["--mode", "zero1"],
    "acco_ds sync": ["--mode", "sync"],
    "dpu": ["--mode", "dpu"],
    "acco fixed": ["--mode", "acco", "--accumulation", "fixed"],
    "acco adaptive": ["--mode", "acco", "--accumulation", "adaptive"],
}
BANDWIDTHS = ["unlimited", "1gbit", "200mbit", "50mbit"]


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60)


class Network:
    """Two namespaces joined by a veth pair with a tbf limit; ``close()`` removes them."""

    def __init__(self):
        self.ns = [f"{PREFIX}{os.getpid()}r{r}" for r in range(2)]
        self.dev = ["acv0", "acv1"]
        self.rate = None
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self.dev[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.dev[1],
               "netns", self.ns[1])
            for r in range(2):
                sh("ip", "-n", self.ns[r], "addr", "add", f"{ADDRS[r]}/24", "dev", self.dev[r])
                sh("ip", "-n", self.ns[r], "link", "set", self.dev[r], "up")
                sh("ip", "-n", self.ns[r], "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def limit(self, rate):
        for r in range(2):
            sh("tc", "-n", self.ns[r], "qdisc", "replace", "dev", self.dev[r], "root", "tbf", "rate", rate, "burst",
               "256kb", "latency", "50ms")
        self.rate = rate

    def close(self):
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)


def cleanup_leftovers():
    out = sh("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]
    for ns in names:
        sh("ip", "netns", "del", ns, check=False)
    return names


def can_use_namespaces():
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_line(args, bandwidth, mode, extra):
    """The command a person runs to reproduce one row (the harness adds nothing else)."""
    flags = " ".join(MODES[mode] + extra)
    return (f"python benchmarks/cluster.py one --bandwidth {bandwidth} --mode '{mode}' --steps {args.steps} "
            f"--warmup {args.warmup}" + (f" --extra '{' '.join(extra)}'" if extra else "")), flags


def run_ranks(args, net, bandwidth, mode, extra, timeout=600):
    """Launch the 2 ranks of one training run; return rank 0's results JSON."""
    out_dir = Path(tempfile.mkdtemp(prefix="acco_cluster_"))
    base = [sys.executable, str(TRAIN), "--deepspeed_config", str(CONFIG), "--steps", str(args.steps),
            "--warmup_steps", str(args.warmup), "--eval_interval", str(args.eval_interval), "--eval_batches",
            str(args.eval_batches), "--results", str(out_dir / "result.json")] + MODES[mode] + extra
    procs, logs = [], []
    port = free_port()
    for r in range(2):
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", RANK=str(r), WORLD_SIZE="2",
                   LOCAL_RANK="0", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        if net is None:
            env.update(MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(r))
            cmd = ["taskset", "-c", str(r % os.cpu_count())] + base
        else:
            env.update(MASTER_ADDR=ADDRS[0], GLOO_SOCKET_IFNAME=net.dev[r])
            cmd = ["ip", "netns", "exec", net.ns[r], "taskset", "-c", str(r % os.cpu_count())] + base
        log = open(out_dir / f"rank{r}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"{mode} at {bandwidth} did not finish in {timeout}s; logs in {out_dir}")
    finally:
        for log in logs:
            log.close()
    if any(p.returncode for p in procs):
        tail = (out_dir / "rank0.log").read_text()[-2000:] + (out_dir / "rank1.log").read_text()[-2000:]
        raise RuntimeError(f"{mode} at {bandwidth} failed (logs in {out_dir}):\n{tail}")
    result = json.loads((out_dir / "result.json").read_text())
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def summarize(result, compute_per_step):
    """Per-step figures of one run (after warm-up)."""
    step = result["measured_step_time_s"]
    row = {"samples_per_s": result["measured_samples_per_s"], "step_time_s": step, "compute_s": compute_per_step,
           "exposed_comm_s": max(step - compute_per_step, 0.0), "final_val_loss": result["final_val_loss"]}
    acco = result.get("acco")
    if acco and "measured" in acco and result["measured_steps"]:
        m = acco["measured"]
        comm = m["comm_s"] / result["measured_steps"]
        row["comm_s"] = comm
        row["hidden"] = max(0.0, 1 - m["wait_s"] / m["comm_s"]) if m["comm_s"] > 0 else None
        row["micro_per_round"] = m["micro_batches"] / max(m["rounds"], 1)
        row["micro_per_rank"] = acco["micro_batches_per_rank"]
    else:
        row["comm_s"], row["hidden"] = row["exposed_comm_s"], 0.0  # stock ZeRO-1 overlaps nothing on CPU
    return row


def median_spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


class Harness:

    def __init__(self, args):
        self.args = args
        self.net = None
        self.rows = []
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.log = open(RESULTS / f"cluster_runs_{args.command}.jsonl", "a")
        self.compute_per_step = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.net is not None:
            self.net.close()
            self.net = None
        self.log.close()

    def network(self, bandwidth):
        if bandwidth == "unlimited":
            return None
        reason = can_use_namespaces()
        if reason:
            raise SystemExit(f"cannot emulate {bandwidth}: {reason}. Run as root, or use --bandwidths unlimited "
                             f"for the plain loopback run")
        if self.net is None:
            self.net = Network()
        if self.net.rate != bandwidth:
            self.net.limit(bandwidth)
        return self.net

    def run(self, bandwidth, mode, extra=(), repeat=0, tag=""):
        extra = list(extra)
        result = run_ranks(self.args, self.network(bandwidth), bandwidth, mode, extra)
        cmd, _ = command_line(self.args, bandwidth, mode, extra)
        record = {"tag": tag, "bandwidth": bandwidth, "mode": mode, "extra": extra, "repeat": repeat, "command": cmd,
                  "result": {k: v for k, v in result.items() if k != "history"}, "history": result["history"]}
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
        print(f"  {tag:<12} {bandwidth:>9}  {mode:<16} {' '.join(extra):<28} "
              f"{result['measured_samples_per_s']:7.1f} samples/s  {result['measured_step_time_s']:.3f} s/step",
              flush=True)
        return result

    def calibrate_compute(self):
        """Compute time per step without communication: one rank alone (world size 1), same per-rank work."""
        if self.compute_per_step is None:
            out = Path(tempfile.mkdtemp()) / "r.json"
            cmd = ["taskset", "-c", "0", sys.executable, str(TRAIN), "--deepspeed_config", str(CONFIG), "--steps",
                   str(self.args.steps), "--warmup_steps", str(self.args.warmup), "--mode", "zero1",
                   "--eval_interval", "100000", "--eval_batches", "1", "--results", str(out)]
            env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1",
                       LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            subprocess.run(cmd, env=env, check=True, timeout=600, cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            self.compute_per_step = json.loads(out.read_text())["measured_step_time_s"]
            print(f"compute per step, 1 rank, no communication: {self.compute_per_step:.3f} s", flush=True)
        return self.compute_per_step


def param_count():
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import GPT
    return sum(p.numel() for p in GPT().parameters())


def workload_line(compute):
    n = param_count()
    # Per step and rank, fp32, 2 ranks: stock ZeRO-1 all-reduces gradients (ring: 2 x N/2 x 4 bytes out) and
    # all-gathers parameters (N/2 x 4); ACCO reduce-scatters and all-gathers (N/2 x 4 each) in each of 2 rounds.
    stock = (2 * n / 2 + n / 2) * 4
    acco = 2 * (n / 2 + n / 2) * 4
    lines = [f"Workload: GPT {n / 1e6:.2f}M parameters (fp32), micro-batch 8 x 128 tokens, 4 micro-batches per "
             f"rank per step, 2 ranks. Compute per step (1 rank alone): {compute:.3f} s."]
    for bw in BANDWIDTHS[1:]:
        rate = float(bw[:-4]) * (1e9 if bw.endswith("gbit") else 1e6) / 8
        lines.append(f"  {bw}: bytes sent per rank per step: stock {stock / 1e6:.1f} MB = {stock / rate:.3f} s, "
                     f"ACCO {acco / 1e6:.1f} MB = {acco / rate:.3f} s of link time")
    return "\n".join(lines)


def table_throughput(h, runs):
    compute = h.calibrate_compute()
    lines = [workload_line(compute), "",
             "| bandwidth | mode | samples/s (median, min–max) | s/step | compute s/step | exposed comm s/step | "
             "comm hidden | speedup vs ZeRO-1 |", "|---|---|---|---|---|---|---|---|"]
    for bw in h.args.bandwidths:
        base = None
        for mode in h.args.modes:
            rows = [summarize(r, compute) for r in runs[(bw, mode)]]
            sps = median_spread([r["samples_per_s"] for r in rows])
            step = median_spread([r["step_time_s"] for r in rows])[0]
            exposed = median_spread([r["exposed_comm_s"] for r in rows])[0]
            hidden = median_spread([r["hidden"] for r in rows])[0]
            if mode == "ZeRO-1 (stock)":
                base = sps[0]
            speedup = f"{sps[0] / base:.2f}x" if base else "-"
            lines.append(f"| {bw} | {mode} | {sps[0]:.1f} ({sps[1]:.1f}–{sps[2]:.1f}) | {step:.3f} | {compute:.3f} | "
                         f"{exposed:.3f} | {'-' if hidden is None else f'{100 * hidden:.0f}%'} | {speedup} |")
    return "\n".join(lines)


def cmd_throughput(h):
    runs = {}
    for repeat in range(h.args.repeats):
        for bw in h.args.bandwidths:
            for mode in h.args.modes:
                runs.setdefault((bw, mode), []).append(h.run(bw, mode, repeat=repeat, tag="throughput"))
    text = table_throughput(h, runs)
    print("\n" + text)
    return "## Throughput\n\n" + text


def cmd_hetero(h):
    bw = h.args.hetero_bandwidth
    lines = [f"Bandwidth {bw}; rank 1 slowed by the factor (benchmark-only: it sleeps (factor-1) x its own "
             f"forward+backward time after each micro-batch).", "",
             "| slow factor (rank 1) | mode | samples/s (median, min–max) | speedup vs ZeRO-1 | micro-batches rank 0 / rank 1 |",
             "|---|---|---|---|---|"]
    for factor in h.args.factors:
        base = None
        for mode in ("ZeRO-1 (stock)", "acco adaptive"):
            extra = ["--slow_rank", "1", "--slow_factor", str(factor)]
            res = [h.run(bw, mode, extra, repeat=i, tag="hetero") for i in range(h.args.repeats)]
            sps = median_spread([r["measured_samples_per_s"] for r in res])
            base = base or sps[0]
            shares = res[0].get("acco", {}).get("micro_batches_per_rank")
            share = f"{shares[0]} / {shares[1]}" if shares else f"{res[0]['micro_batches']} / {res[0]['micro_batches']}"
            lines.append(f"| x{factor} | {mode} | {sps[0]:.1f} ({sps[1]:.1f}–{sps[2]:.1f}) | {sps[0] / base:.2f}x | "
                         f"{share} |")
    text = "\n".join(lines)
    print("\n" + text)
    return "## Heterogeneous workers\n\n" + text


def cmd_convergence(h):
    bw = h.args.convergence_bandwidth
    saved = (h.args.steps, h.args.warmup, h.args.eval_interval, h.args.eval_batches)
    h.args.steps, h.args.warmup, h.args.eval_interval, h.args.eval_batches = h.args.convergence_steps, 0, 10, 16
    results = {mode: h.run(bw, mode, tag="convergence") for mode in ("ZeRO-1 (stock)", "dpu", "acco fixed")}
    h.args.steps, h.args.warmup, h.args.eval_interval, h.args.eval_batches = saved
    json.dump({m: r["history"] for m, r in results.items()}, open(RESULTS / "cluster_convergence.json", "w"), indent=1)
    base = results["ZeRO-1 (stock)"]
    target = base["final_val_loss"] * 1.05

    def time_to(r, loss):
        for point in r["history"]:
            if point["val_loss"] <= loss:
                return point["time"]
        return None

    lines = [f"Bandwidth {bw}, {base['steps']} steps ({base['tokens']:,} tokens) each; target loss = 1.05 x "
             f"ZeRO-1's final validation loss = {target:.3f}.", "",
             "| mode | final val loss | vs ZeRO-1 | val loss at step 10 / 30 | train time (s) | time to target (s) |",
             "|---|---|---|---|---|---|"]
    for mode, r in results.items():
        at = {p["step"]: p["val_loss"] for p in r["history"]}
        ttt = time_to(r, target)
        lines.append(f"| {mode} | {r['final_val_loss']:.3f} | {100 * (r['final_val_loss'] / base['final_val_loss'] - 1):+.1f}% | "
                     f"{at.get(10, float('nan')):.3f} / {at.get(30, float('nan')):.3f} | {r['train_time_s']:.1f} | "
                     f"{'not reached' if ttt is None else f'{ttt:.1f}'} |")
    plot(results, bw)
    text = "\n".join(lines) + "\n\n![validation loss](results/cluster_convergence.png)"
    print("\n" + text)
    return "## Convergence\n\n" + text


def plot(results, bw):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, r in results.items():
        xs = [p["tokens"] / 1e6 for p in r["history"]]
        ts = [p["time"] for p in r["history"]]
        ys = [p["val_loss"] for p in r["history"]]
        axes[0].plot(xs, ys, marker=".", label=mode)
        axes[1].plot(ts, ys, marker=".", label=mode)
    axes[0].set_xlabel("training tokens (M)")
    axes[1].set_xlabel("wall-clock training time (s)")
    for ax in axes:
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"GPT 0.84M on stdlib source, 2 CPU ranks, {bw} link")
    fig.tight_layout()
    fig.savefig(RESULTS / "cluster_convergence.png", dpi=110)


def cmd_one(h):
    extra = h.args.extra.split() if h.args.extra else []
    r = h.run(h.args.bandwidth, h.args.mode, extra, tag="one")
    print(json.dumps(summarize(r, h.calibrate_compute()), indent=1))
    return ""


def main():
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", nargs="?", default="all",
                   choices=["throughput", "hetero", "convergence", "all", "smoke", "one"])
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by a killed run and exit")
    p.add_argument("--bandwidths", type=lambda s: s.split(","), default=BANDWIDTHS)
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--eval_interval", type=int, default=100000)
    p.add_argument("--eval_batches", type=int, default=2)
    p.add_argument("--factors", type=lambda s: [float(x) for x in s.split(",")], default=[1.5, 2.0])
    p.add_argument("--hetero_bandwidth", default="unlimited")
    p.add_argument("--convergence_bandwidth", default="200mbit")
    p.add_argument("--convergence_steps", type=int, default=150)
    p.add_argument("--bandwidth", default="unlimited", help="for `one`")
    p.add_argument("--mode", default="acco fixed", choices=list(MODES), help="for `one`")
    p.add_argument("--extra", default="", help="for `one`: extra train_gpt.py flags")
    p.add_argument("--out", default=None, help="markdown output (default benchmarks/results/cluster_<command>.md)")
    p.add_argument("--results_dir", default=None, help="where run records and plots go (default benchmarks/results)")
    args = p.parse_args()
    RESULTS = Path(args.results_dir) if args.results_dir else RESULTS
    if args.cleanup:
        print("removed:", cleanup_leftovers() or "nothing")
        return
    if args.command == "smoke":
        args.bandwidths, args.repeats, args.steps, args.warmup = ["unlimited"], 1, 2, 1
    for name in args.modes:
        if name not in MODES:
            raise SystemExit(f"unknown mode {name!r}; known: {', '.join(MODES)}")

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    started = time.time()
    machine = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/ *Model name: *//'"],
                             capture_output=True, text=True).stdout.strip()
    import torch
    header = (f"Machine: {machine}, {os.cpu_count()} cores, one core per rank (taskset), gloo; torch "
              f"{torch.__version__}; {time.strftime('%Y-%m-%d')}. Command: `python benchmarks/cluster.py "
              f"{' '.join(sys.argv[1:])}`. {args.repeats} repeat(s), {args.steps} steps per run of which "
              f"{args.warmup} warm-up steps are excluded.")
    sections = []
    with Harness(args) as h:
        try:
            if args.command in ("throughput", "all", "smoke"):
                sections.append(cmd_throughput(h))
            if args.command in ("hetero", "all"):
                sections.append(cmd_hetero(h))
            if args.command in ("convergence", "all"):
                sections.append(cmd_convergence(h))
            if args.command == "one":
                cmd_one(h)
        except KeyboardInterrupt:
            print("interrupted: removing the namespaces")
            raise
    if sections:
        text = header + f" Took {time.time() - started:.0f} s.\n\n" + "\n\n".join(sections) + "\n"
        out = Path(args.out) if args.out else RESULTS / f"cluster_{args.command}.md"
        out.write_text(text)
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
