"""The plan as data and as text: one row per mode at its best layout and period, the recommended row's
``"acco"`` block ready to paste, and the notes that say what the plan assumed."""

import json
from typing import Callable, Optional

from ..config.rulebook import Layout
from . import model as pm
from .factors import choice
from .layouts import expert_parallel, is_moe, search, shape
from .memory import memory


def acco_block(m: pm.Mode, inp: pm.Inputs, fig: dict) -> dict:
    """The ``"acco"`` block of a row, ready to paste into the DeepSpeed config (``inp``: at the row's layout)."""
    if m.mode == "zero1":
        return {"enabled": False}
    block = {"enabled": True, "mode": m.mode}
    if m.mode == "acco":
        block["accumulation"] = m.accumulation
    if m.sync_every is not None:
        ls = {"sync_every": m.sync_every, "replica_group_size": inp.dp_per_node}
        if m.timed:  # A-EDiT: the same period in seconds of wall time
            del ls["sync_every"]
            ls["sync_time_s"] = float(f"{m.sync_every * fig['step_s']:.4g}")  # never rounded to 0
        if m.mode == "sparseloco":
            ls.update(m.sparse, **({"overlap": m.delay} if m.delay else {}))
        elif m.fragments > 1 or m.delay:
            ls.update(fragments=m.fragments, fragment_sync_delay=m.delay, fragment_update_alpha=0.5)
        block["local_sgd"] = ls
    if m.compression:
        block["compression"] = {"dtype": m.compression}
    return block


def row_layout(m: pm.Mode, inp: pm.Inputs, fig: dict, gas: int) -> Layout:
    """The rulebook's layout of a row: the whole fleet, tp x pp, experts over a node's data-parallel ranks, the
    micro-batches per step the time model gives the layout (else the config's)."""
    moe = is_moe(inp)
    return Layout(world=inp.world, ranks_per_node=inp.ranks_per_node, tp=inp.tp, pp=inp.pp, moe=moe,
                  ep_sizes=(expert_parallel(inp),) if moe else (), micro_batches=fig.get("micro_batches") or gas)


def judge(gas: int) -> Callable:
    """``judge(mode, inputs, fig)``: why ``initialize`` would refuse the row's block at its layout (None: it
    runs), in the rulebook's words."""
    from ..config import parse_acco_config, refusals

    def refused(m: pm.Mode, inp: pm.Inputs, fig: dict) -> Optional[str]:
        if m.mode == "zero1":
            return None
        try:
            acco = parse_acco_config({"acco": acco_block(m, inp, fig)})
        except ValueError as err:
            return str(err)
        return "; ".join(refusals(acco, row_layout(m, inp, fig, gas))) or None
    return refused


KEYS = ("compute_s", "step_s", "exposed_comm_s", "layout_s", "compute_utilization", "inter_bytes_per_step",
        "inter_bytes_per_sync", "peak_burst_bytes")


