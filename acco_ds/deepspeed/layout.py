"""The rulebook's ``Layout`` of a DeepSpeed launch, read from what ``deepspeed.initialize`` is given (the model,
Megatron's ``mpu``, the config) or from a live engine, so that the host and ``acco-ds plan`` are judged by the
same rules (``acco_ds.config.rulebook``)."""

import os
from typing import Optional

import torch
import torch.distributed as tdist

from ..config.rulebook import Layout
from .compat import PipelineModule, has_moe_layers


def tensor_parallel(model, mpu) -> int:
    """Tensor-parallel ranks per model copy: Megatron's ``mpu`` (its tensor slice when it has pipelines too),
    else a ``PipelineModule``'s topology, else 1."""
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        size = getattr(mpu, name, None) if mpu is not None else None
        if size is not None:
            return int(size())
    topo = getattr(model, "_topo", None)
    if topo is not None and "model" in topo.get_axis_names():
        return int(topo.get_dim("model"))
    return 1


def expert_sizes(model) -> tuple:
    """The ``ep_size`` of each expert layer DeepSpeed made (``deepspeed.moe.layer.MoE``), each once."""
    if not isinstance(model, torch.nn.Module) or not has_moe_layers(model)[0]:
        return ()
    return tuple(sorted({int(m.ep_size) for m in model.modules() if hasattr(m, "ep_size")}))


def sequence_parallel(ds_config: dict, mpu) -> int:
    sp = getattr(mpu, "get_sequence_parallel_world_size", None) if mpu is not None else None
    return max(int(ds_config.get("sequence_parallel_size", 1) or 1), int(sp() or 1) if sp is not None else 1)


def accumulation_steps(ds_config: dict, dp_world: int) -> Optional[int]:
    """``gradient_accumulation_steps`` as DeepSpeed derives it from the batch keys of a config dict; None while
    a key is not a number yet (``"auto"`` before Accelerate fills it in: the engine checks the parsed value)."""
    gas, micro, total = (ds_config.get(k) for k in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu",
                                                    "train_batch_size"))
    if any(v is not None and (isinstance(v, bool) or not isinstance(v, int)) for v in (gas, micro, total)):
        return None
    if gas is not None:
        return gas
    if micro is not None and total is not None and micro * dp_world and total % (micro * dp_world) == 0:
        return total // (micro * dp_world)
    return 1


def launch_layout(model, mpu=None, ds_config: Optional[dict] = None, gas: Optional[int] = None,
                  ep_sizes: Optional[tuple] = None) -> Layout:
    """The layout this process is part of: the world (the default group's, else ``WORLD_SIZE``), the
    launcher's ranks per node, tp from ``mpu``, pp from a ``PipelineModule``, experts from the model (or
    ``ep_sizes`` as a live engine knows them), and ``gas`` (default: derived from ``ds_config``)."""
    ds_config = ds_config or {}
    world = tdist.get_world_size() if tdist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    pp = int(model.num_stages) if isinstance(model, PipelineModule) else 1
    tp, sp = tensor_parallel(model, mpu), sequence_parallel(ds_config, mpu)
    experts = expert_sizes(model) if ep_sizes is None else tuple(ep_sizes)
    moe = bool(experts) or (isinstance(model, torch.nn.Module) and has_moe_layers(model)[0])
    if gas is None:
        gas = accumulation_steps(ds_config, max(1, world // (tp * pp * sp)))
    return Layout.launch(world, tp=tp, pp=pp, moe=moe, ep_sizes=experts, micro_batches=gas, host="deepspeed",
                         sequence_parallel=sp)


__all__ = ["launch_layout", "tensor_parallel", "expert_sizes", "accumulation_steps"]
