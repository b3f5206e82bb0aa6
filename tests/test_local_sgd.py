"""The local-SGD family (DiLoCo, CO2) on replica groups, against the float64 simulator.

2 ranks: R=2 replicas of k=1 (DiLoCo as published); 4 ranks: R=2 replicas of k=2 (ZeRO-1 inside each
replica). Every rank's replica weights and the anchor users read match the simulator after every
inner step."""

import pytest
import torch

import common
from acco_ds.testing.simulator import simulate_local_sgd
from dist import launch
from test_engine import assert_matches

GAS, STEPS, H = 2, 6, 2


def local(mode, k, **outer):
    block = {"sync_every": H, "replica_group_size": k, **outer}
    return {"mode": mode, "local_sgd": block}


def reference(mode, world, k, clip=0.0, steps=STEPS, **outer):
    from acco_ds.config import ACCOConfig
    settings = ACCOConfig(enabled=True, **local(mode, k, **outer)).outer
    return simulate_local_sgd(mode, common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                              group_size=k, gradient_accumulation_steps=GAS, steps=steps, sync_every=H,
                              optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=settings["outer_lr"],
                              outer_momentum=settings["outer_momentum"], nesterov=settings["nesterov"],
                              staleness_penalty=settings["staleness_penalty"],
                              momentum_clip=settings["outer_momentum_clip"], clip=clip, dtype=torch.float64)


CASES = [("diloco", {}, 0.0), ("co2", {}, 0.0), ("co2", {"staleness_penalty": 2.0, "outer_momentum_clip": 0.01}, 0.05),
         ("diloco", {"nesterov": False, "outer_lr": 0.5}, 0.05)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, k", [(2, 1), (4, 2)])
def test_diloco_and_co2_match_the_simulator(world, k):
    runs = [dict(config=common.ds_config(acco=local(mode, k, **outer), gas=GAS, clip=clip), steps=STEPS,
                 record_committed=True) for mode, outer, clip in CASES]
    results = launch({"runs": runs}, world_size=world, timeout=500)
    for i, (mode, outer, clip) in enumerate(CASES):
        ref = reference(mode, world, k, clip=clip, **outer)
        for rank in range(world):
            r = results[rank][i]
            assert r["global_steps"] == STEPS
            assert_matches(r["params"], ref["replicas"][rank // k])
            assert_matches(r["committed"], ref["anchor"])
        # The replicas really differ between syncs, and the outer step moves the anchor off the mean.
        a, b = results[0][i]["params"][0], results[world - 1][i]["params"][0]
        assert (a - b).abs().max() > 1e-4, "replicas trained on the same data"
    # Different settings give different trajectories (the comparison can tell them apart).
    assert (results[0][1]["committed"][-1] - results[0][2]["committed"][-1]).abs().max() > 1e-5
