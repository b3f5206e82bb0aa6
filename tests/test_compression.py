"""Compressed communication (``acco.compression``) on CPU ranks against the float64 compressed simulator.

Block size 16 on the 146-parameter test model gives several blocks per partition, so scales, short last
blocks and the partition layout all matter. The compressed runs differ from the uncompressed ones by far
more than the tolerance, so matching the simulator is not matching the uncompressed algorithm."""

import pytest
import torch

import common
from acco_ds.memory import acco_buffer_bytes
from acco_ds.testing.compressed import simulate_compressed, simulate_compressed_diloco
from acco_ds.testing.simulator import simulate
from dist import launch
from test_engine import deviation
from test_local_sgd import GAS, H, STEPS as LOCAL_STEPS, local

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

STEPS = 4
# Test ranks share one machine (one node): name what to compress (the default compresses what crosses nodes).
INT8 = {"dtype": "int8", "block_size": 16, "apply_to": ["rounds"]}


FLIP_TOL = 5e-5  # see assert_matches


def assert_matches(engine_params, ref_params, atol=2e-6, rtol=1e-5):
    """Engine (fp32) against the float64 oracle: every element within ``atol``/``rtol``, except that a
    value within ~1e-7 of a rounding boundary of the quantizer may round the other way in fp32 than in
    float64 (a "flip": one gradient element off by one quantum). At most one element in 100 per step
    may flip, and a flip moves a weight by less than ``FLIP_TOL`` (measured: 1.1e-5, fp8; compression
    itself moves the weights by 2e-4 to 5e-2 on these runs)."""
    assert len(engine_params) == len(ref_params), (len(engine_params), len(ref_params))
    for t, (got, want) in enumerate(zip(engine_params, ref_params)):
        diff = (got.double() - want).abs()
        off = diff > atol + rtol * want.abs()
        assert int(off.sum()) <= max(1, want.numel() // 100), f"step {t + 1}: {int(off.sum())} elements differ"
        assert float(diff.max()) < FLIP_TOL, f"step {t + 1}: {float(diff.max())}"


def reference(mode, world, nodes=0, **compression):
    c = {**INT8, **compression}
    return simulate_compressed(mode, common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                               gradient_accumulation_steps=4, steps=STEPS,
                               optimizer_fn=common.reference_optimizer("AdamW"), dtype=c["dtype"],
                               block_size=c["block_size"], error_feedback=c.get("error_feedback", True),
                               nodes=nodes)


def uncompressed(mode, world):
    return simulate(mode, common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                    gradient_accumulation_steps=4, steps=STEPS, optimizer_fn=common.reference_optimizer("AdamW"))


def assert_ranks_equal(results, i):
    for r in range(1, len(results)):
        for a, b in zip(results[0][i]["params"], results[r][i]["params"]):
            assert torch.equal(a, b), f"rank {r} holds other weights than rank 0"


@pytest.mark.timeout(400)
def test_round_modes_match_the_compressed_simulator_on_2_ranks():
    cases = [("acco", INT8), ("dpu", INT8), ("sync", INT8), ("acco", {**INT8, "dtype": "fp8"}),
             ("acco", {**INT8, "error_feedback": False}), ("acco", {"dtype": None})]
    runs = [dict(config=common.ds_config(acco={"mode": m, "compression": c}), steps=STEPS) for m, c in cases]
    runs.append(dict(config=common.ds_config(acco={"mode": "acco"}), steps=STEPS))  # no compression key at all
    results = launch({"runs": runs}, world_size=2, timeout=360)
    for i, (mode, c) in enumerate(cases[:-1]):
        assert_ranks_equal(results, i)
        r = results[0][i]
        assert_matches(r["params"], reference(mode, 2, **c)["params"])
        assert deviation(r["params"], uncompressed(mode, 2)["params"]) > 4 * FLIP_TOL, "compression changed nothing"
        assert r["stats"]["compression"] == f"{c['dtype']} blocks of 16" and r["stats"]["compressed_bytes"] > 0
        # The memory plan counts the residuals (one partition per other rank, fp32) and the fp32 kept shard.
        size = r["group_numels"][0]
        plan = acco_buffer_bytes(size, 2, "fp32", mode=mode, compression=c)
        assert r["buffer_bytes"]["total"] == plan
        assert r["buffer_bytes"].get("residuals", 0) == (size // 2 * 4 if c.get("error_feedback", True) else 0)
    # Error feedback matters: without it the run is another one.
    assert deviation(results[0][0]["params"], results[0][4]["params"]) > 1e-5
    # Off (dtype null, or no key): bit-identical to the uncompressed engine, and no compression in the stats.
    for a, b in zip(results[0][5]["params"], results[0][6]["params"]):
        assert torch.equal(a, b)
    assert results[0][5]["stats"]["compression"] is None and "residuals" not in results[0][5]["buffer_bytes"]


@pytest.mark.timeout(400)
def test_acco_matches_the_compressed_simulator_on_4_ranks_flat_and_node_aware():
    """Flat: every send quantized. Node-aware (2 nodes x 2 ranks, ``apply_to`` auto): only the rail step
    across nodes is, which is another algorithm than flat: each matches its own simulation, not the other's."""
    flat = common.ds_config(acco={"mode": "acco", "compression": INT8, "collectives": {"layout": "flat"}})
    hier = common.ds_config(acco={"mode": "acco", "compression": {"dtype": "int8", "block_size": 16},  # auto
                                  "collectives": {"layout": "hierarchical", "ranks_per_node": 2}})
    results = launch({"runs": [dict(config=flat, steps=STEPS), dict(config=hier, steps=STEPS)]}, world_size=4,
                     timeout=360)
    ref = reference("acco", 4)
    for i in range(2):
        assert_ranks_equal(results, i)
    node_aware = reference("acco", 4, nodes=2)
    assert_matches(results[0][0]["params"], ref["params"])
    assert_matches(results[0][1]["params"], node_aware["params"])
    assert deviation(ref["params"], node_aware["params"]) > 4 * FLIP_TOL
    # Node-aware: the quantized step has 2 peers (residual: one partition).
    assert results[0][1]["buffer_bytes"]["residuals"] == results[0][1]["group_numels"][0] // 4 * 4


def diloco_reference(world, k, apply_to=("rounds", "outer"), layout="zero"):
    return simulate_compressed_diloco(common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                                      group_size=k, gradient_accumulation_steps=GAS, steps=LOCAL_STEPS, sync_every=H,
                                      optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=0.7,
                                      outer_momentum=0.9, nesterov=True, block_size=16, apply_to=apply_to,
                                      layout=layout)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("world, k", [(2, 1), (4, 2)])
def test_diloco_matches_the_compressed_simulator(world, k):
    """Outer all-reduce quantized both ways with error feedback across periods; with k = 2 the inner
    rounds too (``apply_to`` both, and rounds only)."""
    cases = [["rounds", "outer"]] + ([["rounds"]] if k > 1 else [])
    runs = [dict(config=common.ds_config(acco={**local("diloco", k), "compression": {**INT8, "apply_to": a}},
                                         gas=GAS), steps=LOCAL_STEPS, record_committed=True) for a in cases]
    results = launch({"runs": runs}, world_size=world, timeout=450)
    for i, apply_to in enumerate(cases):
        ref = diloco_reference(world, k, apply_to)
        for rank in range(world):
            r = results[rank][i]
            assert_matches(r["params"], ref["replicas"][rank // k])
            assert_matches(r["committed"], ref["anchor"])
            if "outer" in apply_to:
                assert r["stats"]["outer_compression"] == "int8 blocks of 16"
                assert r["stats"]["outer_residual_bytes"] > 0
    # The compressed anchor is another one than the uncompressed simulator's.
    from test_local_sgd import reference as local_reference
    assert deviation(results[0][0]["committed"], local_reference("diloco", world, k)["anchor"]) > 1e-4


@pytest.mark.timeout(500)
def test_resume_with_residuals_is_exact(tmp_path):
    """acco (inside a round) and diloco (mid-period): save, load in fresh processes, go on: bit-identical
    to the uninterrupted run, which needs the error-feedback residuals restored."""
    acco = common.ds_config(acco={"mode": "acco", "compression": INT8}, clip=0.05)
    diloco = common.ds_config(acco={**local("diloco", 1), "compression": {**INT8, "apply_to": ["outer"]}}, gas=GAS)
    paths = [str(tmp_path / "acco"), str(tmp_path / "diloco")]
    full = launch({"runs": [dict(config=acco, steps=4), dict(config=diloco, steps=LOCAL_STEPS, record_committed=True),
                            dict(config=acco, steps=100, max_micro=11, save=paths[0]),
                            dict(config=diloco, steps=100, max_micro=GAS * 3, save=paths[1])]},
                  world_size=2, timeout=300)
    resumed = launch({"runs": [dict(config=acco, steps=4, load=paths[0]),
                               dict(config=diloco, steps=LOCAL_STEPS, load=paths[1], record_committed=True)]},
                     world_size=2, timeout=300)
    for rank in range(2):
        r, want = resumed[rank][0], full[rank][0]
        for got, expect in zip(r["params"], want["params"][2:]):
            assert torch.equal(got, expect), (got - expect).abs().max()
        r, want = resumed[rank][1], full[rank][1]
        for got, expect in zip(r["params"], want["params"][3:]):
            assert torch.equal(got, expect), (got - expect).abs().max()
        for got, expect in zip(r["committed"], want["committed"][3:]):
            assert torch.equal(got, expect)


@pytest.mark.timeout(300)
def test_a_nan_gradient_skips_the_step_and_error_feedback_starts_afresh():
    spec = dict(config=common.ds_config(acco={"mode": "acco", "compression": INT8}), steps=STEPS, nan_at_micro=3)
    results = launch({"runs": [spec]}, world_size=2, timeout=240)
    r0, r1 = results[0][0], results[1][0]
    assert r0["stats"]["skipped_steps"] == r1["stats"]["skipped_steps"] == 1
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b) and torch.isfinite(a).all()
    assert not torch.equal(r0["params"][-1], r0["params"][-2]), "training did not go on after the skipped step"


@pytest.mark.timeout(300)
def test_co2_and_edit_outer_compression_keep_one_model():
    """co2 (all-reduce on its thread over a whole period) and edit (layer-wise chunks): every rank reads the
    same anchor after every step and ends on one model; the anchor moved off the uncompressed one."""
    from test_local_sgd import reference as local_reference
    comp = {**INT8, "apply_to": ["outer"]}
    modes = ("co2", "edit")
    runs = [dict(config=common.ds_config(acco={**local(m, 1), "compression": comp}, gas=GAS), steps=LOCAL_STEPS,
                 record_committed=True, finalize=True) for m in modes]
    results = launch({"runs": runs}, world_size=2, timeout=240)
    for i, mode in enumerate(modes):
        a, b = results[0][i], results[1][i]
        assert torch.equal(a["final_params"], b["final_params"])
        assert all(torch.equal(x, y) for x, y in zip(a["committed"], b["committed"]))
        gap = deviation(a["committed"], local_reference(mode, 2, 1)["anchor"])
        assert 1e-5 < gap < 1e-2, (mode, gap)
        assert a["stats"]["outer_compression"] == "int8 blocks of 16" and a["stats"]["outer_residual_bytes"] > 0
