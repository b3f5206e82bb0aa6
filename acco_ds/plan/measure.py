"""``--measure``: time the user's model and link inside a launch of the job, then plan with those numbers.

    deepspeed --num_nodes 2 --num_gpus 8 --module acco_ds.plan --measure --model mypkg.train:make \\
        --tokens-per-step 4m --micro-batches 8 [any acco-ds plan flag]
    torchrun --nnodes 2 --nproc-per-node 8 -m acco_ds.plan --measure --model mypkg.train:make ...

or from a script whose process group is up: ``measure(model, batch, micro_batches=8)`` then
``acco_ds.plan.plan_measured(figures, tokens_per_step=4e6)``. ``--model MODULE:FACTORY``: a callable returning
``(module, batch)``, ``batch`` a tuple of inputs or a callable returning one; the forward's output, or its
first element, is the loss if it is a scalar, else its mean square is.

What is timed, on every rank at once (as training runs them; the slowest rank counts):
- compute: forward and backward of ``micro_batches`` micro-batches (after one warm-up), times one step;
- the link between nodes: all-reduces of a few sizes on the rails (ranks with the same local index, one per
  node, all rails at once, as the node-aware collectives and the outer all-reduce run), each node sending
  k·2(R−1)/R·S bytes per all-reduce of S bytes; a line fitted through (bytes, seconds) gives the bandwidth
  (slope) and the latency (intercept / 2(R−1) hops); sizes grow until one takes over ``max_s`` seconds;
- inside a node (k > 1): the same over the k ranks of each node;
- contention (world > 1): the compute again while a thread on every rank runs all-reduces back to back on a
  second set of the rail groups, then of the node groups, as acco_ds's communication thread runs beside the
  compute. kappa = compute time with them / alone; lambda = seconds per all-reduce finished during the compute /
  alone. ``overlap_outer_compute_factor`` = kappa beside the rails (what local SGD's outer syncs move);
  ``overlap_compute_factor`` = the larger kappa of the two (a round moves data inside nodes and over the rails);
  ``overlap_comm_factor`` = lambda on the rails (one node: inside it). All >= 1, near 1 on GPUs with NCCL; on CPU
  hosts the thread takes cores from the compute, most when it copies memory inside a node rather than waiting on
  a slow link.
Nodes are counted as the launchers do: rank r is on node r // k, k = ``LOCAL_WORLD_SIZE`` or ``LOCAL_SIZE``.
The plan keeps the layout that was measured (``--tp 1 --pp 1``: the launch's data-parallel ranks) unless
``--tp``/``--pp`` are given.
"""

import contextlib
import importlib
import math
import os
import statistics
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # fp32 elements per all-reduce


def _sync(device):
    """Wait for this thread's stream only (the contention thread's all-reduces run on a stream of their own)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _loss(out):
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out if out.dim() == 0 else out.float().square().mean()


def _max(value: float) -> float:
    """The largest value over all ranks (every rank gets it: they agree on what comes next)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _step(model, batch, micro_batches: int, device):
    """Forward and backward of ``micro_batches`` micro-batches."""
    for _ in range(micro_batches):
        inputs = batch() if callable(batch) else batch
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        _loss(model(*[x.to(device) if torch.is_tensor(x) else x for x in inputs])).backward()


def time_compute(model, batch, micro_batches: int, device, repeats: int = 7) -> float:
    """Median over ``repeats`` of the seconds of forward + backward of ``micro_batches`` micro-batches."""
    model.to(device)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        _step(model, batch, micro_batches, device)
        _sync(device)
        if i:  # the first one warms up
            times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return _max(statistics.median(times))


def _allreduces(buf, group, count: int, device, ends: list):
    """``count`` all-reduces of ``buf`` back to back on ``group``, appending the time each one ends (on a GPU on a
    stream of their own, so that waiting for one does not wait for the compute)."""
    side = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        side = torch.cuda.Stream(device)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for _ in range(count):
            dist.all_reduce(buf, group=group)
            _sync(device)
            ends.append(time.perf_counter())


