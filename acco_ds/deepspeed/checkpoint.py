"""ACCO's part of a ZeRO-1 optimizer checkpoint.

DeepSpeed saves the fp32 master partition and the optimizer state; ACCO adds,
per rank, what is in flight so that a resumed run continues bit for bit:
the round position, the unfinished round's accumulated gradients, the kept
shard of an estimate round, this rank's part of the compute parameters (the
module weights in the checkpoint are the committed ones), and a finished
commit whose parameters are not installed yet.
"""

import contextlib
import os
import re
import shutil
from dataclasses import asdict

import torch
import torch.distributed as tdist

from ..config import checkpoint_mismatch
from ..runtime import collectives
from ..runtime.compression import residuals_to_load
from ..runtime.job import result_from_dict

ACCO_STATE_KEY = "acco"


def _my_part(opt, flat, i):
    part = int(opt.partition_size[i])
    return flat.narrow(0, opt.rank * part, part)


def save_state(opt) -> dict:
    """The ACCO state of ``opt`` (an ``ACCOZeroOptimizer``, drained)."""
    pending = opt.pending
    return {
        "world_size": opt.world_size,
        "rank": opt.rank,
        "gradient_accumulation_steps": opt.gradient_accumulation_steps,
        "schedule": opt.schedule.state_dict(),
        "local_micro": opt.local_micro,
        "round_scale": opt.round_scale,
        "acc": [b.acc.clone() for b in opt.buffers] if opt.local_micro else None,
        "kept": [b.kept.clone() for b in opt.buffers],
        "kept_scale": [b.kept_scale for b in opt.buffers],
        "residuals": [None if b.residual is None else b.residual.clone() for b in opt.buffers],
        "kept_count": opt.kept.count,
        "kept_finite": opt.kept.finite,
        "compute_part": [_my_part(opt, f, i).clone() for i, f in enumerate(opt.bit16_groups_flat)],
        "pending": asdict(pending) if pending is not None else None,
        "pending_part": [_my_part(opt, b.gathered, i).clone() for i, b in enumerate(opt.buffers)]
        if pending is not None else None,
        "outer": opt.outer.state_dict(),
        "host_counters": opt.host_counters,
    }


def load_residuals(owners, saved, what: str) -> None:
    """Restore compression residuals (``owner.residual`` of each owner) saved as a list."""
    saved = saved or [None] * len(owners)
    if not residuals_to_load(any(o.residual is not None for o in owners), any(r is not None for r in saved), what):
        return
    for owner, res in zip(owners, saved):
        if owner.residual is None:
            continue
        if res.numel() != owner.residual.numel():
            raise ValueError(f"ACCO: the checkpoint's error-feedback residuals of {what} have {res.numel()} "
                             f"elements, this run's {owner.residual.numel()}: the node layout "
                             f"(acco.collectives) changed since the save. Resume with the same acco.collectives, "
                             f"or load with load_optimizer_states=False")
        owner.residual.copy_(res)


def find_state(opt, state_dict_list):
    """This rank's ACCO state in the loaded optimizer states (None: saved without ACCO), checked."""
    mine = state_dict_list[opt.rank] if state_dict_list is not None and opt.rank < len(state_dict_list) else {}
    acco = mine.get(ACCO_STATE_KEY)
    if acco is not None:
        check_state(opt, acco)
    return acco


def check_state(opt, acco: dict) -> None:
    """Refuse a checkpoint whose in-flight rounds cannot continue here."""
    replicas = opt.outer.replica_ranks is not None
    if acco["world_size"] != opt.world_size:
        what = "replica_group_size" if replicas else "data-parallel world size"
        raise checkpoint_mismatch(what, acco["world_size"], opt.world_size, replicas)
    gas = acco.get("gradient_accumulation_steps")
    if gas is not None and gas != opt.gradient_accumulation_steps:
        raise checkpoint_mismatch("gradient_accumulation_steps", gas, opt.gradient_accumulation_steps, replicas)


def load_state(opt, acco: dict) -> None:
    """Restore what ``save_state`` saved into ``opt`` (rounds already reset)."""
    opt.schedule.load_state_dict(acco["schedule"])
    opt.local_micro = int(acco["local_micro"])
    opt.round_scale = float(acco["round_scale"])
    for buf, acc in zip(opt.buffers, acco["acc"] or [None] * len(opt.buffers)):
        if acc is not None:
            buf.acc.copy_(acc)
    for buf, saved, scale in zip(opt.buffers, acco["kept"], acco["kept_scale"]):
        buf.kept.copy_(saved)
        buf.kept_scale = scale
    opt.kept.count, opt.kept.finite = int(acco["kept_count"]), bool(acco["kept_finite"])
    load_residuals(opt.buffers, acco.get("residuals"), "the rounds' reduce-scatter")
    group = opt.comm.group
    for flat, saved in zip(opt.bit16_groups_flat, acco["compute_part"]):
        collectives.all_gather_part(flat, saved, opt.rank, group)
    outer = acco.get("outer", acco.get("local_sgd"))  # "local_sgd": the key before the outer-loop interface
    opt.outer.load_state_dict(outer)
    opt.host_counters = acco.get("host_counters", (outer or {}).get("counters"))
    opt.pending = result_from_dict(acco["pending"])
    if opt.pending is not None:
        for buf, saved in zip(opt.buffers, acco["pending_part"]):
            collectives.all_gather_part(buf.gathered, saved, opt.rank, group)


