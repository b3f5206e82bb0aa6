"""Tensor parallelism (DP=2 x TP=2 on 4 ranks, a Megatron-style mpu): every data-parallel collective runs on
the data-parallel group, the global norm counts split parameters on every TP rank and replicated ones once.
ACCO with clipping active matches the simulator of the unsplit model; sync mode matches stock ZeRO-1 with
the same layout."""

import pytest
import torch

import common
import tp
from acco_ds.testing.simulator import simulate
from dist import launch
from test_engine import assert_matches
from test_pipeline import OTHER_LOCAL_SGD, SPLIT_STEPS, other_local_sgd_reference

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

STEPS, GAS, TP = 4, 4, 2


def reference(mode, clip):
    return simulate(mode, tp.make_full(0), common.loss_fn, common.micro_batch, world_size=2,
                    gradient_accumulation_steps=GAS, steps=STEPS, optimizer_fn=common.reference_optimizer("AdamW"),
                    clip=clip, dtype=torch.float64)


@pytest.mark.timeout(600)
def test_tensor_parallel_acco_matches_the_unsplit_simulator_and_sync_matches_stock():
    clip = 0.05
    runs = [dict(config=common.ds_config(acco={"mode": "acco"}, gas=GAS, clip=clip), steps=STEPS, tp=TP),
            dict(config=common.ds_config(acco={"mode": "sync"}, gas=GAS, clip=clip), steps=STEPS, tp=TP),
            dict(config=common.ds_config(gas=GAS, clip=clip), steps=STEPS, tp=TP, use_acco_initialize=False)]
    results = launch({"runs": runs}, world_size=4, timeout=500)
    ref = reference("acco", clip)
    assert any(n > clip for n in ref["grad_norms"]), "clipping never applied: the test would not see it"
    for dp in range(2):
        ranks = [dp * TP + t for t in range(TP)]
        acco = [tp.assemble([results[r][0]["params"][s] for r in ranks]) for s in range(STEPS)]
        assert_matches(acco, ref["params"])
        for r in ranks:  # the norm every rank reports is the unsplit model's
            torch.testing.assert_close(torch.tensor(results[r][0]["norms"], dtype=torch.float64),
                                       torch.tensor(ref["grad_norms"], dtype=torch.float64), rtol=1e-5, atol=1e-7)
        sync = [tp.assemble([results[r][1]["params"][s] for r in ranks]) for s in range(STEPS)]
        stock = [tp.assemble([results[r][2]["params"][s] for r in ranks]) for s in range(STEPS)]
        assert_matches(sync, [p.double() for p in stock], atol=1e-6, rtol=1e-6)
        assert_matches(stock, reference("sync", clip)["params"])


