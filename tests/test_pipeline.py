"""DeepSpeed's PipelineEngine (Megatron-DeepSpeed's default engine). At pipeline size 1 (without
--no-pipeline-parallel): train_batch() with ACCO matches the simulator; sync matches stock; resume is exact;
diloco and co2 on it match the local-SGD simulator (what users read: the anchor). With two stages: sync, dpu,
acco and diloco match the simulator of the unsplit model, resume is exact, and a weight tied across stages is
reduced as stock does."""

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


def _whole(results, run, steps):
    """Per data-parallel rank, the unsplit model's flat parameters after each step, from its two stages."""
    by = {(r[run]["layout"]["stage"], r[run]["layout"]["dp"]): r[run] for r in results}
    return [[torch.cat([by[(0, dp)]["params"][s].reshape(-1), by[(1, dp)]["params"][s].reshape(-1)])
             for s in range(steps)] for dp in range(2)]


# EDiT (layer-wise sync, norm weighting and the pseudo-gradient clip: norms over the whole model) and
# Streaming DiLoCo (2 fragments, each synced one inner step late, half local) on the split layouts
OTHER_LOCAL_SGD = {
    "edit": {"mode": "edit", "local_sgd": {"sync_every": 2, "replica_group_size": 1, "weighting": "norm",
                                           "pseudo_grad_clip": 0.002}},
    "streaming": {"mode": "diloco", "local_sgd": {"sync_every": 4, "replica_group_size": 1, "fragments": 2,
                                                  "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}},
}
SPLIT_STEPS = 6  # EDiT syncs 3 times, each Streaming fragment once or twice


def stage_fragments(model, stages, fragments):
    """Streaming DiLoCo's fragment of each parameter when each of ``stages`` (lists of parameter counts, in
    order) cuts its own parameters by the one-stage rule (parameter j of a stage with N elements goes to
    fragment floor(F o_j / N))."""
    sizes = [p.numel() for p in model.parameters()]
    owner, j = [], 0
    for count in stages:
        stage = sizes[j:j + count]
        owner += [fragments * sum(stage[:i]) // sum(stage) for i in range(count)]
        j += count
    assert j == len(sizes)
    return owner


def other_local_sgd_reference(name, block, model, micro_batch, world, steps, clip=0.0, owner=None):
    """The local-SGD simulator of the unsplit model for one of OTHER_LOCAL_SGD."""
    from acco_ds.config import ACCOConfig
    from acco_ds.testing.simulator import simulate_local_sgd
    cfg = ACCOConfig(enabled=True, **block)
    o, l = cfg.outer, cfg.local_sgd
    extra = (dict(weighting=l.weighting, pseudo_grad_clip=l.pseudo_grad_clip) if name == "edit" else
             dict(fragments=l.fragments, fragment_sync_delay=l.fragment_sync_delay,
                  fragment_update_alpha=l.fragment_update_alpha, fragment_owner=owner))
    return simulate_local_sgd(block["mode"], model, common.loss_fn, micro_batch, world_size=world, group_size=1,
                              gradient_accumulation_steps=2, steps=steps, sync_every=l.sync_every,
                              optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=o["outer_lr"],
                              outer_momentum=o["outer_momentum"], nesterov=o["nesterov"], clip=clip,
                              dtype=torch.float64, **extra)


@pytest.mark.timeout(600)
def test_two_pipeline_stages_match_the_unsplit_simulator(tmp_path):
    """PP 2 x DP 2 on 4 ranks (one Linear per stage): sync, dpu, acco (two pipeline flushes per step, clipping
    on) and diloco (2 replicas of one data-parallel rank, each with both stages, synced per stage; the anchor
    users read) match the float64 simulator of the unsplit model after every step; the norm every stage
    reports is the whole model's. acco saved after 3
    train_batch calls resumes bit for bit."""
    from acco_ds.config import ACCOConfig
    from acco_ds.testing.simulator import simulate_local_sgd
    clip, ckpt = 0.05, str(tmp_path / "ckpt")
    diloco = {"mode": "diloco", "local_sgd": {"sync_every": 2, "replica_group_size": 1}}
    runs = [dict(config=common.ds_config(acco={"mode": m}, clip=clip if m == "acco" else 0.0), steps=STEPS, pipe=2)
            for m in ("sync", "dpu", "acco")]
    runs += [dict(config=common.ds_config(acco=diloco, gas=2), steps=STEPS, pipe=2, record_committed=True),
             dict(config=common.ds_config(acco={"mode": "acco"}, clip=clip), steps=100, pipe=2, max_micro=12,
                  save=ckpt)]
    runs += [dict(config=common.ds_config(acco=block, gas=2), steps=SPLIT_STEPS, pipe=2, record_committed=True)
             for block in OTHER_LOCAL_SGD.values()]
    results = launch({"runs": runs}, world_size=4, timeout=500)
    for i, mode in enumerate(("sync", "dpu", "acco")):
        ref = reference(mode, clip=clip if mode == "acco" else 0.0)
        for dp, params in enumerate(_whole(results, i, STEPS)):
            assert_matches(params, ref["params"])
        for r in results:
            torch.testing.assert_close(torch.tensor(r[i]["norms"], dtype=torch.float64),
                                       torch.tensor(ref["grad_norms"], dtype=torch.float64), rtol=1e-5, atol=1e-7)
    acco = results[0][2]
    assert acco["applied"][:3] == [False, True, True], "one train_batch is one step, the first commits nothing"
    s = ACCOConfig(enabled=True, **diloco).outer
    ref = simulate_local_sgd("diloco", common.make_model(0), common.loss_fn, common.micro_batch, world_size=2,
                             group_size=1, gradient_accumulation_steps=2, steps=STEPS, sync_every=2,
                             optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=s["outer_lr"],
                             outer_momentum=s["outer_momentum"], nesterov=s["nesterov"], dtype=torch.float64)
    for dp, params in enumerate(_whole(results, 3, STEPS)):  # what users read: the anchor (the global model)
        assert_matches(params, ref["anchor"])
    assert not torch.equal(ref["anchor"][0], ref["anchor"][1]), "the anchor moves at the sync"
    for i, (mode, block) in enumerate(OTHER_LOCAL_SGD.items(), start=5):  # EDiT's norms sum the stages
        owner = stage_fragments(common.make_model(0), [2, 2], 2)  # each stage its Linear's weight and bias
        assert owner == [0, 1, 0, 1], owner  # not the unsplit model's cut: the stages cut alone
        ref = other_local_sgd_reference(mode, block, common.make_model(0), common.micro_batch, world=2,
                                        steps=SPLIT_STEPS, owner=owner)
        for dp, params in enumerate(_whole(results, i, SPLIT_STEPS)):
            assert_matches(params, ref["anchor"])
        if mode == "edit":
            assert any(h["mean_norm"] > block["local_sgd"]["pseudo_grad_clip"]
                       for h in results[0][i]["stats"]["sync_history"]), "the pseudo-gradient clip never bit"
    resumed = launch({"runs": [dict(config=common.ds_config(acco={"mode": "acco"}, clip=clip), steps=STEPS, pipe=2,
                                    load=ckpt)]}, world_size=4, timeout=300)
    for rank in range(4):
        got, want = resumed[rank][0], next(r[2] for r in results if r[2]["layout"] == resumed[rank][0]["layout"])
        start = got["loaded"]["global_steps"]
        assert 0 < start < STEPS
        for a, b in zip(got["params"], want["params"][start:]):
            assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.timeout(400)
def test_a_weight_tied_across_stages_is_reduced_as_stock_does():
    """A weight tied between the first and the last stage (Megatron's tied word embeddings), PP 2 x DP 2: ACCO's
    sync mode equals stock ZeRO-1 step for step, and the tied copies stay equal on both stages."""
    runs = [dict(config=common.ds_config(acco={"mode": "sync"}), steps=STEPS, pipe=2, tied=True),
            dict(config=common.ds_config(), steps=STEPS, pipe=2, tied=True, use_acco_initialize=False)]
    results = launch({"runs": runs}, world_size=4, timeout=350)
    for r in results:
        assert_matches(r[0]["params"], [p.double() for p in r[1]["params"]], atol=1e-6, rtol=1e-6)
        assert r[0]["tied"] is not None
    for dp in range(2):
        first, last = [next(r[0]["tied"] for r in results if r[0]["layout"] == {"stage": s, "dp": dp}) for s in (0, 1)]
        assert torch.equal(first, last), "the tied copies drifted apart"
