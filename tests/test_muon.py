"""Muon as the inner optimizer of the local-SGD modes, against the float64 simulator.

2 ranks, R = 2 replicas of k = 1 (DiLoCo as published): DeepSpeed's ``"optimizer": {"type": "Muon"}`` puts
the two weight matrices of the tiny model (13x7 and 3x13: both transposition cases of Newton-Schulz) in
Muon and the biases in AdamW. The simulator's replicas step a float64 Muon written here from the formulas.

Tolerance: the engine runs Newton-Schulz's quintic (3.4445, -4.7750, 2.0315; five steps) in fp32, the
simulator in float64. The quintic does not converge (it spreads the singular values over about [0.7, 1.1]) and
multiplies a perturbation of a small singular value by up to 3.4445 per step, so fp32 rounding (6e-8) can
grow by 3.4445^5 ~ 500. Over 600 random 13x7 / 7x13 matrices, some with singular values down to 1e-4 of the
largest, the fp32 result differs from float64 by at most 1.9e-6 per entry of O (entries of order 0.3 to 1).
Times the learning rate 0.02, that is 4e-8 per inner step; 12 inner steps and four Nesterov outer steps
(lr 0.7, momentum 0.9: x1.33 each) bound the drift near 1e-6. The test holds the AdamW runs' tolerance,
atol 2e-6 and rtol 1e-5 (measured: 3.8e-7 at most). The replicas differ from each other by more than 1e-3
and from an AdamW run by more than 1e-2.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import common
from acco_ds.runtime.outer.inner_muon import muon_direction
from acco_ds.testing.simulator import simulate_local_sgd
from acco_ds.testing.sparseloco import simulate_sparseloco
from dist import launch
from test_engine import assert_matches

GAS, STEPS, H = 2, 12, 3
MUON = {"muon_lr": 0.02, "adam_lr": 0.01, "momentum": 0.95, "weight_decay": 0.01, "betas": [0.9, 0.999],
        "eps": 1e-8}
ATOL, RTOL = 2e-6, 1e-5
MODES = ("diloco", "co2", "sparseloco")


def muon_config(mode="diloco", k=1, **local):
    cfg = common.ds_config(acco={"mode": mode, "local_sgd": {"sync_every": H, "replica_group_size": k, **local}},
                           gas=GAS)
    cfg["optimizer"] = {"type": "Muon", "params": dict(MUON)}
    return cfg


class ReferenceMuon:
    """float64 Muon + AdamW over a module, written from the formulas (not from acco_ds's code)."""

    def __init__(self, module):
        mats = [p for p in module.parameters() if p.dim() >= 2]
        rest = [p for p in module.parameters() if p.dim() < 2]
        self.mats, self.state = mats, {p: torch.zeros_like(p) for p in mats}
        self.adam = torch.optim.AdamW(rest, lr=MUON["adam_lr"], betas=tuple(MUON["betas"]), eps=MUON["eps"],
                                      weight_decay=MUON["weight_decay"])

    @staticmethod
    def orthogonalize(u):
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / (torch.linalg.matrix_norm(x) + 1e-7)
        for _ in range(5):
            a = x @ x.T
            x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
        x = x.T if u.shape[0] > u.shape[1] else x
        return x * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))

    @torch.no_grad()
    def step(self):
        beta, lr, wd = MUON["momentum"], MUON["muon_lr"], MUON["weight_decay"]
        for p in self.mats:
            m = self.state[p]
            m.mul_(beta).add_(p.grad, alpha=1 - beta)
            u = (1 - beta) * p.grad + beta * m
            p.mul_(1 - lr * wd).sub_(lr * self.orthogonalize(u))
        self.adam.step()


SPARSE = {"chunk": 16, "topk": 4, "value_bits": None}  # full-precision values: only the top-k choice is sparse


def reference(mode="diloco", world=2, k=1):
    from acco_ds.config import ACCOConfig
    if mode == "sparseloco":
        return simulate_sparseloco(common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                                   group_size=k, gradient_accumulation_steps=GAS, steps=STEPS, sync_every=H,
                                   optimizer_fn=ReferenceMuon, **SPARSE)
    s = ACCOConfig(enabled=True, mode=mode, local_sgd={"sync_every": H, "replica_group_size": k}).outer
    return simulate_local_sgd(mode, common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                              group_size=k, gradient_accumulation_steps=GAS, steps=STEPS, sync_every=H,
                              optimizer_fn=ReferenceMuon, outer_lr=s["outer_lr"], outer_momentum=s["outer_momentum"],
                              nesterov=s["nesterov"], staleness_penalty=s["staleness_penalty"],
                              momentum_clip=s["outer_momentum_clip"], dtype=torch.float64)


def training_loss(flat) -> float:
    """Mean loss of the model ``flat`` over every micro-batch the two ranks trained on."""
    model = common.make_model(0).double()
    vector_to_parameters(flat.double(), model.parameters())
    with torch.no_grad():
        losses = [float(common.loss_fn(model, common.micro_batch(w, i))) for w in range(2) for i in range(GAS * STEPS)]
    return sum(losses) / len(losses)


