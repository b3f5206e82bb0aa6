"""``"mode": "decoupled"`` with learners that are more than data-parallel ranks: mixture of experts (ep_size 2
inside a learner of 2 ranks), tensor parallelism 2 and two pipeline stages. Rank r of a learner (its
data-parallel shard j at model-parallel position m, r = m k + j) talks to syncer shard r, so learners of one shape
hold the same slice at the same shard. With K = the number of learners and ``grace_s`` 0 each is DiLoCo exactly:
the float64 simulator of the unsplit model (``DenseMoENet`` for the experts) after every inner step. A learner of
another shape is refused by the syncer in words that name both shapes."""

import json

import pytest
import torch

import common
import tp
from acco_ds.config import ACCOConfig
from acco_ds.config.decoupled import shape_refusal
from acco_ds.runtime.outer.decoupled import wire
from acco_ds.runtime.outer.decoupled.link import Link
from acco_ds.runtime.outer.decoupled.syncer import Shard
from acco_ds.testing.simulator import simulate_local_sgd
from dist import launch
from test_engine import assert_matches
from test_decoupled_wire import KEYS, SETTINGS, serve
from test_moe import assert_ranks_match, assert_replicas_agree
from test_pipeline import _whole

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

W, GAS, STEPS, H = 4, 2, 4, 2
INT8 = {"dtype": "int8", "block_size": 16, "apply_to": ["outer"]}


def decoupled(k, state_dir, **extra):
    return {"mode": "decoupled", **extra,
            "local_sgd": {"sync_every": H, "replica_group_size": k, "min_quorum": 2, "grace_s": 0,
                          "syncer": {"state_dir": str(state_dir), "timeout_s": 60}}}


def diloco_reference(model, k):
    o = ACCOConfig(enabled=True, **decoupled(k, "x")).outer
    return simulate_local_sgd("diloco", model, common.loss_fn, common.micro_batch, world_size=2 * k, group_size=k,
                              gradient_accumulation_steps=GAS, steps=STEPS, sync_every=H,
                              optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=o["outer_lr"],
                              outer_momentum=o["outer_momentum"], nesterov=o["nesterov"], dtype=torch.float64)


def merge_log(state_dir):
    return [json.loads(line) for line in (state_dir / "merges.jsonl").read_text().splitlines()]


