"""``acco-ds plan`` (or ``python -m acco_ds.plan``): which mode, which layout, which period, which compression,
how fast, and whether it fits.

    acco-ds plan --params 70b --tokens-per-step 16m --nodes 8 --ranks-per-node 8 --rank-flops 989tflops \\
                 --inter-bandwidth 10gbit --gpu-memory 80gb [--seq-len 4096 --hidden 8192 --layers 80 \\
                 --micro-batch 1] [--tp 8 --pp 2] [--active-params 13b] [--sync-every 100] \\
                 [--token-factors literature|measured] [--token-factor diloco=1.1 ...] [--config ds.json] [--json]

One row per candidate (stock ZeRO-1, sync, dpu, acco fixed and adaptive, diloco, Streaming DiLoCo, co2, edit,
A-EDiT, sparseloco; int8 where it applies; local SGD at the period the model finds best), each at the fastest
tensor x pipeline layout where it fits in --gpu-memory, sorted by the time to the tokens = steps x seconds per
step x token factor; the recommended row's ``"acco"`` block is printed ready to paste. The model
(``acco_ds.plan.model``, ``layouts``, ``memory``, ``factors``) and its sources are in docs/plan.md.
``--measure`` (inside a launch of the job: ``acco_ds.plan.measure``) replaces compute and link figures by
measured ones.
"""

import argparse
import json
import sys

from ..config.rulebook import Layout
from . import model as pm
from .layouts import layouts
from .memory import RECOMPUTE
from .parse import PlanError, parse_bandwidth, parse_count, parse_factors, parse_memory, read_config
from .report import plan, table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="acco-ds plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--params", required=True, help="parameters N (MoE: all of them), e.g. 7e9 or 7b")
    p.add_argument("--active-params", help="MoE: parameters a token passes through (compute); default --params")
    p.add_argument("--moe-top-k", default="2", help="MoE: experts per token, for the all-to-all (default 2)")
    p.add_argument("--tokens-per-step", required=True, help="tokens per optimizer step, all ranks (e.g. 4m)")
    p.add_argument("--nodes", required=True, help="R: nodes (sites), each behind one inter-node link")
    p.add_argument("--ranks-per-node", required=True, help="ranks (GPUs) per node")
    p.add_argument("--tp", help="tensor-parallel ranks (inside a node); default: searched in 1, 2, 4, 8")
    p.add_argument("--pp", help="pipeline stages; default: searched in 1, 2, 4, ...")
    p.add_argument("--gpu-memory", help="memory per rank: 80gb, 141gb, 80gib (default: not checked)")
    for flag, what in (("seq-len", "sequence length"), ("hidden", "hidden size"), ("layers", "transformer layers"),
                       ("heads", "attention heads (default hidden/128)"),
                       ("micro-batch", "sequences per micro-batch (default: --config's)")):
        p.add_argument(f"--{flag}", help=f"model shape: {what}")
    p.add_argument("--recompute", default="full", choices=RECOMPUTE, help="activation recomputation (default full)")
    p.add_argument("--rank-flops", help="peak FLOP/s of one rank, e.g. 989e12 (H100 bf16 dense)")
    p.add_argument("--mfu", default="0.4", help="model FLOPs utilization of the compute (default 0.4)")
    p.add_argument("--compute-s", help="seconds of compute per step, measured (instead of 6NT/(R k F mfu))")
    p.add_argument("--inter-bandwidth", required=True, help="between nodes, bits/s: 100mbit, 1gbit, 10gbit")
    p.add_argument("--inter-latency-ms", default="30", help="one-way latency between nodes (default 30)")
    p.add_argument("--intra-bandwidth", default="400gbit", help="inside a node, per rank (default 400gbit)")
    p.add_argument("--dtype", default=None, choices=list(pm.DTYPE_BYTES), help="model dtype (default: --config's, "
                   "else bf16)")
    p.add_argument("--tokens", default=None, help="tokens to train (default 20 x params)")
    p.add_argument("--config", default=None, help="the DeepSpeed config: micro-batch, accumulation, stage, dtype")
    p.add_argument("--token-factors", default=None, choices=("literature", "measured"),
                   help="token factors from the papers or from the races measured here (default: the papers from "
                        "100M parameters up)")
    p.add_argument("--token-factor", nargs="+", action="extend", default=[], metavar="MODE=F",
                   help="override a token factor (local SGD: at H=8), e.g. diloco=1.1 'diloco int8=1.2'")
    p.add_argument("--sync-every", help="pin the local-SGD period H of every row")
    for x, what in (("compute", "kappa: compute's slowdown beside a round"), ("comm", "lambda: communication's "
                    "slowdown beside compute"), ("outer-compute", "kappa beside an outer sync of local SGD")):
        p.add_argument(f"--overlap-{x}-factor", default=None if "outer" in x else "1.0",
                       help=f"{what}, >= 1 (default {'--overlap-compute-factor' if 'outer' in x else 1})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON only")
    return p


