"""The torch host (acco_ds.torch, no DeepSpeed) beside the DeepSpeed host, and FSDP2 + DiLoCo beside stock HSDP.

    python benchmarks/torch_host.py hosts     # 2 ranks on loopback: acco and diloco, DeepSpeed host vs torch host
    python benchmarks/torch_host.py hsdp      # 4 ranks as 2 nodes of 2 over a 50 Mbit link: stock FSDP2 HSDP vs
                                              # FSDP2 + diloco (replica_mesh(2), H=8), fp32 and int8 outer
                                              # all-reduce, time to 1.01 x stock's loss
    python benchmarks/torch_host.py --cleanup # remove namespaces left by a killed run

Same GPT and data as benchmarks/cluster.py (the quickstart GPT of examples/train_gpt.py, 0.84M
parameters, byte-level, on the stdlib source; held-out batches from the last 10%), same configs
(configs/acco_cpu.json, configs/diloco_cpu.json: AdamW lr 2e-3, betas (0.9, 0.95), weight decay 0.1
on matrices, WarmupCosineLR, gradient clipping 1.0). The DeepSpeed host's rank is
benchmarks/train_worker.py, the torch host's benchmarks/torch_train_worker.py (never imports DeepSpeed).

``hosts``: each rank pinned to its own core (``taskset``), gloo on loopback, no namespaces. Per mode,
the DeepSpeed host and the torch host run the same steps of the same micro-batches; repeats outermost.
samples/s after ``--warmup`` steps (evaluations excluded); peak RSS: each rank process's own peak
resident set (its VmHWM sampled every 0.1 s from outside, the same way for both hosts, and the
worker's own ``ru_maxrss`` where it reports one: every rank of the torch worker, rank 0 of
train_worker.py; a JIT compiler DeepSpeed may start is a child, not counted), the larger rank;
val loss at equal tokens: the committed model after the run's steps on the same ``--eval_batches``
held-out batches (after finalize, unless the run's loop computed micro-batches beyond its last
step: train_worker.py's ACCO loop stops at the N-th commit with half a round more accumulated, which
its finalize commits, so there the loss before finalize, at N steps, is the equal-token one).

``hsdp``: the two-node emulation of ``cluster.py twonode``/``race``: two network namespaces
(``harness.Network``) joined by a veth pair, a ``tbf`` qdisc at ``--bandwidth`` on both ends; ranks
0, 1 in node A's namespace (pinned to core 0), ranks 2, 3 in node B's (core 1); gloo binds each rank to
its namespace's veth address, so only traffic between the nodes crosses the limited link (the two ranks
of a node talk over their namespace's loopback). Stock: FSDP2 HSDP on
``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))`` (sharded inside a node, replicated across),
torch AdamW, no acco_ds; gradient accumulation as FSDP2 documents it for HSDP (reduce-scatter every
micro-batch, all-reduce across nodes on the last one only). Stock trains ``--tokens``; its final
validation loss x ``--race_ratio`` is the target. FSDP2 + diloco (``fully_shard`` on
``acco_ds.torch.replica_mesh(2)``, ``"local_sgd": {"replica_group_size": 2, "sync_every": 8}``) trains
at least the same tokens (its validation there is the equal-token column), then on until its committed
model reaches the target or ``--race_cap`` x stock's training time; then the same with
``"compression": {"dtype": "int8"}`` (the outer all-reduce crosses the nodes, so it is quantized). Validation every
``--eval_interval`` inner steps; times exclude start-up and evaluations. Bytes: each node's veth tx
counter, read inside the ranks from the first step to the end of finalize, per inner step, the larger
node (TCP/IP headers included).

Results: benchmarks/results/torch_host_<command>.{md,json} (machine, settings, table, each run's
rank command lines and records). Each run has a deadline (``--run_timeout``); the ranks are killed and
the namespaces removed on errors, Ctrl-C and SIGTERM.
"""

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
from cluster import machine_line
from cluster_runs import first_reach
from harness import rate_bits

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DS_WORKER = ROOT / "benchmarks" / "train_worker.py"
TORCH_WORKER = ROOT / "benchmarks" / "torch_train_worker.py"
HOST_MODES = {  # mode -> (config, worker flags); the same flags for both workers
    "acco": ("configs/acco_cpu.json", ["--mode", "acco", "--accumulation", "fixed"]),
    "diloco": ("configs/diloco_cpu.json", ["--mode", "diloco", "--replica_group_size", "1"]),
}
HOSTS = ("DeepSpeed", "torch")
HSDP_CONFIG = "configs/diloco_cpu.json"  # optimizer, schedule, clipping; its acco block for the diloco row
HSDP_H = 8
TWONODE_MICRO_BS, TWONODE_GAS, BLOCK = 4, 2, 128  # cluster.py twonode's step: 4 x 128 tokens, 2 per rank
STOCK_HSDP, DILOCO = "stock FSDP2 HSDP", f"FSDP2 + diloco H={HSDP_H}"
DILOCO_INT8 = DILOCO + " + int8"  # acco.compression int8: the outer all-reduce across the nodes, quantized
INT8_BYTES = 1 + 4 / 256  # per value: one byte, plus an fp32 scale per block of 256 (the default block)
RESULT = "{RESULT}"  # in a worker's argv: its record, in the run's own folder (Runner.run)