# What a failed peer looks like from this rank: the communication thread's own wrapped error, or the
# transport's (gloo, NCCL) when a main-thread collective of DeepSpeed's hits the dead peer first.
_PEER_FAILURE = re.compile(r"ACCO communication failed|Connection closed|Connection reset|Broken pipe|"
                           r"Timed out waiting|connectFullMesh|NCCL (error|communicator)|ProcessGroup", re.I)
_DISK_FAILURE = re.compile(r"No space left|inline_container|PytorchStreamWriter|unexpected pos|Disk quota", re.I)


def _free_space(path) -> str:
    try:
        probe = path
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        return f"{shutil.disk_usage(probe or '.').free / 2**20:.1f} MiB"
    except OSError:
        return "unknown"


@contextlib.contextmanager
def save_errors(save_dir):
    """Name the real cause of a failed save: a failed peer, or the disk."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        text = f"{type(err).__name__}: {err}"
        if _PEER_FAILURE.search(text) and not isinstance(err, OSError):
            raise RuntimeError(f"ACCO: save_checkpoint into {save_dir} failed because another rank failed or "
                               f"lost its network during the save ({text}). Check the other ranks' logs, then "
                               f"relaunch and load the previous checkpoint ('latest' was not moved)") from err
        if isinstance(err, OSError) or _DISK_FAILURE.search(text):
            raise RuntimeError(f"ACCO: save_checkpoint into {save_dir} failed, is the disk full? (free space "
                               f"there: {_free_space(save_dir)}; {text}). The previous checkpoint is intact "
                               f"('latest' was not moved); delete the partial tag folder and free space or save "
                               f"elsewhere") from err
        raise


@contextlib.contextmanager
def load_errors(load_dir, tag, replicas: bool = False):
    """Name the real cause of a failed load: another world size, or a damaged file. ``replicas``: the run
    has an outer loop over replica groups (its checkpoints are per replica)."""
    from .compat import ZeRORuntimeException
    try:
        yield
    except ZeRORuntimeException as err:
        sizes = re.search(r"world size of (\d+) but the current world size is (\d+)", str(err))
        if sizes is None:
            raise
        what = "ZeRO-1 group size (replica_group_size)" if replicas else "data-parallel world size"
        raise ValueError(f"ACCO: {checkpoint_mismatch(what, *sizes.groups(), replicas)}. "
                         f"DeepSpeed: {err}") from err
    except (OSError, EOFError, RuntimeError) as err:
        if isinstance(err, FileNotFoundError) or "ACCO" in str(err):
            raise
        text = f"{type(err).__name__}: {err}"
        if isinstance(err, RuntimeError) and _PEER_FAILURE.search(text):
            raise RuntimeError(f"ACCO: load_checkpoint from {load_dir} failed because another rank failed or lost "
                               f"its network during the load ({text}). The checkpoint files may be fine: check the "
                               f"other ranks' logs, then relaunch") from err
        raise RuntimeError(f"ACCO: could not read the checkpoint in {load_dir} (tag {tag or 'latest'}): "
                           f"{type(err).__name__}: {err}. A file is probably truncated or corrupted: load an "
                           f"earlier tag (load_checkpoint(dir, tag='global_stepN'))") from err


# Replicas that run different step counts (A-EDiT): DeepSpeed keeps one copy of the engine counters and the
# LR scheduler (rank 0's model-states file) and names the checkpoint after this rank's global_steps. Each
# rank's own copy travels in its ACCO state instead, and the tag is one every rank agrees on.
def save_own_counters(engine, args, kwargs) -> None:
    """Name the checkpoint ``global_step<N>`` with N the most steps any replica ran (unless the caller named
    it), and keep this rank's counters and LR schedule for its ACCO state."""
    if not args and kwargs.get("tag") is None:
        steps = torch.tensor([engine.global_steps], dtype=torch.int64, device=engine.optimizer.device)
        tdist.all_reduce(steps, op=tdist.ReduceOp.MAX)
        kwargs["tag"] = f"global_step{int(steps.item())}"
    sched = engine.lr_scheduler
    engine.optimizer.host_counters = {
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None}


def load_own_counters(engine) -> None:
    """This rank's counters and LR schedule, not rank 0's (when its checkpoint holds them)."""
    saved = engine.optimizer.host_counters
    if saved is None or not engine.optimizer.outer.per_replica_counters:
        return
    engine.global_steps, engine.global_samples = saved["global_steps"], saved["global_samples"]
    engine.skipped_steps = saved["skipped_steps"]
    if saved["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])


__all__ = ["ACCO_STATE_KEY", "save_state", "find_state", "check_state", "load_state", "save_errors", "load_errors",
           "save_own_counters", "load_own_counters"]
