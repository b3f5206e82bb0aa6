"""The cluster benchmark harness end to end, a few steps on plain loopback (no timing assertions)."""

import json
import math
import os
import subprocess
import sys

from dist import ROOT


def test_cluster_harness_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "benchmarks/cluster.py"), "smoke", "--modes", "ZeRO-1 (stock),acco fixed",
           "--results_dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "cluster_runs_smoke.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in records} == {"ZeRO-1 (stock)", "acco fixed"}
    for r in records:
        assert math.isfinite(r["result"]["final_val_loss"]) and r["result"]["steps"] == 2
        assert r["command"].startswith("python benchmarks/cluster.py one")
    table = (tmp_path / "cluster_smoke.md").read_text()
    assert "| unlimited | acco fixed |" in table and "| unlimited | ZeRO-1 (stock) |" in table