def vm_hwm_kb(pid):
    """The peak resident set of process ``pid`` itself so far (VmHWM, what its ru_maxrss will be; children
    such as a JIT compiler are not in it), or 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except (OSError, ValueError):
        return 0


def param_count():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from torch_train_worker import GPT  # no DeepSpeed import (train_gpt.py has one)
    return sum(p.numel() for p in GPT().parameters())


def loss_at_tokens(history, tokens):
    for p in history:
        if p["tokens"] == tokens:
            return p["val_loss"]
    return None


class Runner:
    """Runs the rank sets of one command; keeps every run's record."""

    def __init__(self, args):
        self.args, self.net, self.records = args, None, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        harness.kill_everything()
        if self.net is not None:
            net, self.net = self.net, None
            net.close()
            print(f"network: namespaces {net.ns[0]}, {net.ns[1]} removed", flush=True)

    def run(self, name, ranks, extra_record=None):
        """``ranks``: (env, worker argv, namespace index or None, core) per rank; the run is killed after
        ``--run_timeout`` s. Returns rank 0's record with ``peak_rss_mb_ranks`` (every rank's own peak
        resident set) and, in namespaces, the veth/loopback counters read from outside over the whole run."""
        out = Path(tempfile.mkdtemp(prefix="acco_torchhost_"))
        cmds = []
        for env, argv, ns, core in ranks:  # taskset and ip netns exec exec: each pid is the rank's python
            argv = ["taskset", "-c", str(core)] + [str(out / "result.json") if x == RESULT else x for x in argv]
            cmds.append((env, argv if ns is None else self.net.wrap(ns, argv)))
        before = (self.net.tx_bytes(), self.net.lo_tx_bytes()) if self.net else None
        t0 = time.perf_counter()
        hwm = [0] * len(cmds)
        try:
            with harness.RankSet(cmds, out, name) as rs:
                until = time.monotonic() + self.args.run_timeout
                while time.monotonic() < until:  # sample each rank's VmHWM while it runs (peak RSS per rank)
                    codes = rs.poll()
                    for r, p in enumerate(rs.procs):
                        if codes[r] is None:
                            hwm[r] = max(hwm[r], vm_hwm_kb(p.pid))
                    if all(c is not None for c in codes) or any(c for c in codes if c is not None):
                        break
                    time.sleep(0.1)
                rs.finish(max(1.0, until - time.monotonic()))  # raises with the logs on a failure or timeout
            wall = time.perf_counter() - t0
            result = json.loads((out / "result.json").read_text())
            # Per rank: the sampled VmHWM, and where the worker reported its own ru_maxrss (the torch worker:
            # every rank; train_worker.py: rank 0) the larger of the two (the last ~0.1 s is not sampled).
            own = result.get("peak_rss_mb_per_rank") or [result["peak_rss_mb"]]
            result["peak_rss_mb_ranks"] = [max(kb / 1024, own[r] if r < len(own) else 0.0)
                                           for r, kb in enumerate(hwm)]
            result["peak_rss_mb_sampled"] = [kb / 1024 for kb in hwm]
            result["after_destroy"] = [json.loads(f.read_text()) for f in sorted(out.glob("result.json.rank*"))]
            if before:
                result["outside_tx_bytes"] = [a - b for a, b in zip(self.net.tx_bytes(), before[0])]
                result["outside_lo_tx_bytes"] = [a - b for a, b in zip(self.net.lo_tx_bytes(), before[1])]
        finally:
            shutil.rmtree(out, ignore_errors=True)
        result["wall_s"] = wall
        result["rank_commands"] = [harness.shell_line(env, [x.replace(str(out) + "/", "") for x in argv])
                                   for env, argv in cmds]
        self.records.append({"name": name, **(extra_record or {}),
                             **{k: v for k, v in result.items() if k not in ("history", "acco")},
                             "history": result.get("history"), "acco_lines": (result.get("acco") or {}).get("lines")})
        print(f"  {name:<40} {result['measured_samples_per_s'] or 0:7.1f} samples/s  val "
              f"{result['final_val_loss']:.3f}  RSS {max(result['peak_rss_mb_ranks']):.0f} MiB  ({wall:.0f} s)",
              flush=True)
        return result


