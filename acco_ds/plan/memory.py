"""Memory per rank of a row at its layout: model states by ``acco_ds.memory.estimate_memory`` (the estimator of
``acco-ds memory``) on the shard one model-parallel rank holds, plus activations when the model's shape is known.

Activations per layer and micro-batch, 16-bit (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", arXiv 2205.05198, Table 2, tensor parallelism without sequence parallelism):
none s·b·h·(10 + 24/t + 5·a·s/(h·t)); selective s·b·h·(10 + 24/t); full (only each layer's input kept)
2·s·b·h. Under 1F1B the first stage holds L/p layers of min(p, m) micro-batches in flight.
"""

import math
from typing import Optional

from . import model as pm
from .layouts import micro_batches, shape

RECOMPUTE = ("none", "selective", "full")


def activation_bytes(inp: pm.Inputs) -> Optional[int]:
    """Activations on the busiest rank (the first pipeline stage), or None when the shape is not all known."""
    if None in (inp.seq_len, inp.hidden, inp.layers, inp.micro_batch):
        return None
    s, b, h, t = inp.seq_len, inp.micro_batch, inp.hidden, inp.tp
    a = inp.heads or max(1, h // 128)
    per_layer = {"none": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), "selective": s * b * h * (10 + 24 / t),
                 "full": 2 * s * b * h}[inp.recompute]
    in_flight = min(inp.pp, micro_batches(inp, shape(inp)))
    return int(per_layer * pm.DTYPE_BYTES[inp.dtype] / 2 * math.ceil(inp.layers / inp.pp) * in_flight)


def model_states(inp: pm.Inputs, m: pm.Mode, grad_accum_dtype=None, zero_stage: int = 1) -> int:
    """Model states per rank of row ``m`` (stock: ZeRO-1; ``zero_stage`` 0: every state on every rank, as
    plain data parallelism keeps them) on the shard of ``inp.tp`` × ``inp.pp``. MoE: the total parameters."""
    from ..memory import estimate_memory
    shard = -(-inp.params // (inp.tp * inp.pp))
    w, k, r = inp.dp_world, inp.dp_per_node, inp.dp_nodes
    if zero_stage == 0:
        return estimate_memory(params=shard, gpus=1, dtype=inp.dtype, grad_accum_dtype=grad_accum_dtype,
                               verbose=False)["stock_bytes"]
    mode = "acco" if m.mode == "zero1" else m.mode
    out = estimate_memory(params=shard, gpus=w, dtype=inp.dtype, grad_accum_dtype=grad_accum_dtype, mode=mode,
                          replica_group_size=k if m.sync_every else None, fragments=m.fragments,
                          # what "apply_to" auto compresses: what crosses nodes (local SGD: the outer all-reduce)
                          compression=({"dtype": m.compression, "apply_to": ["outer"] if m.sync_every else ["rounds"]}
                                       if m.compression else None),
                          nodes=r if 1 < r < w else None, verbose=False)
    return out["stock_bytes"] if m.mode == "zero1" else out["acco_bytes"]


def memory(inp: pm.Inputs, m: pm.Mode, grad_accum_dtype=None, zero_stage: int = 1) -> dict:
    """{"states", "activations" (None: shape unknown), "total", "fits" (True when no --gpu-memory)}."""
    states = model_states(inp, m, grad_accum_dtype, zero_stage)
    act = activation_bytes(inp)
    total = states + (act or 0)
    return {"states": states, "activations": act, "total": total,
            "fits": inp.gpu_memory is None or total <= inp.gpu_memory}
