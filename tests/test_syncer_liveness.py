"""A syncer shard of ``"mode": "decoupled"`` keeps its quorum live and its doors bounded: a learner silent for
``liveness_s`` leaves the quorum (its Δ in flight dropped, so the others merge without it) and is back as soon as it
speaks; with ``--learners M`` nothing merges before M learners joined; 200 idle connections and a peer that never
reads do not stop a real learner. In this process, on loopback."""

import socket
import threading
import time

import pytest
import torch

from acco_ds.runtime.outer.decoupled import transport, wire
from acco_ds.runtime.outer.decoupled.link import Heartbeat, Link
from acco_ds.runtime.outer.decoupled.syncer import Shard

pytestmark = pytest.mark.alone  # a silence of liveness_s measured against bounds of a few seconds

SETTINGS = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, merge="tokens", staleness="none", nesterov_delay=1)
KEYS = transport.Keys(b"liveness tests: a secret of 32+ bytes")


@pytest.fixture
def make_shard(tmp_path):
    made = []

    def make(**kw):
        s = Shard(0, "127.0.0.1", 0, SETTINGS, grace_s=0.0, state_dir=str(tmp_path), keys=KEYS, say=lambda _: None,
                  **kw)
        s.start()
        t = threading.Thread(target=s.serve, daemon=True)
        t.start()
        made.append((s, t))
        return s
    yield make
    for s, t in made:
        s.stop()
        t.join(5)


def join(shard, i, numel=16):
    link = Link(("127.0.0.1", shard.port), i, 100 + i, 0, 5, 1 << 24, KEYS)
    if link.open(5) == wire.NO_VERSION:
        link.send(link.mine("INIT", name="theta", tensor=torch.zeros(numel)))
    return link


def send_delta(link, base, value=1.0, numel=16):
    link.send(link.mine("DELTA", base=base, tokens=1, steps=1, name="delta", tensor=torch.full((numel,), value)))
    link.recv("ACK")
    link.send(link.mine("READY", base=base, steps=1))
    link.waiting_base = base


def wait_for(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_silent_learner_leaves_the_quorum_and_is_readmitted_when_it_speaks(make_shard):
    shard = make_shard(min_quorum=2, liveness_s=0.6)
    a, b = join(shard, 0), join(shard, 1)
    beat = Heartbeat(a)  # a trains and pings; b goes silent (a stopped process) with its Δ in flight
    beat.start()
    try:
        b.send(b.mine("DELTA", base=0, tokens=1, steps=1, name="delta", tensor=torch.full((16,), 3.0)))
        b.recv("ACK")  # its Δ is held; its READY never comes (a rank of it stopped before the others agreed)
        b.waiting_base = 0
        send_delta(a, 0)
        t0 = time.monotonic()
        got = a.recv_params(16)  # K = 2, but b is silent: after liveness_s a merges alone
        assert got.version == 1 and shard.log[-1]["learners"] == [0]
        assert 0.5 < time.monotonic() - t0 < 3.0 and 1 not in shard.live and not shard.pending
        with pytest.raises(wire.Closed, match="does not hold it"):  # b speaks again: its Δ was dropped
            b.recv_params(16)
        assert wait_for(lambda: 1 in shard.live)
        send_delta(b, 0, 3.0)  # re-sent, from the version it had
        send_delta(a, 1)
        pa, pb = a.recv_params(16), b.recv_params(16)
        assert pa.version == pb.version == 2 and sorted(shard.log[-1]["learners"]) == [0, 1]
        assert shard.log[-1]["staleness"] == [1, 0] or shard.log[-1]["staleness"] == [0, 1]
    finally:
        beat.stop()


def test_no_merge_before_the_fleet_has_joined(make_shard):
    shard = make_shard(min_quorum=1, learners=2)
    a = join(shard, 0)
    send_delta(a, 0)
    time.sleep(0.5)
    assert shard.state.version == 0 and shard.pending  # K = 1, but learner 1 has not joined yet
    join(shard, 1)
    assert a.recv_params(16).version == 1


def test_idle_connections_and_a_peer_that_never_reads_do_not_stop_a_learner(make_shard):
    shard, n = make_shard(min_quorum=1), 1 << 18  # θ_g of 1 MiB
    a = join(shard, 0, n)
    idle = [socket.create_connection(("127.0.0.1", shard.port)) for _ in range(200)]
    hog = join(shard, 1, n)
    for _ in range(300):  # 300 MiB of θ_g it never reads: the shard's queue to it fills, and it loses the rest
        hog.send(hog.mine("GET"))
    t0 = time.monotonic()
    for v in range(5):
        send_delta(a, v, numel=n)
        assert a.recv_params(n).version == v + 1
    assert time.monotonic() - t0 < 5.0 and shard.dropped_sends > 0
    for s in idle:
        s.close()