@pytest.mark.timeout(600)
def test_local_sgd_with_tensor_parallelism_matches_the_unsplit_simulator():
    """diloco, co2, EDiT (norm weighting, pseudo-gradient clip), A-EDiT and Streaming DiLoCo at DP 2 x TP 2: a replica
    is one data-parallel rank with its whole tensor-parallel group, and the outer groups join the same
    tensor-parallel slice across replicas. Every replica's weights and the
    anchor users read, assembled from the TP slices, match the local-SGD simulator of the unsplit model."""
    from acco_ds.config import ACCOConfig
    from acco_ds.testing.simulator import simulate_local_sgd
    modes = ("diloco", "co2")
    blocks = {m: {"mode": m, "local_sgd": {"sync_every": 2, "replica_group_size": 1}} for m in modes}
    runs = [dict(config=common.ds_config(acco=blocks[m], gas=2, clip=0.05), steps=STEPS + 2, tp=TP,
                 record_committed=True) for m in modes]
    runs += [dict(config=common.ds_config(acco=block, gas=2, clip=0.05), steps=SPLIT_STEPS, tp=TP,
                  record_committed=True) for block in OTHER_LOCAL_SGD.values()]
    # A-EDiT: rank 3 (replica 1's second TP slice) takes twice as long per micro-batch on an injected clock
    a_edit = {"mode": "edit", "local_sgd": {"sync_time_s": 9.0, "replica_group_size": 1}}
    runs.append(dict(config=common.ds_config(acco=a_edit, gas=2), steps=10**6, until_syncs=3, tp=TP,
                     fake_clock=[1.0, 1.0, 1.0, 2.0], record_committed=True))
    results = launch({"runs": runs}, world_size=4, timeout=500)
    i = len(runs) - 1  # A-EDiT's clock is the slowest rank of the whole replica: both slices end periods together
    period_steps = [[int(s) for s in h["steps"]] for h in results[0][i]["stats"]["sync_history"]]
    assert len(period_steps) == 3 and all(fast > slow for fast, slow in period_steps), period_steps
    assert [len(results[r][i]["params"]) for r in range(4)] == [sum(p[0] for p in period_steps)] * 2 + \
        [sum(p[1] for p in period_steps)] * 2
    s = ACCOConfig(enabled=True, **a_edit).outer
    ref = simulate_local_sgd("edit", tp.make_full(0), common.loss_fn, common.micro_batch, world_size=2, group_size=1,
                             gradient_accumulation_steps=2, steps=0, sync_every=1,
                             optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=s["outer_lr"],
                             outer_momentum=s["outer_momentum"], nesterov=s["nesterov"], period_steps=period_steps,
                             dtype=torch.float64)
    for dp in range(2):
        ranks = [dp * TP + t for t in range(TP)]
        steps = len(results[ranks[0]][i]["params"])
        assert_matches([tp.assemble([results[r][i]["params"][k] for r in ranks]) for k in range(steps)],
                       ref["replicas"][dp])
        assert_matches([tp.assemble([results[r][i]["committed"][-1] for r in ranks])], [ref["anchor"][-1]])
    for i, (name, block) in enumerate(OTHER_LOCAL_SGD.items(), start=len(modes)):  # EDiT's norms count slices once
        ref = other_local_sgd_reference(name, block, tp.make_full(0), common.micro_batch, world=2,
                                        steps=SPLIT_STEPS, clip=0.05)
        for dp in range(2):
            ranks = [dp * TP + t for t in range(TP)]
            assert_matches([tp.assemble([results[r][i]["committed"][k] for r in ranks]) for k in range(SPLIT_STEPS)],
                           ref["anchor"])
            assert_matches([tp.assemble([results[r][i]["params"][k] for r in ranks]) for k in range(SPLIT_STEPS)],
                           ref["replicas"][dp])
    for i, mode in enumerate(modes):
        s = ACCOConfig(enabled=True, **blocks[mode]).outer
        ref = simulate_local_sgd(mode, tp.make_full(0), common.loss_fn, common.micro_batch, world_size=2,
                                 group_size=1, gradient_accumulation_steps=2, steps=STEPS + 2, sync_every=2,
                                 optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=s["outer_lr"],
                                 outer_momentum=s["outer_momentum"], nesterov=s["nesterov"],
                                 staleness_penalty=s["staleness_penalty"], clip=0.05, dtype=torch.float64)
        for dp in range(2):
            ranks = [dp * TP + t for t in range(TP)]
            replica = [tp.assemble([results[r][i]["params"][k] for r in ranks]) for k in range(STEPS + 2)]
            assert_matches(replica, ref["replicas"][dp])
            anchor = [tp.assemble([results[r][i]["committed"][k] for r in ranks]) for k in range(STEPS + 2)]
            assert_matches(anchor, ref["anchor"])


@pytest.mark.timeout(500)
def test_sparseloco_with_tensor_parallelism_cuts_chunks_from_whole_tensors():
    """sparseloco at DP 2 x TP 2, 2-bit values: a column-parallel layer (split along dim 0) and a row-parallel one
    (dim 1, so a chunk of the whole tensor takes columns from both slices). The chunks are the whole tensors'
    (the contract's), so every replica's weights, the anchor and the residual norm, assembled from the TP slices,
    match the sparseloco simulator of the unsplit model; 12 chunks dealt to the replica's 2 ranks."""
    from acco_ds.testing.sparseloco import simulate_sparseloco
    sparse, steps = dict(chunk=16, topk=4, value_bits=2), STEPS + 2
    block = {"mode": "sparseloco", "local_sgd": {"sync_every": 2, "replica_group_size": 1, **sparse}}
    runs = [dict(config=common.ds_config(acco=block, gas=2, clip=0.05), steps=steps, tp=TP, record_committed=True)]
    results = launch({"runs": runs}, world_size=4, timeout=400)
    ref = simulate_sparseloco(tp.make_full(0), common.loss_fn, common.micro_batch, world_size=2, group_size=1,
                              gradient_accumulation_steps=2, steps=steps, sync_every=2,
                              optimizer_fn=common.reference_optimizer("AdamW"), clip=0.05, **sparse)
    assert (ref["anchor"][-1] - ref["anchor"][0]).abs().max() > 1e-3  # the syncs moved the anchor
    for dp in range(2):
        ranks = [dp * TP + t for t in range(TP)]
        assert_matches([tp.assemble([results[r][0]["params"][k] for r in ranks]) for k in range(steps)],
                       ref["replicas"][dp])
        assert_matches([tp.assemble([results[r][0]["committed"][k] for r in ranks]) for k in range(steps)],
                       ref["anchor"])
        want = float(ref["errors"][dp][-1].norm())  # replicated fc2.bias counted once
        for r in ranks:
            got = results[r][0]["stats"]["sparse_residual_norm"]
            assert abs(got - want) <= 1e-4 * want, (got, want)
    # a rank's payload: a tag byte, then per chunk of 16 its 4 indices at 4 bits, 2-bit codes in whole bytes and an
    # fp32 scale; fc2.bias is a 3-element chunk, all kept: its indices do not travel
    assert [results[r][0]["stats"]["sparse_payload_bytes"] for r in range(2)] == [1 + 6 * 7, 1 + 5 * 7 + 1 + 4]