def _opt(args, name, **kw):
    value = getattr(args, name)
    return parse_count(value, "--" + name.replace("_", "-"), **kw) if value is not None else None


def layout_flags(args, nodes: int, k: int):
    """(tp, pp) as given (None: searched), refused by name when they cannot tile the ranks."""
    tp, pp = _opt(args, "tp", integer=True), _opt(args, "pp", integer=True)
    if tp is not None and tp > k:
        raise PlanError(f"--tp {tp} is more than --ranks-per-node {k}: tensor parallelism stays inside a node; "
                        f"use --tp {k} or less (and --pp for more)")
    mp = (tp or 1) * (pp or 1)
    if (nodes * k) % mp or (k % mp and mp % k):
        raise PlanError(f"tp x pp = {tp or 1} x {pp or 1} = {mp} does not divide the {nodes * k} ranks (--nodes "
                        f"{nodes} x --ranks-per-node {k}) into whole model copies (a divisor of {k} or a multiple "
                        f"of it): choose --tp and --pp whose product divides {nodes * k}")
    return tp, pp


def inputs_from(args) -> tuple:
    """(Inputs, gas, grad_accum_dtype, search options) from parsed flags; raises PlanError naming the bad one."""
    nodes = parse_count(args.nodes, "--nodes", integer=True)
    k = parse_count(args.ranks_per_node, "--ranks-per-node", integer=True)
    tp, pp = layout_flags(args, nodes, k)
    mfu = parse_count(args.mfu, "--mfu")
    if mfu > 1:
        raise PlanError(f"--mfu {args.mfu} must be a fraction in (0, 1], e.g. 0.4")
    try:
        latency = float(args.inter_latency_ms)
    except ValueError:
        latency = -1.0
    if not latency >= 0 or latency == float("inf"):
        raise PlanError(f"--inter-latency-ms {args.inter_latency_ms!r} must be a number of milliseconds >= 0")
    params = parse_count(args.params, "--params", integer=True)
    active = _opt(args, "active_params", integer=True)
    if active is not None and active > params:
        raise PlanError(f"--active-params {args.active_params} is more than --params {args.params}: a mixture of "
                        f"experts activates part of its parameters; give the total as --params and the active ones "
                        f"as --active-params")
    moe = active is not None and active < params
    # the config is judged at the layout given (a searched one: at tp 1 x pp 1), experts over a node's ranks
    cfg = read_config(args.config, Layout(world=nodes * k, ranks_per_node=k, tp=tp or 1, pp=pp or 1, moe=moe,
                                          ep_sizes=(k,) if moe and (tp or 1) * (pp or 1) == 1 else ())) \
        if args.config else None
    if args.compute_s is None and args.rank_flops is None:
        raise PlanError("give --rank-flops (peak FLOP/s of one rank, e.g. 989e12) or --compute-s (measured seconds "
                        "per step), or run with --measure inside a launch")
    kappa, lam, outer = (parse_count(getattr(args, f"overlap_{x}_factor"), f"--overlap-{x}-factor".replace("_", "-"),
                                     at_least=1.0, why="a slowdown, 1.0 is none; --measure measures it")
                         if getattr(args, f"overlap_{x}_factor") is not None else None
                         for x in ("compute", "comm", "outer_compute"))
    inp = pm.Inputs(params=params, tokens_per_step=parse_count(args.tokens_per_step, "--tokens-per-step"), nodes=nodes,
                    ranks_per_node=k, mfu=mfu, inter_bps=parse_bandwidth(args.inter_bandwidth, "--inter-bandwidth"),
                    inter_latency_s=latency / 1e3,
                    intra_bps=parse_bandwidth(args.intra_bandwidth, "--intra-bandwidth"),
                    dtype=args.dtype or (cfg["dtype"] if cfg else "bf16"),
                    rank_flops=parse_count(args.rank_flops, "--rank-flops", suffix="flops") if args.rank_flops else 0.0,
                    compute_s=_opt(args, "compute_s"), tokens=_opt(args, "tokens"),
                    micro_batches=cfg["gas"] if cfg else 1, token_factors=parse_factors(args.token_factor),
                    zero_stage=cfg["zero_stage"] if cfg else 1, overlap_compute=kappa, overlap_comm=lam,
                    overlap_outer_compute=outer, factor_source=args.token_factors or "auto",
                    active_params=active if active != params else None,
                    moe_top_k=parse_count(args.moe_top_k, "--moe-top-k", integer=True),
                    seq_len=_opt(args, "seq_len", integer=True), hidden=_opt(args, "hidden", integer=True),
                    layers=_opt(args, "layers", integer=True), heads=_opt(args, "heads", integer=True),
                    micro_batch=_opt(args, "micro_batch", integer=True) or (cfg["micro_batch"] if cfg else None),
                    recompute=args.recompute,
                    gpu_memory=parse_memory(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None)
    if not layouts(inp, tp, pp):
        raise PlanError(f"no tensor x pipeline layout tiles {nodes} x {k} ranks with --tp {tp} --pp {pp} "
                        f"(pipeline stages at most --layers): change --tp or --pp")
    search = {"sync_every": _opt(args, "sync_every", integer=True), "tp": tp, "pp": pp}
    return inp, (cfg["gas"] if cfg else 2), (cfg["grad_accum_dtype"] if cfg else None), search


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--measure" in argv:
        return measure_main(argv)
    p = parser()
    args = p.parse_args(argv)
    try:
        inp, gas, accum, search = inputs_from(args)
    except PlanError as err:
        p.error(str(err))
    result = plan(inp, gas, accum, **search)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


def _measured_inputs(argv, figures):
    from .measure import measured_flags
    inp, gas, accum, search = inputs_from(parser().parse_args(list(argv) + measured_flags(figures, argv)))
    inp.tensor_sizes, inp.micro_batches = figures.get("tensor_sizes"), figures["micro_batches"]
    return inp, gas, accum, search


def plan_measured(figures: dict, **flags) -> dict:
    """The plan with ``acco_ds.plan.measure.measure``'s figures; ``flags``: other flags by name
    (``tokens_per_step=4e6``, ``dtype="bf16"``, ``inter_bandwidth="10gbit"`` when one node)."""
    argv = [a for k, v in flags.items() if v is not None
            for a in (f"--{k.replace('_', '-')}", *map(str, v if isinstance(v, (list, tuple)) else [v]))]
    inp, gas, accum, search = _measured_inputs(argv, figures)
    return plan(inp, gas, accum, **search)


def measure_main(argv) -> int:
    """``--measure`` on every rank of a launch (``acco_ds.plan.measure``); rank 0 prints the plan."""
    import torch.distributed as dist
    from .measure import launch
    figures, rest, ours = launch(argv)
    code = 0
    try:  # on every rank, so that a bad flag stops all of them alike
        inp, gas, accum, search = _measured_inputs(rest, figures)
    except PlanError as err:
        code = 2
        if dist.get_rank() == 0:
            print(f"acco-ds plan --measure: error: {err}", file=sys.stderr)
    if code == 0 and dist.get_rank() == 0:
        result = dict(plan(inp, gas, accum, **search), measured=figures)
        print(json.dumps(result, indent=1) if "--json" in rest else table(result), flush=True)
        if ours.out:
            with open(ours.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return code