def plan(inp: pm.Inputs, gas: int = 1, grad_accum_dtype=None, sparse: bool = True, sync_every=None,
         tp=None, pp=None) -> dict:
    """The plan as ``--json`` prints it: inputs, recommended row name (None: nothing fits or runs), rows."""
    rows = search(inp, lambda m, li: memory(li, m, grad_accum_dtype), judge(gas), sparse, sync_every, tp, pp)
    out = []
    for e in rows:
        m, fig, li, mem = e["mode"], e["fig"], e["inputs"], e["memory"]
        out.append({"name": m.name, "mode": m.mode, "acco": acco_block(m, li, fig), "sync_every": m.sync_every,
                    "tp": li.tp, "pp": li.pp, "data_parallel": li.dp_world,
                    "gradient_accumulation_steps": row_layout(m, li, fig, gas).micro_batches, **{k: fig[k] for k in KEYS},
                    "memory_per_rank_bytes": mem["total"], "model_states_bytes": mem["states"],
                    "activation_bytes": mem["activations"], "fits": mem["fits"],
                    "token_factor": fig["token_factor"], "token_factor_source": fig["token_factor_source"],
                    "time_to_tokens_s": fig["time_to_tokens_s"], "refused": e["refused"]})
    usable = [(e["mode"], e["fig"]) for e, row in zip(rows, out) if row["refused"] is None and row["fits"]]
    inputs = {k: v for k, v in vars(inp).items() if k != "tensor_sizes"}
    sh = shape(inp)
    inputs.update(world=inp.world, compute_s=pm.compute_seconds(inp), total_tokens=inp.total_tokens,
                  token_factors_from=choice(inp), active_params=inp.active_params or inp.params,
                  model_shape={k: sh[k] for k in ("hidden", "layers", "seq_len", "micro_batch")},
                  model_shape_assumed=sh["assumed"])
    return {"inputs": inputs, "recommended": pm.recommend(usable) if usable else None, "modes": out,
            "notes": notes(inp, out, usable)}


def notes(inp: pm.Inputs, rows: list, usable: list) -> list:
    out = []
    if inp.zero_stage != 1:
        out.append(f'your config has ZeRO stage {inp.zero_stage}: acco_ds runs on stage 1 (set "zero_optimization": '
                   f'{{"stage": 1}} with an enabled "acco" block), and the zero1 row models stage 1')
    if inp.gpu_memory is None:
        out.append("no --gpu-memory: memory is not checked (every row fits); give e.g. --gpu-memory 80gb")
    elif rows and rows[0]["activation_bytes"] is None:
        out.append("activations not counted (give --seq-len, --hidden, --layers and --micro-batch, or "
                   "train_micro_batch_size_per_gpu in --config): a row fits when its model states fit")
    if not usable:
        out.append(nothing_usable(inp, rows))
    assumed = shape(inp)["assumed"]
    if assumed and any(r["tp"] * r["pp"] > 1 for r in rows):
        out.append(f"tensor/pipeline traffic and the bubble use an assumed {', '.join(assumed)} (hidden/layers = "
                   f"128, N = 12 L h^2, seq 2048, micro-batch 1): give --hidden, --layers, --seq-len, --micro-batch")
    if choice(inp) == "measured" and inp.params >= 100e6:
        out.append("token factors: measured on a 0.84M model (--token-factors measured); the papers' are the "
                   "default from 100M parameters up")
    return out


def nothing_usable(inp: pm.Inputs, rows: list) -> str:
    """Why no row is recommended: every row that fits is refused (by which rule), or nothing fits."""
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        why = sorted({r["refused"] for r in fitting})
        return (f"no row is recommended: acco_ds refuses every row that fits at its layout ({len(why)} reason(s): "
                + " | ".join(why) + "); change --tp/--pp or the fleet")
    least = min(rows, key=lambda r: r["memory_per_rank_bytes"])
    return (f"nothing fits in {inp.gpu_memory / 1e9:.4g} GB per rank: the least memory is "
            f"{least['memory_per_rank_bytes'] / 1e9:.4g} GB ({least['name']} at tp {least['tp']} x pp {least['pp']}); "
            f"add ranks, a larger --gpu-memory, or activation recomputation; no row is recommended")


