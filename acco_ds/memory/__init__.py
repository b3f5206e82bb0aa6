"""Model-state memory per rank: stock DeepSpeed ZeRO-1 against ACCO.

In the spirit of DeepSpeed's ``estimate_zero2_model_states_mem_needs_all_live``::

    import acco_ds
    acco_ds.estimate_memory(params=7e9, gpus=8, dtype="bf16")
    acco_ds.estimate_memory(model, gpus=8, dtype="bf16", grad_accum_dtype="fp32")

or from a shell: ``acco-ds memory --params 7e9 --gpus 8 --dtype bf16``.

Per rank, N parameters, W ranks, b/a/c bytes per element of the model,
gradient-accumulation and communication dtypes, Adam:

    stock ZeRO-1   bN weights + aN gradients + 16N/W (fp32 master, m, v, fp32 gradient partition)
    ACCO           bN weights + aN accumulator + max(c, b)N communication buffer
                   + 12N/W (fp32 master, m, v) + 4N/W (fp32 gradient shard)
                   + cN/W (the estimate round's kept shard, acco mode only)
                   + cN/W (reduce-scatter output, only when c is not fp32)
    ACCO sync,     the same without the communication buffer (nothing overlaps: the reduce-scatter reads
    local-SGD      the accumulator, the all-gather writes the parameters), or cN for a cast when a != c;
                   local-SGD modes count it over their replica group of k ranks, plus the outer state

The ACCO buffer terms come from ``buffers.plan_bytes``, the same function
the engine allocates by, and the tests check the two against each other.
Activations, temporary buffers and the framework's own memory come on top.
"""

from typing import Optional, Union

import torch

from ..algorithms.rounds import keeps_shard, overlaps
from ..config import CompressionConfig
from ..runtime.comm.compression import residual_dtype
from ..runtime.dtypes import as_dtype as _dtype
from ..runtime.dtypes import size as _size
from ..runtime.rounds.buffers import RoundCompression, padded_numel, plan_bytes


def round_compression(compression: Optional[dict], peers: int) -> Optional[RoundCompression]:
    """The buffers' ``RoundCompression`` for an ``acco.compression`` block (a dict) whose rounds are
    compressed over ``peers`` ranks (the group, or the nodes of a node-aware layout), else None."""
    c = CompressionConfig(**(compression or {}))
    if not c.applies_to("rounds") or peers < 2:
        return None
    return RoundCompression(peers, residual_dtype(c))


def acco_buffer_bytes(numel: int, world_size: int, dtype="bf16", grad_accum_dtype=None,
                      communication_data_type=None, mode: str = "acco", compression: Optional[dict] = None,
                      nodes: Optional[int] = None) -> int:
    """Bytes ACCO allocates for one flat group of ``numel`` (padded) elements in ``mode``; ``compression``:
    the ``acco.compression`` block, ``nodes``: the nodes of a node-aware layout (None: flat)."""
    model = _dtype(dtype)
    accum = _dtype(grad_accum_dtype) if grad_accum_dtype is not None else model
    comm = _dtype(communication_data_type) if communication_data_type is not None else model
    return sum(plan_bytes(numel, numel // world_size, model, accum, comm, keep_shard=keeps_shard(mode),
                          overlap=overlaps(mode),
                          compression=round_compression(compression, nodes or world_size)).values())


