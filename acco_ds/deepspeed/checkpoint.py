"""ACCO's part of a ZeRO-1 optimizer checkpoint.

DeepSpeed saves the fp32 master partition and the optimizer state; ACCO adds,
per rank, what is in flight so that a resumed run continues bit for bit
(``runtime.rounds.state``: the round position, the unfinished round's
gradients, the kept shard, a finished commit not installed yet, the outer
loop's state) under the key ``"acco"`` of each rank's optimizer state. Also
here: the errors of failed saves and loads, and A-EDiT's per-replica counters.
"""

import contextlib
import copy
import os
import re
import shutil
import torch
import torch.distributed as tdist

from ..config import checkpoint_mismatch
from ..runtime.rounds.state import check_state, load_state, save_state  # noqa: F401 - the zero1 side uses them

ACCO_STATE_KEY = "acco"


def find_state(opt, state_dict_list):
    """This rank's ACCO state in the loaded optimizer states (None: saved without ACCO), checked."""
    mine = state_dict_list[opt.rank] if state_dict_list is not None and opt.rank < len(state_dict_list) else {}
    acco = mine.get(ACCO_STATE_KEY)
    if acco is not None:
        check_state(opt, acco)
    return acco


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
    engine.optimizer.host_counters = own_counters(engine)


def own_counters(engine) -> dict:
    """This rank's step counters and LR schedule (a copy): A-EDiT's checkpoints, and what a replica that
    heals from this one takes (``acco.fault_tolerance``)."""
    sched = engine.lr_scheduler
    return copy.deepcopy({
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None})


def apply_own_counters(engine, saved: dict) -> None:
    engine.global_steps, engine.global_samples = saved["global_steps"], saved["global_samples"]
    engine.skipped_steps = saved["skipped_steps"]
    if saved["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])


def load_own_counters(engine) -> None:
    """This rank's counters and LR schedule, not rank 0's (when its checkpoint holds them)."""
    saved = engine.optimizer.host_counters
    if saved is None or not engine.optimizer.outer.per_replica_counters:
        return
    apply_own_counters(engine, saved)


__all__ = ["ACCO_STATE_KEY", "save_state", "find_state", "check_state", "load_state", "save_errors", "load_errors",
           "save_own_counters", "load_own_counters", "own_counters", "apply_own_counters"]
