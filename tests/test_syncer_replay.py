"""A decision replayed after a restart may name a learner that has died since: shard 0 (its own process) ends
abruptly (``ACCO_SYNCER_CRASH``, as SIGKILL would) right after it logged the decision to merge learners A and B,
then B dies and only A comes back. The restarted shard takes B's Δ slice from its ``state_dir`` (every held slice
is written there as it is acknowledged; shard 0 logs no decision before its slices are written), makes the logged merge exactly as decided, and A's later merges
follow: nothing waits for B.

Each held slice is fsynced (file and folder) before the decision that names it can exist: a follower shard
fsyncs it before its ACK (shard 0 decides once every rank had its ACK), shard 0 before it logs the decision."""

import json
import os
import subprocess
import sys
import threading
import time
from unittest.mock import ANY

import pytest
import torch

from acco_ds.runtime.outer.decoupled import transport, wire
from acco_ds.runtime.outer.decoupled.link import Link
from acco_ds.runtime.outer.decoupled.state import ShardState
from acco_ds.runtime.outer.decoupled.syncer import Shard

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


def record_sends(shard, j, events) -> None:
    send = shard._send

    def recording_send(peer, msg, track=False):
        events.append((msg.kind, j, threading.get_ident()))
        send(peer, msg, track)

    shard._send = recording_send


@pytest.mark.timeout(60)
def test_a_held_slice_is_fsynced_before_the_ack_of_a_follower_and_the_decision_of_shard_0(tmp_path, monkeypatch):
    events = []  # (what, file or shard index, thread), in the order they happened
    fsync = os.fsync

    def recording_fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), threading.get_ident()))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    keys = transport.Keys(b"replay tests: a secret of 32+ bytes.")
    shards, threads = [], []
    for j in range(2):
        s = Shard(j, "127.0.0.1", 0, SETTINGS, state_dir=str(tmp_path / "state"), keys=keys, timeout_s=5,
                  leader=None if j == 0 else ("127.0.0.1", shards[0].port), say=lambda _: None)
        record_sends(s, j, events)
        shards.append(s.start())
        threads.append(threading.Thread(target=s.serve, daemon=True))
        threads[-1].start()
    links = [Link(("127.0.0.1", s.port), 0, 9, j, 5, 1 << 20, keys) for j, s in enumerate(shards)]
    try:
        for link in links:  # one learner of two ranks: rank j talks to shard j
            assert link.open(5) == wire.NO_VERSION
            link.send(link.mine("INIT", name="theta", tensor=torch.zeros(16)))
            link.send(link.mine("DELTA", base=0, tokens=1, steps=1, name="delta", tensor=torch.ones(16)))
            link.recv("ACK")
        links[0].send(links[0].mine("READY", base=0, steps=1))
        for link in links:
            link.waiting_base = 0
            assert link.recv_params(16).version == 1
    finally:
        for link in links:
            link.close()
        for s, t in zip(shards, threads):
            s.stop()
            t.join(5)

    def durable(j):  # where slice j's file and then its folder were fsynced
        i = events.index(("fsync", f"shard{j}-delta-0-9-0.pt.tmp", ANY))
        return i, next(k for k in range(i + 1, len(events)) if events[k] == ("fsync", "state", events[i][2]))

    kinds = [e[:2] for e in events]
    assert durable(1)[1] < kinds.index(("ACK", 1)), events
    assert durable(0)[1] < kinds.index(("fsync", "decisions.jsonl")) < kinds.index(("MERGE", 0)), events