def outer_residual_bytes(numel: int, group_size: int, replicas: int, compression: Optional[dict]) -> int:
    """Local-SGD modes with a compressed outer all-reduce: the residuals of its reduce-scatter and
    all-gather, about one fp32 (or bf16) shard of ``numel / group_size`` elements."""
    c = CompressionConfig(**(compression or {}))
    dtype = residual_dtype(c)
    if not c.applies_to("outer") or dtype is None:
        return 0
    shard = numel // group_size
    return replicas * -(-shard // replicas) * _size(dtype)


def outer_state_bytes(numel: int, group_size: int, mode: str, fragments: int = 1, overlap: int = 0) -> int:
    """Local-SGD modes: fp32 shards of the anchor and outer momentum (``co2``: also the period start and the
    in-flight pseudo-gradient; ``sparseloco``: the anchor and the error-feedback buffer, no momentum), plus the
    pseudo-gradient computed at a sync (``edit`` keeps that one: its outer step runs during the next forward;
    Streaming DiLoCo with F ``fragments``: one fragment's, 1/F; ``sparseloco``: the averaged update).
    ``sparseloco`` with ``overlap`` > 0 (``local_sgd.overlap``): while the gather is in flight each rank also
    keeps its weights at the sync (``runtime/outer/sparse_overlap.py``, θ_sent), one more fp32 shard, held
    beside the average when it lands."""
    shards = 2 + (2 if mode == "co2" else 0) + (1 if mode == "sparseloco" and overlap > 0 else 0)
    return shards * 4 * numel // group_size + 4 * numel // group_size // fragments


LOCAL = ("diloco", "co2", "edit", "sparseloco")  # modes that shard ZeRO-1 over a replica group


def estimate_memory(model: Optional[torch.nn.Module] = None, *, params: Union[int, float, None] = None, gpus: int = 1,
                    dtype="bf16", grad_accum_dtype=None, communication_data_type=None, mode: str = "acco",
                    replica_group_size: Optional[int] = None, fragments: int = 1, compression: Optional[dict] = None,
                    nodes: Optional[int] = None, overlap: int = 0, budget_gb: float = 80.0, verbose: bool = True,
                    expert_params: Union[int, float] = 0, ep_size: int = 1) -> dict:
    """Model-state bytes per rank for stock ZeRO-1 and ACCO.

    Args:
        model: a module (its trainable parameters are counted), or
        params: a parameter count.
        gpus: data-parallel world size W.
        dtype: model dtype (``fp32``, ``bf16``, ``fp16``): DeepSpeed's ``bf16``/``fp16`` blocks.
        grad_accum_dtype: DeepSpeed's ``data_types.grad_accum_dtype`` (default: the model dtype).
        communication_data_type: DeepSpeed's ``communication_data_type`` (default: the model dtype).
        mode: ``acco`` keeps the estimate round's reduced shard (cN/W more than ``dpu``/``sync``);
            ``diloco``/``co2``/``edit``/``sparseloco`` shard ZeRO-1 over a replica group of ``replica_group_size``
            ranks (k) and add the outer state: 8N/k bytes (``co2``: 16N/k; ``sparseloco``: the anchor and the
            fp32 error-feedback buffer) plus 4N/k at a sync.
        compression: the ``acco.compression`` block (a dict): compressed rounds add the error-feedback
            residuals of the reduce-scatter, (P-1)N/W elements (P: ranks of the quantized step, W, or the
            ``nodes`` of a node-aware layout), plus an fp32 kept shard and, without overlap, a target shard;
            a compressed outer all-reduce adds about N/k residual elements.
        nodes: nodes of a node-aware layout (None: flat collectives).
        fragments: ``diloco`` with Streaming DiLoCo's ``local_sgd.fragments``: the pseudo-gradient in flight
            is one fragment's (4N/(kF) instead of 4N/k).
        overlap: ``sparseloco`` with ``local_sgd.overlap`` > 0: the weights at the sync kept while the gather
            is in flight, 4N/k more.
        budget_gb: printed beside the figures (fits / does not fit).
        expert_params: mixture of experts: how many of the parameters are experts' (all experts of every MoE
            layer, N_e; the rest are dense). Each rank holds N_e / ``ep_size`` of them, partitioned over the
            W / ``ep_size`` ranks that hold the same experts (k / ``ep_size`` inside a local-SGD replica), flat.
            With ``model``: its expert parameters (DeepSpeed marks them ``allreduce=False``) are this rank's
            share, times ``ep_size``.

    Returns a dict with ``stock_bytes``, ``acco_bytes``, ``extra_bytes`` and the inputs.
    """
    if (model is None) == (params is None):
        raise ValueError("estimate_memory needs exactly one of model= or params=")
    n = sum(p.numel() for p in model.parameters() if p.requires_grad) if model is not None else int(params)
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if overlap < 0 or (overlap and mode != "sparseloco"):
        raise ValueError(f"overlap={overlap}: local_sgd.overlap is sparseloco's (a number of inner steps >= 0), "
                         f"not mode {mode!r}'s; leave overlap at 0 or set mode='sparseloco'")
    if model is not None:
        local = sum(p.numel() for p in model.parameters() if p.requires_grad and getattr(p, "allreduce", True) is False)
        n, expert_params = n - local + local * ep_size, local * ep_size
    settings = dict(dtype=dtype, grad_accum_dtype=grad_accum_dtype, communication_data_type=communication_data_type,
                    mode=mode, replica_group_size=replica_group_size, fragments=fragments, compression=compression,
                    overlap=overlap)
    n_e = int(expert_params)
    if n_e:
        stock, acco = _with_experts(n, n_e, ep_size, gpus, nodes, settings)
        return _report(n, gpus, mode, dtype, grad_accum_dtype, communication_data_type, compression, stock, acco,
                       budget_gb, verbose, expert_params=n_e, ep_size=ep_size)
    stock, acco = _dense(n, gpus, nodes, **settings)
    return _report(n, gpus, mode, dtype, grad_accum_dtype, communication_data_type, compression, stock, acco,
                   budget_gb, verbose)


def _with_experts(n: int, n_e: int, ep_size: int, gpus: int, nodes, settings: dict) -> tuple:
    """(stock, acco) bytes of a model of ``n`` parameters, ``n_e`` of them experts split ``ep_size`` ways: the
    dense part on all ranks, and one rank's experts as a model of N_e / e parameters on W / e ranks (k / e per
    replica), flat."""
    k = settings["replica_group_size"]
    if ep_size < 1 or gpus % ep_size or n_e % ep_size or n_e >= n:
        raise ValueError(f"expert parameters: ep_size {ep_size} must divide gpus={gpus} and expert_params="
                         f"{n_e}, which must be below params={n}")
    k_e = (k or 1) if settings["mode"] in LOCAL else gpus
    if k_e % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide replica_group_size {k_e}: expert parallelism lives "
                         f"inside a replica")
    dense = _dense(n - n_e, gpus, nodes, **settings)
    experts = _dense(n_e // ep_size, gpus // ep_size, None, **dict(settings, replica_group_size=None if k is None
                                                                   else k // ep_size))
    return dense[0] + experts[0], dense[1] + experts[1]


def _dense(n: int, gpus: int, nodes, *, dtype, grad_accum_dtype, communication_data_type, mode, replica_group_size,
           fragments, compression, overlap=0) -> tuple:
    """(stock ZeRO-1, acco_ds) model-state bytes per rank of ``n`` dense parameters on ``gpus`` ranks."""
    model_dt = _dtype(dtype)
    accum = _dtype(grad_accum_dtype) if grad_accum_dtype is not None else model_dt
    b, a = _size(model_dt), _size(accum)
    padded = padded_numel(n, gpus)
    stock = b * padded + a * padded + 16 * padded // gpus  # fp32 master, Adam m and v, fp32 gradient partition
    if mode not in LOCAL:
        return stock, b * padded + 12 * padded // gpus + acco_buffer_bytes(
            padded, gpus, model_dt, accum, communication_data_type, mode, compression, nodes)
    k = replica_group_size or 1
    if gpus % k or k == gpus:
        raise ValueError(f"replica_group_size {k} must divide gpus={gpus} and be smaller (at least 2 replicas)")
    local = padded_numel(n, k)
    return stock, (b * local + 12 * local // k + outer_state_bytes(local, k, mode, fragments, overlap)
                   + acco_buffer_bytes(local, k, model_dt, accum, communication_data_type, "sync", compression,
                                       nodes if nodes and nodes < gpus // k else None)
                   + outer_residual_bytes(local, k, gpus // k, compression))


def _report(n, gpus, mode, dtype, grad_accum_dtype, communication_data_type, compression, stock, acco, budget_gb,
            verbose, **experts) -> dict:
    b = _size(_dtype(dtype))
    out = {"params": n, "gpus": gpus, "mode": mode, "dtype": str(dtype), "grad_accum_dtype": str(grad_accum_dtype or dtype),
           "communication_data_type": str(communication_data_type or dtype), "stock_bytes": stock,
           "acco_bytes": acco, "extra_bytes": acco - stock, "compression": (compression or {}).get("dtype"), **experts}
    if verbose:
        fits = lambda x: "fits" if x <= budget_gb * 1e9 else "does not fit"  # noqa: E731
        moe = f" ({experts['expert_params'] / 1e9:.2f}B in experts, ep_size {experts['ep_size']})" if experts else ""
        print(f"Model states per rank, {n / 1e9:.2f}B params{moe}, {gpus} ranks, model {dtype}, grad accumulation "
              f"{out['grad_accum_dtype']}, communication {out['communication_data_type']}"
              f"{', compressed ' + out['compression'] if out['compression'] else ''}, Adam:")
        print(f"  stock ZeRO-1 : {stock / 1e9:8.2f} GB  ({fits(stock)} in {budget_gb:g} GB)")
        print(f"  ACCO {mode:<8}: {acco / 1e9:8.2f} GB  ({fits(acco)} in {budget_gb:g} GB), "
              f"+{(acco - stock) / 1e9:.2f} GB = {(acco - stock) / (b * n):.2f} x the model ({b}N bytes)")
    return out


__all__ = ["estimate_memory", "acco_buffer_bytes", "outer_residual_bytes", "outer_state_bytes", "round_compression"]
