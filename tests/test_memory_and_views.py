"""Buffers and precision (issue 8), and what users read (issue 10): committed
weights in state_dict, evaluation and checkpoints, and finalize. 2 CPU ranks."""

import torch

import common
from acco_ds.runtime.rounds.buffers import plan_bytes
from acco_ds.memory import acco_buffer_bytes, estimate_memory
from acco_ds.runtime.rounds.buffers import padded_numel
from dist import launch
from test_engine import DRIFT_VS_STOCK, STEPS, W, assert_matches, deviation, reference
import pytest

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_precisions_buffers_and_the_estimator():
    """fp32 / bf16 models, fp32 accumulation on bf16 (ZeRO-1, not BF16_Optimizer),
    bf16 communication of an fp32 model: each agrees with the fp32 reference
    (the reduced-precision ones within DRIFT_VS_STOCK times the drift of stock
    DeepSpeed ZeRO-1 at the same precision, measured in the same launch), and
    allocates exactly the buffers the memory plan and the estimator compute."""
    cases = [  # name, model dtype, grad_accum_dtype, communication_data_type
        ("fp32", "fp32", None, None),
        ("bf16", "bf16", None, None),
        ("bf16+fp32 accumulation", "bf16", "fp32", None),
        ("fp32, bf16 reduce-scatter", "fp32", None, "bf16"),
    ]
    runs, stock_runs = [], []
    for _, dtype, accum, comm in cases:
        extra = {}
        if accum:
            extra["data_types"] = {"grad_accum_dtype": accum}
        if comm:
            extra["communication_data_type"] = comm
        runs.append(dict(config=common.ds_config(acco={"mode": "acco"}, dtype=dtype, **extra), dtype=dtype,
                         steps=STEPS))
        stock_runs.append(dict(config=common.ds_config(dtype=dtype, **extra), dtype=dtype, steps=STEPS,
                               use_acco_initialize=False))
    results = launch({"runs": runs + stock_runs}, world_size=W, timeout=300)
    stock = results[0][len(cases):]
    ref = reference("acco")["params"]
    n = sum(p.numel() for p in common.make_model().parameters())
    for i, ((name, dtype, accum, comm), r) in enumerate(zip(cases, results[0])):
        assert r["optimizer_class"] == "ACCOZeroOptimizer", name
        worst = deviation(r["params"], ref)
        # fp32 in and out: the oracle's own float64 rounding only. Else DRIFT_VS_STOCK x stock's own drift.
        tol = 2e-6 if i == 0 else DRIFT_VS_STOCK * deviation(stock[i]["params"], stock[0]["params"])
        assert worst < tol, f"{name}: max deviation from the fp32 reference {worst:.2e} >= {tol:.2e}"
        if i > 0:
            assert worst > 1e-7, f"{name}: no deviation at all, so the run was not in reduced precision"
        # The engine allocates what the plan says, and the estimator agrees.
        b = r["buffer_bytes"]
        plan = {}
        for numel in r["group_numels"]:
            for key, v in plan_bytes(numel, numel // W, DT[dtype], DT[accum or dtype], DT[comm or dtype]).items():
                plan[key] = plan.get(key, 0) + v
        assert {k: b[k] for k in plan} == plan, name
        assert r["group_numels"] == [padded_numel(n, W)]
        assert b["total"] == acco_buffer_bytes(padded_numel(n, W), W, dtype, accum, comm), name
        est = estimate_memory(params=n, gpus=W, dtype=dtype, grad_accum_dtype=accum, communication_data_type=comm,
                              verbose=False)
        assert est["extra_bytes"] == b["total"] - (DT[accum or dtype].itemsize * padded_numel(n, W)
                                                   + 4 * padded_numel(n, W) // W)
    fp32, bf16, accum32, comm16 = results[0][:len(cases)]
    # One model-sized buffer beyond stock's gradients at default precision (b = 4, 2 bytes).
    size = padded_numel(n, W)
    assert fp32["buffer_bytes"]["communication"] == 4 * size and fp32["buffer_bytes"]["accumulator"] == 4 * size
    assert bf16["buffer_bytes"]["communication"] == 2 * size and bf16["buffer_bytes"]["accumulator"] == 2 * size
    assert accum32["buffer_bytes"]["accumulator"] == 4 * size and accum32["buffer_bytes"]["communication"] == 2 * size
    for a, b in zip(results[0][:len(cases)], results[1][:len(cases)]):
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y), "ranks disagree"


def test_users_see_committed_weights_and_finalize_commits_the_last_step(tmp_path):
    """At every iteration boundary (Accelerate's drive): module.state_dict() and
    eval() give the committed θ_k, equal to the simulator's k-th step, and
    train() gives the compute side back its estimate θ̃_k. A checkpoint
    saved there holds θ_k as module weights and resumes bit-exactly. Without
    any read, finalize after N iterations makes N steps."""
    cfg = common.ds_config(acco={"mode": "acco"})
    runs = [dict(config=cfg, steps=STEPS, drive="b", inspect=True, finalize=True),
            dict(config=common.ds_config(acco={"mode": "dpu"}), steps=STEPS, drive="b", inspect=True),
            dict(config=cfg, steps=STEPS, drive="b", finalize=True),
            dict(config=cfg, steps=100, max_micro=8, drive="b", save=str(tmp_path / "ck")),
            dict(config=cfg, steps=STEPS, drive="b")]
    results = launch({"runs": runs}, world_size=W, timeout=300)
    inspected, dpu, finalized, saved, uninterrupted = results[0]
    ref = reference("acco", steps=STEPS + 1)
    for k, seen in enumerate(inspected["inspect"], start=1):
        assert seen["global_steps"] == seen["global_steps_after"] == k
        assert_matches([seen["state_dict"], seen["eval"]], [ref["params"][k - 1]] * 2)
        assert_matches([seen["compute"]], [ref["estimates"][k - 1]])
    assert len(inspected["inspect"]) == STEPS and inspected["global_steps"] == STEPS
    assert_matches([inspected["final_params"]], [ref["params"][STEPS - 1]])
    ref_dpu = reference("dpu")["params"]
    for k, seen in enumerate(dpu["inspect"], start=1):
        assert seen["global_steps"] == k
        assert_matches([seen["state_dict"], seen["eval"]], [ref_dpu[k - 1]] * 2)
    # No reads: 5 iterations of 4 micro-batches, the 5th step committed by finalize.
    assert finalized["micro"] == 4 * (STEPS + 1) and finalized["global_steps"] == STEPS + 1
    assert_matches([finalized["final_params"]], [ref["params"][STEPS]])
    # Saved at the iteration-2 boundary: the module weights are θ_2, global_steps says 2.
    assert saved["saved_global_steps"] == 2
    module = torch.load(tmp_path / "ck" / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    weights = torch.cat([t.float().reshape(-1) for t in module.values()])
    assert torch.equal(weights, inspected["inspect"][1]["state_dict"])
    resumed = launch({"runs": [dict(config=cfg, steps=STEPS, drive="b", load=str(tmp_path / "ck"))]},
                     world_size=W, timeout=300)[0][0]
    assert resumed["global_steps"] == uninterrupted["global_steps"]
    # was_step_applied() as in the run that did not stop (the save counted the step it waited for).
    assert resumed["applied"] == uninterrupted["applied"][2:] == [True] * len(resumed["applied"])
    for got, want in zip(resumed["params"], uninterrupted["params"][2:]):
        assert torch.equal(got, want), (got - want).abs().max()
