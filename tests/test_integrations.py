"""Zero-code use: the patch, the runner under each launcher, Hugging Face Trainer,
Accelerate, and the report. Every launch runs 2 CPU ranks with a hard timeout."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import acco_ds
from dist import ROOT, free_port, run_in_session

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

HERE = Path(__file__).resolve().parent / "integrations"
BIN = Path(sys.executable).parent


def tool(name):
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name)


def run(cmd, timeout=180, env=None):
    """Run ``cmd`` (a launcher and its ranks) in its own session; on timeout kill the whole
    process group, so no rank outlives the test."""
    extra = dict(env or {})
    path = [extra.pop("PYTHONPATH", ""), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra,
               PYTHONPATH=os.pathsep.join(p for p in path if p))
    return run_in_session(cmd, timeout, env)


def ranks(out, n=2):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def console_script(tmp_path):
    """What ``pip install`` writes for ``acco-ds-run=acco_ds.cli.run:main`` when it is not installed."""
    path = tmp_path / "acco-ds-run"
    path.write_text(f"#!{sys.executable}\nimport sys\nfrom acco_ds.cli.run import main\nsys.exit(main())\n")
    path.chmod(0o755)
    return str(path)


def ds_config(tmp_path, acco=True):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}, "steps_per_print": 1000}
    if acco:
        cfg["acco"] = {"enabled": True, "mode": "acco"}
    path = tmp_path / ("acco.json" if acco else "stock.json")
    path.write_text(json.dumps(cfg))
    return str(path)


def test_patch_is_idempotent_and_reversible():
    import importlib

    import deepspeed
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    autopatched = acco_ds.is_patched()  # the startup hook patched this process's deepspeed
    acco_ds.unpatch()
    original, original_shm = deepspeed.initialize, ds_torch.build_shm_op
    assert not getattr(original_shm, "_acco_guarded", False), "unpatch() left DeepSpeed's build_shm_op wrapped"
    try:
        acco_ds.patch()
        patched = deepspeed.initialize
        acco_ds.patch()
        assert deepspeed.initialize is patched and patched is not original and acco_ds.is_patched()
        assert patched.__wrapped__ is original
        assert ds_torch.build_shm_op.__wrapped__ is original_shm  # patch() guards DeepSpeed's op build
    finally:
        acco_ds.unpatch()
    assert deepspeed.initialize is original and not acco_ds.is_patched()
    assert ds_torch.build_shm_op is original_shm  # everything patch() changed is restored
    acco_ds.unpatch()  # harmless twice
    if autopatched:
        acco_ds.patch()


def test_patched_initialize_picks_the_engine_from_the_config(tmp_path):
    """A real 1-rank gloo group: the engine class follows the "acco" block, the swap is scoped to
    the call, a one-stage PipelineModule gets ACCO's pipeline engine, unpatch restores."""
    out = tmp_path / "patch.json"
    # Opt out of the startup hook: this test is about explicit patch()/unpatch().
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "ACCO_DS_AUTOPATCH": "0"}
    run([sys.executable, str(HERE / "patch_check.py"), str(out)], timeout=120, env=env)
    r = json.loads(out.read_text())
    assert r["stock_before_patch"] == "DeepSpeedEngine"  # without patch() the block is inert
    assert r["idempotent"] and r["acco_engine"] == "ACCOEngine" and r["acco_is_subclass"]
    assert r["acco_global_steps"] == 3  # 7 micro-batches, gas=2 (k=1): commits after 3, 5, 7
    assert r["acco_config_params_engine"] == "ACCOEngine"  # Accelerate's way of passing the config
    assert r["disabled_engine"] == r["no_block_engine"] == "DeepSpeedEngine" and r["name_restored"]
    assert r["pipeline_engine"] == "ACCOPipelineEngine" and r["pipeline_name_restored"]
    assert r["unpatched"] and r["after_unpatch_engine"] == "DeepSpeedEngine"


