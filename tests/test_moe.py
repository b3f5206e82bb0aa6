"""Mixture of experts (``deepspeed.moe.layer.MoE``, 4 experts, ep_size 2, top-1) on 4 CPU ranks (gloo).

Each rank holds 2 of the 4 experts (its position in its expert-parallel run of 2 ranks); ZeRO-1 partitions
them over the expert-data-parallel group of 2 ranks. ``sync`` must equal stock ZeRO-1 on every rank, and
every mode must equal the float64 simulator run on ``common.DenseMoENet``, the same model with every expert in
one process (an expert's gradient is the gradient of the mean loss of all ranks, as a dense one).
"""

import pytest
import torch

import common
from acco_ds.memory import acco_buffer_bytes, estimate_memory
from acco_ds.testing.simulator import simulate, simulate_local_sgd
from dist import launch

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

W, STEPS = 4, 3


def canonical(flat, rank, ep=common.MOE_EP):
    """A rank's flat parameters (``module.parameters()`` order) by canonical name."""
    model = common.MoENet(ep)
    names = common.moe_canonical_names(model, rank % ep)
    out, offset = {}, 0
    for name, p in zip(names, model.parameters()):
        out[name] = flat[offset:offset + p.numel()].double()
        offset += p.numel()
    assert offset == flat.numel()
    return out


def dense(flat):
    model = common.make_model(0, "dense_moe")
    out, offset = {}, 0
    for name, p in model.named_parameters():
        out[name] = flat[offset:offset + p.numel()]
        offset += p.numel()
    return out


def reference(mode, steps=STEPS, gas=4, clip=0.0, optimizer="AdamW"):
    return simulate(mode, common.make_model(0, "dense_moe"), common.loss_fn, common.micro_batch, world_size=W,
                    gradient_accumulation_steps=gas, steps=steps, optimizer_fn=common.reference_optimizer(optimizer),
                    clip=clip, dtype=torch.float64)


def assert_ranks_match(results, ref_params, atol=2e-6, rtol=1e-5, key="params", ep=common.MOE_EP):
    """Every rank's weights after every step equal the reference's, name by name (its own experts).
    ``ref_params``: one list for every rank, or a function of the rank giving its list."""
    for rank, r in enumerate(results):
        wanted = ref_params(rank) if callable(ref_params) else ref_params
        assert len(r[key]) == len(wanted)
        for t, (got, want) in enumerate(zip(r[key], wanted)):
            want = dense(want)
            for name, value in canonical(got, rank, ep).items():
                torch.testing.assert_close(value, want[name], atol=atol, rtol=rtol,
                                           msg=lambda m: f"rank {rank} step {t + 1} {name}: {m}")


def moe_spec(acco=None, **kw):
    clip = kw.pop("clip", 0.0)
    return dict(config=common.ds_config(acco=acco, clip=clip), model="moe", steps=STEPS, **kw)