# ---------------------------------------------------------------------------------------- hosts


def host_ranks(host, mode, args):
    config, flags = HOST_MODES[mode]
    worker = DS_WORKER if host == "DeepSpeed" else TORCH_WORKER
    argv = [sys.executable, str(worker), "--deepspeed_config" if host == "DeepSpeed" else "--config",
            str(ROOT / config), "--steps", str(args.steps), "--warmup_steps", str(args.warmup), "--eval_interval",
            "1000000", "--eval_batches", str(args.eval_batches), "--results", RESULT] + flags
    port, cores = harness.free_port(), os.cpu_count() or 1
    return [(harness.rank_env(r, 2, port), argv, None, r % cores) for r in range(2)]


def equal_token_loss(result, mode):
    """The validation loss of the committed model after exactly the run's ``steps`` (see the docstring)."""
    gas = json.loads((ROOT / HOST_MODES[mode][0]).read_text())["gradient_accumulation_steps"]
    fin = result.get("final_val_loss_finalized")
    if fin is None:
        return result["final_val_loss"], "no finalize"
    if result["micro_batches"] == result["steps"] * gas:
        return fin, "after finalize"
    return result["final_val_loss"], (f"its loop computed {result['micro_batches']} micro-batches per rank for "
                                      f"{result['steps']} steps; finalize commits the rest (val loss after "
                                      f"finalize {fin:.4f})")


