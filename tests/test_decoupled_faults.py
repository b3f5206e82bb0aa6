"""Faults of ``"mode": "decoupled"``: a learner that dies stalls no one (its pseudo-gradient in flight is dropped);
across launches (``acco-ds syncer``) a restarted syncer resumes from its checkpoint and a relaunched learner takes
the current global model at once; an unreachable syncer is a clear error after a bounded retry."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import common
from dist import ROOT, free_port, launch

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

GAS, H = 2, 2


def block(state_dir, **keys):
    return {"mode": "decoupled", "local_sgd": {"sync_every": H, "grace_s": 0,
                                               "syncer": {"state_dir": str(state_dir), "timeout_s": 30,
                                                                          "liveness_s": 2}, **keys}}


def merges(state_dir):
    path = state_dir / "merges.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.timeout(120)
def test_a_learner_that_dies_stalls_no_one_and_the_shards_stop(tmp_path):
    """K = 2 learners; learner 1 raises in its second period. Learner 0 merges alone from then on and ends its
    6 steps; the launch's own shard stops once no learner is connected."""
    state = tmp_path / "syncer"
    run = dict(config=common.ds_config(acco=block(state, min_quorum=2, replica_group_size=1), gas=GAS), steps=6,
               raise_at_micro=5, raise_rank=1)
    work = tmp_path / "run"
    out = launch({"runs": [run]}, world_size=2, timeout=100, expect_failure=True, workdir=work)
    assert out[1][0] != 0 and "deliberate failure" in out[1][1]
    r0 = torch.load(work / "result0.pt", weights_only=False)[0]  # written before the launch's last barrier
    assert r0["global_steps"] == 6 and r0["stats"]["merges"] == 3
    log = merges(state)
    assert [sorted(rec["learners"]) for rec in log] == [[0, 1], [0], [0]], log  # in arrival order
    assert wait_for(lambda: "stopping" in (state / "shard0.log").read_text(), 20), (state / "shard0.log").read_text()


def syncer_cmd(config_path, port, state_dir, shards=1):
    return [sys.executable, "-m", "acco_ds.cli.report", "syncer", "--config", str(config_path), "--shards", str(shards),
            "--port", str(port), "--host", "127.0.0.1", "--state-dir", str(state_dir)]