def time_contention(model, batch, micro_batches: int, device, group, samples, compute_s: float, max_s: float = 1.0,
                    repeats: int = 3):
    """(kappa, lambda): the step's compute while a thread runs all-reduces on ``group`` beside it (on every rank),
    its seconds over those of the compute alone run right before each (medians; ``compute_s`` sizes the
    thread's work); the seconds per all-reduce that ended during the compute over the same size's
    alone in ``samples``. The size: the largest of ``samples`` under ``max_s``. The count is fixed beforehand from
    figures every rank shares, so every rank's thread issues the same all-reduces; it spans about twice the compute
    alone, so that the compute stays covered even if it slows more than the all-reduces."""
    n, alone = ([(s, t) for s, t in samples if t < max_s] or samples[:1])[-1]
    count = max(1, math.ceil(2 * compute_s / alone))
    buf = torch.ones(n, dtype=torch.float32, device=device)
    steps, per, solo = [], [], []
    for _ in range(repeats):
        # the compute alone right before, so that kappa is a ratio of neighbours (a shared host drifts)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        _step(model, batch, micro_batches, device)
        _sync(device)
        solo.append(time.perf_counter() - t0)
        ends = []
        thread = threading.Thread(target=_allreduces, args=(buf, group, count, device, ends), daemon=True)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        thread.start()
        _step(model, batch, micro_batches, device)
        _sync(device)
        t1 = time.perf_counter()
        thread.join()
        if len(ends) < count:
            raise RuntimeError("acco-ds plan --measure: the all-reduce thread failed (its error is above)")
        during = [t for t in ends if t <= t1]
        steps.append(t1 - t0)
        per.append((during[-1] - t0) / len(during) if during else (ends[-1] - t0) / count)
    model.zero_grad(set_to_none=True)
    kappa = _max(statistics.median(steps)) / _max(statistics.median(solo))
    return max(1.0, kappa), max(1.0, _max(statistics.median(per)) / alone)


