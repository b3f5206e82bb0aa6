"""The cluster benchmark harness end to end: a few steps on plain loopback (no namespaces, no root, no timing
assertions). Checks that every mode it ran has a row, a record with a reproducible command, and finite losses."""

import csv
import json
import math
import os
import subprocess
import sys

import pytest

from dist import ROOT

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

MODES = ["ZeRO-1 (stock)", "acco fixed"]


@pytest.mark.timeout(300)
def test_cluster_harness_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "benchmarks/cluster.py"), "smoke", "--modes", ",".join(MODES),
           "--results_dir", str(tmp_path), "--run_timeout", "120"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)  # hard limit
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    records = [json.loads(line) for line in (tmp_path / "cluster_runs_smoke.jsonl").read_text().splitlines()]
    assert sorted(r["mode"] for r in records) == sorted(MODES)
    for r in records:
        assert r["bandwidth"] == "unlimited" and r["result"]["steps"] == 2
        assert math.isfinite(r["result"]["final_val_loss"]) and math.isfinite(r["result"]["first_loss"])
        assert all(math.isfinite(p["val_loss"]) for p in r["history"])
        assert r["command"].startswith("python benchmarks/cluster.py one --bandwidth unlimited")
        assert len(r["rank_commands"]) == 2 and "benchmarks/train_worker.py" in r["rank_commands"][0]

    rows = list(csv.DictReader(open(tmp_path / "cluster_smoke.csv")))
    assert sorted(row["mode"] for row in rows) == sorted(MODES)
    assert all(math.isfinite(float(row["final_val_loss"])) and float(row["samples_per_s"]) > 0 for row in rows)
    table = json.loads((tmp_path / "cluster_smoke.json").read_text())["tables"]["throughput"]
    assert sorted(t["mode"] for t in table) == sorted(MODES)
    md = (tmp_path / "cluster_smoke.md").read_text()
    for mode in MODES:
        assert f"| unlimited | {mode} |" in md
