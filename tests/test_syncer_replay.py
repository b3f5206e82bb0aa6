"""A decision replayed after a restart may name a learner that has died since: shard 0 (its own process) ends
abruptly (``ACCO_SYNCER_CRASH``, as SIGKILL would) right after it logged the decision to merge learners A and B,
then B dies and only A comes back. The restarted shard takes B's Δ slice from its ``state_dir`` (every held slice
is written there as it is acknowledged; shard 0 logs no decision before its slices are written), makes the logged merge exactly as decided, and A's later merges
follow: nothing waits for B."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from acco_ds.runtime.outer.decoupled import transport, wire
from acco_ds.runtime.outer.decoupled.link import Link
from acco_ds.runtime.outer.decoupled.state import ShardState

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, merge="tokens", staleness="none", nesterov_delay=1)


def start(tmp_path, key, crash=None):
    port_file = tmp_path / "port"
    if port_file.exists():
        port_file.unlink()
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("ACCO_SYNCER_CRASH", None)
    if crash:
        env["ACCO_SYNCER_CRASH"] = crash
    proc = subprocess.Popen([sys.executable, "-m", "acco_ds.runtime.outer.decoupled.syncer", "--settings",
                             json.dumps(SETTINGS), "--auth-file", str(key), "--port-file", str(port_file),
                             "--state-dir", str(tmp_path / "state"), "--min-quorum", "2", "--liveness-s", "30"],
                            env=env, stdout=open(tmp_path / "shard.log", "a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "shard.log").read_text()
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def post(link, base, delta):
    link.send(link.mine("DELTA", base=base, tokens=1, steps=1, name="delta", tensor=delta))
    link.recv("ACK")
    link.send(link.mine("READY", base=base, steps=1))
    link.waiting_base = base


@pytest.mark.timeout(120)
def test_a_replayed_decision_naming_a_dead_learner_is_merged_from_the_disk(tmp_path):
    key = tmp_path / "syncer.key"
    transport.make_secret(str(key))
    keys = transport.load_keys(str(key))
    theta0, dA, dB, dA2 = (torch.randn(64) for _ in range(4))
    proc, port = start(tmp_path, key, crash="0:decided:1")
    try:
        a = Link(("127.0.0.1", port), 0, 11, 0, 20, 1 << 20, keys)
        b = Link(("127.0.0.1", port), 1, 22, 0, 20, 1 << 20, keys)
        assert a.open(20) == wire.NO_VERSION
        a.send(a.mine("INIT", name="theta", tensor=theta0))
        b.open(20)
        post(a, 0, dA)
        post(b, 0, dB)
        assert proc.wait(30) == 137  # decision 1 (A and B) logged and announced, nothing merged
        b.close()  # B dies: it never comes back
        a.close()
        proc, port = start(tmp_path, key)
        a = Link(("127.0.0.1", port), 0, 11, 0, 20, 1 << 20, keys)
        assert a.open(20) == 1  # merged at start, B's slice taken from the disk
        post(a, 0, dA)  # A re-sends the Δ it held in flight: merged already, so θ_g of version 1 comes back
        first = a.recv_params(64)
        a.waiting_base = None
        post(a, 1, dA2)  # and A goes on alone (B is not live here): version 2
        second = a.recv_params(64)
        a.done()  # answered once the save of version 2 is on disk
    finally:
        if proc.poll() is None:
            proc.kill()
    rule = ShardState(**SETTINGS)
    rule.adopt(theta0)
    rule.step(rule.mean([dA, dB], [1, 1]))
    assert first.version == 1 and torch.equal(first.tensor, rule.x)
    rule.step(rule.mean([dA2], [1]))
    assert second.version == 2 and torch.equal(second.tensor, rule.x)
    assert not list((tmp_path / "state").glob("shard0-delta-*"))  # each held slice is removed once its merge is saved
