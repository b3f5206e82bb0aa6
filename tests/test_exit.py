"""Every finished launch exits 0: acco_ds destroys the process groups it creates, in ``engine.destroy()`` and, for
a script that never calls it, at interpreter exit, together with the default group the script left up.

Why: a gloo group left to the interpreter's teardown can abort its rank after the script's last line
("terminate called without an active exception": a gloo worker thread frees a Python-owned tensor once the
interpreter is finalizing; see benchmarks/exit_codes.py), and the ``deepspeed`` launcher then kills the ranks
still finishing."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dist import ROOT, free_port, run_in_session

ENGINE_SCRIPT = textwrap.dedent('''
    import atexit, json, os, sys
    import torch, torch.distributed as tdist
    import deepspeed, acco_ds
    from acco_ds.runtime.comm import lifetime

    def still_up():  # registered before any engine: runs after acco_ds's exit handler
        print(json.dumps({"initialized_at_exit": tdist.is_initialized()}), flush=True)
    atexit.register(still_up)
    deepspeed.init_distributed(dist_backend="gloo")

    def build(mode):
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
                  "acco": {"enabled": True, "mode": mode, "kernels": "torch"}}
        model = torch.nn.Linear(4, 1)
        engine = acco_ds.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        for _ in range(4):
            engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
            engine.step()
        return engine

    def gone(g):
        try:
            tdist.get_process_group_ranks(g)
        except (KeyError, ValueError, RuntimeError):
            return True
        return False

    kept = []
    for mode in sys.argv[1:]:  # each mode: one engine destroyed, one left to the exit handler
        out = {"mode": mode}
        first = build(mode)
        groups = list(first._acco_groups)
        out["groups"] = len(groups)
        out["armed"] = lifetime.is_armed() and first in lifetime.owners()
        first.destroy()
        out["destroyed"] = all(gone(g) for g in groups) and first._acco_groups == []
        out["forgotten"] = first not in lifetime.owners()
        kept.append(build(mode))  # never destroyed: the exit handler closes it
        out["second_owned"] = kept[-1] in lifetime.owners()
        print(json.dumps(out), flush=True)
''')


@pytest.mark.timeout(240)
def test_destroy_ends_the_engines_groups_and_exit_ends_the_rest(tmp_path):
    """acco and sync, one process: each mode's destroyed engine and its groups gone; the engines left up (one
    per mode) and the default group closed at exit."""
    modes = ["acco", "sync"]
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(script), *modes], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [out.get("mode") for out in lines[:-1]] == modes, lines
    for out in lines[:-1]:
        assert out["groups"] >= 1 and out["armed"], out
        assert out["destroyed"] and out["forgotten"] and out["second_owned"], out
    assert lines[-1] == {"initialized_at_exit": False}, lines  # the default group went too
    assert "terminate called" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_rank_diloco_launches_all_exit_zero(tmp_path):
    """The 4-rank local-SGD launch of the issue, as a user runs it (``engine.destroy()`` at the end, no
    ``destroy_process_group()``), several times: the launcher exits 0 each time, so every rank did."""
    bin_ = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ACCO_DS_AUTOPATCH")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for launch in range(3):
        cmd = [os.path.join(bin_, "deepspeed"), "--num_gpus", "4", "--master_port", str(free_port()),
               "examples/train_gpt.py", "--deepspeed_config", "configs/diloco_cpu.json", "--steps", "8",
               "--n_layer", "1", "--n_embd", "32", "--eval_batches", "2", "--corpus_bytes", "200000"]
        proc = run_in_session(cmd, 240, env, cwd=ROOT, check=False)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "terminate called" not in text, f"launch {launch}:\n{text[-4000:]}"
        assert "==== summary ====" in text and "exits with return code" not in text, text[-3000:]
