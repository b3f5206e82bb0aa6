"""benchmarks/gpu_check.py, the one-command GPU check, dry-run on the CPU with --tiny: every section runs
and reports real figures (the GPU run itself happens on a lent GPU machine)."""

import json
import math
import os
import sys

import pytest

from dist import ROOT, run_in_session

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

SECTIONS = ["environment", "build", "correctness", "timing", "quantization", "training", "local_sgd", "moe", "pytest",
            "summary"]
MODES = ["stock", "acco", "dpu", "sync"]


@pytest.mark.timeout(420)
def test_gpu_check_cpu_dry_run(tmp_path):
    out = tmp_path / "x.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", "--skip-pytest", "--out", str(out)]
    proc = run_in_session(cmd, timeout=360, env=env, check=False)
    assert out.exists(), f"no JSON written:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    sections = result["sections"]
    assert list(sections) == SECTIONS
    failed = {name: s.get("traceback") or s.get("error") for name, s in sections.items() if not s["ok"]}
    assert not failed and proc.returncode == 0, f"failed sections: {failed}\n{proc.stdout[-3000:]}"

    env_section = sections["environment"]
    for key in ("python", "torch", "deepspeed", "device_name"):
        assert env_section[key], key
    assert sections["build"]["loaded"] and sections["build"]["kernels"] == "native-cpu"

    cases = sections["correctness"]["cases"]
    assert len(cases) == 12  # out fp32/bf16/fp16 x commit/peek x AdamW/Adam
    assert all(c["pass"] for c in cases), [c for c in cases if not c["pass"]]

    rows = sections["timing"]["rows"]
    assert {r["kernel"] for r in rows} == {"peek", "commit"} and sections["timing"]["copy_GBps"] > 0
    assert all(r["fused_ms"] > 0 and r["torch_ms"] > 0 and r["fused_GBps"] > 0 for r in rows)

    quant = sections["quantization"]  # quantize/dequantize: native against the reference, bit for bit
    assert quant["all_pass"] and len(quant["cases"]) == 8, quant["cases"]  # int8, fp8 x 4 layouts
    assert all(c["reference_on_device_equals_cpu"] for c in quant["cases"]), quant["cases"]
    assert all(r["GBps"] > 0 for r in quant["rows"]) and quant["peek_ms"] > 0 and quant["torch_fused_adamw_ms"] > 0

    training = sections["training"]
    runs = training["runs"]
    assert list(runs) == MODES
    for mode, run in runs.items():
        losses = run["losses"]
        assert len(losses) == training["steps"] and all(math.isfinite(x) for x in losses), mode
        assert losses[-1] < losses[0], f"{mode} did not learn: {losses}"
        assert run["tokens_per_s"] > 0, mode
        if mode == "stock":
            assert run["acco_stats"] is None and run["buffer_bytes"] is None
        else:
            assert run["buffer_bytes"] > 0 and run["estimate"]["extra_bytes"] is not None, mode
            assert run["acco_stats"]["kernels"] == "native-cpu", mode
    # sync is plain ZeRO-1: the same losses as stock DeepSpeed, step for step.
    assert max(abs(a - b) for a, b in zip(runs["sync"]["losses"], runs["stock"]["losses"])) <= 1e-5
    assert training["sync_vs_stock_max_loss_diff"] <= 1e-5

    local = sections["local_sgd"]  # 2 CPU ranks here (gloo), 2 replicas of 1
    assert list(local["runs"]) == ["diloco", "streaming", "sparseloco", "co2", "edit", "decoupled"], local["status"]
    for mode, run in local["runs"].items():
        assert run["syncs"] >= 2 and all(math.isfinite(x) for x in run["losses"]), (mode, run)
        assert run["one_model_after_finalize"], mode
    resume = local["a_edit_resume"]  # saved without a tag: the ranks agreed on it (an all-reduce)
    assert resume["tag"].startswith("global_step") and resume["loaded_equals_saved"] is True, resume
    assert resume["syncs_after"] > resume["syncs_at_load"] and resume["one_model_after_finalize"], resume
    moe = sections["moe"]  # the MoE GPT, ep_size 2, on one replica of 2 CPU ranks
    assert list(moe["runs"]) == ["stock", "sync", "acco"] and moe["moe"]["ep_size"] == 2, moe["status"]
    for mode, run in moe["runs"].items():
        assert run["finite"] and run["dense_same_on_every_rank"] and run["experts_on_rank"] > 0, (mode, run)
    # sync is stock's update on the expert groups too; bf16 here: one rounding flip apart at most (fp32: tests/test_moe.py)
    assert moe["sync_vs_stock_max_loss_diff"] <= 1e-3
    assert sections["pytest"]["skipped"] is True
    checks = {row["check"]: row for row in sections["summary"]["rows"]}
    assert checks["sync vs stock losses"]["verdict"] == "met"
    assert checks["A-EDiT save/resume"]["verdict"] == "met"
    assert "sync vs stock tokens/s" in checks
    assert "adamw_update vs reference" in proc.stdout and "sections failed" in proc.stdout  # the table