def cmd_hosts(h):
    a = h.args
    runs, failed = {}, {}
    for repeat in range(a.repeats):  # repeats outermost: drift of the machine hits every row alike
        for mode in a.modes:
            for host in HOSTS:
                name = f"{host} host, {mode}" + (f" (repeat {repeat + 1})" if a.repeats > 1 else "")
                try:
                    runs.setdefault((host, mode), []).append(
                        h.run(name, host_ranks(host, mode, a), {"host": host, "mode": mode, "repeat": repeat}))
                except (RuntimeError, harness.DeadlineExceeded) as err:
                    failed[name] = str(err)[-4000:]
                    print(f"  {name} FAILED:\n{failed[name]}", flush=True)
    lines = [f"Workload: GPT {param_count() / 1e6:.2f}M parameters (fp32), 2 ranks (one core each, gloo on "
             f"loopback), micro-batch 8 x {BLOCK} tokens, 4 micro-batches per rank per step ({8 * 4 * 2 * BLOCK:,} "
             f"tokens/step), {a.steps} steps, samples/s over the steps after the first {a.warmup} (evaluations "
             f"excluded), {a.repeats} repeat(s) (median, min–max). acco: configs/acco_cpu.json (acco fixed); "
             f"diloco: configs/diloco_cpu.json's acco block with replica_group_size 1 (2 replicas of 1 rank, "
             f"sync every 8). Peak RSS: each rank process's own peak resident set (VmHWM sampled from outside, and "
             f"its own ru_maxrss where the worker reports it), the larger rank. Val loss: the committed model after "
             f"the same steps (tokens column), on the same {a.eval_batches} held-out batches, after finalize unless "
             f"marked.", "",
             "| host | mode | samples/s | peak RSS MiB (max over ranks) | val loss at equal tokens | tokens | "
             "samples/s torch / DeepSpeed | RSS torch / DeepSpeed | val loss torch / DeepSpeed |",
             "|---|---|---|---|---|---|---|---|---|"]
    table = []
    for mode in a.modes:
        base = None
        for host in HOSTS:
            rs = runs.get((host, mode), [])
            if not rs:
                lines.append(f"| {host} | {mode} | failed (below) |" + " |" * 6)
                continue
            sps = stats3([r["measured_samples_per_s"] for r in rs])
            rss = stats3([max(r["peak_rss_mb_ranks"]) for r in rs])
            loss, when = equal_token_loss(rs[0], mode)
            row = {"host": host, "mode": mode, "samples_per_s": sps, "peak_rss_mib": rss, "val_loss": loss,
                   "val_loss_when": when, "val_loss_finalized": rs[0].get("final_val_loss_finalized"),
                   "val_loss_before_finalize": rs[0]["final_val_loss"], "tokens": rs[0]["tokens"],
                   "steps": rs[0]["steps"], "micro_batches_per_rank": rs[0]["micro_batches"],
                   "peak_rss_mb_per_rank_in_process": rs[0].get("peak_rss_mb_per_rank", [rs[0]["peak_rss_mb"]]),
                   "rank_commands": rs[0]["rank_commands"]}
            if host == "DeepSpeed":
                base = row
                ratios = "| – | – | – |"
            elif base is not None:
                row["vs_deepspeed"] = {"samples_per_s": sps[0] / base["samples_per_s"][0],
                                       "peak_rss": rss[0] / base["peak_rss_mib"][0],
                                       "val_loss": loss / base["val_loss"]}
                v = row["vs_deepspeed"]
                ratios = f"| {v['samples_per_s']:.2f}x | {v['peak_rss']:.2f}x | {v['val_loss']:.3f}x |"
            else:
                ratios = "| – | – | – |"
            mark = "" if when == "after finalize" else " ¹"
            lines.append(f"| {host} | {mode} | {fmt3(sps)} | {fmt3(rss, 0)} | {loss:.4f}{mark} | {row['tokens']:,} "
                         + ratios)
            table.append(row)
    marked = [f"{r['host']} host, {r['mode']}: {r['val_loss_when']}" for r in table
              if r["val_loss_when"] != "after finalize"]
    if marked:
        lines += ["", "¹ before finalize: " + "; ".join(marked) + "."]
    mismatched = [f"{mode}: tokens {', '.join(str(r['tokens']) for r in table if r['mode'] == mode)}"
                  for mode in a.modes if len({r["tokens"] for r in table if r["mode"] == mode}) > 1]
    if mismatched:
        lines += ["", "Note: the hosts' token counts differ (" + "; ".join(mismatched) + ")."]
    for name, err in failed.items():
        lines += ["", f"**{name} failed**:", "", "```", err, "```"]
    lines += ["", "Each run (rank commands):", ""]
    for row in table:
        lines += [f"    # {row['host']} host, {row['mode']}"] + [f"    {c}" for c in row["rank_commands"]]
    text = "\n".join(lines)
    print("\n" + text)
    h.tables["hosts"] = table
    return "### DeepSpeed host vs torch host\n\n" + text


# ----------------------------------------------------------------------------------------- hsdp


def hsdp_ranks(h, flags):
    a = h.args
    argv = [sys.executable, str(TORCH_WORKER), "--config", str(ROOT / HSDP_CONFIG), "--micro_batch",
            str(TWONODE_MICRO_BS), "--gas", str(TWONODE_GAS), "--replica_group_size", "2", "--warmup_steps",
            str(a.warmup), "--eval_interval", str(a.eval_interval), "--eval_batches", str(a.eval_batches),
            "--results", RESULT] + flags
    port, cores = harness.free_port(), os.cpu_count() or 1
    out = []
    for r in range(4):
        node = r // 2
        env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": "4",
               "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
               **h.net.rank_env(node)}
        out.append((env, argv, node, node % cores))
    return out


def hsdp_row(result, n):
    steps = max(result["steps"], 1)
    nodes = (result.get("run_tx_bytes_per_rank") or [])[0::2]  # the two ranks of a node read one counter
    lo = (result.get("run_lo_tx_bytes_per_rank") or [])[0::2]
    return {"steps": result["steps"], "tokens": result["tokens"], "samples_per_s": result["measured_samples_per_s"],
            "train_time_s": result["train_time_s"], "final_val_loss": result["final_val_loss"],
            "final_val_loss_finalized": result.get("final_val_loss_finalized"),
            "inter_node_bytes": nodes, "inter_mb_per_step": max(nodes) / steps / 1e6 if nodes else None,
            "intra_node_bytes": lo, "intra_mb_per_step": max(lo) / steps / 1e6 if lo else None,
            "outside_tx_bytes": result.get("outside_tx_bytes"), "peak_rss_mib": max(result["peak_rss_mb_ranks"]),
            "syncs": (result.get("acco") or {}).get("syncs")}


