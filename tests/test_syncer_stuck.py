"""A stuck learner stalls no one: 3 learners of one rank, K = M = 3, ``liveness_s`` 1. Learner 2 is stopped
(SIGSTOP) for 3 × ``liveness_s`` after the first merge: shard 0 stops hearing its heartbeat and takes it out of
the quorum, the other two keep merging without it, and after SIGCONT it speaks again, is re-admitted, sends its
pseudo-gradient again and finishes. Every inner step of every learner is merged exactly once."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import common
from dist import launch

pytestmark = pytest.mark.slow

GAS, H, STEPS = 2, 2, 16


def rank_pid(workdir: Path, rank: int) -> int:
    """The process of ``rank`` of the launch in ``workdir`` (ranks are plain subprocesses here)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(workdir).encode() in cmdline and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no process of rank {rank} under {workdir}")


def merges(state):
    path = state / "merges.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(240)
def test_a_stopped_learner_leaves_the_quorum_and_rejoins(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCO_TEST_FORKSERVER", "0")
    monkeypatch.setattr("dist.FORKSERVER", False)
    state, work = tmp_path / "syncer", tmp_path / "run"
    acco = {"mode": "decoupled", "local_sgd": {"sync_every": H, "grace_s": 0, "min_quorum": 3, "replica_group_size": 1,
                                               "syncer": {"state_dir": str(state), "timeout_s": 60,
                                                          "liveness_s": 1.0}},
            "emulation": {"slow_rank": 0, "slow_factor": 4.0}}
    out = {}
    t = threading.Thread(target=lambda: out.update(r=launch({"runs": [dict(config=common.ds_config(acco=acco, gas=GAS),
                                                                           steps=STEPS)]},
                                                            world_size=3, timeout=200, workdir=work)))
    t.start()
    deadline = time.monotonic() + 150
    while not merges(state) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert merges(state), "no first merge"
    pid = rank_pid(work, 2)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    time.sleep(3.0)
    resumed = time.time()
    os.kill(pid, signal.SIGCONT)
    t.join(200)
    results = out["r"]
    during = [m for m in merges(state) if stopped < m["time"] < resumed]  # the log is written after each merge
    # No wait for learner 2: the others merge without it (its Δ sent before the stop may still be in the first).
    assert sum(sorted(m["learners"]) == [0, 1] for m in during) >= 2, during
    assert sum(2 in m["learners"] for m in during) <= 1, during
    log = merges(state)
    for rank in range(3):
        r = results[rank][0]
        assert r["global_steps"] == STEPS
        steps = [c["steps"] for m in log for c in m["contributions"] if c["learner"] == rank]
        assert sum(steps) == STEPS, (rank, steps)  # every inner step merged exactly once
    assert any(2 in m["learners"] for m in log if m["time"] > resumed)  # back after SIGCONT
    assert "learner 2 silent for 1 s" in (state / "shard0.log").read_text()
