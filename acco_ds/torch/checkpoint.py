"""``save`` / ``load`` of the torch host: one folder, DeepSpeed-like.

    <dir>/model.pt       the committed weights as a plain state dict (rank 0 writes it; full tensors also
                         for FSDP2), loadable by ``model.load_state_dict`` without acco_ds
    <dir>/rank<r>.pt     rank r's ``optimizer.state_dict()``: its optimizer shard, its rounds or replica in
                         flight, the outer loop's state and the counters
    <dir>/meta.pt        world size, mode and the user's ``client_state``

Every file is read with ``torch.load(weights_only=True)`` (``acco_ds/safe_load.py``): loading a checkpoint
runs no code, and a file holding anything but tensors and plain data is refused by name. ``client_state`` is
checked against the same rule at ``save``.

``load`` restores everything (the run continues bit for bit), or with
``load_optimizer_states=False`` only the weights of ``model.pt``: the
optimizer state and the outer loop then start afresh from them. A checkpoint
of another world size or replica layout is resharded (``torch/reshard.py``).
"""

import os

import torch
import torch.distributed as tdist

from ..safe_load import check_safe
from .reshard import load_resharded, read, replica_size, saved_replica_size


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def save(path, model, optimizer, client_state=None) -> None:
    """Write the checkpoint folder ``path`` (collective: every rank calls it). ``client_state``: rank 0's
    extras (data position, scheduler state), returned by ``load``: tensors and plain data only (what
    ``torch.load(weights_only=True)`` builds), else a ``ValueError`` on every rank before anything is written."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    problem = [None]
    if rank == 0:
        try:
            check_safe(client_state, "acco_ds.torch.save: client_state")
        except ValueError as err:
            problem[0] = str(err)
    tdist.broadcast_object_list(problem, src=0)  # every rank refuses alike (none waits at the barrier below)
    if problem[0]:
        raise ValueError(problem[0])
    os.makedirs(path, exist_ok=True)
    with optimizer.committed_weights():
        weights = {k: _full(v) for k, v in model.state_dict().items()}
    state = optimizer.state_dict()
    if rank == 0:
        torch.save(weights, os.path.join(path, "model.pt"))
        torch.save({"world_size": world, "mode": optimizer.acco.mode, "client_state": client_state},
                   os.path.join(path, "meta.pt"))
    torch.save(state, os.path.join(path, f"rank{rank}.pt"))
    tdist.barrier()


def load(path, model, optimizer, load_optimizer_states: bool = True):
    """Restore ``save``'s folder into ``model`` and ``optimizer`` (collective); returns ``client_state``."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    meta_path = os.path.join(path, "meta.pt")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"acco_ds.torch.load: {path} is not an acco_ds.torch checkpoint (no meta.pt)")
    meta = read(meta_path)
    if not load_optimizer_states:
        weights = read(os.path.join(path, "model.pt"))
        if hasattr(optimizer, "locals"):  # FSDP2: full tensors into the shards
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
            optimizer.weights_changed()
        else:
            model.load_state_dict(weights)  # the optimizer's load hook restarts from them
        return meta["client_state"]
    if meta["mode"] != optimizer.acco.mode:
        raise ValueError(f"acco_ds.torch.load: {path} was saved in mode {meta['mode']!r} but this run is "
                         f"{optimizer.acco.mode!r}: resume in the same mode, or load only the weights "
                         f"(load_optimizer_states=False)")
    files = [os.path.join(path, f"rank{r}.pt") for r in range(meta["world_size"])]
    for name in files:
        if not os.path.isfile(name):
            raise FileNotFoundError(f"acco_ds.torch.load: the checkpoint in {path} is partial: {name} is missing (it "
                                    f"was saved by {meta['world_size']} ranks, each writing one such file): copy it "
                                    f"back, load an earlier checkpoint, or load only the weights "
                                    f"(load_optimizer_states=False)")
    if meta["world_size"] != world or saved_replica_size(files[0], world) != replica_size(optimizer):
        load_resharded(path, files, model, optimizer, meta)
    else:
        optimizer.load_state_dict(_read_everywhere(files[rank]))
    return meta["client_state"]


def _read_everywhere(name):
    """This rank's file, or an error on every rank if any rank could not read its own: a rank that went on
    alone would wait forever in its first collective for the peers that stopped."""
    try:
        state, problem = read(name), None
    except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
        state, problem = None, err
    problems = [None] * tdist.get_world_size()
    tdist.all_gather_object(problems, None if problem is None else str(problem))
    if problem is not None:
        raise problem
    for r, text in enumerate(problems):
        if text is not None:
            raise RuntimeError(f"acco_ds.torch.load: rank {r} could not load its file: {text}")
    return state



__all__ = ["save", "load"]