def test_the_direction_is_orthogonal_up_to_newton_schulz_spread():
    g = torch.randn(13, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    o = muon_direction(g.clone(), torch.zeros_like(g), beta=0.95) / math.sqrt(13 / 7)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.2, s  # the quintic's spread around 1, not the gradient's spectrum
    want = ReferenceMuon.orthogonalize(0.05 * g + 0.95 * 0.05 * g)  # (1-β)g + β·m, m = (1-β)g
    torch.testing.assert_close(o * math.sqrt(13 / 7), want, atol=1e-12, rtol=1e-10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diloco_co2_and_sparseloco_with_muon_match_the_float64_simulator_and_learn():
    runs = [dict(config=muon_config(mode, **(SPARSE if mode == "sparseloco" else {})), steps=STEPS,
                 record_committed=True) for mode in MODES]
    adamw_config = common.ds_config(acco={"mode": "diloco", "local_sgd": {"sync_every": H, "replica_group_size": 1}},
                                    gas=GAS)
    runs.append(dict(config=adamw_config, steps=STEPS))
    results = launch({"runs": runs}, world_size=2, timeout=240)
    for i, mode in enumerate(MODES):
        ref = reference(mode)
        for rank in range(2):
            r = results[rank][i]
            assert r["global_steps"] == STEPS
            assert_matches(r["params"], ref["replicas"][rank], atol=ATOL, rtol=RTOL)
            assert_matches(r["committed"], ref["anchor"], atol=ATOL, rtol=RTOL)
        a, b = results[0][i]["params"][-1], results[1][i]["params"][-2]
        assert (a - b).abs().max() > 1e-3, "the replicas trained on the same data"
        start = parameters_to_vector(common.make_model(0).parameters()).detach()
        before, after = training_loss(start), training_loss(results[0][i]["committed"][-1])
        assert after < 0.95 * before, (mode, before, after)  # the committed model learned its batches
    adamw = results[0][len(MODES)]["params"][-1]
    assert (adamw - results[0][0]["params"][-1]).abs().max() > 1e-2, "Muon ran as AdamW"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_muon_outside_one_rank_local_sgd_replicas_is_refused_naming_the_fix():
    acco_mode = common.ds_config(acco={"mode": "acco"}, gas=GAS)
    acco_mode["optimizer"] = {"type": "Muon", "params": dict(MUON)}
    bad = [(acco_mode, 'not in mode "acco"')]
    results = launch({"runs": [dict(config=cfg, steps=1, init_error=True) for cfg, _ in bad]}, world_size=2,
                     timeout=100)
    for i, (_, text) in enumerate(bad):
        for rank in range(2):
            assert text in results[rank][i]["init_error"], results[rank][i]["init_error"]


def test_muon_on_replicas_of_several_ranks_and_per_head_muon_are_refused_naming_the_fix():
    from acco_ds.config import ACCOConfig
    from acco_ds.config.acco import _muon_rules
    from acco_ds.config.rulebook import Layout
    acco = ACCOConfig(enabled=True, mode="diloco", local_sgd={"sync_every": H, "replica_group_size": 2})
    muon = SimpleNamespace(optimizer_name="muon", optimizer_params={})
    problems = _muon_rules(acco, muon, Layout(world=4))
    assert len(problems) == 1 and 'but a replica is 2 ranks' in problems[0], problems
    assert '"local_sgd": {"replica_group_size": 1}' in problems[0]
    per_head = SimpleNamespace(optimizer_name="Muon", optimizer_params={"per_head_muon": True})
    one = ACCOConfig(enabled=True, mode="diloco", local_sgd={"sync_every": H, "replica_group_size": 1})
    assert ['remove "per_head_muon"' in p for p in _muon_rules(one, per_head, Layout(world=4))] == [True]
    assert _muon_rules(acco, SimpleNamespace(optimizer_name="adamw", optimizer_params={}), Layout(world=4)) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_with_muon_is_exact(tmp_path):
    """The Muon momentum and the AdamW moments travel in DeepSpeed's checkpoint: saved mid-period (step 4 of
    periods of 3), fresh processes load and go on bit-identical to the uninterrupted run."""
    cfg, path, stop = muon_config("diloco"), str(tmp_path / "ckpt"), 4
    full = launch({"runs": [dict(config=cfg, steps=STEPS), dict(config=cfg, steps=100, max_micro=GAS * stop,
                                                                 save=path)]}, world_size=2, timeout=200)
    resumed = launch({"runs": [dict(config=cfg, steps=STEPS, load=path)]}, world_size=2, timeout=200)
    for rank in range(2):
        r, want = resumed[rank][0], full[rank][0]
        assert r["loaded"]["global_steps"] == stop
        assert len(r["params"]) == STEPS - stop
        for got, expect in zip(r["params"], want["params"][stop:]):
            assert torch.equal(got, expect), (rank, (got - expect).abs().max())
