"""Streaming DiLoCo, SparseLoCo and A-EDiT on mixture of experts (``common.MoENet``: one DeepSpeed ``MoE`` layer of
4 experts, ep_size 2, top-1) on 4 CPU ranks as 2 replicas of 2 (gloo).

Each replica holds the whole expert-parallel run of 2 ranks; rank r holds experts 2(r mod 2), 2(r mod 2)+1, alone
in its expert group's partition inside the replica, while the dense group is split over both ranks of the replica.
The ranks holding the same experts in every replica (the expert group's rails) are the outer group. Every mode
must match its float64 simulator run on ``common.DenseMoENet`` (every expert in one process), rank by rank.
"""

import pytest
import torch

import common
from acco_ds.testing.simulator import simulate_local_sgd
from acco_ds.testing.sparseloco import simulate_sparseloco
from dist import launch
from test_compression import assert_matches as assert_matches_or_flip
from test_moe import assert_ranks_match, assert_replicas_agree, dense

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

W, K, GAS, STEPS, H, F = 4, 2, 2, 8, 4, 2
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
STREAMING = {"fragments": F, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
SPARSE = {"chunk": 16, "topk": 4, "value_bits": 2, "error_decay": 0.95}
A_EDIT = {"sync_time_s": 9.0, "weighting": "norm"}
INT8 = {"dtype": "int8", "block_size": 16, "apply_to": ["outer"]}


def block(mode, **ls):
    return {"mode": mode, "local_sgd": {"replica_group_size": K, **({} if "sync_time_s" in ls else
                                                                    {"sync_every": H}), **ls}}


def fragment_owner(fragments):
    """Per ``DenseMoENet`` parameter, its Streaming DiLoCo fragment: a rank cuts its own parameters, dense group
    first then its experts, at F equal element offsets (``streaming.fragment_slices``); local expert i is in the
    same fragment on every rank, so global expert 2p + i is in local expert i's."""
    model = common.MoENet()
    params = list(model.parameters())
    order = [p for p in params if getattr(p, "allreduce", True)] + \
        [p for p in params if not getattr(p, "allreduce", True)]
    total, offset, frag = sum(p.numel() for p in order), 0, {}
    for p in order:
        frag[id(p)] = fragments * offset // total
        offset += p.numel()
    of = {}
    for ep_rank in range(common.MOE_EP):
        for name, p in zip(common.moe_canonical_names(model, ep_rank), params):
            of[name] = frag[id(p)]
    return [of[name] for name, _ in common.make_model(0, "dense_moe").named_parameters()]


def streaming_reference():
    return simulate_local_sgd("diloco", common.make_model(0, "dense_moe"), common.loss_fn, common.micro_batch,
                              world_size=W, group_size=K, gradient_accumulation_steps=GAS, steps=STEPS, sync_every=H,
                              optimizer_fn=common.reference_optimizer("AdamW"), fragment_owner=fragment_owner(F),
                              fragments=F, **{k: v for k, v in STREAMING.items() if k != "fragments"}, **OUTER)


def per_rank(ref_params, ep_rank):
    """The simulator's flat vectors cut to one rank's parameters (its own experts), in its module's order."""
    names = common.moe_canonical_names(common.MoENet(), ep_rank)
    return [torch.cat([dense(v)[n] for n in names]) for v in ref_params]


def a_edit_reference(period_steps, **ls):
    from acco_ds.config import ACCOConfig
    o = ACCOConfig(enabled=True, **block("edit", **ls)).outer
    return simulate_local_sgd("edit", common.make_model(0, "dense_moe"), common.loss_fn, common.micro_batch,
                              world_size=W, group_size=K, gradient_accumulation_steps=GAS, steps=0, sync_every=1,
                              optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=o["outer_lr"],
                              outer_momentum=o["outer_momentum"], nesterov=o["nesterov"],
                              staleness_penalty=o["staleness_penalty"], momentum_clip=o["outer_momentum_clip"],
                              weighting=ls.get("weighting", "mean"), period_steps=period_steps)


def test_streaming_sparseloco_and_a_edit_on_moe_match_their_simulators():
    costs = [1.0, 1.0, 1.0, 2.0]  # rank 3 (replica 1) computes at half speed on A-EDiT's injected clock
    runs = [dict(config=common.ds_config(acco=block("diloco", **STREAMING, **OUTER), gas=GAS), model="moe",
                 steps=STEPS, record_committed=True, finalize=True),
            dict(config=common.ds_config(acco={**block("diloco", **STREAMING, **OUTER), "compression": INT8},
                                         gas=GAS), model="moe", steps=STEPS, record_committed=True, finalize=True),
            dict(config=common.ds_config(acco=block("sparseloco", **SPARSE), gas=GAS), model="moe", steps=STEPS,
                 record_committed=True),
            dict(config=common.ds_config(acco=block("edit", **A_EDIT), gas=GAS),
                 model="moe", steps=10**6, until_syncs=3, fake_clock=costs, record_committed=True),
            dict(config=common.ds_config(acco=block("sparseloco", **SPARSE, overlap=2), gas=GAS), model="moe",
                 steps=STEPS, record_committed=True)]
    results = launch({"runs": runs}, world_size=W, timeout=500)
    stream, stream8, sparse, aedit, overlapped = ([results[r][i] for r in range(W)] for i in range(5))

    # Streaming DiLoCo: both fragments hold dense and expert slices; each rank's replica and anchor are the
    # simulator's at every step, and finalize leaves one model (every copy of an expert alike).
    owner = fragment_owner(F)  # DenseMoENet's order: fc_in (2), gate, 4 experts (8), fc_out (2)
    assert owner == [0, 0, 0] + [0, 1, 1, 1] * 2 + [0, 0], owner
    ref = streaming_reference()
    assert_ranks_match(stream, lambda rank: ref["replicas"][rank // K])
    assert_ranks_match(stream, ref["anchor"], key="committed")
    for rank, r in enumerate(stream):
        s = r["stats"]
        assert s["fragment_syncs"] == [STEPS // H + 1, STEPS // H + 1] and all(b > 0 for b in s["fragment_outer_bytes"])
    assert_replicas_agree([dict(params=[r["final_params"]]) for r in stream])
    assert (stream[0]["params"][0] - stream[2]["params"][0]).abs().max() > 1e-4, "replicas trained alike"

    # int8 outer all-reduce (each fragment its own error-feedback residual): every copy of a weight reads the
    # same global values, near the full-precision run's.
    assert_replicas_agree([dict(params=r["committed"]) for r in stream8])
    assert_replicas_agree([dict(params=[r["final_params"]]) for r in stream8])
    gap = max(float((a - b).abs().max()) for rank in range(W)
              for a, b in zip(stream8[rank]["committed"], stream[rank]["committed"]))
    assert 1e-6 < gap < 1e-2, gap
    assert stream8[0]["stats"]["outer_compression"] == "int8 blocks of 16"
    assert stream8[0]["stats"]["outer_residual_bytes"] > 0

    # SparseLoCo: top-k with error feedback per chunk of every tensor, experts over their rails; the dense
    # group's partition boundary (62 of 124) cuts fc_in.bias's chunk, so the straddle exchange runs too.
    sref = simulate_sparseloco(common.make_model(0, "dense_moe"), common.loss_fn, common.micro_batch, world_size=W,
                               group_size=K, gradient_accumulation_steps=GAS, steps=STEPS, sync_every=H,
                               optimizer_fn=common.reference_optimizer("AdamW"), **SPARSE)
    for rank, r in enumerate(sparse):
        assert_matches_or_flip(r["params"], per_rank(sref["replicas"][rank // K], rank % common.MOE_EP))
        assert_matches_or_flip(r["committed"], per_rank(sref["anchor"], rank % common.MOE_EP))
        assert r["stats"]["syncs"] == STEPS // H
    assert sum(r["stats"]["sparse_boundary_bytes"] for r in sparse) > 0
    for rank, r in enumerate(sparse):  # the summary's residual norm: this replica's ‖e‖, every expert once
        want = float(sref["errors"][rank // K][-1].norm())
        assert abs(r["stats"]["sparse_residual_norm"] - want) <= 1e-4 * want, (r["stats"], want)
    # overlapped (the gather behind the next 2 inner steps, dense and expert groups alike): the simulator's rule
    oref = simulate_sparseloco(common.make_model(0, "dense_moe"), common.loss_fn, common.micro_batch, world_size=W,
                               group_size=K, gradient_accumulation_steps=GAS, steps=STEPS, sync_every=H,
                               optimizer_fn=common.reference_optimizer("AdamW"), overlap=2, **SPARSE)
    for rank, r in enumerate(overlapped):
        assert_matches_or_flip(r["params"], per_rank(oref["replicas"][rank // K], rank % common.MOE_EP))
        assert_matches_or_flip(r["committed"], per_rank(oref["anchor"], rank % common.MOE_EP))

    # A-EDiT: the slow replica runs fewer inner steps per period; the anchor and each replica equal the
    # simulator fed the step counts the syncs exchanged.
    history = aedit[0]["stats"]["sync_history"]
    period_steps = [[int(s) for s in h["steps"]] for h in history]
    assert len(period_steps) == 3 and all(fast > slow for fast, slow in period_steps), period_steps
    aref = a_edit_reference(period_steps, **A_EDIT)
    for rank, r in enumerate(aedit):
        assert r["global_steps"] == len(aref["replicas"][rank // K])
    assert_ranks_match(aedit, lambda rank: aref["replicas"][rank // K])
    assert_ranks_match([dict(committed=[r["committed"][-1]]) for r in aedit], [aref["anchor"][-1]], key="committed")
