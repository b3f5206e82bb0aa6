"""Node-aware (hierarchical) collectives in the engine: 4 CPU ranks as 2 nodes of 2 (gloo), every round mode
against the float64 simulator with clipping that bites, sync against stock DeepSpeed ZeRO-1, checkpoints
interchangeable with flat runs, a local-SGD mode, and the config's refusals."""

import pytest
import torch

import common
from acco_ds.testing.simulator import simulate
from dist import launch
from test_engine import assert_matches

pytestmark = pytest.mark.slow
W, STEPS, CLIP = 4, 4, 0.05
HIER = {"layout": "hierarchical", "ranks_per_node": 2}


def reference(mode, steps=STEPS):
    return simulate(mode, common.make_model(0), common.loss_fn, common.micro_batch, world_size=W,
                    gradient_accumulation_steps=4, steps=steps, optimizer_fn=common.reference_optimizer("AdamW"),
                    clip=CLIP, dtype=torch.float64)


@pytest.mark.timeout(420)
def test_every_round_mode_matches_the_simulator_and_sync_matches_stock():
    modes = ("acco", "dpu", "sync")
    runs = [dict(config=common.ds_config(acco={"mode": m, "collectives": HIER}, clip=CLIP), steps=STEPS)
            for m in modes]
    runs.append(dict(config=common.ds_config(clip=CLIP), steps=STEPS, use_acco_initialize=False))
    results = launch({"runs": runs}, world_size=W, timeout=360)
    for i, mode in enumerate(modes):
        for rank in range(W):
            r = results[rank][i]
            assert r["collectives"] == "hierarchical (2 nodes x 2 ranks)", r["collectives"]
            assert torch.equal(r["params"][-1], results[0][i]["params"][-1]), "ranks disagree"
        assert_matches(results[0][i]["params"], reference(mode)["params"])
    assert max(n for n in results[0][0]["norms"]) > CLIP, "clipping did not bite"
    assert_matches(results[0][2]["params"], [p.double() for p in results[0][3]["params"]], atol=1e-6, rtol=1e-6)


@pytest.mark.timeout(420)
def test_checkpoints_move_between_flat_and_hierarchical_runs(tmp_path):
    """Saved mid-run with one layout, loaded with the other: the loaded weights are the saved ones bit for
    bit and the run goes on along the simulator's trajectory; both directions."""
    layouts = {"flat": {"layout": "flat"}, "hierarchical": HIER}
    cfg = {name: common.ds_config(acco={"mode": "acco", "collectives": c}, clip=CLIP) for name, c in layouts.items()}
    saves = {name: str(tmp_path / name) for name in layouts}
    saved = launch({"runs": [dict(config=cfg[name], steps=100, max_micro=11, save=path, record_committed=True)
                             for name, path in saves.items()]}, world_size=W, timeout=300)
    other = {"flat": "hierarchical", "hierarchical": "flat"}
    resumed = launch({"runs": [dict(config=cfg[other[name]], steps=STEPS, load=path) for name, path in saves.items()]},
                     world_size=W, timeout=300)
    ref = reference("acco")["params"]
    for i, name in enumerate(saves):
        r = resumed[0][i]
        assert r["collectives"] == ("flat" if other[name] == "flat" else "hierarchical (2 nodes x 2 ranks)")
        assert torch.equal(r["loaded"]["params"], saved[0][i]["committed"][-1]), name
        steps = r["loaded"]["global_steps"]
        assert steps == len(saved[0][i]["committed"]) and 0 < steps < STEPS
        assert_matches(r["params"], ref[steps:])


@pytest.mark.timeout(300)
def test_local_sgd_with_replicas_inside_nodes_keeps_flat_inner_steps():
    """diloco, replicas of 2 on nodes of 2: inner steps never leave the node (flat), the outer all-reduce
    runs over the rails; the run matches a flat run bit for bit."""
    block = {"sync_every": 2, "replica_group_size": 2}
    runs = [dict(config=common.ds_config(acco={"mode": "diloco", "local_sgd": block, "collectives": c}, gas=2),
                 steps=STEPS) for c in (HIER, {"layout": "flat"})]
    results = launch({"runs": runs}, world_size=W, timeout=240)
    for rank in range(W):
        hier, flat = results[rank]
        assert hier["collectives"] == flat["collectives"] == "flat"
        for a, b in zip(hier["params"], flat["params"]):
            assert torch.equal(a, b)