def groups(world: int, k: int):
    """(rail group of this rank, node group of this rank): every rank creates every group, in one order."""
    rank = dist.get_rank()
    rail = node = None
    for i in range(k):
        g = dist.new_group(list(range(i, world, k)))
        if rank % k == i:
            rail = g
    for n in range(world // k):
        g = dist.new_group(list(range(n * k, (n + 1) * k)))
        if rank // k == n:
            node = g
    return rail, node


def time_allreduce(group, members: int, device, sizes=SIZES, repeats: int = 3, max_s: float = 1.0):
    """[(elements, seconds)]: the median of ``repeats`` all-reduces of each size on ``group`` (all groups of
    its kind at once), the slowest rank's; stops after the first size that takes over ``max_s``."""
    out = []
    for n in sizes:
        buf = torch.ones(n, dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            _sync(device)
            times.append(time.perf_counter() - t0)
        t = _max(statistics.median(times))
        out.append((n, t))
        if t > max_s and len(out) >= 2:
            break
    return out


def fit(samples, bytes_per_element: float, hops: int):
    """(bits/s, latency s) from [(elements, seconds)]: least squares t = a + bytes / B."""
    xs = [n * bytes_per_element for n, _ in samples]
    ts = [t for _, t in samples]
    mx, mt = statistics.mean(xs), statistics.mean(ts)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var else 0.0
    if slope <= 0:  # noise swamped the line: the largest transfer's average rate, no latency
        return 8 * xs[-1] / ts[-1], 0.0
    return 8 / slope, max(mt - slope * mx, 0.0) / max(hops, 1)


def measure(model: torch.nn.Module, batch, micro_batches: int = 1, ranks_per_node: Optional[int] = None,
            sizes=SIZES, max_s: float = 1.0) -> dict:
    """Compute and link figures of this launch (every rank calls it; the process group must be up)."""
    world = dist.get_world_size()
    k = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)
    if world % k:
        raise ValueError(f"ranks per node {k} does not divide the world size {world}: set LOCAL_WORLD_SIZE or "
                         f"pass ranks_per_node")
    r = world // k
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = {"nodes": r, "ranks_per_node": k, "micro_batches": micro_batches,
           "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "tensor_sizes": [p.numel() for p in model.parameters() if p.requires_grad],
           "dtype": {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(next(model.parameters()).dtype, "fp32")}
    out["compute_s"] = time_compute(model, batch, micro_batches, device)
    rail, node = groups(world, k)
    if r > 1:
        samples = time_allreduce(rail, r, device, sizes, max_s=max_s)
        out["inter_samples"] = samples
        out["inter_bps"], out["inter_latency_s"] = fit(samples, k * 2 * (r - 1) / r * 4, 2 * (r - 1))
    if k > 1:
        samples = time_allreduce(node, k, device, sizes, max_s=max_s)
        out["intra_samples"] = samples
        out["intra_bps"], out["intra_latency_s"] = fit(samples, 2 * (k - 1) / k * 4, 2 * (k - 1))
    out["overlap_compute_factor"] = out["overlap_comm_factor"] = 1.0  # one rank: nothing to overlap
    if world > 1:  # new groups over the same ranks: the thread's all-reduces never meet the main thread's
        rail2, node2 = groups(world, k)
        beside = {}
        if r > 1:  # the link between nodes: what an outer sync of local SGD moves
            beside["rail"] = time_contention(model, batch, micro_batches, device, rail2, out["inter_samples"],
                                             out["compute_s"], max_s)
        if k > 1:  # inside a node: on CPU hosts memory copies on the compute's own cores
            beside["node"] = time_contention(model, batch, micro_batches, device, node2, out["intra_samples"],
                                             out["compute_s"], max_s)
        # a round (sync, dpu, acco) moves data inside each node and over the rails, so its kappa is the larger;
        # lambda stretches the time on the slowest link, the rails' when there are several nodes
        out["overlap_compute_factor"] = max(kappa for kappa, _ in beside.values())
        out["overlap_comm_factor"] = beside["rail" if r > 1 else "node"][1]
        out["overlap_outer_compute_factor"] = beside["rail" if r > 1 else "node"][0]
    return out


def measured_flags(figures: dict, argv) -> list:
    """The ``acco-ds plan`` flags that carry the measured figures (after the user's ``argv``: they win)."""
    measured = ["--compute-s", repr(figures["compute_s"]), "--nodes", str(figures["nodes"]),
                "--ranks-per-node", str(figures["ranks_per_node"])]
    if "--dtype" not in argv and "--config" not in argv:
        measured += ["--dtype", figures["dtype"]]
    if "--params" not in argv:
        measured += ["--params", str(figures["params"])]
    for flag in ("--overlap-compute-factor", "--overlap-comm-factor", "--overlap-outer-compute-factor"):
        if flag not in argv and flag[2:].replace("-", "_") in figures:  # the user's wins (e.g. to plan for GPUs)
            measured += [flag, repr(figures[flag[2:].replace("-", "_")])]
    if "inter_bps" in figures:
        measured += ["--inter-bandwidth", repr(figures["inter_bps"]),
                     "--inter-latency-ms", repr(1e3 * figures["inter_latency_s"])]
    if "intra_bps" in figures:
        measured += ["--intra-bandwidth", repr(figures["intra_bps"])]
    for flag in ("--tp", "--pp"):  # the layout that was measured (a plain data-parallel launch), unless given
        if flag not in argv:
            measured += [flag, "1"]
    if "--inter-bandwidth" not in list(argv) + measured:
        measured += ["--inter-bandwidth", "1e12"]  # one node: no link between nodes to plan for
    return measured


def load_factory(spec: str) -> Callable:
    if ":" not in spec:
        raise ValueError(f"--model {spec!r}: write MODULE:FACTORY, e.g. mypkg.train:make_model_and_batch")
    module, name = spec.split(":", 1)
    return getattr(importlib.import_module(module), name)


def launch(argv):
    """``--measure``'s own flags parsed, the process group up (from the launcher's environment), the model
    built and measured on every rank: (figures, the other flags, our flags)."""
    import argparse
    import json
    p = argparse.ArgumentParser(prog="acco-ds plan --measure", add_help=True)
    p.add_argument("--measure", action="store_true")
    p.add_argument("--model", required=True, help="MODULE:FACTORY returning (module, batch)")
    p.add_argument("--micro-batches", type=int, default=None, help="per rank per step (default: --config's "
                   "gradient_accumulation_steps, else 1)")
    p.add_argument("--max-s", type=float, default=1.0, help="stop growing the all-reduce size past this time")
    p.add_argument("--out", default=None, help="also write the plan's JSON (with the measured figures) here")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    ours, rest = p.parse_known_args(argv)
    sys.path.insert(0, os.getcwd())
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    model, batch = load_factory(ours.model)()
    gas = ours.micro_batches
    if gas is None and "--config" in rest:
        with open(rest[rest.index("--config") + 1]) as f:
            gas = json.load(f).get("gradient_accumulation_steps", 1)
    return measure(model, batch, gas or 1, max_s=ours.max_s), rest, ours
