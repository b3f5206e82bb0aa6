"""ACCO's part of a ZeRO-1 optimizer checkpoint.

DeepSpeed saves the fp32 master partition and the optimizer state; ACCO adds,
per rank, what is in flight so that a resumed run continues bit for bit:
the round position, the unfinished round's accumulated gradients, the kept
shard of an estimate round, this rank's part of the compute parameters (the
module weights in the checkpoint are the committed ones), and a finished
commit whose parameters are not installed yet.
"""

from dataclasses import asdict

from ..config import checkpoint_mismatch
from ..runtime import collectives
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
        "kept_count": opt.kept.count,
        "kept_finite": opt.kept.finite,
        "compute_part": [_my_part(opt, f, i).clone() for i, f in enumerate(opt.bit16_groups_flat)],
        "pending": asdict(pending) if pending is not None else None,
        "pending_part": [_my_part(opt, b.gathered, i).clone() for i, b in enumerate(opt.buffers)]
        if pending is not None else None,
    }


def check_state(opt, acco: dict) -> None:
    """Refuse a checkpoint whose in-flight rounds cannot continue here."""
    if acco["world_size"] != opt.world_size:
        raise checkpoint_mismatch("data-parallel world size", acco["world_size"], opt.world_size)
    gas = acco.get("gradient_accumulation_steps")
    if gas is not None and gas != opt.gradient_accumulation_steps:
        raise checkpoint_mismatch("gradient_accumulation_steps", gas, opt.gradient_accumulation_steps)


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
    group = opt.comm.group
    for i, (flat, saved) in enumerate(zip(opt.bit16_groups_flat, acco["compute_part"])):
        _my_part(opt, flat, i).copy_(saved)
        collectives.all_gather(flat, _my_part(opt, flat, i), group)
    opt.pending = result_from_dict(acco["pending"])
    if opt.pending is not None:
        for i, (buf, saved) in enumerate(zip(opt.buffers, acco["pending_part"])):
            out = buf.gathered_part(opt.rank)
            out.copy_(saved)
            collectives.all_gather(buf.gathered, out, group)


__all__ = ["ACCO_STATE_KEY", "save_state", "check_state", "load_state"]
