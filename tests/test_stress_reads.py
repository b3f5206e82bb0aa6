"""The quick version of ``benchmarks/stress_reads.py``: 10 launches of the reported adaptive-accumulation
sequence (40 backward/step calls, eval() with a forward and a user all-reduce, train(), 40 more,
save_checkpoint, 10 more, acco_finalize; acco.timeout_s 60) beside a CPU hog. Before the read protocol of
``runtime/rounds/peers.py`` 4 of 10 such launches deadlocked here (benchmarks/results/
stress_reads_before_fix.json: rank 0 in the read's all-reduce, rank 1 waiting for its round's job)."""

import json
import subprocess
import sys

import pytest

from dist import ROOT

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out


def test_adaptive_reads_never_hang_under_load(tmp_path):
    out = tmp_path / "stress.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "stress_reads.py"), "--scenarios", "ds-issue45",
           "--launches", "10", "--trials", "1", "--hogs", "1", "--timeout", "90", "--seed", "7", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT / "benchmarks")
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())["scenarios"]["ds-issue45"]
    assert s["launches"] == 10
    assert s["hangs"] == 0 and s["crashes"] == 0, json.dumps(s["failed"], indent=1)[-6000:]
    assert s["trials_done"] == 10  # every launch ran its reads on every rank
    assert proc.returncode == 0, proc.stdout[-3000:]