def cmd_hsdp(h):
    a = h.args
    n = param_count()
    h.net = harness.Network("torchhsdp")
    print(f"network: namespaces {h.net.describe()}, veth pair", flush=True)
    h.net.limit(a.bandwidth)
    link = None
    if not a.skip_netcheck:
        link = h.net.goodput()
        print(f"  link check {a.bandwidth}: {link / 1e6:.1f} Mbit/s", flush=True)
    per_step = TWONODE_MICRO_BS * TWONODE_GAS * 4 * BLOCK
    budget_steps = math.ceil(a.tokens / per_step)
    budget = budget_steps * per_step
    runs, failed = {}, {}
    try:
        runs[STOCK_HSDP] = h.run(f"{STOCK_HSDP} at {a.bandwidth}", hsdp_ranks(
            h, ["--stock_hsdp", "--tokens", str(budget)]), {"mode": STOCK_HSDP})
    except (RuntimeError, harness.DeadlineExceeded) as err:
        failed[STOCK_HSDP] = str(err)[-4000:]
        print(f"  {STOCK_HSDP} FAILED:\n{failed[STOCK_HSDP]}", flush=True)
    stock = runs.get(STOCK_HSDP)
    target = a.target or (stock["final_val_loss"] * a.race_ratio if stock else None)
    target = None if target is None else round(target, 4)  # as the workers get it (--target_loss): one number
    cap = a.race_cap * stock["train_time_s"] if stock else a.run_timeout / 2
    flags = ["--fsdp", "--mode", "diloco", "--sync_every", str(HSDP_H), "--tokens", str(50 * budget),
             "--min_tokens", str(budget), "--time_cap_s", f"{cap:.1f}"]
    if target is not None:
        flags += ["--target_loss", f"{target:.4f}"]
    for mode, extra in ((DILOCO, []), (DILOCO_INT8, ["--compression", "int8"])):
        try:
            runs[mode] = h.run(f"{mode} at {a.bandwidth}", hsdp_ranks(h, flags + extra), {"mode": mode})
        except (RuntimeError, harness.DeadlineExceeded) as err:
            failed[mode] = str(err)[-4000:]
            print(f"  {mode} FAILED:\n{failed[mode]}", flush=True)

    ideal = {STOCK_HSDP: 4 * n, DILOCO: 4 * n / HSDP_H, DILOCO_INT8: INT8_BYTES * n / HSDP_H}
    stock_reach = first_reach(stock["history"], target) if stock and target else None
    lines = [f"Workload: GPT {n / 1e6:.2f}M parameters (fp32), 4 ranks as 2 nodes of 2 (one core per node, shared "
             f"by its 2 ranks), {a.bandwidth} between the nodes" +
             (f" (measured TCP goodput {link / 1e6:.1f} Mbit/s)" if link else "") +
             f", micro-batch {TWONODE_MICRO_BS} x {BLOCK} tokens, {TWONODE_GAS} micro-batches per rank per inner "
             f"step ({per_step:,} tokens per step). Stock trains {budget:,} tokens ({budget_steps} steps); target = "
             f"{a.race_ratio:g} x stock's final validation loss" + (f" = {target:.4f}" if target else "") +
             f"; diloco trains at least the same tokens, then until the target or {a.race_cap:g} x stock's training "
             f"time ({cap:.0f} s). Validation every {a.eval_interval} inner steps on {a.eval_batches} held-out "
             f"batches (diloco: the committed model, which moves only at a sync). samples/s after {a.warmup} warm-up "
             f"steps, evaluations excluded. Inter-node bytes: the larger node's veth tx counter from the first step "
             f"to the end of finalize, per inner step; ideal (fp32, 2 nodes): stock HSDP all-reduces every "
             f"gradient shard across the nodes once per step, 4N = {4 * n / 1e6:.2f} MB per node; diloco all-reduces "
             f"the model shards once per sync, 4N/H = {4 * n / HSDP_H / 1e6:.3f} MB per node per inner step; with "
             f"int8 (`acco.compression` {{\"dtype\": \"int8\"}}, block 256: {INT8_BYTES:.4f} bytes per value) "
             f"{INT8_BYTES:.4f}N/H = {ideal[DILOCO_INT8] / 1e6:.3f} MB.", "",
             "| mode | inner steps | inter-node MB/step (measured) | ideal | samples/s | val loss at equal tokens "
             f"({budget:,}) | final val loss (tokens) | time to target (s) | vs stock | tokens to target | "
             "stopped by | peak RSS MiB |", "|---" * 12 + "|"]
    table = []
    for mode in (STOCK_HSDP, DILOCO, DILOCO_INT8):
        r = runs.get(mode)
        if r is None:
            lines.append(f"| {mode} | failed (below) |" + " |" * 10)
            continue
        row = hsdp_row(r, n)
        reach = first_reach(r["history"], target) if target else None
        at_budget = loss_at_tokens(r["history"], budget)
        vs = reach[0] / stock_reach[0] if reach and stock_reach else None
        fin = row["final_val_loss_finalized"] if row["final_val_loss_finalized"] is not None else row["final_val_loss"]
        why = "budget" if mode == STOCK_HSDP else ("target" if reach and r["tokens"] > budget else
                                                   "target (at the budget)" if reach else f"time cap ({cap:.0f} s)")
        mb = row["inter_mb_per_step"]
        lines.append(f"| {mode} | {row['steps']} | {'–' if mb is None else f'{mb:.3f}'} | {ideal[mode] / 1e6:.3f} | "
                     f"{row['samples_per_s']:.1f} | {'–' if at_budget is None else f'{at_budget:.4f}'} | "
                     f"{fin:.4f} ({row['tokens']:,}) | {'not reached' if not reach else f'{reach[0]:.1f}'} | "
                     f"{'–' if vs is None else f'{vs:.2f}x'} | {'–' if not reach else f'{int(reach[1]):,}'} | "
                     f"{why} | {row['peak_rss_mib']:.0f} |")
        table.append({"mode": mode, "target": target, "time_cap_s": cap, "time_to_target": reach, "vs_stock": vs,
                      "val_loss_at_equal_tokens": at_budget, "equal_tokens": budget, "ideal_mb_per_step":
                      ideal[mode] / 1e6, **row, "rank_commands": r["rank_commands"]})
    lines += ["", "Bytes over the training loop (MB, node A / node B): inter-node (veth) and intra-node (loopback), "
                  "and the veth counters read from outside over the whole run (start-up and evaluations included):",
              "", "| mode | inter-node | intra-node | whole run, inter-node |", "|---|---|---|---|"]
    mbs = lambda v: "–" if not v else " / ".join(f"{x / 1e6:.2f}" for x in v)  # noqa: E731
    for row in table:
        lines.append(f"| {row['mode']} | {mbs(row['inter_node_bytes'])} | {mbs(row['intra_node_bytes'])} | "
                     f"{mbs(row['outside_tx_bytes'])} |")
    for mode, err in failed.items():
        lines += ["", f"**{mode} failed**:", "", "```", err, "```"]
    lines += ["", "Each run (rank commands):", ""]
    for row in table:
        lines += [f"    # {row['mode']}"] + [f"    {c}" for c in row["rank_commands"]]
    text = "\n".join(lines)
    print("\n" + text)
    h.tables["hsdp"] = table
    return f"### Two nodes at {a.bandwidth}: stock FSDP2 HSDP vs FSDP2 + diloco (fp32 and int8)\n\n" + text


