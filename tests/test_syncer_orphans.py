"""Δ slices on disk whose learner died while the syncer was down: a restarted shard 0 drops them once the learner
stays silent for ``liveness_s`` (held.py), on every shard, a follower that connects later included, and keeps the
slices of a learner that speaks again."""

import threading
import time

import pytest
import torch

from acco_ds.runtime.outer.decoupled import transport
from acco_ds.runtime.outer.decoupled.link import Heartbeat, Link
from acco_ds.runtime.outer.decoupled.syncer import Shard

SETTINGS = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, merge="tokens", staleness="none", nesterov_delay=1)
KEYS = transport.Keys(b"orphan tests: a secret of 32+ bytes.")


def start(index, state, leader=None, liveness_s=30.0):
    shard = Shard(index, "127.0.0.1", 0, SETTINGS, min_quorum=2, state_dir=str(state), keys=KEYS, timeout_s=10,
                  leader=None if leader is None else ("127.0.0.1", leader.port), liveness_s=liveness_s,
                  say=lambda _: None).start()
    thread = threading.Thread(target=shard.serve, daemon=True)
    thread.start()
    return shard, thread


def stop(*running):
    for shard, thread in running:
        shard.stop()
        thread.join(10)


def slices(state, learner):
    return sorted(p.name for p in state.glob(f"shard*-delta-{learner}-*.pt"))


def wait_for(condition, seconds=15.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_the_slices_of_a_learner_that_died_while_the_syncer_was_down_go_and_a_live_ones_stay(tmp_path):
    state = tmp_path / "state"
    first = start(0, state)
    second = start(1, state, leader=first[0])
    links = {}
    try:
        for learner, incarnation in ((0, 11), (1, 22)):  # two learners of two ranks: rank j talks to shard j
            for j, (shard, _) in enumerate((first, second)):
                link = links[(learner, j)] = Link(("127.0.0.1", shard.port), learner, incarnation, j, 10, 1 << 20, KEYS)
                link.open(10)
                if learner == 0:
                    link.send(link.mine("INIT", name="theta", tensor=torch.zeros(16)))
                link.send(link.mine("DELTA", base=0, tokens=1, steps=1, name="delta", tensor=torch.ones(16)))
                link.recv("ACK")
        wait_for(lambda: len(slices(state, 0)) == 2 and len(slices(state, 1)) == 2)  # K = 2: no READY, no merge
    finally:
        for link in links.values():
            link.close()
        stop(second, first)
    assert slices(state, 1) == ["shard0-delta-1-22-0.pt", "shard1-delta-1-22-0.pt"]

    # Shard 0 restarts alone; learner 0 speaks again (its heartbeat), learner 1 never does.
    first = start(0, state, liveness_s=1.0)
    alive = Link(("127.0.0.1", first[0].port), 0, 11, 0, 10, 1 << 20, KEYS)
    heartbeat = None
    try:
        alive.open(10)
        heartbeat = Heartbeat(alive)
        heartbeat.start()
        wait_for(lambda: slices(state, 1) == ["shard1-delta-1-22-0.pt"])  # dropped after liveness_s of silence
        assert first[0].dropped_orphans == [(1, 22)]
        second = start(1, state, leader=first[0])  # a follower that comes after the drop hears it too
        wait_for(lambda: slices(state, 1) == [])
        assert slices(state, 0) == ["shard0-delta-0-11-0.pt", "shard1-delta-0-11-0.pt"]  # learner 0 spoke: kept
        assert 1 not in first[0].pending
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        alive.close()
        stop(second, first)
