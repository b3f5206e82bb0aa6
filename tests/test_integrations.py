"""Zero-code use: the patch, the runner under each launcher, Hugging Face Trainer,
Accelerate, and the report. Every launch runs 2 CPU ranks with a hard timeout."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import acco_ds
from dist import ROOT, free_port

HERE = Path(__file__).resolve().parent / "integrations"
BIN = Path(sys.executable).parent


def tool(name):
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name)


def run(cmd, timeout=240):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s:\n{(err.stdout or '')[-3000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def ranks(out, n=2):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def ds_config(tmp_path, acco=True):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}, "steps_per_print": 1000}
    if acco:
        cfg["acco"] = {"enabled": True, "mode": "acco"}
    path = tmp_path / ("acco.json" if acco else "stock.json")
    path.write_text(json.dumps(cfg))
    return str(path)


def test_patch_is_idempotent_and_reversible():
    import deepspeed
    original = deepspeed.initialize
    try:
        acco_ds.patch()
        patched = deepspeed.initialize
        acco_ds.patch()
        assert deepspeed.initialize is patched and patched is not original and acco_ds.is_patched()
        assert patched.__wrapped__ is original
    finally:
        acco_ds.unpatch()
    assert deepspeed.initialize is original and not acco_ds.is_patched()
    acco_ds.unpatch()  # harmless twice


def test_runner_moves_local_rank_after_the_script():
    from acco_ds.run import split_argv
    assert split_argv(["--local_rank=1", "train.py", "--lr", "1"]) == (["--local_rank=1"], "train.py", False,
                                                                       ["--lr", "1"])
    assert split_argv(["--local_rank", "0", "-m", "pkg.train", "x"]) == (["--local_rank=0"], "pkg.train", True, ["x"])
    with pytest.raises(SystemExit, match="no script"):
        split_argv(["--local_rank=0"])


@pytest.mark.parametrize("launcher", ["deepspeed --module", "deepspeed --no_python", "torchrun", "accelerate"])
def test_runner_gives_an_unmodified_script_acco(launcher, tmp_path):
    script = str(HERE / "plain_deepspeed.py")
    args = [script, "--out", str(tmp_path), "--steps", "3"]
    port = str(free_port())
    if launcher == "deepspeed --module":
        cmd = [tool("deepspeed"), "--num_gpus", "2", "--master_port", port, "--module", "acco_ds.run"]
    elif launcher == "deepspeed --no_python":
        if tool("acco-ds-run") is None:
            pytest.skip("acco-ds-run console script not installed (pip install -e .)")
        cmd = [tool("deepspeed"), "--num_gpus", "2", "--master_port", port, "--no_python", tool("acco-ds-run")]
    elif launcher == "torchrun":
        cmd = [tool("torchrun"), "--nproc_per_node", "2", "--master_port", port, "-m", "acco_ds.run"]
    else:
        if tool("accelerate") is None:
            pytest.skip("accelerate not installed")
        cmd = [tool("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port, "-m", "acco_ds.run"]
    run(cmd + args + ["--deepspeed_config", ds_config(tmp_path)])
    for r in ranks(tmp_path):
        assert r["engine"] == "ACCOEngine" and r["global_steps"] == 3
    if launcher.startswith("deepspeed"):
        assert [r["local_rank"] for r in ranks(tmp_path)] == [0, 1]  # --local_rank reached the script
    # Without the block the same runner gives stock DeepSpeed.
    if launcher == "torchrun":
        cmd[cmd.index(port)] = str(free_port())  # a fresh port: the first run's may linger in TIME_WAIT
        run(cmd + args + ["--deepspeed_config", ds_config(tmp_path, acco=False)])
        assert {r["engine"] for r in ranks(tmp_path)} == {"DeepSpeedEngine"}


def test_hugging_face_trainer_with_acco_block(tmp_path):
    pytest.importorskip("transformers")
    steps = 6
    run([tool("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module", "acco_ds.run",
         str(HERE / "hf_trainer.py"), str(tmp_path), str(steps)], timeout=400)
    r = ranks(tmp_path)[0]
    rows = r["first"]["rows"]
    assert {row["engine"] for row in rows} == {"ACCOEngine"}
    # gradient_accumulation_steps=2, so k=1: ACCO commits after micro-batches 3, 5, 7, ...
    # and the Trainer's step s (after micro-batch 2s) sees s-1 committed steps.
    assert [row["engine_steps"] for row in rows] == [row["hf_step"] - 1 for row in rows]
    assert [row["hf_step"] for row in rows] == list(range(1, steps + 1))
    losses = r["first"]["losses"]
    assert losses[-1] < losses[0] - 0.3, losses
    resumed = r["resumed"]["rows"]
    assert [row["hf_step"] for row in resumed] == [steps + 1, steps + 2]
    assert resumed[-1]["engine_steps"] == steps + 1


def test_accelerate_loop_with_deepspeed_plugin(tmp_path):
    pytest.importorskip("accelerate")
    run([tool("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(HERE / "hf_accelerate.py"), str(tmp_path), "40"], timeout=300)
    for r in ranks(tmp_path):
        assert r["engine"] == "ACCOEngine" and r["global_steps"] == 40
        assert r["micro"] == 1 + 2 * 40  # k start-up micro-batches, then 2k per step (k=1)
        first, last = sum(r["losses"][:8]) / 8, sum(r["losses"][-8:]) / 8
        assert last < 0.2 * first, r["losses"]
        assert r["restored"] and r["steps_after_load"] == 40


def test_report():
    proc = run([sys.executable, "-m", "acco_ds.report"], timeout=300)
    out = proc.stdout
    for needle in ("acco_ds report", "deepspeed", "patch active ....... False", "acco_cpu_ops",
                   "engine kernels ..... native-cpu", "DeepSpeed general environment info"):
        assert needle in out, out