@pytest.mark.timeout(180)
def test_across_launches_a_restarted_syncer_resumes_and_a_relaunched_learner_takes_the_current_model(
        tmp_path, monkeypatch):
    port, state = free_port(), tmp_path / "syncer"
    acco = block(state, syncer={"address": f"127.0.0.1:{port}", "state_dir": str(state), "timeout_s": 30})
    cfg = common.ds_config(acco=acco, gas=GAS)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log = open(tmp_path / "syncer.log", "w")
    syncer = subprocess.Popen(syncer_cmd(path, port, state), env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        monkeypatch.setenv("ACCO_LEARNER_ID", "0")
        a = launch({"runs": [dict(config=cfg, steps=4, record_committed=True)]}, world_size=1, timeout=80,
                   workdir=tmp_path / "a")[0][0]
        assert a["stats"]["version"] == 2 and [r["learners"] for r in merges(state)] == [[0], [0]]
        syncer.terminate()
        syncer.wait(20)
        assert (state / "shard0.pt").exists()
        syncer = subprocess.Popen(syncer_cmd(path, port, state), env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        monkeypatch.setenv("ACCO_LEARNER_ID", "1")
        b = launch({"runs": [dict(config=cfg, steps=2, record_committed=True)]}, world_size=1, timeout=80,
                   workdir=tmp_path / "b")[0][0]
    finally:
        if syncer.poll() is None:
            syncer.terminate()
            syncer.wait(20)
        log.close()
    text = (tmp_path / "syncer.log").read_text()
    assert "resumed version 2" in text, text
    # Learner 1 joined at version 2 (learner 0's last merge), with nothing to wait for, and merged from there.
    last = merges(state)[-1]
    assert last["version"] == 3 and last["learners"] == [1] and last["contributions"][0]["base"] == 2
    assert b["stats"]["version"] == 3 and b["stats"]["staleness"] == [0]
    # Learner 1 started from the model learner 0 left: its first inner step moved away from that, not from θ0.
    from torch.nn.utils import parameters_to_vector
    theta0 = parameters_to_vector(common.make_model(0).parameters()).detach()
    first_b = b["params"][0]
    assert (first_b - a["committed"][-1]).norm() < 0.5 * (first_b - theta0).norm()


@pytest.mark.timeout(60)
def test_an_unreachable_syncer_is_a_clear_error_after_a_bounded_retry(tmp_path):
    port = free_port()
    acco = block(tmp_path, syncer={"address": f"127.0.0.1:{port}", "timeout_s": 2})
    run = dict(config=common.ds_config(acco=acco, gas=GAS), steps=1, init_error=True)
    t0 = time.monotonic()
    r = launch({"runs": [run]}, world_size=1, timeout=50)[0][0]
    assert f"could not reach syncer shard 0 at 127.0.0.1:{port} within 2 s" in r["init_error"], r["init_error"]
    assert time.monotonic() - t0 < 40


@pytest.mark.timeout(180)
def test_a_learner_of_two_ranks_re_sends_after_a_syncer_restart_and_its_ranks_adopt_one_merge(tmp_path):
    """One learner of 2 ranks (shards 0 and 1 of ``acco-ds syncer``), rank 0 slowed so that training lasts. The
    syncer is killed (SIGKILL, both shards) after two merges and restarted on its state_dir: each rank connects
    again and re-sends its pending Δ slice, the ranks adopt one version, every inner step is merged exactly once,
    and the log replays to the syncer's θ_g, which both ranks end on."""
    from acco_ds.testing.decoupled import replay
    steps, port, state = 24, free_port(), tmp_path / "syncer"
    acco = {**block(state, replica_group_size=2, syncer={"address": f"127.0.0.1:{port}", "state_dir": str(state),
                                                          "timeout_s": 40}),
            "emulation": {"slow_rank": 0, "slow_factor": 25.0}}
    cfg = common.ds_config(acco=acco, gas=GAS)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log = open(tmp_path / "syncer.log", "w")

    def start():
        return subprocess.Popen(syncer_cmd(path, port, state, shards=2), env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    syncer, out = start(), {}
    run = dict(config=cfg, steps=steps, record_committed=True)
    learner = threading.Thread(target=lambda: out.update(results=launch({"runs": [run]}, world_size=2, timeout=150,
                                                                        workdir=tmp_path / "run")))
    try:
        learner.start()
        assert wait_for(lambda: len(merges(state)) >= 2, 90), (tmp_path / "syncer.log").read_text()
        os.killpg(syncer.pid, signal.SIGKILL)
        syncer.wait(20)
        killed_at = len(merges(state))
        time.sleep(1.0)
        syncer = start()
        learner.join(160)
    finally:
        if syncer.poll() is None:
            os.killpg(syncer.pid, signal.SIGTERM)
            syncer.wait(20)
        log.close()
    assert killed_at < steps // H, "the learner finished before the kill: nothing was re-sent"
    assert "resumed version" in (tmp_path / "syncer.log").read_text()
    r0, r1 = out["results"][0][0], out["results"][1][0]
    log_ = merges(state)
    assert [rec["version"] for rec in log_] == list(range(1, steps // H + 1))  # nothing merged twice or lost
    assert sum(c["steps"] for rec in log_ for c in rec["contributions"]) == steps
    for r in (r0, r1):
        assert r["global_steps"] == steps and r["stats"]["version"] == steps // H
        assert r["stats"]["reconnects"] >= 1 and r["stats"]["merges"] == steps // H
    assert torch.equal(r0["params"][-1], r1["params"][-1])  # the ranks adopted one merge
    theta = torch.cat([torch.load(state / f"shard{j}.pt", weights_only=True)["x"] for j in range(2)])
    numel = r0["params"][-1].numel()
    rep = replay(log_, common.make_model(0), common.loss_fn, common.micro_batch, learners=1, group_size=2,
                 gradient_accumulation_steps=GAS, optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=0.7,
                 outer_momentum=0.9, nesterov=True)
    torch.testing.assert_close(theta[:numel].double(), rep["theta"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r0["committed"][-1].double(), rep["theta"], rtol=1e-5, atol=1e-6)