def test_round_modes_on_moe_match_stock_zero1_and_the_simulator():
    runs = [moe_spec(use_acco_initialize=False), moe_spec({"mode": "sync"}), moe_spec({"mode": "acco"}, clip=0.5),
            moe_spec({"mode": "dpu"})]
    results = launch({"runs": runs}, world_size=W, timeout=300)
    stock, sync, acco, dpu = ([results[r][i] for r in range(W)] for i in range(4))
    # sync is stock ZeRO-1 on every rank: the same weights, to float rounding.
    for rank in range(W):
        for t, (a, b) in enumerate(zip(stock[rank]["params"], sync[rank]["params"])):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"rank {rank} step {t + 1}: {m}")
        torch.testing.assert_close(torch.tensor(stock[rank]["norms"]), torch.tensor(sync[rank]["norms"]),
                                   rtol=1e-5, atol=1e-7)
    assert_ranks_match(stock, reference("sync")["params"])  # the dense-equivalent oracle is the right one
    ref = reference("acco", clip=0.5)
    assert any(n > 0.5 for n in ref["grad_norms"]), "clipping never applied: the test would not see it"
    assert_ranks_match(acco, ref["params"])
    torch.testing.assert_close(torch.tensor(acco[0]["norms"], dtype=torch.float64),
                               torch.tensor(ref["grad_norms"], dtype=torch.float64), rtol=1e-5, atol=1e-7)
    assert_ranks_match(dpu, reference("dpu")["params"])
    # The experts really are partitioned apart: ranks at different expert-parallel positions hold different
    # experts, and both positions' experts move.
    first, last = canonical(acco[0]["params"][0], 0), canonical(acco[1]["params"][-1], 1)
    assert "expert.0.weight" in first and "expert.2.weight" in last
    # Memory: the dense group's buffers over 4 ranks, the expert group's over its 2 (what the estimator counts).
    dense_numel, expert_numel = acco[0]["group_numels"]
    for run, mode in ((acco, "acco"), (dpu, "dpu"), (sync, "sync")):
        assert run[0]["buffer_bytes"]["total"] == acco_buffer_bytes(dense_numel, W, "fp32", mode=mode) + \
            acco_buffer_bytes(expert_numel, W // common.MOE_EP, "fp32", mode=mode)
    model = common.MoENet()  # one rank's model: its 2 local experts
    est = estimate_memory(model, gpus=W, dtype="fp32", ep_size=common.MOE_EP, verbose=False)
    local = sum(p.numel() for p in model.parameters() if getattr(p, "allreduce", True) is False)
    assert est["expert_params"] == local * common.MOE_EP and est["params"] == 7 * 8 + 8 + 8 * 4 + 8 * 3 + 3 + 4 * 72
    dense_only = estimate_memory(params=est["params"] - est["expert_params"], gpus=W, dtype="fp32", verbose=False)
    experts = estimate_memory(params=local, gpus=W // common.MOE_EP, dtype="fp32", verbose=False)
    assert est["acco_bytes"] == dense_only["acco_bytes"] + experts["acco_bytes"]


def assert_replicas_agree(results, step=-1):
    """Dense weights equal on every rank, each expert's on every rank that holds it (bit for bit)."""
    seen = {}
    for rank, r in enumerate(results):
        for name, value in canonical(r["params"][step], rank).items():
            if name in seen:
                assert torch.equal(seen[name], value), f"rank {rank} disagrees on {name}"
            seen[name] = value
    return seen


def test_adaptive_node_aware_and_compressed_rounds_on_moe():
    """Adaptive accumulation (rank 1 slowed; ep_size 1, as ep_size 2 is refused) matches the simulator with each
    worker's counts; node-aware
    collectives (2 nodes of 2 ranks: the dense group hierarchical, the expert groups flat) match it too;
    int8 and fp8 rounds stay close to full precision and keep every copy of a weight identical."""
    adaptive = {"mode": "acco", "accumulation": "adaptive", "max_micro_batches_per_round": 8,
                "emulation": {"comm_delay_s": 0.05, "slow_rank": 1, "slow_factor": 30.0}}
    hier = {"layout": "hierarchical", "ranks_per_node": 2}
    int8 = {"dtype": "int8", "block_size": 16, "apply_to": ["rounds"]}
    fp8 = {**int8, "dtype": "fp8"}
    runs = [dict(moe_spec(adaptive), model="moe_ep1"), moe_spec({"mode": "acco", "collectives": hier}),
            moe_spec({"mode": "acco", "compression": int8, "collectives": hier}),
            moe_spec({"mode": "sync", "compression": int8}), moe_spec({"mode": "acco", "compression": fp8})]
    results = launch({"runs": runs}, world_size=W, timeout=300)
    ada, hierarchical, compressed, sync8, acco_fp8 = ([results[r][i] for r in range(W)] for i in range(5))
    counts = {i: c for i, (_, c) in enumerate(ada[0]["round_counts"]) if c is not None}
    assert any(len(set(c)) > 1 for c in counts.values()), f"workers contributed equally: {counts}"
    ref = simulate("acco", common.make_model(0, "dense_moe"), common.loss_fn, common.micro_batch, world_size=W,
                   gradient_accumulation_steps=4, steps=STEPS, optimizer_fn=common.reference_optimizer("AdamW"),
                   counts=lambda rnd, w: counts[rnd][w] if rnd in counts else 2, dtype=torch.float64)
    assert_ranks_match(ada, ref["params"], ep=1)
    assert hierarchical[0]["collectives"] == "hierarchical (2 nodes x 2 ranks)"
    assert_ranks_match(hierarchical, reference("acco")["params"])
    for runs_, mode in ((compressed, "acco"), (sync8, "sync"), (acco_fp8, "acco")):
        weights = assert_replicas_agree(runs_)
        exact = dense(reference(mode)["params"][-1])
        gap = max(float((weights[n] - exact[n]).abs().max()) for n in weights)
        assert 1e-6 < gap < 5e-2, f"{mode} compressed: {gap}"
        assert runs_[0]["stats"]["compressed_bytes"] > 0


def local_sgd(mode, H=2, k=2, **outer):
    return {"mode": mode, "local_sgd": {"sync_every": H, "replica_group_size": k, **outer}}


def local_reference(mode, **ls):
    from acco_ds.config import ACCOConfig
    cfg = ACCOConfig(enabled=True, **local_sgd(mode, **ls))
    o, l = cfg.outer, cfg.local_sgd
    anomaly = l.anomaly.model_dump(exclude={"enabled"}) if l.anomaly.enabled else None
    return simulate_local_sgd(mode, common.make_model(0, "dense_moe"), common.loss_fn, common.micro_batch,
                              world_size=W, group_size=2, gradient_accumulation_steps=2, steps=4, sync_every=2,
                              optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=o["outer_lr"],
                              outer_momentum=o["outer_momentum"], nesterov=o["nesterov"],
                              staleness_penalty=o["staleness_penalty"], momentum_clip=o["outer_momentum_clip"],
                              weighting=l.weighting, pseudo_grad_clip=l.pseudo_grad_clip, anomaly=anomaly,
                              dtype=torch.float64)


SGD_CONFIG = dict(optimizer=None, zero_allow_untested_optimizer=True)


def test_diloco_on_moe_is_stock_zero1_at_one_step_periods_and_matches_the_simulator():
    """Replicas of 2 ranks (each holds the whole expert-parallel run of 2: experts live inside a replica).
    DiLoCo with sync_every 1, outer_lr 1, no momentum and inner SGD is the same update as stock ZeRO-1 with
    SGD; with Nesterov and AdamW over 2-step periods it matches the simulator replica by replica, and the
    committed model is the simulator's anchor."""
    one = local_sgd("diloco", H=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    runs = [dict(config=common.ds_config(gas=2, **SGD_CONFIG), model="moe", steps=STEPS, client_optimizer="SGD",
                 use_acco_initialize=False),
            dict(config=common.ds_config(acco=one, gas=2, **SGD_CONFIG), model="moe", steps=STEPS,
                 client_optimizer="SGD"),
            dict(config=common.ds_config(acco=local_sgd("diloco"), gas=2), model="moe", steps=4,
                 record_committed=True)]
    results = launch({"runs": runs}, world_size=W, timeout=300)
    stock, diloco1, diloco = ([results[r][i] for r in range(W)] for i in range(3))
    for rank in range(W):
        for t, (a, b) in enumerate(zip(stock[rank]["params"], diloco1[rank]["params"])):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"rank {rank} step {t + 1}: {m}")
    assert len(diloco1[0]["params"]) == STEPS
    ref = local_reference("diloco")
    assert_ranks_match(diloco, lambda rank: ref["replicas"][rank // 2])
    assert_ranks_match(diloco, ref["anchor"], key="committed")
    # The replicas really differ between syncs (the comparison above can tell them apart).
    assert not torch.equal(diloco[0]["params"][0], diloco[2]["params"][0])
    # ep_size 1 (every rank holds the 4 experts): the expert group is partitioned over both ranks of a replica
    # (its expert-data-parallel group inside the replica), and over all 4 ranks in the round modes.
    edit = {"weighting": "norm"}
    runs = [dict(config=common.ds_config(acco=local_sgd("diloco"), gas=2), model="moe_ep1", steps=4),
            dict(config=common.ds_config(acco={"mode": "acco"}), model="moe_ep1", steps=STEPS),
            dict(config=common.ds_config(acco=local_sgd("edit", **edit), gas=2), model="moe_ep1", steps=4)]
    results = launch({"runs": runs}, world_size=W, timeout=300)
    assert_ranks_match([results[r][0] for r in range(W)], lambda rank: ref["replicas"][rank // 2], ep=1)
    assert_ranks_match([results[r][1] for r in range(W)], reference("acco")["params"], ep=1)
    ref = local_reference("edit", **edit)
    assert_ranks_match([results[r][2] for r in range(W)], lambda rank: ref["replicas"][rank // 2], ep=1)


def test_co2_and_edit_on_moe_match_the_simulator():
    """CO2 (the outer all-reduce on its own thread, one period stale) and EDiT (the layer-wise sync, its
    norm-weighted average and clipping over every expert of the replica) on MoE, replica by replica."""
    cases = [("co2", {}), ("edit", {"weighting": "norm", "pseudo_grad_clip": 0.002})]
    runs = [dict(config=common.ds_config(acco=local_sgd(mode, **ls), gas=2), model="moe", steps=4,
                 record_committed=True) for mode, ls in cases]
    results = launch({"runs": runs}, world_size=W, timeout=300)
    for i, (mode, ls) in enumerate(cases):
        ref = local_reference(mode, **ls)
        got = [results[r][i] for r in range(W)]
        assert_ranks_match(got, lambda rank: ref["replicas"][rank // 2])
        assert_ranks_match(got, ref["anchor"], key="committed")


def test_moe_checkpoints_resume_bit_for_bit_and_other_layouts_are_refused_by_name(tmp_path):
    """acco (a half-computed step in flight at the save) resumes bit for bit on every rank; loading it with
    another ep_size is refused by name (another data-parallel size: test_moe_checkpoints.py); so are the layouts
    that do not support experts yet."""
    ckpt = str(tmp_path / "ckpt")
    cfg = common.ds_config(acco={"mode": "acco"})
    full, saved = (dict(config=cfg, model="moe", steps=6), dict(config=cfg, model="moe", steps=3, save=ckpt))
    refusals = [dict(config=common.ds_config(acco=local_sgd("diloco", k=1)), model="moe", init_error=True),
                dict(config=common.ds_config(acco={"mode": "acco", "accumulation": "adaptive"}), model="moe",
                     init_error=True)]
    lcfg, lckpt = common.ds_config(acco=local_sgd("diloco", H=3), gas=2), str(tmp_path / "local")
    local = [dict(config=lcfg, model="moe", steps=5), dict(config=lcfg, model="moe", steps=2, save=lckpt)]  # 2, 3
    first = launch({"runs": [full, saved] + local}, world_size=W, timeout=300)
    refused = launch({"runs": refusals}, world_size=W, timeout=200)
    errors = [refused[0][i]["init_error"] for i in range(2)]
    assert "ep_size 2 does not divide acco.local_sgd.replica_group_size 1" in errors[0], errors[0]
    assert 'acco.accumulation="adaptive" cannot run with expert parallelism (ep_size 2)' in errors[1], errors[1]
    resumed = launch({"runs": [dict(config=cfg, model="moe", steps=6, load=ckpt),
                               dict(config=cfg, model="moe_ep1", steps=6, load=ckpt, load_error=True),
                               dict(config=lcfg, model="moe", steps=5, load=lckpt)]},
                     world_size=W, timeout=300)
    for rank in range(W):
        # acco from step 3, diloco (replicas of 2 ranks, mid-period at the save) from step 2
        for i, full_run, (done, steps) in ((0, 0, (3, 6)), (2, 2, (2, 5))):
            assert resumed[rank][i]["loaded"]["global_steps"] == done
            assert len(resumed[rank][i]["params"]) == steps - done
            for t, (a, b) in enumerate(zip(resumed[rank][i]["params"], first[rank][full_run]["params"][done:])):
                assert torch.equal(a, b), f"rank {rank} run {i}: step {done + t + 1} differs after the resume"
    assert "changing ep_size" in resumed[0][1]["load_error"], resumed[0][1]["load_error"]
