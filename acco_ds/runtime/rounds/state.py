"""What a ``driver.RoundDriver`` adds to a checkpoint, per rank, so that a resumed run continues bit for bit.

The host saves the fp32 master partition and the optimizer state its own way;
this is the rest: the round position, the unfinished round's accumulated
gradients, the kept shard of an estimate round, compression residuals, this
rank's part of the compute parameters (the module weights a checkpoint holds
are the committed ones), a finished commit whose parameters are not installed
yet, and the outer loop's state.
"""

import copy
from dataclasses import asdict

import torch

from ...config import checkpoint_mismatch
from ..comm import collectives
from ..comm.compression import residuals_to_load
from .experts import buffer_part
from .job import result_from_dict


def _my_part(opt, flat, buf, i: int):
    """This rank's partition of buffer ``i`` (an expert group's: by its rank in its expert-data-parallel group)."""
    return flat.narrow(0, buffer_part(opt, i)[0] * buf.partition, buf.partition)


def _gather_part(opt, i: int, flat, saved) -> None:
    collectives.all_gather_part(flat, saved, *buffer_part(opt, i))


def save_state(opt) -> dict:
    """The round state of ``opt`` (a ``RoundDriver``, drained)."""
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
        "compute_part": [_my_part(opt, f, b, i).clone()
                         for i, (f, b) in enumerate(zip(opt.compute_flats, opt.buffers))],
        "pending": asdict(pending) if pending is not None else None,
        "pending_part": [_my_part(opt, b.gathered, b, i).clone() for i, b in enumerate(opt.buffers)]
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
    if acco.get("resharded"):
        return _load_resharded(opt, acco)
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
    for i, (flat, saved) in enumerate(zip(opt.compute_flats, acco["compute_part"])):
        _gather_part(opt, i, flat, saved)
    outer = acco.get("outer", acco.get("local_sgd"))  # "local_sgd": the key before the outer-loop interface
    opt.outer.load_state_dict(outer)
    opt.host_counters = acco.get("host_counters", (outer or {}).get("counters"))
    opt.pending = result_from_dict(acco["pending"])
    if opt.pending is not None:
        for i, (buf, saved) in enumerate(zip(opt.buffers, acco["pending_part"])):
            _gather_part(opt, i, buf.gathered, saved)


def load_optimizer_state(optimizer, saved: dict) -> None:
    """``optimizer.load_state_dict(saved)`` that copies into the state tensors the optimizer already has, so
    that whatever holds them (DeepSpeed's links from parameters to their optimizer state) stays valid."""
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for saved_group in saved["param_groups"] for i in saved_group["params"]]
    for p, i in zip(params, ids):
        state = optimizer.state[p]
        for key, value in saved["state"].get(i, {}).items():
            mine = state.get(key)
            if torch.is_tensor(value) and torch.is_tensor(mine) and mine.shape == value.shape:
                mine.copy_(value)
            else:
                state[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)


def heal_state(opt) -> dict:
    """What a healing replica's rank takes from this rank of ``opt`` (a ``RoundDriver``) besides the outer
    state (copies, ``acco.fault_tolerance``): the inner optimizer's state over this rank's master shard (its
    moments and step) and the host's counters."""
    return {"optimizer": copy.deepcopy(opt.update.optimizer.state_dict()), "counters": opt.counters()}


def load_heal_state(opt, state: dict) -> None:
    load_optimizer_state(opt.update.optimizer, state["optimizer"])
    opt.load_counters(state["counters"])


def _load_resharded(opt, acco: dict) -> None:
    """A state ``runtime.reshard`` made for this layout: the rounds start afresh (nothing in flight, residuals
    at zero); a local-SGD replica takes its compute weights and outer state, a round mode keeps the loaded
    committed weights."""
    for buf in opt.buffers:
        if buf.residual is not None:
            buf.residual.zero_()
    for i, (flat, saved) in enumerate(zip(opt.compute_flats, acco["compute_part"] or [])):
        _gather_part(opt, i, flat, saved)
    opt.outer.load_state_dict(acco["outer"])
    opt.host_counters = acco.get("host_counters")


__all__ = ["save_state", "load_state", "check_state", "load_residuals", "load_optimizer_state", "heal_state",
           "load_heal_state"]
