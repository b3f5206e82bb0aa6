"""DeepSpeed's PipelineEngine at pipeline size 1 (Megatron-DeepSpeed's default engine, without
--no-pipeline-parallel): train_batch() with ACCO matches the simulator; sync matches stock; resume is exact;
diloco and co2 on it match the local-SGD simulator (what users read: the anchor)."""

import pytest
import torch

import common
from dist import launch
from test_engine import STEPS, W, assert_matches, reference
from test_local_sgd import GAS, STEPS as LOCAL_STEPS, local, reference as local_reference

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out


@pytest.mark.timeout(600)
def test_pipeline_engine_with_acco_matches_the_simulator_and_resumes(tmp_path):
    cfg = common.ds_config(acco={"mode": "acco"}, clip=0.05)
    ckpt = str(tmp_path / "ckpt")
    runs = [dict(config=cfg, steps=STEPS, pipe=True),
            dict(config=common.ds_config(acco={"mode": "sync"}), steps=STEPS, pipe=True),
            dict(config=common.ds_config(), steps=STEPS, pipe=True, use_acco_initialize=False),
            dict(config=cfg, steps=100, pipe=True, max_micro=10, save=ckpt)]
    runs += [dict(config=common.ds_config(acco=local(mode, 1), gas=GAS), steps=LOCAL_STEPS, pipe=True)
             for mode in ("diloco", "co2")]
    results = launch({"runs": runs}, world_size=W, timeout=400)
    acco, sync, stock, saved = results[0][:4]
    for rank in range(W):
        for i, mode in enumerate(("diloco", "co2"), start=4):
            assert_matches(results[rank][i]["params"], local_reference(mode, W, 1)["anchor"])
    assert acco["optimizer_class"] == "ACCOZeroOptimizer"
    assert_matches(acco["params"], reference("acco", clip=0.05)["params"])
    # One train_batch is one step; the first has nothing to commit yet (ACCO's start-up half-batch).
    assert acco["applied"][:3] == [False, True, True]
    assert_matches(sync["params"], [p.double() for p in stock["params"]], atol=1e-6, rtol=1e-6)
    resumed = launch({"runs": [dict(config=cfg, steps=STEPS, pipe=True, load=ckpt)]}, world_size=W, timeout=300)[0][0]
    start = resumed["loaded"]["global_steps"]
    assert start == saved["global_steps"] and start < STEPS
    for got, want in zip(resumed["params"], acco["params"][start:]):
        assert torch.equal(got, want), (got - want).abs().max()
