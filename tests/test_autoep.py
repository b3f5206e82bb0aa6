"""DeepSpeed's AutoEP (an ``"expert_parallel"`` block turns a Hugging Face MoE model's layers into expert-parallel
ones) under acco_ds: a tiny Mixtral from a config (random weights, no download), ``autoep_size`` 2 on 2 CPU ranks.
``sync`` equals stock ZeRO-1 on every rank, weights and losses; ``acco`` trains it (loss goes down)."""

import json
import os
import sys

import pytest

from dist import ROOT, free_port, run_in_session

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_autoep_mixtral_sync_equals_stock_and_acco_trains(tmp_path):
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ACCO_DS_AUTOPATCH")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
           str(free_port()), "tests/integrations/autoep_mixtral.py", "--out", str(tmp_path), "--modes", "sync,acco"]
    run_in_session(cmd, 360, env, cwd=ROOT)
    for r in range(2):
        runs = json.loads((tmp_path / f"rank{r}.json").read_text())
        stock, sync, acco = runs["stock"], runs["sync"], runs["acco"]
        assert stock["engine"] == "DeepSpeedEngine" and sync["engine"] == acco["engine"] == "ACCOEngine"
        assert sync["losses"] == pytest.approx(stock["losses"], rel=1e-6), (r, sync["losses"], stock["losses"])
        assert stock["digest"].keys() == sync["digest"].keys()
        assert any(".experts." in name for name in stock["digest"]), list(stock["digest"])[:8]
        for name, value in stock["digest"].items():
            assert sync["digest"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), (r, name)
        first, last = sum(acco["losses"][:4]) / 4, sum(acco["losses"][-4:]) / 4
        assert last < first - 0.2, (r, acco["losses"])
