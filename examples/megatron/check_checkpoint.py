"""Check a Megatron-DeepSpeed checkpoint written with ACCO.

    python check_checkpoint.py CKPT [TAG]        # module weights == zero_to_fp32 master weights
    python check_checkpoint.py CKPT OTHER_CKPT   # the two latest checkpoints are bit-identical (but RNG states)

The first form rebuilds the fp32 master weights with DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` and compares every module tensor
the checkpoint holds with them. ``zero_to_fp32`` knows one model-parallel rank
only, so with tensor parallelism each ``mp_rank_XX`` slice is checked alone
(its files are linked into a scratch folder under the names it expects).
Module weights live in ``mp_rank_XX_model_states.pt`` (plain engine) or in
``layer_LL-model_XX-model_states.pt`` files (PipelineEngine).
"""

import glob
import os
import re
import sys
import tempfile

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def flatten(d, pre=""):
    out = {}
    items = d.items() if isinstance(d, dict) else enumerate(d or [])
    for k, v in items:
        k = str(k)
        if isinstance(v, (dict, list, tuple)):
            out.update(flatten(v, pre + k + "."))
        elif torch.is_tensor(v):
            out[pre + k] = v
    return out


def layer_tp_size(folder):
    """How many tensor-parallel ranks the pipeline engine's layer files name (0: the plain engine, no layer files)."""
    return len({re.search(r"-model_(\d+)-", p).group(1) for p in glob.glob(f"{folder}/layer_*-model_*")})


def module_tensors(folder, mp, tp_size):
    """The module weights a checkpoint shows for model-parallel rank ``mp``, named as zero_to_fp32 names them.
    Layer files are named by tensor-parallel rank (``model_XX``) and hold every pipeline stage's layers;
    Megatron's model-parallel rank is stage x TP size + TP rank, so its TP rank is ``mp % TP size``
    (``match`` keeps the layers of the stage whose master weights it is given). ``tp_size``: ``layer_tp_size``."""
    if not tp_size:
        return flatten(load(f"{folder}/mp_rank_{mp:02d}_model_states.pt")["module"])
    layers = sorted(glob.glob(f"{folder}/layer_*-model_{mp % tp_size:02d}-model_states.pt"))
    out = {}
    for path in layers:
        index = int(re.search(r"layer_(\d+)-", path).group(1))
        for k, v in flatten(load(path)).items():
            out[(index, k)] = v
    return out


def master_tensors(folder, tag, mp):
    """``zero_to_fp32``'s fp32 weights of model-parallel rank ``mp`` (its files linked under rank 00's names).
    A PipelineEngine's model-states file has ``module: None`` (its layers have files of their own), which
    ``zero_to_fp32`` cannot parse: that file is copied with an empty module (it only reads buffers there)."""
    with tempfile.TemporaryDirectory() as scratch:
        os.mkdir(f"{scratch}/{tag}")
        for path in glob.glob(f"{folder}/*mp_rank_{mp:02d}*"):
            name = os.path.basename(path).replace(f"mp_rank_{mp:02d}", "mp_rank_00")
            sd = load(path) if name == "mp_rank_00_model_states.pt" else None
            if sd is not None and sd.get("module") is None:
                torch.save(dict(sd, module={}), f"{scratch}/{tag}/{name}")
            else:
                os.symlink(os.path.abspath(path), f"{scratch}/{tag}/{name}")
        return get_fp32_state_dict_from_zero_checkpoint(scratch, tag)


def match(module, master, tied_here=True):
    """Pair module tensors with master ones (pipeline layer files name parameters inside their layer).
    A tied layer's file (Megatron's embedding) is written by the first stage; a later stage's copy is
    tied by its word embeddings only, and its other parameters (the position embeddings) are never
    trained there, so the file is paired with the first stage's master weights only (``tied_here``)."""
    pairs = {}
    for key, v in module.items():
        if isinstance(key, str):
            pairs[key] = (v, master[key])
            continue
        index, name = key
        full = f"{index}.{name}"
        if full not in master:  # a tied layer (the embedding): named tied_modules.<key>.<name>
            tied = [m for m in master if m.startswith("tied_modules.") and m.split(".", 2)[2] == name]
            assert len(tied) <= 1, (key, tied)
            if not tied or not tied_here:
                continue  # a layer of another pipeline stage: checked with that stage's master weights
            full = tied[0]
        pairs[full] = (v, master[full])
    missing = [k for k in master if k not in pairs and not k.endswith(".inv_freq")
               and (tied_here or not k.startswith("tied_modules."))]
    assert not missing, f"master weights without a module tensor: {missing}"
    return pairs


def check_master(ckpt, tag=None):
    tag = tag or open(f"{ckpt}/latest").read().strip()
    folder = f"{ckpt}/{tag}"
    mps = sorted({int(m) for m in re.findall(r"mp_rank_(\d+)_model_states", " ".join(os.listdir(folder)))})
    worst, count = 0.0, 0
    tp_size = layer_tp_size(folder)
    for mp in mps:
        pairs = match(module_tensors(folder, mp, tp_size), master_tensors(folder, tag, mp),
                      tied_here=mp < max(1, tp_size))
        diff = {k: (v.float() - m.to(v.dtype).float()).abs().max().item() for k, (v, m) in pairs.items()}
        worst, count = max(worst, max(diff.values())), count + len(diff)
        print(f"{tag} mp_rank_{mp:02d}: {len(diff)} tensors, max abs difference {max(diff.values()):.3e}")
    sd = load(f"{folder}/mp_rank_00_model_states.pt")
    print(f"{tag}: {count} tensors over {len(mps)} model-parallel rank(s), max abs difference {worst:.3e} "
          f"(LR scheduler at {sd['lr_scheduler']['num_steps']} samples, global_steps {sd['global_steps']})")
    return worst == 0.0


def check_same(a, b):
    tags = [open(f"{c}/latest").read().strip() for c in (a, b)]
    names = sorted(os.listdir(f"{a}/{tags[0]}"))
    assert names == sorted(os.listdir(f"{b}/{tags[1]}")), "the checkpoints hold different files"
    worst = 0.0
    for name in names:
        x, y = (flatten(load(f"{c}/{t}/{name}")) for c, t in zip((a, b), tags))
        assert x.keys() == y.keys(), name
        for k in x:
            if k.startswith("rng_state."):  # Megatron's saved RNG states: a resumed process drew differently
                continue
            if x[k].is_floating_point():
                worst = max(worst, (x[k].float() - y[k].float()).abs().max().item() if x[k].numel() else 0.0)
            elif not torch.equal(x[k], y[k]):
                worst = float("inf")
    print(f"{tags[0]} vs {tags[1]}: {len(names)} files, every tensor (weights, fp32 partitions, Adam moments; "
          f"not Megatron's saved RNG states), max abs difference {worst:.3e}")
    return worst == 0.0


if __name__ == "__main__":
    if len(sys.argv) == 2 or sys.argv[2].startswith("global_step"):
        ok = check_master(*sys.argv[1:3])
    else:
        ok = check_same(sys.argv[1], sys.argv[2])
    sys.exit(0 if ok else 1)
