"""A ZeRO-1 checkpoint of another data-parallel size or replica layout, loaded by resharding.

Stock DeepSpeed refuses another data-parallel size ("Automatic adjustment of ZeRO's optimizer state
partitioning with a new world size is not currently supported"). ``ACCOEngine._load_zero_checkpoint``
comes here first: with the same layout it goes on to DeepSpeed's own load, unchanged (bit-exact resume).
With another one, this rank reads every old rank's ZeRO file of its model-parallel rank
(``zero_pp_rank_{dp}_mp_rank_{mp}_optim_states.pt``, memory-mapped: only the slices it needs are read),
turns them into the host-neutral pieces of ``runtime.reshard``, and builds its own file's state dict in the
new layout: DeepSpeed's stock rigid load then consumes it, and ACCO's state (marked resharded) restarts
the rounds or carries the replica and outer state. The module weights were loaded before (DeepSpeed reads
the model-states file first): they are the committed weights. Rank 0 says what happened in one warning.
A model with MoE layers keeps its ep_size: each expert group is regathered over its old expert-data-parallel
group and re-split over the new one (``moe.reshard_strides``); DeepSpeed reads its per-expert weight files by
global expert id at any data-parallel size.
"""

import os

from ..runtime.reshard import Layout, Plan, reshard_rounds
from ..safe_load import UnsafeCheckpointFile, load_safely
from .checkpoint import ACCO_STATE_KEY
from .compat import (BASE_OPTIMIZER_STATE, GROUP_PADDINGS, OPTIMIZER_STATE_DICT, PARAM_ALIGNMENT_PADDINGS,
                     PARTITION_COUNT, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS, ZERO_FILE_TYPES,
                     check_instance, comm)
from . import moe
from .progress import _say

_FIX = ("copy it back from where the checkpoint was written, or load an earlier tag (load_checkpoint(dir, "
        "tag='global_stepN')); the module weights alone load with load_optimizer_states=False")


def load_zero_checkpoint(engine, load_dir, tag, load_optimizer_states, stock) -> bool:
    """``ACCOEngine._load_zero_checkpoint``: DeepSpeed's own load (``stock``) with the same layout, else a
    resharding load. Every ZeRO file of the checkpoint must be there (a partial checkpoint is refused on
    every rank, naming the missing file)."""
    if engine.load_universal_checkpoint() or not load_optimizer_states:
        return stock(load_dir, tag, load_optimizer_states=load_optimizer_states)
    check_instance(engine, "DeepSpeedEngine (a checkpoint loaded)")
    old_world = engine.loaded_checkpoint_dp_world_size
    names = [engine._get_rank_zero_ckpt_name(load_dir, tag, engine.checkpoint_mp_rank, dp, engine.bfloat16_enabled())
             for dp in range(old_world)]
    for name in names:
        if not os.path.isfile(name):
            raise FileNotFoundError(f"ACCO: the checkpoint in {load_dir} (tag {tag}) is partial: {name} is missing "
                                    f"(it was saved by {old_world} data-parallel ranks, each writing one such "
                                    f"file): {_FIX}")
    opt = engine.optimizer
    local = opt.outer.replica_ranks is not None
    old_k = old_world
    if local:  # the replica layout is in the ACCO state (rank 0's file, memory-mapped: only that is read)
        old_k = ((_read(names[0], load_dir, tag).get(ACCO_STATE_KEY) or {}).get("outer") or {}).get("k", old_world)
    if old_world == engine.dp_world_size and old_k == opt.world_size:
        return stock(load_dir, tag, load_optimizer_states=load_optimizer_states)
    _reshard(engine, names, old_world, old_k, load_dir, tag)
    return True


def _read(name, load_dir, tag) -> dict:
    """A ZeRO file's optimizer state, memory-mapped (slices are read when used) and loaded safely
    (``acco_ds/safe_load.py``: tensors, plain data and DeepSpeed's few plain data types, no code runs)."""
    try:
        state = load_safely(name, allowed=ZERO_FILE_TYPES, mmap=True)
    except UnsafeCheckpointFile as err:
        raise UnsafeCheckpointFile(f"ACCO: the checkpoint in {load_dir} (tag {tag}): {err}") from None
    except Exception as err:  # noqa: BLE001 - any failure to read is a damaged file, named with the fix
        raise RuntimeError(f"ACCO: could not read the checkpoint in {load_dir} (tag {tag}): {name}: "
                           f"{type(err).__name__}: {err}. A file is probably truncated or corrupted: load an "
                           f"earlier tag (load_checkpoint(dir, tag='global_stepN'))") from err
    return state[OPTIMIZER_STATE_DICT]


