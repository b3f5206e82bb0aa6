"""``acco-ds plan`` (or ``python -m acco_ds.plan``): which mode, which period, which compression, how fast.

    acco-ds plan --params 7e9 --tokens-per-step 4m --nodes 2 --ranks-per-node 8 --rank-flops 989e12 \\
                 --inter-bandwidth 10gbit [--inter-latency-ms 30] [--intra-bandwidth 400gbit] [--dtype bf16] \\
                 [--config ds_config.json] [--token-factor diloco=1.1 ...] [--tokens 140e9] [--json]

One row per candidate (stock ZeRO-1, sync, dpu, acco fixed and adaptive, diloco, Streaming DiLoCo, co2, edit,
A-EDiT, sparseloco; int8 where it applies; local SGD at the period the model finds best), sorted by the time
to the tokens = steps × seconds per step × token factor; the recommended row's ``"acco"`` block is printed
ready to paste. The model (``acco_ds.plan_model``) and its sources are in docs/plan.md. ``--measure`` (inside
a launch of the job: ``acco_ds.plan_measure``, ``measure_main``) replaces compute and link figures by measured ones.
"""

import argparse
import json
import re
import sys
from typing import Optional

from . import plan_model as pm

UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}


class PlanError(ValueError):
    """Bad input to the plan: the message names the flag and the fix."""


