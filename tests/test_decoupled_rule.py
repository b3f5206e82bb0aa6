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


def test_overlap_adopts_at_the_next_step_boundary_keeping_the_progress_since_the_send():
    """adopt "overlap", one learner, K = 1: each merge is made as its Δ arrives, and the learner takes it one inner
    step into its next period: θ ← θ_g + (θ − sent). Written out by hand here, and replayed from the log."""
    from acco_ds.testing.simulator import replica_inner_step
    from torch.nn.utils import parameters_to_vector, vector_to_parameters
    H, P = 3, 3
    out = run(learners=1, min_quorum=1, grace_s=0.0, sync_every=H, periods=P, adopt="overlap")
    assert [c.adopted_after for rec in out["log"] for c in rec.contributions] == [0, 1, 1]
    assert out["idle_s"] == [0.0]
    model = common.make_model(0).double()
    params = [p for p in model.parameters()]
    opt = common.reference_optimizer("AdamW")(model)
    rule = OuterRule(parameters_to_vector(params).detach().clone(), **OUTER, nesterov_delay=1)
    nxt, anchor, sent = [0], rule.x.clone(), None
    for p in range(P):
        for n in range(H):
            if n == 1 and sent is not None:  # the merge of the last Δ arrived: adopt it, keep one step's progress
                theta = parameters_to_vector(params).detach()
                vector_to_parameters(rule.x + (theta - sent), params)
                anchor = rule.x.clone()
            replica_inner_step(model, params, range(1), 2, nxt, common.loss_fn, common.micro_batch, opt, 0.0, None)
        sent = parameters_to_vector(params).detach().clone()
        rule.step(anchor - sent)
    torch.testing.assert_close(out["theta"], rule.x, rtol=0, atol=1e-12)
    torch.testing.assert_close(replay_of(out, learners=1)["theta"], out["theta"], rtol=0, atol=0)


def test_overlap_learners_never_wait_their_periods_stretch_to_their_merge_and_the_log_replays():
    wait = run(min_quorum=2, grace_s=0.0, step_time=[1.0, 3.0], periods=3)
    over = run(min_quorum=2, grace_s=0.0, step_time=[1.0, 3.0], periods=3, adopt="overlap")
    # K = 2: waiting, the fast learner (periods of 2 s) idles 4 s a merge for the slow one (6 s). Overlapping, it
    # trains on: sent at 2, merged at 6, its period runs to its adoption (4 steps), and so on; the slow one
    # adopts one step into its next period. Steps, and so tokens, follow.
    assert wait["idle_s"] == [12.0, 0.0] and over["idle_s"] == [0.0, 0.0]
    assert [[(c.adopted_after, c.steps, c.tokens) for c in rec.contributions] for rec in over["log"]] == \
        [[(0, 2, 2), (0, 2, 2)], [(4, 4, 4), (1, 2, 2)], [(6, 6, 6), (1, 2, 2)]]
    rep = replay_of(over)
    torch.testing.assert_close(rep["theta"], over["theta"], rtol=0, atol=0)
    assert float((over["theta"] - wait["theta"]).abs().max()) > 1e-4  # another rule than "wait"


@pytest.mark.parametrize("k", [1, 2])
def test_a_quantized_up_link_is_merged_dequantized_and_the_log_replays_with_it(k):
    """int8 blocks of 16 with error feedback on each rank's ZeRO-1 slice: another θ_g than fp32, and the replay
    (which quantizes the same way) reproduces it exactly."""
    from acco_ds.testing.compressed import Quantizer
    comp = {"dtype": "int8", "block_size": 16, "error_feedback": True}
    plain = run(group_size=k, min_quorum=1, grace_s=0.0, step_time=[1.0, 1.5])
    quant = run(group_size=k, min_quorum=1, grace_s=0.0, step_time=[1.0, 1.5], compression=comp)
    assert [r.as_dict()["learners"] for r in quant["log"]] == [r.as_dict()["learners"] for r in plain["log"]]
    assert float((quant["theta"] - plain["theta"]).abs().max()) > 1e-4
    torch.testing.assert_close(replay_of(quant, group_size=k, compression=comp)["theta"], quant["theta"], rtol=0,
                               atol=0)
    # The first merge is learner 0's first Δ, quantized by hand: one Nesterov step on deq(Q(Δ)) per slice.
    first = run(learners=1, group_size=k, min_quorum=1, grace_s=0.0, periods=1)
    delta = first["versions"][0] - first["theta"]  # plain: Δ = (1 + 0.9) 0.7 Δ̄ undone below
    delta = delta / (0.7 * 1.9)
    n = delta.numel()
    padded = torch.cat([delta, delta.new_zeros(-(-n // (2 * k)) * 2 * k - n)])
    P = padded.numel() // k
    q = Quantizer("int8", 16)
    sent = torch.cat([q.send(padded[r * P:(r + 1) * P], key=r) for r in range(k)])[:n]
    one = run(learners=1, group_size=k, min_quorum=1, grace_s=0.0, periods=1, compression=comp)
    torch.testing.assert_close(one["theta"], first["versions"][0] - 0.7 * 1.9 * sent, rtol=0, atol=1e-12)
