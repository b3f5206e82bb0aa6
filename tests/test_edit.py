"""EDiT and A-EDiT: the pseudo-gradient penalty alone, then the engine against the float64 simulator.

Pure: the anomaly detector, the weights, the clip. Engine: ``edit`` with each penalty option alone (and
all together on 4 ranks, k=2) matches ``simulate_local_sgd`` on every rank after every inner step; A-EDiT
with an injected clock and a slowed rank; resume is bit-exact, including the detector and the period timer.
"""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import common
from acco_ds.algorithms.penalty import AnomalyDetector, clip_scale, replica_weights
from acco_ds.algorithms.periods import PeriodSchedule
from acco_ds.runtime.outer.layerwise import ChunkGate, chunk_bounds, last_chunk
from acco_ds.testing.simulator import simulate_local_sgd
from dist import launch
from test_engine import assert_matches

GAS, STEPS, H = 2, 12, 2
# Rank 1's targets x10 during the fourth period (inner steps 7-8: its micro-batches 12..15). The inner
# optimizer is SGD without momentum, whose pseudo-gradient grows with the gradients (Adam's steps are
# bounded, so a data spike barely changes their norm).
SPIKE = {"worker": 1, "from": 6 * GAS, "to": 8 * GAS, "scale": 10.0}
ANOMALY = {"enabled": True, "warmup_syncs": 3, "threshold": 3.0, "ewma_alpha": 0.1}
INNER = "plain SGD"


# ------------------------------------------------------------------ pure logic
def test_detector_flags_a_spike_after_warmup_and_keeps_it_out_of_its_statistics():
    d = AnomalyDetector(2, alpha=0.1, warmup_syncs=3, threshold=3.0)
    for norms in ([1.0, 2.0], [1.1, 2.1], [0.9, 1.9]):
        assert d.observe(norms) == [False, False]  # warming up: never flagged
    before = d.state_dict()
    assert d.observe([1.0, 50.0]) == [False, True]
    after = d.state_dict()
    # The outlier did not feed replica 1's statistics (EDiT's reference code would have widened them).
    assert (after["count"][1], after["mean"][1], after["var"][1]) == (before["count"][1], before["mean"][1],
                                                                      before["var"][1])
    assert after["count"][0] == before["count"][0] + 1
    assert d.observe([1.0, 2.05]) == [False, False]  # back to normal: kept
    assert math.isclose(before["mean"][0], 1.0) and math.isclose(before["var"][0], 0.02 / 3)


def test_detector_never_flags_during_warmup_and_flags_non_finite_norms():
    d = AnomalyDetector(1, warmup_syncs=2)
    assert d.observe([1.0]) == [False] and d.observe([1e9]) == [False]
    d2 = AnomalyDetector(1, warmup_syncs=2)
    d2.observe([1.0]), d2.observe([1.2])
    assert d2.observe([float("nan")]) == [True]


@settings(max_examples=200, deadline=None)
@given(norms=st.lists(st.floats(0.0, 50.0), min_size=2, max_size=6), data=st.data())
def test_weights_sum_to_one_over_kept_replicas(norms, data):
    R = len(norms)
    flags = data.draw(st.lists(st.booleans(), min_size=R, max_size=R))
    steps = data.draw(st.lists(st.integers(1, 9), min_size=R, max_size=R))
    for weighting in ("mean", "norm"):
        w = replica_weights(norms, weighting=weighting, steps=steps, anomalous=flags)
        assert all(wi == 0.0 for wi, f in zip(w, flags) if f)
        assert math.isclose(sum(w), 0.0 if all(flags) else 1.0, abs_tol=1e-12)
    kept = [i for i in range(R) if not flags[i]]
    if kept:
        w = replica_weights(norms, weighting="mean", steps=steps, anomalous=flags)
        total = sum(steps[i] for i in kept)
        assert all(math.isclose(w[i], steps[i] / total) for i in kept)  # A-EDiT: proportional to steps
        w = replica_weights(norms, weighting="norm", anomalous=flags)
        z = sum(math.exp(-norms[i]) for i in kept)
        assert all(math.isclose(w[i], math.exp(-norms[i]) / z, rel_tol=1e-9) for i in kept)


def test_clip_scale_and_timed_periods():
    assert clip_scale(10.0, None) == 1.0 and clip_scale(0.5, 1.0) == 1.0
    assert math.isclose(clip_scale(4.0, 1.0), 1.0 / (4.0 + 1e-6))
    s = PeriodSchedule("edit", None)
    assert s.after_inner_step(False) is None and s.after_inner_step(False) is None
    sync = s.after_inner_step(True)
    assert sync.blocking and sync.steps == 3 and s.period == 1
    with pytest.raises(ValueError, match="mode 'edit' only"):
        PeriodSchedule("diloco", None)


