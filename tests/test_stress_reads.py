"""The quick version of ``benchmarks/stress_reads.py``: 10 launches of the adaptive-accumulation read
scenario (eval with a user all-reduce, state_dict, a user collective between steps, save_checkpoint,
acco_finalize, each at a random point of a round, random communication delays and slow ranks) beside a CPU
hog. Before the read protocol of ``runtime/rounds/peers.py`` about one launch in seven hung here."""

import json
import subprocess
import sys

import pytest

from dist import ROOT

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out


def test_adaptive_reads_never_hang_under_load(tmp_path):
    out = tmp_path / "stress.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "stress_reads.py"), "--scenarios", "ds-acco-adaptive",
           "--launches", "10", "--trials", "1", "--hogs", "1", "--timeout", "90", "--seed", "7", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT / "benchmarks")
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())["scenarios"]["ds-acco-adaptive"]
    assert s["launches"] == 10
    assert s["hangs"] == 0 and s["crashes"] == 0, json.dumps(s["failed"], indent=1)[-6000:]
    assert proc.returncode == 0, proc.stdout[-3000:]
