"""A learner id on a syncer shard of ``"mode": "decoupled"`` belongs to the connection that said HELLO under it
(``identity``): a peer that holds the secret and says HELLO under a live learner's id (another incarnation, the
same one, or the very routing id of the learner's socket) is refused with an error naming the id, and the learner
keeps its place and its pending Δ; a learner that really restarted (its old connection gone, or silent for
``liveness_s``) is admitted again. In this process, on loopback."""

import threading
import time

import pytest
import torch

from acco_ds.runtime.outer.decoupled import transport, wire
from acco_ds.runtime.outer.decoupled.link import Link
from acco_ds.runtime.outer.decoupled.syncer import Shard

SETTINGS = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, merge="tokens", staleness="none", nesterov_delay=1)
KEYS = transport.Keys(b"identity tests: a secret of 32+ bytes")


@pytest.fixture
def shard(tmp_path):
    s = Shard(0, "127.0.0.1", 0, SETTINGS, min_quorum=2, learners=2, grace_s=0.0, state_dir=str(tmp_path), keys=KEYS,
              liveness_s=1.5, say=lambda _: None)
    s.start()
    t = threading.Thread(target=s.serve, daemon=True)
    t.start()
    yield s
    s.stop()
    t.join(5)


def link(shard, learner, incarnation, rank=0, timeout_s=5.0):
    a = Link(("127.0.0.1", shard.port), learner, incarnation, rank, timeout_s, 1 << 20, KEYS)
    if a.open(timeout_s) == wire.NO_VERSION:
        a.send(a.mine("INIT", name="theta", tensor=torch.zeros(8)))
    return a


def post(a, base=0, value=1.0):
    a.send(a.mine("DELTA", base=base, tokens=1, steps=1, name="delta", tensor=torch.full((8,), value)))
    a.recv("ACK")
    a.send(a.mine("READY", base=base, steps=1))
    a.waiting_base = base


def refused_hello(shard, learner, incarnation, rank=0) -> str:
    rogue = Link(("127.0.0.1", shard.port), learner, incarnation, rank, 0.5, 1 << 20, KEYS)
    try:
        with pytest.raises(wire.Refused) as err:
            rogue.open(0.5)
    finally:
        rogue.close()
    return str(err.value)


@pytest.mark.timeout(60)
def test_a_forged_learner_id_is_refused_and_the_learner_keeps_its_pending_delta(shard):
    a = link(shard, 0, 1)
    post(a)
    held = {"incarnation": 1, "base": 0}
    assert {k: shard.pending[0][k] for k in held} == held
    for incarnation, rank in ((2, 0), (1, 3), (1, 0)):  # a new incarnation; another rank; A's own name
        a._ping()  # A is live
        why = refused_hello(shard, 0, incarnation, rank)
        assert "learner 0 is held by another live connection (incarnation 1" in why and "liveness_s" in why
        assert {k: shard.pending[0][k] for k in held} == held and shard.live[0] == 1
    rogue = link(shard, 5, 1)  # a learner of its own may not speak for learner 0
    with pytest.raises(wire.Refused, match="refused message: learner: learner 0 incarnation 1 on the connection of "
                                           "learner 5"):
        post(_as(rogue, 0, 1))
    b = link(shard, 1, 1)  # the real learner 0 is still served: its Δ merges with B's
    post(b, value=3.0)
    for x in (a, b):
        got = x.recv_params(8)
        assert got.version == 1 and torch.allclose(got.tensor, shard.state.x)
    assert shard.log[-1]["learners"] == [0, 1]


def _as(rogue, learner, incarnation):
    """Make ``rogue``'s next messages claim another learner's id (on its own connection, with its own token)."""
    rogue.learner, rogue.incarnation = learner, incarnation
    return rogue


@pytest.mark.timeout(60)
def test_a_restarted_learner_is_admitted_once_its_old_connection_is_gone_or_silent(shard):
    a = link(shard, 0, 1)
    post(a)
    a.close()  # the process ended: its connection is gone, so its next incarnation is admitted at once
    t0 = time.monotonic()
    a2 = link(shard, 0, 2)
    assert time.monotonic() - t0 < 1.0 and 0 not in shard.pending  # the old incarnation's Δ is void
    post(a2)
    # a hung process keeps its connection open: its relaunch waits until it was silent for liveness_s (1.5 s)
    t0 = time.monotonic()
    a3 = link(shard, 0, 3, timeout_s=6.0)
    assert 1.0 < time.monotonic() - t0 < 5.0 and 0 not in shard.pending
    with pytest.raises(wire.Refused, match="GET before HELLO"):  # the old connection holds nothing now
        a2.send(a2.mine("GET"))
        a2.recv("PARAMS")
    a3.send(a3.mine("GET"))
    assert a3.recv("PARAMS", "theta", 8).version == 0
