"""``save`` / ``load`` of the torch host: one folder, DeepSpeed-like.

    <dir>/model.pt       the committed weights as a plain state dict (rank 0 writes it; full tensors also
                         for FSDP2), loadable by ``model.load_state_dict`` without acco_ds
    <dir>/rank<r>.pt     rank r's ``optimizer.state_dict()``: its optimizer shard, its rounds or replica in
                         flight, the outer loop's state and the counters
    <dir>/meta.pt        world size and mode

``load`` restores everything (the run continues bit for bit), or with
``load_optimizer_states=False`` only the weights of ``model.pt``: the
optimizer state and the outer loop then start afresh from them. A checkpoint
of another world size or replica layout is resharded (``torch/reshard.py``).
"""

import os

import torch
import torch.distributed as tdist

from .reshard import load_resharded, read, replica_size, saved_replica_size


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def save(path, model, optimizer, client_state=None) -> None:
    """Write the checkpoint folder ``path`` (collective: every rank calls it). ``client_state``: anything
    picklable of yours (data position, scheduler state), returned by ``load``."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
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
        weights = torch.load(os.path.join(path, "model.pt"), weights_only=False)
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
        optimizer.load_state_dict(read(files[rank]))
    return meta["client_state"]



__all__ = ["save", "load"]