def _pieces(sd: dict, groups: int):
    """(masters, inner states, param ids) per group of one rank's ZeRO state (rigid: the torch optimizer's
    state_dict over the padded partition)."""
    base = sd[BASE_OPTIMIZER_STATE]
    if not isinstance(base, dict):
        raise ValueError("ACCO: this ZeRO checkpoint was saved with zero_optimization.elastic_checkpoint, which a "
                         "resharding load does not read: resume with the same layout, or load only the module "
                         "weights (load_optimizer_states=False)")
    ids = [g["params"][0] for g in base["param_groups"]]
    if len(ids) != groups:
        raise ValueError(f"ACCO: the checkpoint has {len(ids)} parameter groups, this run {groups}: it was saved "
                         f"with another model or optimizer")
    return sd[SINGLE_PARTITION_OF_FP32_GROUPS], [base["state"].get(i, {}) for i in ids], ids


def _reshard(engine, names, old_world, old_k, load_dir, tag) -> None:
    opt = engine.optimizer
    if opt.round_robin_gradients:
        raise ValueError("ACCO: zero_optimization.round_robin_gradients orders each flat group by the world size, so "
                         "its partitions cannot be resharded: resume with the same layout, or train with "
                         "round_robin_gradients false")
    groups = len(opt.bit16_groups_flat)
    sizes = [sum(p.numel() for p in ps) + sum(pad) for ps, pad in zip(opt.round_robin_bit16_groups,
                                                                       opt.round_robin_bit16_padding)]
    for n, flat, ways in zip(sizes, opt.bit16_groups_flat, opt.partition_count):
        assert Layout.zero(n, ways).sizes[0] * ways == flat.numel(), "ZeRO-1's padding rule"
    # Every file is opened (memory-mapped: cheap) so that a damaged one is refused on every rank alike.
    files = [_read(name, load_dir, tag) for name in names]
    # MoE: each expert group is partitioned over its expert-data-parallel group (ep_size kept).
    strides = moe.reshard_strides(opt, (files[0].get(ACCO_STATE_KEY) or {}).get("ep_sizes"),
                                  files[0].get(PARTITION_COUNT), old_k)
    plan = Plan(old_world=old_world, old_k=old_k, new_world=engine.dp_world_size, new_k=opt.world_size,
                rank=comm.get_rank(group=engine.seq_data_parallel_group), local=opt.outer.replica_ranks is not None,
                layouts=lambda ways: [Layout.zero(n, ways) for n in sizes], strides=strides)
    if any(f.get(PARAM_ALIGNMENT_PADDINGS, opt.round_robin_bit16_padding) != opt.round_robin_bit16_padding
           for f in files):
        raise RuntimeError("ACCO: the ZeRO checkpoint's parameter-alignment layout does not match the current "
                           "zero_optimization.parameter_alignment setting: load with the setting used to save it, "
                           "or load only the module weights (load_optimizer_states=False)")
    mine, first = [files[o] for o in plan.mapped_ranks], [files[o] for o in plan.first_ranks]
    pieces = [_pieces(sd, groups) for sd in mine]
    masters = plan.piece([p[0] for p in pieces])
    inner = plan.inner_state([p[1] for p in pieces])
    acco = reshard_rounds(plan, [sd.get(ACCO_STATE_KEY) for sd in first], [sd.get(ACCO_STATE_KEY) for sd in mine],
                          opt.outer, opt.acco.round_mode(), opt.gradient_accumulation_steps)
    base = mine[0][BASE_OPTIMIZER_STATE]
    keep = {k: v for k, v in files[0].items() if k not in (BASE_OPTIMIZER_STATE, SINGLE_PARTITION_OF_FP32_GROUPS,
                                                          GROUP_PADDINGS, PARTITION_COUNT, PARAM_SLICE_MAPPINGS,
                                                          ACCO_STATE_KEY)}  # the loss scaler: old rank 0's
    # DeepSpeed saves the fp32 partitions without their padding and pads them again when it loads.
    keep[SINGLE_PARTITION_OF_FP32_GROUPS] = [m[:m.numel() - pad] for m, pad in zip(masters, opt.groups_padding)]
    keep[BASE_OPTIMIZER_STATE] = {"state": {pid: s for pid, s in zip(pieces[0][2], inner) if s},
                                  "param_groups": base["param_groups"]}
    keep.update({GROUP_PADDINGS: opt.groups_padding, PARAM_ALIGNMENT_PADDINGS: opt.round_robin_bit16_padding,
                 PARTITION_COUNT: opt.partition_count, ACCO_STATE_KEY: acco})
    states = [None] * opt.world_size
    states[opt.rank] = keep
    opt.load_state_dict(states, load_optimizer_states=True,
                        load_from_fp32_weights=engine.zero_load_from_fp32_weights())
    _say(plan.message(f"{load_dir} (tag {tag})"))


__all__ = ["load_zero_checkpoint"]
