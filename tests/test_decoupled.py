"""``"mode": "decoupled"`` in one ``deepspeed``-style launch (CPU ranks, gloo): the launch starts its own syncer
shards. With K = the number of learners and ``grace_s`` 0 it is DiLoCo exactly (the float64 simulators of both
agree with the engine after every inner step); with K = 1 learners run apart and the syncer's merge log replays,
in the float64 simulator, to the θ_g the syncer holds."""

import json

import pytest
import torch

import common
from acco_ds.testing.decoupled import replay, simulate_decoupled
from acco_ds.testing.simulator import simulate_local_sgd
from dist import launch
from test_engine import assert_matches

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

GAS, STEPS, H = 2, 6, 2
OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)


def decoupled(k, state_dir, **keys):
    return {"mode": "decoupled", "local_sgd": {"sync_every": H, "replica_group_size": k,
                                               "syncer": {"state_dir": str(state_dir), "timeout_s": 60}, **keys}}


def syncer_theta(state_dir, k):
    return torch.cat([torch.load(state_dir / f"shard{j}.pt", weights_only=True)["x"] for j in range(k)])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, k", [(2, 1), (4, 2)])
def test_full_quorum_without_grace_is_diloco(tmp_path, world, k):
    state = tmp_path / "syncer"
    run = dict(config=common.ds_config(acco=decoupled(k, state, min_quorum=world // k, grace_s=0), gas=GAS),
               steps=STEPS, record_committed=True)
    results = launch({"runs": [run]}, world_size=world, timeout=200, workdir=tmp_path / "run")
    ref = simulate_local_sgd("diloco", common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                             group_size=k, gradient_accumulation_steps=GAS, steps=STEPS, sync_every=H,
                             optimizer_fn=common.reference_optimizer("AdamW"), **OUTER)
    for rank in range(world):
        r = results[rank][0]
        assert r["global_steps"] == STEPS
        assert_matches(r["params"], ref["replicas"][rank // k])
        assert_matches(r["committed"], ref["anchor"])
        assert r["stats"]["decoupled"] and r["stats"]["merges"] == STEPS // H
        assert r["stats"]["staleness"] == [0] * (STEPS // H)
    log = [json.loads(line) for line in (state / "merges.jsonl").read_text().splitlines()]
    assert [sorted(rec["learners"]) for rec in log] == [[0, 1]] * (STEPS // H)
    numel = results[0][0]["params"][-1].numel()
    theta = syncer_theta(state, k)[:numel]  # the slices end to end hold ZeRO-1's padded partitions
    torch.testing.assert_close(theta.double(), ref["anchor"][-1], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_quorum_one_learners_run_apart_and_the_merge_log_replays(tmp_path):
    """Learner 1 (rank 1) is slowed 3x: with K = 1 learner 0 never waits for it, merges alone and runs more
    periods; every merge of the log replays, in float64, to the syncer's θ_g."""
    state = tmp_path / "syncer"
    acco = {**decoupled(1, state, min_quorum=1, grace_s=0), "emulation": {"slow_rank": 1, "slow_factor": 3.0}}
    runs = [dict(config=common.ds_config(acco=acco, gas=GAS), steps=STEPS)]
    results = launch({"runs": runs}, world_size=2, timeout=200, workdir=tmp_path / "run")
    log = [json.loads(line) for line in (state / "merges.jsonl").read_text().splitlines()]
    assert len(log) >= STEPS // H  # learner 0 merges at least as often as it ends a period
    assert any(len(rec["learners"]) == 1 for rec in log)  # K = 1: nobody waited for the other
    assert max(s for rec in log for s in rec["staleness"]) >= 1  # a Δ from an older version, merged as it is
    rep = replay(log, common.make_model(0), common.loss_fn, common.micro_batch, learners=2, group_size=1,
                 gradient_accumulation_steps=GAS, optimizer_fn=common.reference_optimizer("AdamW"), **OUTER)
    numel = results[0][0]["params"][-1].numel()
    torch.testing.assert_close(syncer_theta(state, 1)[:numel].double(), rep["theta"], rtol=1e-5, atol=1e-6)
    for rank in range(2):
        s = results[rank][0]["stats"]
        assert s["merges"] == STEPS // H


@pytest.mark.timeout(240)
def test_timed_periods_weigh_learners_by_tokens_and_replay(tmp_path):
    """``sync_every_s``: a period ends on wall time, so the slowed learner brings fewer inner steps per period;
    with ``merge: "tokens"`` its pseudo-gradient weighs that much less (Delayed Nesterov, K = 1), and the log
    still replays to the syncer's θ_g."""
    state = tmp_path / "syncer"
    acco = {"mode": "decoupled", "local_sgd": {"sync_every_s": 0.3, "replica_group_size": 1, "min_quorum": 1,
                                               "grace_s": 0, "staleness": "delayed_nesterov",
                                               "syncer": {"state_dir": str(state), "timeout_s": 60}},
            "emulation": {"slow_rank": 1, "slow_factor": 3.0}}
    results = launch({"runs": [dict(config=common.ds_config(acco=acco, gas=GAS), steps=12)]}, world_size=2,
                     timeout=200, workdir=tmp_path / "run")
    log = [json.loads(line) for line in (state / "merges.jsonl").read_text().splitlines()]
    steps = {c["learner"]: [] for rec in log for c in rec["contributions"]}
    for rec in log:
        for c in rec["contributions"]:
            assert c["tokens"] == c["steps"] >= 1
            steps[c["learner"]].append(c["steps"])
    assert sum(steps[0]) == 12 and sum(steps[1]) == 12  # every inner step merged once (the last period at the end)
    rep = replay(log, common.make_model(0), common.loss_fn, common.micro_batch, learners=2, group_size=1,
                 gradient_accumulation_steps=GAS, optimizer_fn=common.reference_optimizer("AdamW"),
                 staleness="delayed_nesterov", **OUTER)
    numel = results[0][0]["params"][-1].numel()
    torch.testing.assert_close(syncer_theta(state, 1)[:numel].double(), rep["theta"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_a_quantized_up_link_and_overlapping_learners_match_the_simulator(tmp_path):
    """2 learners of 2 ranks. An int8 up-link (blocks of 16, error feedback on each rank's slice) with K = 2 and
    no grace: every θ_g a learner adopts is the float64 simulator's with the same quantization, and each DELTA
    carries 4 ceil(P / 16) + P payload bytes. adopt "overlap" with K = 1 and learner 1 slowed: learners adopt
    a merge one or more inner steps after their send, and the log (with those steps) replays to the syncer's θ_g."""
    from test_compression import assert_matches as assert_matches_quantized
    comp = {"dtype": "int8", "block_size": 16, "apply_to": ["outer"]}
    q, o = tmp_path / "quantized", tmp_path / "overlap"
    overlap = {**decoupled(2, o, min_quorum=1, grace_s=0, adopt="overlap"),
               "emulation": {"slow_rank": 2, "slow_factor": 3.0}}
    runs = [dict(config=common.ds_config(acco={**decoupled(2, q, min_quorum=2, grace_s=0), "compression": comp},
                                         gas=GAS), steps=STEPS, record_committed=True),
            dict(config=common.ds_config(acco=overlap, gas=GAS), steps=4 * H)]
    results = launch({"runs": runs}, world_size=4, timeout=200, workdir=tmp_path / "run")
    sim = simulate_decoupled(common.make_model(0), common.loss_fn, common.micro_batch, learners=2, group_size=2,
                             gradient_accumulation_steps=GAS, sync_every=H, periods=STEPS // H, min_quorum=2,
                             optimizer_fn=common.reference_optimizer("AdamW"), **OUTER,
                             compression={"dtype": "int8", "block_size": 16, "error_feedback": True})
    P = 74  # the test model's 146 parameters, padded to 148, in 2 slices
    for rank in range(4):
        r = results[rank][0]
        assert r["stats"]["uplink"] == "int8 blocks of 16" and r["stats"]["merges"] == STEPS // H
        assert r["stats"]["delta_bytes"] == STEPS // H * (84 + len("delta") + 4 * -(-P // 16) + P)
        assert_matches_quantized(r["committed"], [sim["versions"][(t + 1) // H] for t in range(STEPS)])
    plain = simulate_decoupled(common.make_model(0), common.loss_fn, common.micro_batch, learners=2, group_size=2,
                               gradient_accumulation_steps=GAS, sync_every=H, periods=STEPS // H, min_quorum=2,
                               optimizer_fn=common.reference_optimizer("AdamW"), **OUTER)
    assert float((plain["theta"] - sim["theta"]).abs().max()) > 1e-4  # the quantization shows
    log = [json.loads(line) for line in (o / "merges.jsonl").read_text().splitlines()]
    firsts = {}
    for rec in log:
        for c in rec["contributions"]:
            assert c["adopted_after"] >= (1 if c["learner"] in firsts else 0)
            firsts.setdefault(c["learner"], c)
    assert sum(c["steps"] for rec in log for c in rec["contributions"]) == 2 * 4 * H  # every step merged once
    rep = replay(log, common.make_model(0), common.loss_fn, common.micro_batch, learners=2, group_size=2,
                 gradient_accumulation_steps=GAS, optimizer_fn=common.reference_optimizer("AdamW"), **OUTER)
    numel = results[0][1]["params"][-1].numel()
    torch.testing.assert_close(syncer_theta(o, 2)[:numel].double(), rep["theta"], rtol=1e-5, atol=1e-6)
