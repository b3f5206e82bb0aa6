"""Crash safety of the syncer of ``"mode": "decoupled"``: shard 0 of ``acco-ds syncer`` ends abruptly (as SIGKILL
would: ``os._exit``) right after it logged and announced a merge decision and before it merged, and again right
after it sent a merge's θ_g and before it saved it; restarted each time on its ``state_dir``, it replays the
logged decision from the pseudo-gradients the learners send again (the one they hold in flight, or the one of the
merge they adopted), and with K = M and ``grace_s`` 0 the run ends on the same weights as an undisturbed one,
bit for bit, every merge made exactly once."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import common
from dist import ROOT, free_port, launch

pytestmark = pytest.mark.slow

GAS, H, STEPS = 2, 2, 12


def run(tmp_path, name, crashes):
    port, state = free_port(), tmp_path / name / "syncer"
    acco = {"mode": "decoupled", "local_sgd": {"sync_every": H, "grace_s": 0, "min_quorum": 2, "replica_group_size": 1,
                                               "syncer": {"address": f"127.0.0.1:{port}", "state_dir": str(state),
                                                          "timeout_s": 60}},
            "emulation": {"slow_rank": 0, "slow_factor": 8.0}}
    cfg = common.ds_config(acco=acco, gas=GAS)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    log = open(tmp_path / f"{name}.log", "w")
    cmd = [sys.executable, "-m", "acco_ds.cli.report", "syncer", "--config", str(path), "--shards", "1", "--port",
           str(port), "--state-dir", str(state), "--learners", "2"]

    def start(crash):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        if crash:
            env["ACCO_SYNCER_CRASH"] = crash
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    out, restarts = {}, 0
    learners = threading.Thread(target=lambda: out.update(r=launch({"runs": [dict(config=cfg, steps=STEPS,
                                                                                record_committed=True)]},
                                                                   world_size=2, timeout=200,
                                                                   workdir=tmp_path / name / "run")))
    syncer = start(crashes[0] if crashes else None)
    learners.start()
    try:
        while learners.is_alive():
            if syncer.poll() == 137:  # the drill ended shard 0 (and with it the command): start it again
                restarts += 1
                syncer = start(crashes[restarts] if restarts < len(crashes) else None)
            learners.join(0.2)
        syncer.wait(60)
    finally:
        if syncer.poll() is None:
            syncer.terminate()
            syncer.wait(20)
        log.close()
    merges = [json.loads(line) for line in (state / "merges.jsonl").read_text().splitlines()]
    theta = torch.load(state / "shard0.pt", weights_only=True)["x"]
    return out["r"], merges, theta, restarts


@pytest.mark.timeout(420)
def test_shard_0_ended_after_a_decision_and_after_a_send_resumes_bit_for_bit(tmp_path):
    base, base_merges, base_theta, _ = run(tmp_path, "undisturbed", [])
    res, merges, theta, restarts = run(tmp_path, "chaos", ["0:decided:2", "0:sent:4"])
    text = (tmp_path / "chaos.log").read_text()
    assert restarts == 2 and "not merged yet" in text, text[-3000:]
    assert [m["version"] for m in merges] == list(range(1, STEPS // H + 1))  # each once, none lost
    assert [sorted(m["learners"]) for m in merges] == [[0, 1]] * (STEPS // H)
    assert torch.equal(theta, base_theta)
    for rank in range(2):
        r, b = res[rank][0], base[rank][0]
        assert r["global_steps"] == STEPS and r["stats"]["version"] == STEPS // H
        assert torch.equal(r["committed"][-1], b["committed"][-1]) and torch.equal(r["params"][-1], b["params"][-1])
    assert sum(res[rank][0]["stats"]["reconnects"] for rank in range(2)) >= 2
