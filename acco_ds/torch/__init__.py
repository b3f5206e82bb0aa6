"""acco_ds.torch: ACCO and the local-SGD family for PyTorch scripts under ``torchrun``, without DeepSpeed.

The same ``"acco"`` JSON block as the DeepSpeed host, plus
``gradient_accumulation_steps`` and optional ``gradient_clipping`` with
DeepSpeed's meaning (``acco_ds.torch.settings``)::

    model = GPT(...)                                    # a plain module, not wrapped in DDP
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = acco_ds.torch.initialize(model, optimizer, "ds_config.json")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ...)   # over the returned optimizer
    for step in range(steps):
        for micro in range(gradient_accumulation_steps):
            (loss_fn(model, batch) / gradient_accumulation_steps).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    acco_ds.torch.finalize(model, optimizer)            # commit the last step / last period
    acco_ds.torch.save("ckpt", model, optimizer)

Two kinds of model:

* a plain module (``ACCOOptimizer``, ``replicated.py``): every mode, acco,
  dpu, sync, diloco, co2, edit, with the optimizer state sharded across the
  ranks like ``ZeroRedundancyOptimizer`` (inside each replica in the
  local-SGD modes); ``sync`` is ZeRO-1 with DDP's averaging, step for step;
* an FSDP2 model sharded with ``fully_shard(..., mesh=replica_mesh(k))``
  (``FSDPLocalSGD``, ``fsdp.py``): the local-SGD modes, each replica sharded
  by FSDP2.

``model.state_dict()``, ``eval()`` forward passes and ``save`` see the
committed weights (θ_t in acco/dpu, the anchor in the local-SGD modes); so
does anything inside ``with optimizer.committed_weights():``. Reads are
collective: every rank reads. ``optimizer.acco_stats()`` and
``optimizer.acco_report()`` give the figures and summary lines.

This package never imports DeepSpeed (the native kernels load only from the
ahead-of-time build; without it the pure-torch kernels run, with one log line).
"""

import os
from typing import Optional, Tuple, Union

import torch
import torch.distributed as tdist

from ..config import Layout, replica_group_size
from ..runtime.comm import lifetime
from ..runtime.outer.interface import make_groups
from .fsdp import FSDPLocalSGD
from .replicated import ACCOOptimizer
from .settings import HostSettings, read_config
from .._lazy_dynamo import defer_optimizer

defer_optimizer()  # a script imports this before it builds its optimizer: no torch._dynamo import (~2.4 s CPU)