def stats3(values):
    values = [v for v in values if v is not None]
    return (statistics.median(values), min(values), max(values)) if values else None


def fmt3(s, digits=1):
    if s is None:
        return "–"
    return f"{s[0]:.{digits}f}" if s[1] == s[2] else f"{s[0]:.{digits}f} ({s[1]:.{digits}f}–{s[2]:.{digits}f})"


def estimate_s(args):
    """Rough duration on a quiet 2-core machine (docs/benchmarks/'s), for the printed estimate."""
    if args.command == "hosts":
        per_run = {"DeepSpeed": 12.0, "torch": 6.0}  # start-up + the evaluations
        return args.repeats * sum(per_run[host] + args.steps * 0.36 for host in HOSTS for _ in args.modes)
    n, rate = 0.84e6, rate_bits(args.bandwidth) / 8
    steps = math.ceil(args.tokens / (TWONODE_MICRO_BS * TWONODE_GAS * 4 * BLOCK))
    stock = steps * (0.3 + 4.2 * n / rate)
    evals = (steps / args.eval_interval + 1) * 0.4
    diloco = min(args.race_cap * stock, 2 * steps * (0.3 + 4.2 * n / rate / HSDP_H))
    return 10 + 3 * (8 + evals) + stock + 2 * diloco


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("command", nargs="?", choices=["hosts", "hsdp"])
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by a killed run, and exit")
    p.add_argument("--steps", type=int, default=64, help="hosts: optimizer steps per run")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timings (hosts 8, hsdp 3)")
    p.add_argument("--repeats", type=int, default=2, help="hosts: repeats of every run (median)")
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(HOST_MODES), help="hosts: acco,diloco")
    p.add_argument("--eval_batches", type=int, default=16)
    p.add_argument("--bandwidth", default="50mbit", help="hsdp: the tbf rate between the nodes")
    p.add_argument("--tokens", type=int, default=262_144, help="hsdp: stock's token budget (64 steps)")
    p.add_argument("--eval_interval", type=int, default=4, help="hsdp: inner steps between validations")
    p.add_argument("--race_ratio", type=float, default=1.01, help="hsdp: target = ratio x stock's final loss")
    p.add_argument("--race_cap", type=float, default=3.0, help="hsdp: diloco's time cap = this x stock's time")
    p.add_argument("--target", type=float, default=None, help="hsdp: a fixed target loss instead")
    p.add_argument("--skip_netcheck", action="store_true", help="hsdp: no TCP goodput check of the link")
    p.add_argument("--run_timeout", type=float, default=420, help="seconds before a run is killed")
    p.add_argument("--results_dir", "--out", default=None, help="default benchmarks/results")
    args = p.parse_args()
    if args.cleanup:
        if harness.namespaces_unavailable():
            raise SystemExit(f"--cleanup: {harness.namespaces_unavailable()}")
        print("removed:", ", ".join(harness.cleanup_leftovers()) or "nothing to remove")
        return
    if args.command is None:
        p.error("a command: hosts or hsdp")
    for m in args.modes:
        if m not in HOST_MODES:
            p.error(f"unknown mode {m!r}; known: {', '.join(HOST_MODES)}")
    if args.warmup is None:
        args.warmup = 8 if args.command == "hosts" else 3
    if args.command == "hsdp":
        rate_bits(args.bandwidth)
        reason = harness.namespaces_unavailable()
        if reason:
            raise SystemExit(f"hsdp emulates two nodes with network namespaces: {reason}")
    results = Path(args.results_dir).resolve() if args.results_dir else RESULTS
    results.mkdir(parents=True, exist_ok=True)

    harness.interrupt_on_signals()
    est = estimate_s(args)
    command = "python benchmarks/torch_host.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    print(f"{command}\nestimated duration on a quiet 2-core machine: {est / 60:.1f} min", flush=True)
    started = time.time()
    layout = "twonode" if args.command == "hsdp" else "pair"
    with Runner(args) as h:
        h.tables = {}
        try:
            section = {"hosts": cmd_hosts, "hsdp": cmd_hsdp}[args.command](h)
        except KeyboardInterrupt as e:
            print(f"\ninterrupted ({e}): stopping the ranks and removing the namespaces", flush=True)
            raise SystemExit(130)
        took = time.time() - started
        settings = (f"{args.repeats} repeat(s) of {args.steps} steps per run, the first {args.warmup} left out of "
                    f"the timings" if args.command == "hosts" else
                    f"{args.bandwidth} between the nodes, stock's budget {args.tokens:,} tokens, validation every "
                    f"{args.eval_interval} inner steps on {args.eval_batches} batches, the first {args.warmup} steps "
                    f"left out of the timings")
        header = (f"Machine: {machine_line(layout)}. {time.strftime('%Y-%m-%d %H:%M')}. Command: `{command}` (took "
                  f"{took / 60:.1f} min; estimate {est / 60:.1f} min). {settings}; start-up and evaluations never "
                  f"count.")
        stem = results / f"torch_host_{args.command}"
        stem.with_suffix(".md").write_text(header + "\n\n" + section + "\n")
        json.dump({"command": command, "machine": machine_line(layout), "took_s": took, "estimate_s": est,
                   "settings": vars(args), "tables": h.tables, "runs": h.records},
                  open(stem.with_suffix(".json"), "w"), indent=1, default=str)
        print(f"\ntook {took / 60:.1f} min; wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