def table(result: dict) -> str:
    """The plan as text: one line per row, then the recommended block."""
    inp = result["inputs"]
    stock = next(r for r in result["modes"] if r["name"] == "zero1")["time_to_tokens_s"]
    mem = f"{inp['gpu_memory'] / 1e9:g} GB" if inp["gpu_memory"] else "not checked"
    sh = inp["model_shape"]
    lines = [f"acco-ds plan: {inp['params'] / 1e9:.3g}B params ({inp['active_params'] / 1e9:.3g}B active), "
             f"{inp['nodes']} node(s) x {inp['ranks_per_node']} ranks, {inp['tokens_per_step']:.4g} tokens/step, "
             f"{inp['total_tokens']:.4g} tokens, {inp['dtype']}, memory per rank {mem}, inter "
             f"{inp['inter_bps'] / 1e9:g} Gbit/s + {inp['inter_latency_s'] * 1e3:g} ms, intra "
             f"{inp['intra_bps'] / 1e9:g} Gbit/s, compute {inp['compute_s']:.4g} s/step, shape h {sh['hidden']:.0f} "
             f"L {sh['layers']} seq {sh['seq_len']} micro-batch {sh['micro_batch']}, recompute {inp['recompute']}, "
             f"token factors: {inp['token_factors_from']}, overlap slowdown (kappa, lambda, outer kappa) "
             f"{inp['overlap_compute']:.3g}, {inp['overlap_comm']:.3g}, "
             f"{inp['overlap_outer_compute'] or inp['overlap_compute']:.3g}",
             f"{'mode':<20}{'tp':>3}{'pp':>4}{'H':>5}{'step s':>9}{'exposed':>9}{'util':>6}{'MB/step':>10}"
             f"{'MB/sync':>10}{'GB/rank':>8}{'tokens x':>9}{'to tokens':>11}{'vs zero1':>9}"]
    for r in result["modes"]:
        mark = "*" if r["name"] == result["recommended"] else "!" if r["refused"] else "x" if not r["fits"] else " "
        h = r["sync_every"] or "-"
        if r["acco"].get("local_sgd", {}).get("fragments"):
            h = f"{h}/{r['acco']['local_sgd']['fragments']}"
        lines.append(f"{mark}{r['name']:<19}{r['tp']:>3}{r['pp']:>4}{h:>5}{r['step_s']:9.3g}{r['exposed_comm_s']:9.3g}"
                     f"{100 * r['compute_utilization']:5.0f}% {r['inter_bytes_per_step'] / 1e6:9.4g}"
                     f" {r['inter_bytes_per_sync'] / 1e6:9.4g} {r['memory_per_rank_bytes'] / 1e9:7.3g}"
                     f" {r['token_factor']:8.3g}{_duration(r['time_to_tokens_s']):>11}"
                     f"{r['time_to_tokens_s'] / stock:8.2f}x")
    lines += ["", "tp, pp: the layout; H: local-SGD period (/F: Streaming DiLoCo fragments); MB: bytes a node sends "
              "across its link; GB/rank: model states + activations; tokens x: token factor (tokens to a target / "
              "stock's); '!': acco_ds refuses that block here; 'x': does not fit in memory.",
              "int8 rows: fp8 (\"dtype\": \"fp8\") sends the same bytes. Token factors:"]
    lines += [f"  {r['name']:<19} {r['token_factor']:.3g}: {r['token_factor_source']}" for r in result["modes"]]
    refused = [r for r in result["modes"] if r["refused"]]
    if refused:
        lines += ["Refused by acco_ds at their layout ('!'), in initialize's words:"]
        lines += [f"  {r['name']:<19} tp {r['tp']} x pp {r['pp']}: {r['refused']}" for r in refused]
    rec = next((r for r in result["modes"] if r["name"] == result["recommended"]), None)
    if rec is None:
        lines += ["", "recommended: none (nothing fits, see the notes)"]
    else:
        lines += ["", f"recommended: {rec['name']} at tp {rec['tp']} x pp {rec['pp']} ({rec['data_parallel']} "
                  f"data-parallel ranks; {_duration(rec['time_to_tokens_s'])}, {rec['time_to_tokens_s'] / stock:.2f}x "
                  f"stock ZeRO-1's time). Paste into the DeepSpeed config:", json.dumps({"acco": rec["acco"]})]
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)


def _duration(s: float) -> str:
    return f"{s / 86400:.2f} d" if s >= 86400 else f"{s / 3600:.2f} h" if s >= 3600 else f"{s:.1f} s"