def replica_mesh(k: Optional[int] = None):
    """This rank's 1D ``DeviceMesh`` over its replica's ``k`` consecutive ranks (default: the ranks per
    node, ``LOCAL_WORLD_SIZE``), for ``fully_shard(module, mesh=...)``. Collective: every rank calls it."""
    world = tdist.get_world_size()
    k = int(k if k is not None else os.environ.get("LOCAL_WORLD_SIZE", world))
    if k < 1 or world % k:
        raise ValueError(f"replica_mesh({k}): the replica size must divide the world size {world}")
    from torch.distributed.device_mesh import DeviceMesh
    mine, _ = tdist.new_subgroups_by_enumeration([list(range(g * k, (g + 1) * k)) for g in range(world // k)])
    return DeviceMesh.from_group(mine, "cuda" if torch.cuda.is_available() else "cpu")


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               config: Union[dict, str, os.PathLike]) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Set up ACCO (or a local-SGD mode) for ``model`` and ``optimizer``; returns ``(model, optimizer)``.

    ``model``: a plain module or an FSDP2 model; ``optimizer``: a fresh torch optimizer over the model's
    parameters (param groups welcome); ``config``: a dict or a JSON path. Collective: every rank calls it,
    after ``torch.distributed.init_process_group``. Raises ``ValueError`` naming what is wrong and the fix.

    The optimizer's ``close()`` destroys the process groups it created; a script that never calls it has them
    destroyed at interpreter exit, with the default group if it is still up."""
    groups = []
    with lifetime.owned_by(groups):
        model, host = _initialize(model, optimizer, config)
    host.acco_groups = groups
    lifetime.end_at_exit(host, type(host).close)
    return model, host


def _initialize(model, optimizer, config):
    if not tdist.is_initialized():
        raise RuntimeError("acco_ds.torch.initialize: call torch.distributed.init_process_group() first "
                           "(torchrun sets the environment it reads)")
    world = tdist.get_world_size()
    params = _check(model, optimizer)
    fsdp2 = any(_is_dtensor(p) for group in params for p in group)
    layout = Layout.launch(world, host="fsdp2" if fsdp2 else "torch")
    settings: HostSettings = read_config(config, layout)
    acco = settings.acco
    groups = make_groups([list(range(world))], replica_group_size(acco, layout), acco.timeout_s) if acco.local else None
    if fsdp2:
        inner = _fsdp2_inner_settings(settings)
        if inner:
            raise ValueError("acco_ds.torch: on an FSDP2 model FSDP2 runs each replica's gradient reduction itself, so "
                             "these settings would change nothing:\n  - " + "\n  - ".join(inner))
        flat = [p for group in params for p in group]
        _check_mesh(flat, groups)
        return model, FSDPLocalSGD(model, optimizer, flat, settings, groups)
    return model, ACCOOptimizer(model, optimizer, params, settings, groups)


def _fsdp2_inner_settings(settings: HostSettings) -> list:
    """The settings of the replica's own gradient reduction (ACCO's rounds), which FSDP2 replaces: each one
    set, named with what to do instead (nothing set is ignored)."""
    acco, out = settings.acco, []
    if settings.comm_dtype is not None or settings.accum_dtype is not None:
        out.append("communication_data_type / data_types.grad_accum_dtype: remove them and set FSDP2's own, "
                   "fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype=...))")
    if acco.compression.apply_to is not None and "rounds" in acco.compression.apply_to:
        out.append('acco.compression.apply_to "rounds": FSDP2 does not compress its reduce-scatter; use '
                   '"apply_to": ["outer"] (the outer all-reduce across replicas is compressed)')
    if acco.collectives.layout == "hierarchical":
        out.append('acco.collectives.layout "hierarchical" shapes the rounds\' collectives: remove it (a replica '
                   'is best kept inside one node)')
    return out


def finalize(model: torch.nn.Module, optimizer) -> bool:
    """Commit the last step (round modes) or sync the last period (local-SGD): every rank ends on the
    committed weights. Collective. Returns whether it committed or synced anything."""
    return optimizer.finalize()


def _is_dtensor(p) -> bool:
    return type(p).__name__ == "DTensor" or hasattr(p, "device_mesh")


def _check(model, optimizer):
    """The optimizer's parameters per param group, after refusing what cannot be trained."""
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel):
        raise ValueError("acco_ds.torch: the model is wrapped in DistributedDataParallel: pass the module itself "
                         "(model.module). ACCO averages the gradients in its own rounds; DDP would all-reduce them "
                         "in every backward as well")
    from torch.distributed.fsdp import FullyShardedDataParallel
    if isinstance(model, FullyShardedDataParallel) or any(isinstance(m, FullyShardedDataParallel)
                                                          for m in model.modules()):
        raise ValueError("acco_ds.torch: FSDP1 (FullyShardedDataParallel) is not supported: shard with FSDP2 "
                         "(torch.distributed.fsdp.fully_shard(module, mesh=acco_ds.torch.replica_mesh(k))) for the "
                         "local-SGD modes, or pass the plain module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"acco_ds.torch: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        raise ValueError("acco_ds.torch: pass the optimizer ZeroRedundancyOptimizer wraps (e.g. "
                         "torch.optim.AdamW(model.parameters(), ...)): acco_ds.torch shards its state itself")
    if optimizer.state:
        raise ValueError("acco_ds.torch: the optimizer already has state (it stepped or loaded a state_dict): pass "
                         "a fresh one, and restore checkpoints after initialize with acco_ds.torch.load")
    if hasattr(optimizer.step, "_wrapped_by_lr_sched") or getattr(optimizer, "_opt_called", None) is not None:
        raise ValueError("acco_ds.torch: an LR scheduler was created over this optimizer before initialize: create "
                         "it over the optimizer initialize returns (its param_groups are the ones that count)")
    names = {id(p): n for n, p in model.named_parameters()}
    seen, groups = set(), []
    for i, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError(f"acco_ds.torch: param group {i} of the optimizer holds a tensor of shape "
                                 f"{tuple(p.shape)} that is not a parameter of the model: build the optimizer over "
                                 f"model.parameters() (or param groups of them)")
            if id(p) in seen:
                raise ValueError(f"acco_ds.torch: parameter {names[id(p)]} is in the optimizer twice")
            if not p.requires_grad:
                raise ValueError(f"acco_ds.torch: parameter {names[id(p)]} is in the optimizer but does not require "
                                 f"grad: leave frozen parameters out of the optimizer")
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"acco_ds.torch: parameter {names[id(p)]} is {p.dtype}: the torch host trains fp32 "
                                 f"or bf16 parameters (fp16 needs loss scaling: use bf16, or DeepSpeed's fp16)")
            seen.add(id(p))
        if not g["params"]:
            raise ValueError(f"acco_ds.torch: param group {i} of the optimizer is empty: remove it")
        if len({p.dtype for p in g["params"]}) > 1 or len({p.device for p in g["params"]}) > 1:
            raise ValueError(f"acco_ds.torch: param group {i} mixes dtypes or devices: give each its own group")
        groups.append(list(g["params"]))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"acco_ds.torch: model parameter {missing[0]} requires grad but is in no param group of "
                         f"the optimizer ({len(missing)} such): build the optimizer over model.parameters(), or set "
                         f"requires_grad=False on the frozen ones")
    return groups


def _check_mesh(params, groups) -> None:
    """An FSDP2 model must be sharded, every parameter, on this rank's 1D replica mesh."""
    for p in params:
        if not _is_dtensor(p):
            raise ValueError("acco_ds.torch: the model is only partly sharded by FSDP2 (a parameter of shape "
                             f"{tuple(p.shape)} is a plain tensor): apply fully_shard to the root module too")
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise ValueError(f"acco_ds.torch: the model is sharded on a {mesh.ndim}D mesh {tuple(mesh.shape)}. On a "
                             f"2D (replicate, shard) mesh FSDP2 is HSDP and all-reduces the gradients across the "
                             f"replicas in every backward (no public switch avoids it), so the replicas could not "
                             f"train apart. Shard each replica on its own 1D mesh: fully_shard(module, "
                             f"mesh=acco_ds.torch.replica_mesh({groups.k}))")
        ranks = sorted(mesh.mesh.flatten().tolist())
        if ranks != sorted(groups.replica_ranks):
            raise ValueError(f"acco_ds.torch: the model's FSDP2 mesh has ranks {ranks} (size {len(ranks)}) but this "
                             f"rank's replica is {groups.replica_ranks} (acco.local_sgd.replica_group_size="
                             f"{groups.k}): shard with mesh=acco_ds.torch.replica_mesh({groups.k}), or set "
                             f"replica_group_size to the mesh size")


from .checkpoint import load, save  # noqa: E402 - after the names it uses

__all__ = ["initialize", "finalize", "replica_mesh", "save", "load", "ACCOOptimizer", "FSDPLocalSGD"]