def parse_bandwidth(text: str, flag: str) -> float:
    """Bits per second from ``100mbit``, ``1gbit``, ``400gbit``, ``10gbps`` or a bare number of bits/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]*)\s*", str(text).lower())
    if not m:
        raise PlanError(f"{flag} {text!r} is not a bandwidth: write bits per second such as 100mbit, 1gbit, 400gbit")
    unit = m.group(2) or "bit"
    if unit not in UNITS:
        raise PlanError(f"{flag} {text!r}: unknown unit {m.group(2)!r}. Bandwidths are bits per second: write "
                        f"100mbit, 1gbit, 400gbit (units: {', '.join(UNITS)}), or a bare number of bits/s; "
                        f"bytes per second (GB/s) are not accepted, multiply them by 8")
    value = float(m.group(1)) * UNITS[unit]
    if value <= 0:
        raise PlanError(f"{flag} {text!r} must be positive (a link that carries nothing cannot be planned)")
    return value


def parse_count(text: str, flag: str, integer: bool = False, suffix: str = "", at_least=None, why="") -> float:
    """A positive count such as 7e9, 7b, 1.3B, 4m, 989e12, 989tflops (and >= ``at_least``, ``why`` says why)."""
    t = str(text).strip().lower()
    if suffix and t.endswith(suffix):
        t = t[:-len(suffix)]
    m = re.fullmatch(r"([-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([kmbgtp]?)", t)
    if not m:
        raise PlanError(f"{flag} {text!r} is not a number: write e.g. 7e9 or 7b (suffixes k, m, b/g, t, p)")
    value = float(m.group(1)) * SCALE[m.group(2)]
    if value <= 0:
        raise PlanError(f"{flag} must be positive, got {text!r}")
    if integer and value != int(value):
        raise PlanError(f"{flag} must be a whole number, got {text!r}")
    if at_least is not None and value < at_least:
        raise PlanError(f"{flag} {text!r} must be >= {at_least:g} ({why})")
    return int(value) if integer else value


def parse_factors(items) -> dict:
    out = {}
    for item in items or []:
        name, _, value = item.partition("=")
        name = name.strip().replace("_", " ")
        if name not in pm.TOKEN_FACTORS:
            raise PlanError(f"--token-factor {item!r}: unknown mode {name!r}. Known: {', '.join(pm.TOKEN_FACTORS)} "
                            f"(local-SGD factors are at H={pm.REFERENCE_H})")
        try:
            out[name] = float(value)
        except ValueError:
            raise PlanError(f"--token-factor {item!r}: write NAME=FACTOR, e.g. diloco=1.1") from None
        if out[name] <= 0:
            raise PlanError(f"--token-factor {item!r}: the factor must be positive")
    return out


def read_config(path: str, world: int) -> dict:
    """Micro-batch, accumulation, ZeRO stage, dtypes and the ``"acco"`` block of a DeepSpeed config, checked
    by DeepSpeed's own config model and acco_ds's validation (what ``initialize`` would refuse, refused)."""
    from .config import host_problems, parse_acco_config
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as err:
        raise PlanError(f"--config {path}: cannot read it as JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"--config {path}: a DeepSpeed config is a JSON object, got {type(cfg).__name__}")
    micro = cfg.get("train_micro_batch_size_per_gpu")
    gas = cfg.get("gradient_accumulation_steps", 1)
    tbs = cfg.get("train_batch_size")
    if tbs is not None and micro is not None and tbs != micro * gas * world:  # DeepSpeed's batch rule
        raise PlanError(f"--config {path}: train_batch_size {tbs} != train_micro_batch_size_per_gpu {micro} x "
                        f"gradient_accumulation_steps {gas} x world size {world} (--nodes x --ranks-per-node), "
                        f"which DeepSpeed refuses: fix the batch sizes or the world size")
    try:
        from .deepspeed.compat import DeepSpeedConfig
        body = {k: v for k, v in cfg.items() if k not in ("train_batch_size", "acco")}
        if micro is None and tbs is not None:
            body["train_micro_batch_size_per_gpu"] = max(1, tbs // (gas * world))
        ds = DeepSpeedConfig(body)  # world size 1 here: the batch rule above is checked at the plan's world size
        acco = parse_acco_config(cfg)
    except Exception as err:  # noqa: BLE001 - DeepSpeed raises assorted types for a bad config
        raise PlanError(f"--config {path} is refused: {err}") from None
    problems = host_problems(acco, int(ds.gradient_accumulation_steps), world, world) if acco.enabled else []
    if problems:
        raise PlanError(f"--config {path} is refused:\n  - " + "\n  - ".join(problems))
    dt = "bf16" if ds.bfloat16_config.enabled else "fp16" if ds.float16_config.enabled else "fp32"
    return {"micro_batch": int(ds.train_micro_batch_size_per_gpu), "gas": int(ds.gradient_accumulation_steps),
            "zero_stage": int(ds.zero_optimization_stage), "dtype": dt, "acco": cfg.get("acco"), "parsed": acco,
            "grad_accum_dtype": (cfg.get("data_types") or {}).get("grad_accum_dtype")}


def acco_block(m: pm.Mode, inp: pm.Inputs, fig: dict) -> dict:
    """The ``"acco"`` block of a row, ready to paste into the DeepSpeed config."""
    if m.mode == "zero1":
        return {"enabled": False}
    block = {"enabled": True, "mode": m.mode}
    if m.mode == "acco":
        block["accumulation"] = m.accumulation
    if m.sync_every is not None:
        ls = {"sync_every": m.sync_every, "replica_group_size": inp.ranks_per_node}
        if m.timed:  # A-EDiT: the same period in seconds of wall time
            del ls["sync_every"]
            ls["sync_time_s"] = round(m.sync_every * fig["step_s"], 3)
        if m.fragments > 1 or m.delay:
            ls.update(fragments=m.fragments, fragment_sync_delay=m.delay, fragment_update_alpha=0.5)
        if m.mode == "sparseloco":
            ls.update(m.sparse)
        block["local_sgd"] = ls
    if m.compression:
        block["compression"] = {"dtype": m.compression}
    return block


def check_block(block: dict, gas: int, world: int) -> Optional[str]:
    """Why acco_ds would refuse the block (None: it would run)."""
    from .config import host_problems, parse_acco_config
    try:
        acco = parse_acco_config({"acco": block})
    except ValueError as err:
        return str(err)
    problems = host_problems(acco, gas, world, world) if acco.enabled else []
    return "; ".join(problems) or None


def memory_bytes(m: pm.Mode, inp: pm.Inputs, grad_accum_dtype=None) -> int:
    """Model states per rank by ``acco_ds.memory.estimate_memory``."""
    from .memory import estimate_memory
    k, w = inp.ranks_per_node, inp.world
    mode = "acco" if m.mode == "zero1" else m.mode
    out = estimate_memory(params=inp.params, gpus=w, dtype=inp.dtype, grad_accum_dtype=grad_accum_dtype, mode=mode,
                          replica_group_size=k if m.sync_every else None, fragments=m.fragments,
                          # what "apply_to" auto compresses: what crosses nodes (local SGD: the outer all-reduce)
                          compression=({"dtype": m.compression, "apply_to": ["outer"] if m.sync_every else ["rounds"]}
                                       if m.compression else None),
                          nodes=inp.nodes if 1 < inp.nodes < w else None, verbose=False)
    if m.mode == "zero1":
        return out["stock_bytes"]
    return out["acco_bytes"]


def plan(inp: pm.Inputs, gas: int = 1, grad_accum_dtype=None, sparse: bool = True) -> dict:
    """The plan as ``--json`` prints it: inputs, recommended row name, one dict per row."""
    rows = pm.best(inp, pm.candidates(inp, sparse))
    out = []
    for m, fig in rows:
        block = acco_block(m, inp, fig)
        refused = check_block(block, gas, inp.world)
        out.append({"name": m.name, "mode": m.mode, "acco": block, "sync_every": m.sync_every, **{k: fig[k] for k in (
                        "compute_s", "step_s", "exposed_comm_s", "compute_utilization", "inter_bytes_per_step",
                        "inter_bytes_per_sync", "peak_burst_bytes")},
                    "memory_per_rank_bytes": memory_bytes(m, inp, grad_accum_dtype),
                    "token_factor": fig["token_factor"], "token_factor_source": fig["token_factor_source"],
                    "time_to_tokens_s": fig["time_to_tokens_s"], "refused": refused})
    usable = [(m, f) for (m, f), row in zip(rows, out) if row["refused"] is None]
    inputs = {k: v for k, v in vars(inp).items() if k != "tensor_sizes"}
    inputs.update(world=inp.world, compute_s=pm.compute_seconds(inp), total_tokens=inp.total_tokens)
    notes = [] if inp.zero_stage == 1 else [
        f'your config has ZeRO stage {inp.zero_stage}: acco_ds runs on stage 1 (set "zero_optimization": '
        f'{{"stage": 1}} with an enabled "acco" block), and the zero1 row models stage 1']
    return {"inputs": inputs, "recommended": pm.recommend(usable), "modes": out, "notes": notes}


def table(result: dict) -> str:
    """The plan as text: one line per row, then the recommended block."""
    inp = result["inputs"]
    stock = next(r for r in result["modes"] if r["name"] == "zero1")["time_to_tokens_s"]
    lines = [f"acco-ds plan: {inp['params'] / 1e9:.3g}B params, {inp['nodes']} node(s) x {inp['ranks_per_node']} "
             f"ranks, {inp['tokens_per_step']:.4g} tokens/step, {inp['total_tokens']:.4g} tokens, {inp['dtype']}, "
             f"inter {inp['inter_bps'] / 1e9:g} Gbit/s + {inp['inter_latency_s'] * 1e3:g} ms, intra "
             f"{inp['intra_bps'] / 1e9:g} Gbit/s, compute {inp['compute_s']:.4g} s/step, overlap slowdown "
             f"(kappa, lambda, outer kappa) {inp['overlap_compute']:.3g}, {inp['overlap_comm']:.3g}, "
             f"{inp['overlap_outer_compute'] or inp['overlap_compute']:.3g}",
             f"{'mode':<20}{'H':>5}{'step s':>9}{'exposed':>9}{'util':>6}{'MB/step':>10}{'MB/sync':>10}"
             f"{'peak MB':>10}{'GB/rank':>8}{'tokens x':>9}{'to tokens':>11}{'vs zero1':>9}"]
    for r in result["modes"]:
        mark = "*" if r["name"] == result["recommended"] else "!" if r["refused"] else " "
        h = r["sync_every"] or "-"
        if r["acco"].get("local_sgd", {}).get("fragments"):
            h = f"{h}/{r['acco']['local_sgd']['fragments']}"
        lines.append(f"{mark}{r['name']:<19}{h:>5}{r['step_s']:9.3g}{r['exposed_comm_s']:9.3g}"
                     f"{100 * r['compute_utilization']:5.0f}% {r['inter_bytes_per_step'] / 1e6:9.4g}"
                     f" {r['inter_bytes_per_sync'] / 1e6:9.4g} {r['peak_burst_bytes'] / 1e6:9.4g}"
                     f" {r['memory_per_rank_bytes'] / 1e9:7.3g} {r['token_factor']:8.3g}"
                     f"{_duration(r['time_to_tokens_s']):>11}{r['time_to_tokens_s'] / stock:8.2f}x")
    rec = next(r for r in result["modes"] if r["name"] == result["recommended"])
    lines += ["", "H: local-SGD period (/F: Streaming DiLoCo fragments); MB: bytes a node sends across its link; "
              "tokens x: token factor (tokens to a target / stock's); '!': acco_ds refuses that block here.",
              "int8 rows: fp8 (\"dtype\": \"fp8\") sends the same bytes. Token factors:"]
    lines += [f"  {r['name']:<19} {r['token_factor']:.3g}: {r['token_factor_source']}" for r in result["modes"]]
    lines += ["", f"recommended: {rec['name']} ({_duration(rec['time_to_tokens_s'])}, "
              f"{rec['time_to_tokens_s'] / stock:.2f}x stock ZeRO-1's time). Paste into the DeepSpeed config:",
              json.dumps({"acco": rec["acco"]})]
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)


def _duration(s: float) -> str:
    return f"{s / 86400:.2f} d" if s >= 86400 else f"{s / 3600:.2f} h" if s >= 3600 else f"{s:.1f} s"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="acco-ds plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--params", required=True, help="parameters N, e.g. 7e9 or 7b")
    p.add_argument("--tokens-per-step", required=True, help="tokens per optimizer step, all ranks (e.g. 4m)")
    p.add_argument("--nodes", required=True, help="R: nodes (sites), each behind one inter-node link")
    p.add_argument("--ranks-per-node", required=True, help="k: data-parallel ranks per node")
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
    p.add_argument("--token-factor", nargs="+", action="extend", default=[], metavar="MODE=F",
                   help="override a token factor (local SGD: at H=8), e.g. diloco=1.1 'diloco int8=1.2'")
    for x, what in (("compute", "kappa: compute's slowdown beside a round"), ("comm", "lambda: communication's "
                    "slowdown beside compute"), ("outer-compute", "kappa beside an outer sync of local SGD")):
        p.add_argument(f"--overlap-{x}-factor", default=None if "outer" in x else "1.0",
                       help=f"{what}, >= 1 (default {'--overlap-compute-factor' if 'outer' in x else 1})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON only")
    return p


def inputs_from(args) -> tuple:
    """(Inputs, gas, grad_accum_dtype) from parsed flags; raises PlanError naming the bad one."""
    nodes = parse_count(args.nodes, "--nodes", integer=True)
    k = parse_count(args.ranks_per_node, "--ranks-per-node", integer=True)
    mfu = parse_count(args.mfu, "--mfu")
    if mfu > 1:
        raise PlanError(f"--mfu {args.mfu} must be a fraction in (0, 1], e.g. 0.4")
    try:
        latency = float(args.inter_latency_ms)
    except ValueError:
        latency = -1.0
    if not latency >= 0 or latency == float("inf"):
        raise PlanError(f"--inter-latency-ms {args.inter_latency_ms!r} must be a number of milliseconds >= 0")
    cfg = read_config(args.config, nodes * k) if args.config else None
    if args.compute_s is None and args.rank_flops is None:
        raise PlanError("give --rank-flops (peak FLOP/s of one rank, e.g. 989e12) or --compute-s (measured seconds "
                        "per step), or run with --measure inside a launch")
    kappa, lam, outer = (parse_count(getattr(args, f"overlap_{x}_factor"), f"--overlap-{x}-factor".replace("_", "-"),
                                     at_least=1.0, why="a slowdown, 1.0 is none; --measure measures it")
                         if getattr(args, f"overlap_{x}_factor") is not None else None
                         for x in ("compute", "comm", "outer_compute"))
    inp = pm.Inputs(params=parse_count(args.params, "--params", integer=True),
                    tokens_per_step=parse_count(args.tokens_per_step, "--tokens-per-step"), nodes=nodes,
                    ranks_per_node=k, mfu=mfu, inter_bps=parse_bandwidth(args.inter_bandwidth, "--inter-bandwidth"),
                    inter_latency_s=latency / 1e3,
                    intra_bps=parse_bandwidth(args.intra_bandwidth, "--intra-bandwidth"),
                    dtype=args.dtype or (cfg["dtype"] if cfg else "bf16"),
                    rank_flops=parse_count(args.rank_flops, "--rank-flops", suffix="flops") if args.rank_flops else 0.0,
                    compute_s=parse_count(args.compute_s, "--compute-s") if args.compute_s else None,
                    tokens=parse_count(args.tokens, "--tokens") if args.tokens else None,
                    micro_batches=cfg["gas"] if cfg else 1, token_factors=parse_factors(args.token_factor),
                    zero_stage=cfg["zero_stage"] if cfg else 1, overlap_compute=kappa, overlap_comm=lam,
                    overlap_outer_compute=outer)
    return inp, (cfg["gas"] if cfg else 2), (cfg["grad_accum_dtype"] if cfg else None)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--measure" in argv:
        return measure_main(argv)
    p = parser()
    args = p.parse_args(argv)
    try:
        inp, gas, accum = inputs_from(args)
    except PlanError as err:
        p.error(str(err))
    result = plan(inp, gas, accum)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


def _measured_inputs(argv, figures):
    from .plan_measure import measured_flags
    inp, gas, accum = inputs_from(parser().parse_args(list(argv) + measured_flags(figures, argv)))
    inp.tensor_sizes, inp.micro_batches = figures.get("tensor_sizes"), figures["micro_batches"]
    return inp, gas, accum


def plan_measured(figures: dict, **flags) -> dict:
    """The plan with ``acco_ds.plan_measure.measure``'s figures; ``flags``: other flags by name
    (``tokens_per_step=4e6``, ``dtype="bf16"``, ``inter_bandwidth="10gbit"`` when one node)."""
    argv = [a for k, v in flags.items() if v is not None
            for a in (f"--{k.replace('_', '-')}", *map(str, v if isinstance(v, (list, tuple)) else [v]))]
    return plan(*_measured_inputs(argv, figures))


def measure_main(argv) -> int:
    """``--measure`` on every rank of a launch (``acco_ds.plan_measure``); rank 0 prints the plan."""
    import torch.distributed as dist
    from .plan_measure import launch
    figures, rest, ours = launch(argv)
    code = 0
    try:  # on every rank, so that a bad flag stops all of them alike
        inp, gas, accum = _measured_inputs(rest, figures)
    except PlanError as err:
        code = 2
        if dist.get_rank() == 0:
            print(f"acco-ds plan --measure: error: {err}", file=sys.stderr)
    if code == 0 and dist.get_rank() == 0:
        result = dict(plan(inp, gas, accum), measured=figures)
        print(json.dumps(result, indent=1) if "--json" in rest else table(result), flush=True)
        if ours.out:
            with open(ours.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
