"""Loading a checkpoint runs no code (``acco_ds/safe_load.py``).

Each file of an ``acco_ds.torch`` checkpoint (meta.pt, model.pt, rank0.pt, rank1.pt) is replaced in turn by a
``torch.save``d object whose ``__reduce__`` would create a marker file, the way a hostile checkpoint would run
a command. Every copy is loaded fully and weights-only on the layout it was saved with (2 ranks: this module
is the worker of one launch) and resharded (1 rank, in the test process): no marker appears, and every load
that reads the file fails on every rank with an error naming it. Loads that do not read a file are unaffected
(a same-layout full load takes its optimizer state from rank*.pt, not model.pt; a weights-only load reads
meta.pt and model.pt only). ``client_state`` that a safe load would refuse is refused at save, and the
DeepSpeed host's resharding reads ZeRO files safely too.
"""

import json
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import common

FILES = ("meta.pt", "model.pt", "rank0.pt", "rank1.pt")
KINDS = {"full": {}, "weights": {"load_optimizer_states": False}}
CONFIG = {"gradient_accumulation_steps": 2, "acco": {"enabled": True, "mode": "acco"}}
SAFE_LOAD_REFUSAL = "holds objects a safe load does not accept: Unsupported global: GLOBAL io.open"


class Payload:
    """Unpickled unsafely, creates the file ``marker`` (the harmless stand-in for ``os.system``)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def poison(ckpt: Path, root: Path) -> dict:
    """One copy of ``ckpt`` per file, that file replaced by a payload; {file: copy}."""
    copies = {}
    for name in FILES:
        copy = root / f"poisoned_{name[:-3]}"
        shutil.copytree(ckpt, copy)
        torch.save({"weights": Payload(root / f"ran_{name}")}, copy / name)
        copies[name] = copy
    return copies


def train(model, optimizer, rank, steps=2):
    micro = 0
    for _ in range(steps):
        for _ in range(CONFIG["gradient_accumulation_steps"]):
            (common.loss_fn(model, common.micro_batch(rank, micro)) / 2).backward()
            micro += 1
        optimizer.step()
        optimizer.zero_grad()


def build():
    import acco_ds.torch
    model = common.make_model(0)
    return acco_ds.torch.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), CONFIG)


def try_loads(copies, model, optimizer) -> dict:
    """{(file, kind): None if the load went through, else the error's text} for every poisoned copy."""
    import acco_ds.torch
    seen = {}
    for name, copy in copies.items():
        for kind, kwargs in KINDS.items():
            try:
                acco_ds.torch.load(str(copy), model, optimizer, **kwargs)
                seen[(name, kind)] = None
            except Exception as err:  # noqa: BLE001 - the test reads the message
                seen[(name, kind)] = f"{type(err).__name__}: {err}"
    return seen


def worker():
    """One of the launch's 2 ranks: train, save, refuse an unsafe client_state, load every poisoned copy."""
    import acco_ds.torch
    import numpy
    import torch.distributed as dist
    spec, outdir = json.load(open(sys.argv[1])), Path(sys.argv[2])
    rank, root = int(os.environ["RANK"]), Path(spec["root"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model, optimizer = build()
    train(model, optimizer, rank)
    acco_ds.torch.save(str(root / "ckpt"), model, optimizer, client_state={"step": 2, "rng": torch.get_rng_state()})
    out = {}
    try:  # numpy's RNG state holds numpy arrays, which a safe load does not build
        acco_ds.torch.save(str(root / "bad"), model, optimizer, client_state={"rng": numpy.random.get_state()})
    except ValueError as err:
        out["bad_save"] = str(err)
    out["bad_written"] = (root / "bad").exists()
    if rank == 0:
        poison(root / "ckpt", root)
    dist.barrier()
    out["loads"] = try_loads({name: root / f"poisoned_{name[:-3]}" for name in FILES}, model, optimizer)
    train(model, optimizer, rank, steps=1)  # every rank still in step after the refusals
    torch.save(out, outdir / f"result{rank}.pt")
    optimizer.close()
    dist.barrier()
    dist.destroy_process_group()


def assert_refused(text, name):
    assert text is not None and SAFE_LOAD_REFUSAL in text and f"poisoned_{name[:-3]}/{name}" in text, text
    assert "never retries unsafely" in text, text


def test_client_state_and_zero_files_are_checked_without_running_code(tmp_path):
    """The unit-level checks: check_safe refuses what a safe load would, naming why; DeepSpeed's ZeRO files
    load with their plain data types allowed, and a payload in one is refused by name."""
    from acco_ds.safe_load import check_safe
    check_safe({"step": 3, "rng": torch.get_rng_state(), "names": ["a", ("b", 1.5)], "none": None}, "x")
    with pytest.raises(ValueError, match=r"^client_state holds objects a safe load does not accept: Unsupported "
                                         r"global: GLOBAL test_checkpoint_safety\.Other was not an allowed global "
                                         r"by default\. Checkpoints are loaded with torch.load\(weights_only=True\)"):
        check_safe({"obj": Other()}, "client_state")
    from acco_ds.deepspeed.compat import ZERO_FILE_TYPES
    from acco_ds.deepspeed.reshard import _read
    from acco_ds.safe_load import UnsafeCheckpointFile
    ds = {t.__name__: t for t in ZERO_FILE_TYPES}
    good = tmp_path / "zero_good.pt"
    torch.save({"optimizer_state_dict": {
        "loss_scaler": ds["LossScaler"](2.0), "zero_stage": ds["ZeroStageEnum"](1), "w": torch.ones(3),
        "param_slice_mappings": [{"fc1.weight": ds["fragment_address"](numel=3, start=0)}]}}, good)
    state = _read(good, tmp_path, "global_step1")
    assert state["loss_scaler"].cur_scale == 2.0 and state["zero_stage"] == ds["ZeroStageEnum"](1)
    assert state["param_slice_mappings"][0]["fc1.weight"].numel == 3 and torch.equal(state["w"], torch.ones(3))
    bad = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Payload(tmp_path / "ran")}, bad)
    with pytest.raises(UnsafeCheckpointFile, match=f"the checkpoint in {tmp_path} .tag global_step1.: {bad} "
                                                   f"{SAFE_LOAD_REFUSAL}"):
        _read(bad, tmp_path, "global_step1")
    assert not (tmp_path / "ran").exists()


class Other:
    pass


@pytest.fixture
def one_rank():
    import torch.distributed as tdist
    from dist import free_port
    own = not tdist.is_initialized()
    if own:
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if own:
        tdist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_no_checkpoint_file_runs_code_when_loaded(tmp_path, one_rank):
    from dist import launch
    out = launch({"root": str(tmp_path)}, world_size=2, timeout=150, worker=Path(__file__),
                 workdir=tmp_path / "logs")
    for rank in range(2):
        assert "client_state holds objects a safe load does not accept: Unsupported global: GLOBAL numpy" in \
            out[rank]["bad_save"] and "a numpy array as a tensor" in out[rank]["bad_save"], out[rank]
        assert not out[rank]["bad_written"], "the refused save wrote a folder"
        loads = out[rank]["loads"]
        assert_refused(loads[("meta.pt", "full")], "meta.pt")
        assert_refused(loads[("meta.pt", "weights")], "meta.pt")
        assert_refused(loads[("model.pt", "weights")], "model.pt")
        assert loads[("model.pt", "full")] is None  # model.pt is not read: the optimizer state has it all
        for name in ("rank0.pt", "rank1.pt"):  # every rank refuses, also one whose own file is intact
            assert_refused(loads[(name, "full")], name)
            assert loads[(name, "weights")] is None  # a weights-only load reads meta.pt and model.pt only
    told = out[0]["loads"][("rank1.pt", "full")]  # rank 0's own file is intact: it says rank 1's problem
    assert told.startswith("RuntimeError: acco_ds.torch.load: rank 1 could not load its file: acco_ds.torch"), told
    # On one rank the full load reshards (2 ranks to 1): every file is read, so each poisoned one is refused.
    model, optimizer = build()
    try:
        loads = try_loads({name: tmp_path / f"poisoned_{name[:-3]}" for name in FILES}, model, optimizer)
    finally:
        optimizer.close()
    for name in FILES:
        assert_refused(loads[(name, "full")], name)
        assert (loads[(name, "weights")] is None) == name.startswith("rank"), loads[(name, "weights")]
    assert not list(tmp_path.glob("ran_*")), "a checkpoint file ran code"
    torch.load(tmp_path / "poisoned_meta" / "meta.pt", weights_only=False)  # the payload is live: unsafe, it runs
    assert (tmp_path / "ran_meta.pt").exists()


if __name__ == "__main__":
    worker()
