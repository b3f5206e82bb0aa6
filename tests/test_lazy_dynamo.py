"""acco_ds._lazy_dynamo: an ACCO engine builds, trains and checkpoints without importing torch._dynamo
(about 2.4 s of CPU per rank), and torch.compile still works afterwards, with the optimizer's methods disabled
for dynamo exactly as torch does it. Each case runs in a fresh interpreter: this test process has imported
torch._dynamo long ago."""

import os
import subprocess
import sys
import textwrap

import pytest

from dist import ROOT, free_port


def run(code: str) -> str:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(300)
def test_an_acco_engine_never_imports_dynamo(tmp_path):
    out = run(f"""
        import sys, torch, deepspeed
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        cfg = {{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
               "zero_optimization": {{"stage": 1}}, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2}}}},
               "acco": {{"enabled": True, "mode": "acco"}}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x = torch.randn(4, 16); y = x.sum(1, keepdim=True)
        losses = []
        for _ in range(60):
            loss = torch.nn.functional.mse_loss(engine(x), y); engine.backward(loss); engine.step()
            losses.append(loss.item())
        engine.save_checkpoint({str(tmp_path)!r})
        engine.module.state_dict()
        print("dynamo", "torch._dynamo" in sys.modules, "loss", losses[0], losses[-1])
    """)
    words = out.split()
    assert words[words.index("dynamo") + 1] == "False", out
    first, last = float(words[-2]), float(words[-1])
    assert last < 0.5 * first, out  # it trained


@pytest.mark.timeout(300)
def test_compile_still_works_and_the_optimizer_is_disabled_as_torch_does_it():
    out = run("""
        import sys, torch
        import acco_ds.torch  # defers the optimizer's dynamo import, as a torch-host script does
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad(); opt.state_dict()
        print("before", "torch._dynamo" in sys.modules)
        import deepspeed
        from acco_ds.deepspeed.compat import defer_muon_compile
        defer_muon_compile()
        from deepspeed.runtime.zero.muon import original_muon  # its torch.compile decorators now wait
        print("muon", "torch._dynamo" in sys.modules)
        compiled = torch.compile(model, backend="eager")  # imports torch._dynamo
        x = torch.randn(4, 8)
        assert torch.equal(compiled(x), model(x))
        opt.zero_grad()
        slot = getattr(torch.optim.Optimizer.zero_grad.__wrapped__, "__dynamo_disable")
        print("slot", slot.__qualname__)
        loss = compiled(x).pow(2).mean(); loss.backward(); opt.step()
        print("after", float(compiled(x).pow(2).mean()) < float(loss))
    """)
    assert "before False" in out and "muon False" in out and "after True" in out, out
    assert "_call_through" not in out.split("slot", 1)[1].split()[0], out  # torch's own disabled wrapper now