def test_runner_moves_local_rank_after_the_script():
    from acco_ds.cli.run import split_argv
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
        cmd = [tool("deepspeed"), "--num_gpus", "2", "--master_port", port, "--module", "acco_ds.cli.run"]
    elif launcher == "deepspeed --no_python":
        runner = tool("acco-ds-run") or console_script(tmp_path)
        cmd = [tool("deepspeed"), "--num_gpus", "2", "--master_port", port, "--no_python", runner]
    elif launcher == "torchrun":
        cmd = [tool("torchrun"), "--nproc_per_node", "2", "--master_port", port, "-m", "acco_ds.cli.run"]
    else:
        if tool("accelerate") is None:
            pytest.skip("accelerate not installed")
        cmd = [tool("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port, "-m", "acco_ds.cli.run"]
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
    run([tool("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module", "acco_ds.cli.run",
         str(HERE / "hf_trainer.py"), str(tmp_path), str(steps)], timeout=180)
    r = ranks(tmp_path)[0]
    rows = r["first"]["rows"]
    assert {row["engine"] for row in rows} == {"ACCOEngine"}
    # gradient_accumulation_steps=2, so k=1: ACCO commits after micro-batches 3, 5, 7, ...
    # and the Trainer's step s (after micro-batch 2s) sees s-1 committed steps.
    assert [row["engine_steps"] for row in rows] == [row["hf_step"] - 1 for row in rows]
    assert [row["hf_step"] for row in rows] == list(range(1, steps + 1))
    losses = r["first"]["losses"]
    assert losses[-1] < losses[0] - 0.3, losses
    assert r["first"]["saved_model_matches"]
    # The Trainer's save at step 6 commits the step whose half-batches are complete: N iterations, N steps
    # (DeepSpeed's tag = engine steps).
    assert "global_step%d" % steps in r["first"]["checkpoint_files"]
    resumed = r["resumed"]["rows"]
    assert [row["hf_step"] for row in resumed] == [steps + 1, steps + 2]
    # The resumed engine continues ACCO's pipeline where it stopped: still one commit behind.
    assert [row["engine_steps"] for row in resumed] == [steps, steps + 1]


def test_accelerate_loop_with_deepspeed_plugin(tmp_path):
    pytest.importorskip("accelerate")
    run([tool("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(HERE / "hf_accelerate.py"), str(tmp_path), "40"], timeout=180)
    for r in ranks(tmp_path):
        assert r["engine"] == "ACCOEngine" and r["global_steps"] == 40
        assert r["micro"] == 1 + 2 * 40  # k start-up micro-batches, then 2k per step (k=1)
        first, last = sum(r["losses"][:8]) / 8, sum(r["losses"][-8:]) / 8
        assert last < 0.2 * first, r["losses"]
        assert r["restored"] and r["steps_after_load"] == 40


def test_report():
    proc = run([sys.executable, "-m", "acco_ds.cli.report"], timeout=180)
    out = proc.stdout
    import deepspeed
    import torch
    for needle in ("acco_ds report", f"acco_ds ............ {acco_ds.__version__}",
                   f"torch............... {torch.__version__}", f"deepspeed........... {deepspeed.__version__}",
                   "pydantic............", "patch active ....... False",
                   "DeepSpeed internals  ok (", "acco_cpu_ops", "acco_cuda_ops",
                   "DeepSpeed general environment info", "torch version ...................."):
        assert needle in out, out
    # The engine's choice agrees with the ops table's "auto uses" for the CPU op.
    cpu_row = next(line.split() for line in out.splitlines() if line.strip().startswith("acco_cpu_ops"))
    assert f"engine kernels ..... {cpu_row[5]} " in out, out
    # `acco-ds report` form, and a usage error for anything else.
    assert "acco_ds report" in run([sys.executable, "-c", "import sys; from acco_ds.cli.report import main; "
                                    "sys.exit(main(['report']))"], timeout=180).stdout


def test_report_without_ops_says_so(tmp_path):
    """A build where acco_ds.ops lacks op_report/load_kernels: clear lines, no crash."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, types\nsys.modules['acco_ds.ops'] = types.ModuleType('acco_ds.ops')\n")
    proc = run([sys.executable, "-m", "acco_ds.cli.report"], timeout=180,
               env={"PYTHONPATH": str(tmp_path)})
    assert "acco_ds.ops has no op_report()" in proc.stdout, proc.stdout
    assert "engine kernels ..... unavailable (AttributeError" in proc.stdout, proc.stdout
    assert "DeepSpeed general environment info" in proc.stdout