def assert_two_learners_merged(results, state_dir, ranks=W):
    assert [sorted(rec["learners"]) for rec in merge_log(state_dir)] == [[0, 1]] * (STEPS // H)
    for rank in range(ranks):
        s = results[rank]["stats"]
        assert s["decoupled"] and s["merges"] == STEPS // H and s["staleness"] == [0] * (STEPS // H), s
    assert sorted(p.name for p in state_dir.glob("shard*.pt")) == [f"shard{j}.pt" for j in range(ranks // 2)]


@pytest.mark.timeout(300)
def test_moe_learners_with_expert_parallelism_are_diloco_quantize_and_resume(tmp_path):
    """Two learners of 2 ranks, ep_size 2: rank j holds experts 2j, 2j + 1 and half of the dense group, and sends
    both to shard j. fp32: the diloco simulator on every rank, every step. int8 up-link: the experts travel
    quantized too (every copy of an expert reads one global value, near the fp32 run's). Saved after the first
    merge and resumed on the syncer's state: the rest of the run bit for bit."""
    ckpt, states = tmp_path / "ckpt", [tmp_path / f"syncer{i}" for i in range(3)]
    run = dict(model="moe", steps=STEPS, record_committed=True)
    runs = [dict(config=common.ds_config(acco=decoupled(2, states[0]), gas=GAS), **run),
            dict(config=common.ds_config(acco=decoupled(2, states[1], compression=INT8), gas=GAS), **run),
            dict(config=common.ds_config(acco=decoupled(2, states[2]), gas=GAS), model="moe", steps=H,
                 save=str(ckpt))]
    runs.append(dict(config=runs[2]["config"], model="moe", steps=STEPS, load=str(ckpt)))  # on the shards' state
    results = launch({"runs": runs}, world_size=W, timeout=240, workdir=tmp_path / "run")
    fp32, int8 = ([results[r][i] for r in range(W)] for i in range(2))
    ref = diloco_reference(common.make_model(0, "dense_moe"), 2)
    assert_ranks_match(fp32, lambda rank: ref["replicas"][rank // 2])
    assert_ranks_match(fp32, ref["anchor"], key="committed")
    assert_two_learners_merged(fp32, states[0])
    assert not torch.equal(fp32[0]["params"][0], fp32[2]["params"][0]), "the learners trained alike"

    assert_replicas_agree([dict(params=r["committed"]) for r in int8])
    gap = max(float((a - b).abs().max()) for rank in range(W)
              for a, b in zip(int8[rank]["committed"], fp32[rank]["committed"]))
    assert 1e-6 < gap < 1e-2, gap
    assert int8[0]["stats"]["uplink"] == "int8 blocks of 16" and int8[0]["stats"]["outer_residual_bytes"] > 0
    assert_two_learners_merged(int8, states[1])

    for rank in range(W):
        got = results[rank][3]
        assert got["loaded"]["global_steps"] == H and got["stats"]["version"] == STEPS // H
        for t, (a, b) in enumerate(zip(got["params"], fp32[rank]["params"][H:])):
            assert torch.equal(a, b), f"rank {rank} step {H + t + 1} differs after the resume"


@pytest.mark.timeout(300)
def test_tensor_and_pipeline_parallel_learners_are_diloco(tmp_path):
    """DP 2 x TP 2 and DP 2 x PP 2 on 4 ranks: a learner is one data-parallel rank with both of its model-parallel
    ranks, each sending its own slice (a tensor-parallel shard, a stage) to its own shard. Put back together, the
    anchor and every replica (tensor parallel) and the anchor a pipeline's weights read are the diloco simulator's
    of the unsplit model after every step."""
    states = [tmp_path / "tp", tmp_path / "pp"]
    runs = [dict(config=common.ds_config(acco=decoupled(1, states[0]), gas=GAS), steps=STEPS, tp=2,
                 record_committed=True),
            dict(config=common.ds_config(acco=decoupled(1, states[1]), gas=GAS), steps=STEPS, pipe=2,
                 record_committed=True)]
    results = launch({"runs": runs}, world_size=W, timeout=240, workdir=tmp_path / "run")
    ref = diloco_reference(tp.make_full(0), 1)
    for dp in range(2):
        ranks = [dp * 2 + t for t in range(2)]
        assert_matches([tp.assemble([results[r][0]["params"][s] for r in ranks]) for s in range(STEPS)],
                       ref["replicas"][dp])
        assert_matches([tp.assemble([results[r][0]["committed"][s] for r in ranks]) for s in range(STEPS)],
                       ref["anchor"])
    assert_two_learners_merged([results[r][0] for r in range(W)], states[0])
    ref = diloco_reference(common.make_model(0), 1)
    for dp, params in enumerate(_whole(results, 1, STEPS)):  # a pipeline's weights read: the anchor
        assert_matches(params, ref["anchor"])
    assert_two_learners_merged([results[r][1] for r in range(W)], states[1])
    assert not torch.equal(ref["anchor"][0], ref["anchor"][H]), "the anchor moves at the merge"


def say_hello(port, learner, layout):
    """HELLO to the shard on ``port`` as ``learner`` of shape ``layout``: the shard's version (a refusal raises)."""
    link = Link(("127.0.0.1", port), learner, 10 + learner, 0, 5, 1 << 20, KEYS, 1, layout)
    try:
        return link.open(5)
    finally:
        link.close()


def test_a_learner_of_another_shape_is_refused_naming_both(tmp_path):
    """A shard takes the first learner's shape (said at HELLO); a learner of another is refused before it sends
    anything, in words naming both shapes and the fix; one of the same shape, and rank 0's heartbeat (no shape),
    are let in."""
    shard, thread = serve(Shard(0, "127.0.0.1", 0, SETTINGS, min_quorum=2, grace_s=0.0, state_dir=str(tmp_path),
                                keys=KEYS, say=lambda _: None))

    def hello(learner, layout):
        return say_hello(shard.port, learner, layout)
    try:
        assert hello(0, "dp2.tp1.pp1.ep2.n62.g0000abcd") == wire.NO_VERSION
        with pytest.raises(wire.Refused) as err:
            hello(1, "dp0.tp2.pp1.ep1.n40.g1234abcd")
        assert hello(2, "dp2.tp1.pp1.ep2.n62.g0000abcd") == wire.NO_VERSION and hello(0, "") == wire.NO_VERSION
    finally:
        shard.stop()
        thread.join(5)
    assert str(err.value) == ("the peer refused: refused message: layout: "
                              + shape_refusal(1, "dp0.tp2.pp1.ep1.n40.g1234abcd", "dp2.tp1.pp1.ep2.n62.g0000abcd", 0))
    assert ('learner 1 runs as any number of data-parallel ranks x tensor parallel 2 x pipeline 1, expert parallel '
            '1 (40 elements at this model-parallel position, parameter groups 1234abcd), but learner 0 as 2 '
            'data-parallel rank(s) (experts) x tensor parallel 1 x pipeline 1, expert parallel 2 (62 elements at '
            'this model-parallel position, parameter groups 0000abcd)') in str(err.value)
    assert "launch this learner with the first one's model and sizes" in str(err.value)