@settings(max_examples=200, deadline=None)
@given(P=st.integers(1, 500), k=st.integers(1, 4), data=st.data())
def test_chunks_cover_each_shard_and_a_parameter_waits_for_its_last_chunk(P, k, data):
    bounds = chunk_bounds(P)
    assert bounds[0][0] == 0 and bounds[-1][1] == P and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    offset = data.draw(st.integers(0, k * P - 1))
    numel = data.draw(st.integers(1, k * P - offset))
    c = last_chunk(offset, numel, P, bounds)
    # Every element of the parameter is in a chunk at or before c (shard-local offsets, every shard cut alike).
    for q in range(offset, offset + numel):
        local = q % P
        assert next(i for i, (lo, hi) in enumerate(bounds) if lo <= local < hi) <= c


def test_gate_releases_waiters_in_order_and_reports_failure():
    import threading
    gate = ChunkGate(3, cuda=False, on_failure=lambda: (_ for _ in ()).throw(RuntimeError("sync failed")))
    gate.wait(2)  # nothing armed: returns at once
    gate.arm()
    seen = []
    t = threading.Thread(target=lambda: (gate.wait(1), seen.append("through")))
    t.start()
    gate.release(0)
    t.join(0.2)
    assert t.is_alive() and not seen  # chunk 1 not released yet
    gate.release(1)
    t.join(5)
    assert seen == ["through"]
    gate.fail()
    with pytest.raises(RuntimeError, match="sync failed"):
        gate.wait(2)


# ------------------------------------------------------------------ engine
def local(k, **ls):
    return {"mode": "edit", "local_sgd": {"replica_group_size": k, **({"sync_every": H} if
                                                                     "sync_time_s" not in ls else {}), **ls}}


def reference(world, k, clip=0.0, spike=None, period_steps=None, optimizer=INNER, **ls):
    from acco_ds.config import ACCOConfig
    cfg = ACCOConfig(enabled=True, **local(k, **ls))
    o, l = cfg.outer, cfg.local_sgd
    anomaly = l.anomaly.model_dump(exclude={"enabled"}) if l.anomaly.enabled else None
    return simulate_local_sgd("edit", common.make_model(0), common.loss_fn,
                              lambda w, i: common.spiked_batch(w, i, spike), world_size=world, group_size=k,
                              gradient_accumulation_steps=GAS, steps=STEPS, sync_every=H,
                              optimizer_fn=common.reference_optimizer(optimizer), outer_lr=o["outer_lr"],
                              outer_momentum=o["outer_momentum"], nesterov=o["nesterov"], clip=clip,
                              weighting=l.weighting, pseudo_grad_clip=l.pseudo_grad_clip, anomaly=anomaly,
                              period_steps=period_steps, dtype=torch.float64)


CASES = [({}, 0.0), ({"anomaly": ANOMALY}, 0.0), ({"weighting": "norm"}, 0.0), ({"pseudo_grad_clip": 0.002}, 0.05)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, k, cases", [(2, 1, CASES),
                                             (4, 2, [({"anomaly": ANOMALY, "weighting": "norm",
                                                       "pseudo_grad_clip": 0.02}, 0.0)])])
