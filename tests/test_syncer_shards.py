"""Two syncer shards of ``"mode": "decoupled"`` in this process, a learner of two ranks talking to them: shard 0
decides, logs the decision before it announces it, and the follower merges the same learners' slices. A follower
that dies after sending θ_g and before saving it (its checkpoint one merge behind) restarts, takes the decision
again from shard 0's log and the Δ slice it names from its own state_dir (written there as it was
acknowledged; the rank that kept it sends it again and is answered with the merge), and ends on the same weights
as an undisturbed pair, bit for bit; shard 0 restarting does not end the follower."""

import threading
import time

import torch

from acco_ds.runtime.outer.decoupled import transport, wire
from acco_ds.runtime.outer.decoupled.link import Link
from acco_ds.runtime.outer.decoupled.syncer import Shard

SETTINGS = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, merge="tokens", staleness="none", nesterov_delay=1)
KEYS = transport.Keys(b"shards tests: a secret of 32+ bytes..")
N = 12


def serve(index, state, port=0, leader=None):
    s = Shard(index, "127.0.0.1", port, SETTINGS, grace_s=0.0, state_dir=str(state), keys=KEYS, leader=leader,
              timeout_s=5, say=lambda _: None)
    s.start()
    t = threading.Thread(target=s.serve, daemon=True)
    t.start()
    return s, t


def stop(shard, thread):
    shard.stop()
    thread.join(5)


class Ranks:
    """One learner of two ranks: rank j talks to shard j."""

    def __init__(self, shards):
        self.links = [Link(("127.0.0.1", s.port), 0, 9, j, 5, 1 << 20, KEYS) for j, s in enumerate(shards)]
        for j, link in enumerate(self.links):
            if link.open(5) == wire.NO_VERSION:
                link.send(link.mine("INIT", name="theta", tensor=torch.arange(N, dtype=torch.float32) + j))
        self.version = 0

    def period(self, seed):
        torch.manual_seed(seed)
        sent = []
        for link in self.links:
            msg = link.mine("DELTA", base=self.version, tokens=1, steps=1, name="delta", tensor=torch.randn(N))
            link.send(msg)
            link.recv("ACK")
            sent.append(msg)
        self.links[0].send(self.links[0].mine("READY", base=self.version, steps=1))
        got = []
        for link, msg in zip(self.links, sent):
            link.waiting_base = self.version
            got.append(link.recv_params(N))
        for link, msg in zip(self.links, sent):  # kept until the next merge, as a learner does
            link.retained, link.adopted, link.waiting_base = msg, got[0].version, None
        assert got[0].version == got[1].version
        self.version = got[0].version
        return torch.cat([g.tensor for g in got])


def test_a_follower_that_lost_a_merge_catches_up_bit_for_bit(tmp_path):
    # Undisturbed: three merges.
    s0, t0 = serve(0, tmp_path / "a")
    s1, t1 = serve(1, tmp_path / "a", leader=("127.0.0.1", s0.port))
    learner = Ranks([s0, s1])
    want = [learner.period(seed) for seed in range(3)]
    stop(s1, t1)
    stop(s0, t0)
    # The same, but the follower's save of merge 2 never happens, and it dies right after sending θ_g.
    s0, t0 = serve(0, tmp_path / "b")
    s1, t1 = serve(1, tmp_path / "b", leader=("127.0.0.1", s0.port))
    learner = Ranks([s0, s1])
    assert torch.equal(learner.period(0), want[0])
    real = s1.checkpoint
    s1.checkpoint = lambda record, theta=None, members=(): (None if record and record["version"] == 2 else
                                                            real(record, theta, members))
    assert torch.equal(learner.period(1), want[1])
    port = s1.port
    stop(s1, t1)
    s1, t1 = serve(1, tmp_path / "b", port=port, leader=("127.0.0.1", s0.port))
    # its checkpoint is behind by one: the decision comes from shard 0, its Δ slice from this shard's state_dir
    assert s1.state.version == 2 and not s1.decided
    learner.links[1].reopen(time.monotonic() + 5, RuntimeError("restart"))  # sends the Δ of merge 2 again
    deadline = time.monotonic() + 5
    while s1.state.version != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s1.state.version == 2 and not s1.decided
    assert torch.equal(learner.period(2), want[2])
    assert torch.equal(s1.state.x, torch.load(tmp_path / "a" / "shard1.pt", weights_only=True)["x"])
    # Shard 0 restarts: the follower follows it again and both serve the next merge.
    port0 = s0.port
    stop(s0, t0)
    s0, t0 = serve(0, tmp_path / "b", port=port0)
    learner.links[0].reopen(time.monotonic() + 5, RuntimeError("restart"))
    deadline = time.monotonic() + 5
    while s1.leader_boot != s0.boot and time.monotonic() < deadline:
        time.sleep(0.05)
    assert learner.period(3) is not None and s0.state.version == s1.state.version == 4
    stop(s1, t1)
    stop(s0, t0)
