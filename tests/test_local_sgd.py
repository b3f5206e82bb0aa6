"""The local-SGD family (DiLoCo, CO2) on replica groups, against the float64 simulator.

2 ranks: R=2 replicas of k=1 (DiLoCo as published); 4 ranks: R=2 replicas of k=2 (ZeRO-1 inside each
replica). Every rank's replica weights and the anchor users read match the simulator after every
inner step."""

import pytest
import torch

import common
from acco_ds.memory import acco_buffer_bytes
from acco_ds.testing.simulator import simulate_local_sgd
from dist import launch
from test_engine import assert_matches

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

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
            # Inner steps do not overlap: no communication buffer, ZeRO-1's own costs over k ranks.
            size = r["group_numels"][0]
            assert r["buffer_bytes"]["communication"] == 0
            assert r["buffer_bytes"]["total"] == acco_buffer_bytes(size, k, "fp32", mode=mode)
        # The replicas really differ between syncs, and the outer step moves the anchor off the mean.
        a, b = results[0][i]["params"][0], results[world - 1][i]["params"][0]
        assert (a - b).abs().max() > 1e-4, "replicas trained on the same data"
    # Different settings give different trajectories (the comparison can tell them apart).
    assert (results[0][1]["committed"][-1] - results[0][2]["committed"][-1]).abs().max() > 1e-5


@pytest.mark.timeout(600)
def test_resume_is_exact_from_any_inner_step_and_finalize_leaves_one_model(tmp_path):
    """For diloco and co2 (a run per mode; the uninterrupted and the saving runs share a launch): save
    mid-period (co2: an all-reduce in flight) and right at a sync; fresh processes load and go on:
    bit-identical to the uninterrupted run.
    The end of training syncs every replica onto one model."""
    modes = ["diloco", "co2"]
    cfgs = {mode: common.ds_config(acco=local(mode, 1), gas=GAS, clip=0.05) for mode in modes}
    saves = {(m, stop): str(tmp_path / f"ckpt_{m}{stop}") for m in modes for stop in (3, 4)}  # steps at the save
    full = launch({"runs": [dict(config=cfgs[m], steps=STEPS, record_committed=True, finalize=True) for m in modes] +
                   [dict(config=cfgs[m], steps=100, max_micro=GAS * stop, save=path)
                    for (m, stop), path in saves.items()]}, world_size=2, timeout=300)
    resumed = launch({"runs": [dict(config=cfgs[m], steps=STEPS, load=path, record_committed=True)
                               for (m, _), path in saves.items()]}, world_size=2, timeout=300)
    for rank in range(2):
        for ((mode, stop), _), r in zip(saves.items(), resumed[rank]):
            want = full[rank][modes.index(mode)]
            assert r["loaded"]["global_steps"] == stop
            assert torch.equal(r["loaded"]["params"], want["committed"][stop - 1]), "checkpoint holds another anchor"
            for got, expect in zip(r["params"], want["params"][stop:]):
                assert torch.equal(got, expect), (mode, stop, (got - expect).abs().max())
            for got, expect in zip(r["committed"], want["committed"][stop:]):
                assert torch.equal(got, expect)
    for i, mode in enumerate(modes):
        finals = [full[rank][i]["final_params"] for rank in range(2)]
        assert torch.equal(finals[0], finals[1]), f"{mode}: replicas did not end on one model"
    assert not torch.equal(full[0][1]["params"][-1], full[1][1]["params"][-1]), "co2 replicas never differed"


BAD_LOCAL_SGD = [
    ({"sync_every": 0}, '"acco.local_sgd.sync_every": Input should be greater than or equal to 1'),
    ({"outer_lr": 0.0}, '"acco.local_sgd.outer_lr": Input should be greater than 0'),
    ({"replica_group_size": 3}, "does not divide the data-parallel world size 2"),
    ({"replica_group_size": 2}, "one replica, nothing to average"),
    ({"staleness_penalty": 2.0}, 'applies to mode "co2"'),
]


def test_bad_local_sgd_settings_are_rejected_at_initialize():
    """Each is refused at initialize, on every rank (2 ranks), before any step, naming the key and the fix;
    one engine per setting, in one launch."""
    runs = [dict(config=common.ds_config(acco={"mode": "diloco", "local_sgd": ls}, gas=GAS), steps=1, init_error=True)
            for ls, _ in BAD_LOCAL_SGD]
    results = launch({"runs": runs}, world_size=2, timeout=120)
    for rank in results:
        for (ls, needle), r in zip(BAD_LOCAL_SGD, rank):
            assert needle in r["init_error"], (ls, r["init_error"])


@pytest.mark.timeout(300)
def test_an_outer_loop_registered_from_outside_the_package_is_driven_by_the_host():
    """``register_outer_loop("diloco", "outer_probe:CountingLoop")`` in the training process (tests/outer_probe.py,
    DiLoCo that counts the host's calls): the host builds that loop, calls its hooks, reports its statistics and
    summary lines as they are, and the run still matches the simulator."""
    run = dict(config=common.ds_config(acco=local("diloco", 1), gas=GAS), steps=STEPS, record_committed=True,
               outer_loops={"diloco": "outer_probe:CountingLoop"})
    results = launch({"runs": [run]}, world_size=2, timeout=240)
    ref = reference("diloco", 2, 1)
    for rank in range(2):
        r = results[rank][0]
        calls = r["stats"]["probe_calls"]
        assert calls["attach"] == 1 and calls["after_inner_step"] == STEPS, calls
        assert calls["before_read"] >= STEPS and calls["committed_flats"] >= STEPS, calls
        assert ["probe", "counted by a loop registered from outside acco_ds"] in [list(line) for line in r["report"]]
        assert_matches(r["params"], ref["replicas"][rank])
        assert_matches(r["committed"], ref["anchor"])