def test_edit_matches_the_simulator_with_each_penalty_option(world, k, cases):
    runs = [dict(config=common.ds_config(acco=local(k, **ls), gas=GAS, clip=clip, optimizer=None,
                                         zero_allow_untested_optimizer=True),
                 client_optimizer=INNER, steps=STEPS, record_committed=True, spike=SPIKE) for ls, clip in cases]
    results = launch({"runs": runs}, world_size=world, timeout=500)
    for i, (ls, clip) in enumerate(cases):
        ref = reference(world, k, clip=clip, spike=SPIKE, **ls)
        for rank in range(world):
            r = results[rank][i]
            assert r["global_steps"] == STEPS
            assert_matches(r["params"], ref["replicas"][rank // k])
            assert_matches(r["committed"], ref["anchor"])
            history = r["stats"]["sync_history"]
            assert [h["anomalous"] for h in history] == ref["flags"]
        if "anomaly" in ls:  # the spiked period of rank 1's replica was left out (with k=1, only that one)
            assert ref["flags"][3][1 // k] and (k > 1 or sum(map(sum, ref["flags"])) == 1), ref["flags"]
        if "pseudo_grad_clip" in ls:  # the clip bites
            assert any(h["mean_norm"] > ls["pseudo_grad_clip"] for h in history), history
    if len(cases) > 1:  # the options change the trajectory: the comparison can tell them apart
        finals = [results[0][i]["committed"][-1] for i in range(len(cases))]
        assert all((finals[0] - f).abs().max() > 1e-6 for f in finals[1:])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_edit_slow_replica_runs_fewer_steps_and_nobody_waits_more_than_one_step(tmp_path):
    """4 ranks, 2 replicas of 2; rank 3 (replica 1) takes twice as long per micro-batch on an injected
    clock. Replica 1 does fewer inner steps per period; at every sync the faster replica waits at most one
    of the slow replica's inner steps; the anchor equals the simulator fed the observed step counts.
    Save mid-period and resume: the period timer and the trajectory go on bit for bit."""
    costs = [1.0, 1.0, 1.0, 2.0]
    ls = {"sync_time_s": 9.0, "weighting": "norm"}
    cfg = common.ds_config(acco=local(2, **ls), gas=GAS)
    base = dict(config=cfg, steps=10**6, until_syncs=3, fake_clock=costs, record_committed=True)
    ckpt = str(tmp_path / "ckpt")
    # The save: one inner step into period 3 on both replicas (a save is collective, so A-EDiT's loops
    # stop on the sync count, never on a step count).
    full = launch({"runs": [base, dict(base, until_syncs=2, extra_micro=GAS, save=ckpt)]}, world_size=4,
                  timeout=500)
    resumed = launch({"runs": [dict(base, load=ckpt)]}, world_size=4, timeout=300)
    history = full[0][0]["stats"]["sync_history"]
    period_steps = [[int(s) for s in h["steps"]] for h in history]
    assert len(period_steps) == 3 and all(fast > slow for fast, slow in period_steps), period_steps
    slow_step = GAS * max(costs)
    for rank in range(4):
        stats = full[rank][0]["stats"]
        assert stats["max_sync_wait_s"] <= slow_step, stats["max_sync_wait_s"]
        for h in stats["sync_history"]:
            assert max(h["elapsed"]) - min(h["elapsed"]) <= slow_step
    ref = reference(4, 2, period_steps=period_steps, optimizer="AdamW", **ls)
    for rank in range(4):
        r = full[rank][0]
        mine = ref["replicas"][rank // 2]
        assert r["global_steps"] == len(mine)
        assert_matches(r["params"], mine)
        assert_matches([r["committed"][-1]], [ref["anchor"][-1]])
        got = resumed[rank][0]
        assert got["stats"]["sync_history"][-1]["steps"] == history[-1]["steps"]
        assert torch.equal(got["params"][-1], r["params"][-1]), "resume changed the trajectory"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_edit_resume_is_exact_with_the_detector_state(tmp_path):
    cfg = common.ds_config(acco=local(1, anomaly=ANOMALY), gas=GAS, clip=0.05, optimizer=None,
                           zero_allow_untested_optimizer=True)
    run = dict(config=cfg, client_optimizer=INNER, spike=SPIKE)
    saves = {stop: str(tmp_path / f"ckpt{stop}") for stop in (5, 8)}  # mid-period; at the sync after the spike
    full = launch({"runs": [dict(run, steps=STEPS, record_committed=True, finalize=True)] + [
        dict(run, steps=100, max_micro=GAS * stop, save=path) for stop, path in saves.items()]}, world_size=2,
        timeout=300)
    resumed = launch({"runs": [dict(run, steps=STEPS, load=path, record_committed=True) for path in saves.values()]},
                     world_size=2, timeout=300)
    for rank in range(2):
        want = full[rank][0]
        for stop, r in zip(saves, resumed[rank]):
            for got, expect in zip(r["params"], want["params"][stop:]):
                assert torch.equal(got, expect), (stop, (got - expect).abs().max())
            assert r["stats"]["anomalies"] == want["stats"]["anomalies"] == 1
    assert torch.equal(full[0][0]["final_params"], full[1][0]["final_params"]), "replicas did not end on one model"


@pytest.mark.parametrize("local_sgd, mode, needle", [
    ({"sync_time_s": 5.0, "sync_every": 4}, "edit", "exclude each other"),
    ({"weighting": "norm"}, "diloco", 'applies to mode "edit", not to mode "diloco"'),
    ({"anomaly": {"enabled": True, "threshold": 0}}, "edit", '"acco.local_sgd.anomaly.threshold"'),
    ({"weighting": "median"}, "edit", '"acco.local_sgd.weighting"'),
])
def test_bad_edit_settings_are_rejected(local_sgd, mode, needle):
    from acco_ds.config import parse_acco_config
    with pytest.raises(ValueError, match=None) as err:
        parse_acco_config({"acco": {"enabled": True, "mode": mode, "local_sgd": local_sgd}})
    assert needle in str(err.value), str(err.value)
