"""Streaming DiLoCo (``diloco`` with ``fragments``, ``fragment_sync_delay``, ``fragment_update_alpha``) against
the float64 simulator on 2 ranks (k = 1) and 4 ranks (k = 2), resume from a checkpoint saved with a fragment's
all-reduce in flight, finalize, refusals, and torchft's own regression fixtures."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
from acco_ds.testing.simulator import simulate_local_sgd
from dist import launch
from test_engine import assert_matches

slow = pytest.mark.slow  # multi-process: `make test-fast` leaves these out

ROOT = Path(__file__).resolve().parents[1]
GAS, STEPS, H = 2, 8, 4
CASES = [  # (model, fragments, fragment_sync_delay, fragment_update_alpha)
    ("tiny", 2, 1, 0.5),  # fc1.weight | the rest; prepared one step before each sync; half local
    ("deep", 4, 0, 0.0),  # one layer per fragment, a fragment every inner step, blocking
    ("tiny", 1, 1, 0.0),  # plain DiLoCo's partition, its all-reduce overlapped with one inner step
]


def streaming(k, F, tau, alpha, **extra):
    return {"mode": "diloco", "local_sgd": {"sync_every": H, "replica_group_size": k, "fragments": F,
                                            "fragment_sync_delay": tau, "fragment_update_alpha": alpha, **extra}}


def reference(world, k, model, F, tau, alpha, steps=STEPS):
    return simulate_local_sgd("diloco", common.make_model(0, model), common.loss_fn, common.micro_batch,
                              world_size=world, group_size=k, gradient_accumulation_steps=GAS, steps=steps,
                              sync_every=H, optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=0.7,
                              outer_momentum=0.9, nesterov=True, fragments=F, fragment_sync_delay=tau,
                              fragment_update_alpha=alpha)


@slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, k", [(2, 1), (4, 2)])
def test_streaming_diloco_matches_the_simulator(world, k):
    runs = [dict(config=common.ds_config(acco=streaming(k, F, tau, alpha), gas=GAS), steps=STEPS, model=model,
                 record_committed=True, finalize=True) for model, F, tau, alpha in CASES]
    results = launch({"runs": runs}, world_size=world, timeout=500)
    for i, (model, F, tau, alpha) in enumerate(CASES):
        ref = reference(world, k, model, F, tau, alpha)
        for rank in range(world):
            r = results[rank][i]
            assert_matches(r["params"], ref["replicas"][rank // k])
            assert_matches(r["committed"], ref["anchor"])
            s = r["stats"]  # after finalize: one more sync for each fragment with steps since its last δ
            h = H // F
            last = [max(t for t in range(1, STEPS + 1) if ((t - 1) // h) % F == f and t - (t - 1) // h * h == h - tau)
                    for f in range(F)]
            assert s["fragment_syncs"] == [STEPS // H + (last[f] < STEPS) for f in range(F)], s["fragment_syncs"]
            assert s["syncs"] == sum(s["fragment_syncs"]) and sum(s["fragment_outer_bytes"]) == s["outer_bytes"] > 0
            assert len(s["fragment_hidden_fraction"]) == F and s["outer_wait_s"] == sum(s["fragment_outer_wait_s"])
            lines = dict(map(tuple, r["report"]))
            assert lines["fragments"].startswith(f"{F} fragments, a sync every {h} inner steps"), lines
            assert ("blocking" in lines["outer syncs"]) == (tau == 0), lines["outer syncs"]
        finals = [results[rank][i]["final_params"] for rank in range(world)]
        assert all(torch.equal(finals[0], f) for f in finals[1:]), "finalize left the replicas apart"
    # The replicas really differ between syncs, and streaming is another algorithm than diloco.
    plain = simulate_local_sgd("diloco", common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                               group_size=k, gradient_accumulation_steps=GAS, steps=STEPS, sync_every=H,
                               optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=0.7, outer_momentum=0.9,
                               nesterov=True)
    got = results[0][0]["committed"][-1].double()
    assert (got - plain["anchor"][-1]).abs().max() > 1e-4
    assert (results[0][0]["params"][0] - results[world - 1][0]["params"][0]).abs().max() > 1e-4


@slow
@pytest.mark.timeout(600)
def test_resume_with_a_fragment_in_flight_is_exact(tmp_path):
    """F=2, τ=1 on 2 ranks: a fragment's all-reduce starts at inner steps 1, 3, 5, ... and lands at 2, 4, 6.
    Saving after step 3 saves its δ̄ in flight (as received); after step 4 right after a sync. Fresh
    processes load and go on bit for bit; the checkpoint refuses another fragment count."""
    cfg = common.ds_config(acco=streaming(1, 2, 1, 0.5), gas=GAS, clip=0.05)
    saves = {stop: str(tmp_path / f"ckpt{stop}") for stop in (3, 4)}
    full = launch({"runs": [dict(config=cfg, steps=STEPS, record_committed=True)] + [
        dict(config=cfg, steps=100, max_micro=GAS * stop, save=path) for stop, path in saves.items()]},
        world_size=2, timeout=300)
    plain = common.ds_config(acco={"mode": "diloco", "local_sgd": {"sync_every": H, "replica_group_size": 1}},
                             gas=GAS)
    other_delay = common.ds_config(acco=streaming(1, 2, 0, 0.5), gas=GAS, clip=0.05)
    # The module weights alone load (the committed g) and the outer loop starts over from them: nothing in
    # flight, the windows from fragment 0, the loaded model as every fragment's g.
    weights_only = {"load_optimizer_states": False, "load_lr_scheduler_states": False}
    resumed = launch({"runs": [dict(config=cfg, steps=STEPS, load=path, record_committed=True)
                               for path in saves.values()] + [
        dict(config=plain, steps=STEPS, load=saves[3], load_error=True),
        dict(config=other_delay, steps=STEPS, load=saves[3], load_error=True),
        dict(config=cfg, steps=STEPS, load=saves[3], record_committed=True, load_kwargs=weights_only)]},
        world_size=2, timeout=300)
    for rank in range(2):
        want = full[rank][0]
        for stop, r in zip(saves, resumed[rank]):
            assert r["loaded"]["global_steps"] == stop
            for got, expect in zip(r["params"], want["params"][stop:]):
                assert torch.equal(got, expect), (stop, (got - expect).abs().max())
            for got, expect in zip(r["committed"], want["committed"][stop:]):
                assert torch.equal(got, expect), stop
        assert "saved with acco.local_sgd.fragments=2 but this run has 1" in resumed[rank][2]["load_error"]
        assert "saved with acco.local_sgd.fragment_sync_delay=1 but this run has fragment_sync_delay=0" in \
            resumed[rank][3]["load_error"]
    weights = [r[4:] for r in resumed]
    for rank in range(2):
        r = weights[rank][0]
        assert torch.equal(r["loaded"]["params"], full[rank][0]["committed"][2])
        assert torch.equal(r["committed"][0], r["loaded"]["params"]), "restart kept the old global values"
        assert sum(r["stats"]["fragment_syncs"]) == (STEPS - r["loaded"]["global_steps"]) // 2  # windows from 0


@slow
@pytest.mark.timeout(300)
def test_a_fragment_without_parameters_is_refused_at_initialize():
    cfg = common.ds_config(acco=streaming(1, 4, 0, 0.0), gas=GAS)  # TinyNet: fc1.weight holds 91 of 146 elements
    results = launch({"runs": [dict(config=cfg, steps=1)]}, world_size=2, timeout=200, expect_failure=True)
    for code, log in results:
        assert code != 0 and "fragments = 4: fragment 1 gets no parameter" in log, log[-2000:]
        assert "Use fewer fragments: 3 is the most below 4" in log, log[-2000:]


@slow
@pytest.mark.timeout(300)
def test_the_default_keys_are_plain_diloco_bit_for_bit():
    """fragments=1, fragment_sync_delay=0, fragment_update_alpha=0 written out builds plain DiLoCo; and
    ``StreamingDiLoCo`` itself forced onto those defaults (registered as diloco's loop) computes DiLoCo bit for
    bit: its fragment path reduces to the blocking sync of the whole model."""
    plain = {"sync_every": H, "replica_group_size": 1}
    explicit = {**plain, "fragments": 1, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}
    runs = [dict(config=common.ds_config(acco={"mode": "diloco", "local_sgd": block}, gas=GAS, clip=0.05),
                 steps=STEPS + 1, record_committed=True, finalize=True) for block in (plain, explicit, explicit)]
    runs[2]["outer_loops"] = {"diloco": "acco_ds.runtime.outer.streaming:StreamingDiLoCo"}  # last: it stays registered
    results = launch({"runs": runs}, world_size=2, timeout=280)
    for rank in range(2):
        want = results[rank][0]
        assert "fragments" not in want["stats"], "plain diloco built the streaming loop"
        for got in results[rank][1:]:
            for key in ("params", "committed"):
                assert all(torch.equal(a, b) for a, b in zip(got[key], want[key])), key
            assert torch.equal(got["final_params"], want["final_params"])
        assert "fragments" not in results[rank][1]["stats"]
        forced = results[rank][2]["stats"]
        assert forced["fragment_syncs"] == [STEPS // H + 1], forced  # finalize syncs the last step
        assert forced["syncs"] == want["stats"]["syncs"], (forced["syncs"], want["stats"]["syncs"])


@pytest.mark.parametrize("block, needle", [
    ({"mode": "diloco", "local_sgd": {"sync_every": 6, "fragments": 4}},
     "acco.local_sgd.fragments (4) must divide acco.local_sgd.sync_every (6)"),
    ({"mode": "diloco", "local_sgd": {"sync_every": 6, "fragments": 2, "fragment_sync_delay": 3}},
     "acco.local_sgd.fragment_sync_delay (3) must be below sync_every / fragments = 3"),
    ({"mode": "diloco", "local_sgd": {"fragments": 0}}, '"acco.local_sgd.fragments": Input should be greater than'),
    ({"mode": "diloco", "local_sgd": {"fragment_sync_delay": -1}}, '"acco.local_sgd.fragment_sync_delay"'),
    ({"mode": "diloco", "local_sgd": {"fragments": 2.0}}, '"acco.local_sgd.fragments": Input should be a valid integer'),
    ({"mode": "diloco", "local_sgd": {"fragment_update_alpha": 1.5}},
     '"acco.local_sgd.fragment_update_alpha": Input should be less than or equal to 1'),
    ({"mode": "diloco", "local_sgd": {"fragment_update_alpha": -0.1}}, '"acco.local_sgd.fragment_update_alpha"'),
    ({"mode": "co2", "local_sgd": {"fragments": 2}},
     'acco.local_sgd.fragments is Streaming DiLoCo\'s: it applies to mode "diloco", not to mode "co2"'),
    ({"mode": "edit", "local_sgd": {"fragment_sync_delay": 1}},
     'acco.local_sgd.fragment_sync_delay is Streaming DiLoCo\'s: it applies to mode "diloco", not to mode "edit"'),
    ({"mode": "edit", "local_sgd": {"sync_time_s": 5.0, "fragment_update_alpha": 0.5}},
     'acco.local_sgd.fragment_update_alpha is Streaming DiLoCo\'s'),
    ({"mode": "diloco", "local_sgd": {"sync_time_s": 5.0, "fragments": 2}},
     'acco.local_sgd.sync_time_s is EDiT\'s pseudo-gradient penalty / A-EDiT timing'),
    ({"mode": "acco", "local_sgd": {"fragments": 2}}, 'acco.local_sgd configures the local-SGD modes'),
    ({"mode": "sync", "local_sgd": {"fragment_update_alpha": 0.5}}, 'remove acco.local_sgd or set acco.mode'),
])
def test_bad_streaming_settings_are_refused_naming_the_key_and_the_fix(block, needle):
    from acco_ds.config import parse_acco_config
    with pytest.raises(ValueError) as err:
        parse_acco_config({"acco": {"enabled": True, **block}})
    assert needle in str(err.value), str(err.value)


def test_streaming_is_built_only_when_its_keys_leave_diloco():
    from acco_ds.config import parse_acco_config
    for extra, streams in (({}, False), ({"fragments": 1, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0},
                                         False), ({"fragments": 2}, True), ({"fragment_sync_delay": 1}, True),
                           ({"fragment_update_alpha": 0.25}, True)):
        acco = parse_acco_config({"acco": {"enabled": True, "mode": "diloco", "local_sgd": {"sync_every": 4, **extra}}})
        assert acco.local_sgd.streaming is streams, extra


TORCHFT = os.environ.get("TORCHFT_DIR")


@pytest.mark.timeout(150)
@pytest.mark.skipif(not TORCHFT, reason="set TORCHFT_DIR to a torchft checkout (its fixtures are not vendored)")
def test_torchft_regression_fixtures_are_reproduced():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torchft_fixtures.py"), TORCHFT, "--out",
                          os.devnull], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("MATCH") == 6, out.stdout + out.stderr


@slow
@pytest.mark.timeout(300)
def test_streaming_with_a_compressed_outer_all_reduce():
    """Each fragment's all-reduce quantized with its own error-feedback residual: every rank reads the same
    global values, near the uncompressed run's."""
    comp = {"dtype": "int8", "block_size": 16, "apply_to": ["outer"]}
    cfg = common.ds_config(acco={**streaming(1, 2, 1, 0.5), "compression": comp}, gas=GAS)
    results = launch({"runs": [dict(config=cfg, steps=STEPS, record_committed=True, finalize=True)]}, world_size=2,
                     timeout=240)
    a, b = results[0][0], results[1][0]
    assert all(torch.equal(x, y) for x, y in zip(a["committed"], b["committed"]))
    assert torch.equal(a["final_params"], b["final_params"])
    ref = reference(2, 1, "tiny", 2, 1, 0.5)["anchor"]
    gap = max(float((x.double() - y).abs().max()) for x, y in zip(a["committed"], ref))
    assert 1e-6 < gap < 1e-2, gap
    assert a["stats"]["outer_residual_bytes"] > 0 and a["stats"]["outer_compression"] == "int8 blocks of 16"


def test_the_memory_estimate_counts_one_fragment_in_flight():
    """Streaming keeps diloco's sharded anchor and momentum (8N/k) and one fragment's δ (4N/(kF)), not a
    whole-model one (4N/k)."""
    from acco_ds.memory import estimate_memory
    from acco_ds.runtime.rounds.buffers import padded_numel
    n, gpus, k = 10_000_000, 8, 4
    plain = estimate_memory(params=n, gpus=gpus, mode="diloco", replica_group_size=k, verbose=False)["acco_bytes"]
    local = padded_numel(n, k)
    for F in (1, 2, 4):
        est = estimate_memory(params=n, gpus=gpus, mode="diloco", replica_group_size=k, fragments=F, verbose=False)
        assert plain - est["acco_bytes"] == 4 * local // k - 4 * local // k // F, F
