"""The fast scenarios of the fault drill (benchmarks/faults.py) as tests.

Each test runs one scenario of the drill on 2 CPU ranks (gloo) under the
drill's hard per-scenario limit (every process killed on expiry) and a
pytest timeout, and asserts what a user would see: every rank exits with an
error, the message, bit-exact resumption from the last checkpoint, skipped
steps and finite weights. Slow or privileged scenarios (the JIT build kill,
the veth link cut) run only in the drill itself.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(name, tmp_path, limit, **opts):
    """The drill's own command line for one scenario (a subprocess: the tests import nothing from
    benchmarks/); its rows come back through the results file it writes."""
    out = tmp_path / name
    cmd = [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--only", name, "--limit", str(limit),
           "--opts", json.dumps(opts), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit + 15)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    for r in rows:
        assert not r["seen"].startswith(("TIMEOUT", "ERROR")), f"{r['seen']}\n{r.get('error', '')}"
    return rows


def assert_comm_failure(message, timeout_s):
    """The engine's own message for a failed round (the communication thread's error, re-raised by the
    compute side), not a raw gloo error: what failed, why, and what to do."""
    assert message.startswith("RuntimeError: ACCO communication failed on this rank: RuntimeError: "), message
    assert (f"Another rank has probably died, hung or lost its network (a hang is detected after "
            f"acco.timeout_s = {timeout_s:g} s): check the other ranks' logs, then relaunch and load_checkpoint"
            ) in message, message


@pytest.mark.timeout(200)
def test_sigkill_one_rank_then_resume_bit_exact(tmp_path):
    (r, ) = run("kill_rank", tmp_path, limit=180)
    assert r["codes"][1] == -9, r
    assert r["codes"][0] not in (0, None), f"the survivor did not exit with an error: {r}"
    assert r["exit_seconds"][0] < 30, r
    assert_comm_failure(r["message"], 1800)  # fault_worker's default acco.timeout_s
    assert r["loaded"] and "step=4" in r["loaded"], r
    assert r["bit_exact"] is True, "relaunch + load_checkpoint did not reproduce the uninterrupted run bit for bit"


@pytest.mark.timeout(150)
def test_sigstop_one_rank_errors_within_timeout(tmp_path):
    timeout_s = 8
    (r, ) = run("stop_rank", tmp_path, limit=130, stop_timeout_s=timeout_s)
    assert r["codes"][0] not in (0, None), f"rank 0 did not exit with an error while rank 1 hung: {r}"
    assert r["exit_seconds"][0] < 3 * timeout_s + 10, r
    assert_comm_failure(r["message"], timeout_s)


@pytest.mark.timeout(200)
def test_nan_inf_gradients_skip_step_on_every_rank(tmp_path):
    rows = run("bad_grads", tmp_path, limit=180)
    assert [r["fault"].rsplit(", ", 1)[-1] for r in rows] == ["fp32", "bf16", "fp16"]
    for r in rows:
        assert r["global_steps"] == [8, 8], r  # training went on
        assert all(s >= 2 for s in r["skipped_steps"]), r  # the NaN step and the Inf step
        assert r["skipped_steps"][0] == r["skipped_steps"][1], r
        assert all(n >= 1 for n in r["warnings_per_rank"]), r  # every rank warns
        assert "non-finite gradients" in r["warning"], r
        assert r["finite"], r


def _can_mount():
    if os.geteuid() != 0:
        return False
    d = Path(tempfile.mkdtemp(prefix="acco_tmpfs_probe_"))
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(d)], capture_output=True)
        return ok
    finally:
        d.rmdir()


@pytest.mark.timeout(200)
@pytest.mark.skipif(not _can_mount(), reason="needs root and mount -t tmpfs")
def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path):
    (r, ) = run("disk_full", tmp_path, limit=180)
    assert all(c not in (0, None) for c in r["codes"]), f"not every rank exited with an error: {r}"
    msg = r["message"]
    assert msg.startswith("RuntimeError: ACCO: save_checkpoint into ") and " failed, is the disk full? " in msg, r
    assert "The previous checkpoint is intact ('latest' was not moved)" in msg, r
    assert "free space or save elsewhere" in msg, r
    assert r["latest"] == "global_step4", f"latest must still name the last complete checkpoint: {r}"
    assert r["previous_loads"], f"the previous checkpoint did not load: {r}"


@pytest.mark.timeout(150)
def test_truncated_checkpoint_gives_an_error(tmp_path):
    cases = [("truncated optim states", "optim", "truncate"), ("truncated model states", "model", "truncate")]
    rows = run("corrupt", tmp_path, limit=130, corrupt_cases=cases)
    assert len(rows) == 2
    for r in rows:
        assert r["errored"], f"a truncated checkpoint loaded without error: {r}"
        assert all(c not in (0, None) for c in r["codes"]), r
        msg = r["message"]
        assert msg.startswith("RuntimeError: ACCO: could not read the checkpoint in "), r
        assert "A file is probably truncated or corrupted: load an earlier tag" in msg, r
        # The rank that read the damaged file reports the file's error, not a peer's lost connection.
        assert "Connection closed" not in msg, r


@pytest.mark.timeout(220)
def test_checkpoint_from_other_settings(tmp_path):
    rows = {r["fault"]: r for r in run("mismatch", tmp_path, limit=200, mismatch_cases=[0, 1, 2, 4])}
    ws = rows["ACCO checkpoint, 2 ranks -> 1 rank"]  # resharded (issue 38), and said so
    assert len(ws["codes"]) == 1 and ws["loads"], ws
    assert ws["warning"] and "resharded the checkpoint" in ws["warning"] and \
        "from 2 data-parallel ranks to 1 data-parallel rank" in ws["warning"], ws
    for label, key in (("ACCO checkpoint, mode acco -> dpu", "mode"),
                       ("ACCO checkpoint, gradient_accumulation_steps 2 -> 4", "gradient_accumulation_steps")):
        r = rows[label]
        assert all(c not in (0, None) for c in r["codes"]), r
        assert r["message"] and key in r["message"], r
    stock = rows["stock DeepSpeed ZeRO-1 checkpoint -> ACCO"]
    assert stock["loads"], stock
    assert stock["warning"] and "no ACCO state" in stock["warning"] and "start-up round" in stock["warning"], stock
    assert "step=8" in stock["loaded"], stock
