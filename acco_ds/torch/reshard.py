"""``acco_ds.torch.load`` of a checkpoint saved with another world size or replica layout: resharded.

Each rank reads the old ranks' files it needs (``rank<r>.pt``, memory-mapped: only the slices it uses are
read), turns them into ``runtime.reshard``'s pieces and builds its own ``optimizer.state_dict()`` in the new
layout, which the optimizer then loads like any other. A plain module's flat groups are split by ZeRO-1's
rule (``buffers.padded_numel``); an FSDP2 local shard is the ``Shard(0)`` chunk of each parameter. The
round modes first take the committed weights of ``model.pt``; a local-SGD replica takes its mapped old
replica's weights. Rank 0 says what happened in one line.
"""

import os

import torch
import torch.distributed as tdist

from ..runtime.reshard import Layout, Plan, reshard_rounds
from ..safe_load import UnsafeCheckpointFile, load_safely


def read(name):
    """One file of a checkpoint folder, memory-mapped (a resharding load reads only the slices it needs) and
    loaded safely (``acco_ds/safe_load.py``: no code runs); an unsafe or damaged file is named, with the fix."""
    try:
        return load_safely(name, mmap=True)
    except UnsafeCheckpointFile as err:
        raise UnsafeCheckpointFile(f"acco_ds.torch.load: {err}") from None
    except Exception as err:  # noqa: BLE001 - any failure to read is a damaged file
        raise RuntimeError(f"acco_ds.torch.load: could not read {name}: {type(err).__name__}: {err}. The file is "
                           f"probably truncated or corrupted: load an earlier checkpoint, or load only the "
                           f"weights (load_optimizer_states=False) if model.pt is intact") from err


def replica_size(optimizer) -> int:
    """Ranks that share one copy of the model (the ZeRO or FSDP2 group: all ranks in a round mode)."""
    groups = getattr(optimizer, "groups", None)
    return groups.k if groups is not None else optimizer.world_size


def saved_replica_size(name, world: int) -> int:
    """Ranks per replica (one ZeRO or FSDP2 group) of the checkpoint whose rank-0 file is ``name``."""
    sd = read(name)
    if "rounds" in sd:  # a plain module: the rounds' group is the replica (all ranks in a round mode)
        return sd["rounds"]["world_size"]
    return (sd.get("outer") or {}).get("k", world)


def load_resharded(path, files, model, optimizer, meta) -> None:
    """Load the checkpoint folder ``path`` (its rank files ``files``) into this run's layout."""
    fsdp2 = hasattr(optimizer, "locals")
    old_world, world = meta["world_size"], tdist.get_world_size()
    old_k = saved_replica_size(files[0], old_world)
    if fsdp2:
        shapes = [tuple(p.shape) for p in optimizer.params]
        layouts = lambda ways: [Layout.dim0(s, ways) for s in shapes]  # noqa: E731
        new_k = optimizer.groups.k
    else:
        sizes = [sum(p.numel() for p in g["params"]) for g in optimizer.param_groups]
        layouts = lambda ways: [Layout.zero(n, ways) for n in sizes]  # noqa: E731
        new_k = optimizer.world_size
    plan = Plan(old_world=old_world, old_k=old_k, new_world=world, new_k=new_k, rank=tdist.get_rank(),
                layouts=layouts, local=optimizer.acco.local)
    states = [read(name) for name in files]  # every file, memory-mapped: a damaged one is refused on every rank
    mine, first = [states[o] for o in plan.mapped_ranks], [states[o] for o in plan.first_ranks]
    state = (_fsdp2_state if fsdp2 else _plain_state)(plan, mine, first, optimizer)
    if not fsdp2:  # the round modes restart at the committed weights; a replica takes its own (its state's)
        model.load_state_dict(read(os.path.join(path, "model.pt")))
    optimizer.load_state_dict(state)
    if tdist.get_rank() == 0:
        print(f"[acco_ds] {plan.message(path)}", flush=True)


def _inner(plan, mine, ids, unwrap=lambda state: state):
    """This rank's inner optimizer state per plan group (the torch state of parameter ``ids[i]``) from the
    mapped replica's files."""
    return plan.inner_state([[unwrap(sd["inner"]["state"].get(i, {})) for i in ids] for sd in mine])


def _plain_state(plan, mine, first, optimizer) -> dict:
    sd0 = mine[0]
    ids = [g["params"][0] for g in sd0["inner"]["param_groups"]]
    inner = _inner(plan, mine, ids)
    rounds = reshard_rounds(plan, [sd["rounds"] for sd in first], [sd["rounds"] for sd in mine], optimizer.outer,
                            optimizer.acco.round_mode(), optimizer.gradient_accumulation_steps)
    return {"format": sd0["format"], "masters": plan.piece([sd["masters"] for sd in mine]), "rounds": rounds,
            "inner": {"state": {i: s for i, s in zip(ids, inner) if s}, "param_groups": sd0["inner"]["param_groups"]},
            "global_steps": sd0["global_steps"], "skipped_steps": sd0["skipped_steps"],
            "param_groups": sd0["param_groups"]}


def _fsdp2_state(plan, mine, first, optimizer) -> dict:
    sd0 = mine[0]

    def unwrap(state):  # DTensor states are saved as their local tensors
        return {k: v["dtensor_local"] if isinstance(v, dict) and "dtensor_local" in v else v for k, v in state.items()}

    inner = _inner(plan, mine, range(len(optimizer.params)), unwrap)
    state = {}
    for i, (s, p) in enumerate(zip(inner, optimizer.params)):
        local = p.to_local().shape
        wrapped = {k: {"dtensor_local": v.view(local)} if torch.is_tensor(v) and v.dim() > 0 else v
                   for k, v in s.items()}
        if wrapped:
            state[i] = wrapped
    outer = optimizer.outer.reshard_state([sd["outer"] for sd in first], [sd["outer"] for sd in mine], plan)
    return {"format": sd0["format"], "world_size": plan.new_world, "rank": tdist.get_rank(),
            "shards": plan.piece([sd["shards"] for sd in mine]), "outer": outer,
            "inner": {"state": state, "param_groups": sd0["inner"]["param_groups"]},
            "global_steps": sd0["global_steps"], "skipped_steps": sd0["skipped_steps"]}


__all__ = ["load_resharded", "read", "replica_size", "saved_replica_size"]
