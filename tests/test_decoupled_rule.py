"""The rule of ``"mode": "decoupled"`` in its float64 simulator (acco_ds/testing/decoupled.py): with K = M and no
grace window it is DiLoCo; a merge log replays to the same θ_g; Delayed Nesterov with N = 1 is Nesterov, and
over N merges it is one Nesterov step on their mean; a slow or dead learner never stalls the others."""

import pytest
import torch

import common
from acco_ds.testing.decoupled import OuterRule, replay, simulate_decoupled
from acco_ds.testing.simulator import simulate_local_sgd

OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
COMMON = dict(group_size=1, gradient_accumulation_steps=2, optimizer_fn=common.reference_optimizer("AdamW"))


def run(**kw):
    args = {**COMMON, **OUTER, "learners": 2, "sync_every": 2, "periods": 3, **kw}
    return simulate_decoupled(common.make_model(0), common.loss_fn, common.micro_batch, **args)


def replay_of(out, **kw):
    args = {**COMMON, **OUTER, "learners": 2, **kw}
    return replay(out["log"], common.make_model(0), common.loss_fn, common.micro_batch, **args)


@pytest.mark.parametrize("k", [1, 2])
def test_full_quorum_without_grace_is_diloco(k):
    M, H, P = 2, 2, 3
    out = run(group_size=k, min_quorum=M, grace_s=0.0, step_time=[1.0, 3.0])
    ref = simulate_local_sgd("diloco", common.make_model(0), common.loss_fn, common.micro_batch, world_size=M * k,
                             group_size=k, gradient_accumulation_steps=2, steps=H * P, sync_every=H,
                             optimizer_fn=common.reference_optimizer("AdamW"), **OUTER)
    assert out["version"] == P
    torch.testing.assert_close(out["theta"], ref["anchor"][-1], rtol=0, atol=1e-12)
    for p in range(P):
        torch.testing.assert_close(out["versions"][p + 1], ref["anchor"][H * (p + 1) - 1], rtol=0, atol=1e-12)
    assert all(rec.staleness == [0, 0] for rec in out["log"])


def test_quorum_one_lets_the_fast_learner_run_ahead_and_the_log_replays():
    out = run(min_quorum=1, grace_s=0.0, step_time=[1.0, 3.0], periods=4)
    # The fast learner never waits: it finished its 4 periods at t = 8, merged alone each time.
    assert out["idle_s"][0] == 0.0 and out["idle_s"][1] == 0.0
    assert out["learner_periods"] == [4, 4]
    assert out["version"] == 8
    stale = [s for rec in out["log"] for s in rec.staleness]
    assert max(stale) >= 1  # the slow learner's Δ is merged as it is, from an older version
    rep = replay_of(out)
    torch.testing.assert_close(rep["theta"], out["theta"], rtol=0, atol=0)
    # A log that lost its order is refused by name.
    bad = [r.as_dict() for r in out["log"]][::-1]
    with pytest.raises(ValueError, match="merge log out of order"):
        replay_of({"log": bad})


def test_grace_window_gathers_learners_arriving_within_it():
    # K=1, three learners at speeds 1, 1.1, 3: a 0.5 s window merges the two fast ones together.
    out = run(learners=3, min_quorum=1, grace_s=0.5, step_time=[1.0, 1.1, 3.0], periods=2)
    first = out["log"][0]
    assert [c.learner for c in first.contributions] == [0, 1] and first.time == pytest.approx(2.5)
    rep = replay_of(out, learners=3)
    torch.testing.assert_close(rep["theta"], out["theta"], rtol=0, atol=0)
    auto = run(learners=3, min_quorum=1, grace_s="auto", step_time=[1.0, 1.1, 3.0], periods=3)
    assert auto["version"] >= 3


def test_token_weights_and_equal_weights_differ_only_with_unequal_tokens():
    x = torch.zeros(3, dtype=torch.float64)
    d1, d2 = torch.ones(3, dtype=torch.float64), 3 * torch.ones(3, dtype=torch.float64)
    tokens = OuterRule(x, **OUTER).mean([d1, d2], [1, 3])
    equal = OuterRule(x, **OUTER, merge="equal").mean([d1, d2], [1, 3])
    torch.testing.assert_close(tokens, torch.full((3,), 2.5, dtype=torch.float64))
    torch.testing.assert_close(equal, torch.full((3,), 2.0, dtype=torch.float64))


def test_delayed_nesterov():
    torch.manual_seed(0)
    x0 = torch.randn(5, dtype=torch.float64)
    grads = [torch.randn(5, dtype=torch.float64) for _ in range(6)]
    plain = OuterRule(x0, **OUTER)
    one = OuterRule(x0, **OUTER, staleness="delayed_nesterov", nesterov_delay=1)
    for g in grads:
        plain.step(g)
        one.step(g)
    torch.testing.assert_close(one.x, plain.x, rtol=0, atol=1e-14)
    # N = 3: after every 3 merges x moved as one Nesterov step on their mean.
    three = OuterRule(x0, **OUTER, staleness="delayed_nesterov", nesterov_delay=3)
    window = OuterRule(x0, **OUTER)
    for i in range(0, 6, 3):
        for g in grads[i:i + 3]:
            three.step(g)
        window.step(sum(grads[i:i + 3]) / 3)
        torch.testing.assert_close(three.x, window.x, rtol=0, atol=1e-13)
    # In between, only the plain averaged gradient moves x: the momentum waits.
    mid = OuterRule(x0, **OUTER, staleness="delayed_nesterov", nesterov_delay=3)
    mid.step(grads[0])
    torch.testing.assert_close(mid.x, x0 - 0.7 * grads[0] / 3)
    assert mid.m.abs().max() == 0


def test_a_dead_learner_never_stalls_the_others_and_a_relaunched_one_starts_from_the_current_model():
    # K = M = 2: learner 1 dies at t=3 inside its second period; learner 0 waits only until then.
    out = run(min_quorum=2, grace_s=0.0, deaths={1: 3.0}, periods=3)
    assert out["learner_periods"][0] == 3
    assert max(out["idle_s"]) <= 1.0 + 1e-9
    # Relaunched at t=4.5: it starts from the version current then, and merges again.
    back = run(min_quorum=1, grace_s=0.0, deaths={1: 3.0}, rejoins={1: 4.5}, periods=3)
    rejoined = [c for rec in back["log"] for c in rec.contributions if c.learner == 1]
    assert len(rejoined) >= 2 and rejoined[1].base >= 2
