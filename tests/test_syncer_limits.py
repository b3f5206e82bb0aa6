"""Sizes are checked before memory is taken: a syncer shard (its own process, ``python -m
acco_ds.runtime.outer.decoupled.syncer``) sets ZeroMQ's ``MAXMSGSIZE`` to the largest legal frame (a payload piece,
``wire.CHUNK``, plus a header), so a frame above it closes the peer's connection before it is allocated: the shard
stays up, θ_g is unchanged and its peak resident memory (``VmHWM``) does not grow by the frame. A payload that is
not the size of the shard's slice is refused on its header, by name, before a byte of it is copied.

ZeroMQ bounds each frame but not how many make a message, and hands a message over only once all of its frames
are in: a peer that holds the secret can make the shard hold a message of many 1 MiB frames before the header says
that one frame was due. The shard refuses it by name (ERROR, ``frames``) and serves the next message; three such
messages of 64 MiB in a row raise its peak resident memory by about two of them (the loop keeps the last one read
until the next is complete), not three."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch
import zmq

from acco_ds.runtime.outer.decoupled import transport, wire
from acco_ds.runtime.outer.decoupled.link import Link

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = '{"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": true}'


def peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (``VmHWM``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def shard_process(tmp_path):
    key = tmp_path / "syncer.key"
    transport.make_secret(str(key))
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "acco_ds.runtime.outer.decoupled.syncer", "--settings", SETTINGS,
                             "--auth-file", str(key), "--port-file", str(port_file), "--state-dir",
                             str(tmp_path / "state")], env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the shard did not start"
        time.sleep(0.05)
    yield proc, int(port_file.read_text()), transport.load_keys(str(key))
    proc.kill()
    proc.wait(10)


def seeded(port, keys):
    """A learner's link to the shard, which took 1024 random values from it as θ_g: ``(link, θ_g)``."""
    theta = torch.randn(1024)
    a = Link(("127.0.0.1", port), 0, 1, 0, 20, 1 << 30, keys)
    assert a.open(20) == wire.NO_VERSION
    a.send(a.mine("INIT", name="theta", tensor=theta))
    a.send(a.mine("GET"))
    assert torch.equal(a.recv("PARAMS", "theta", 1024).tensor, theta)
    return a, theta


@pytest.mark.timeout(120)
def test_an_oversized_frame_is_dropped_before_it_is_allocated(shard_process):
    proc, port, keys = shard_process
    a, theta = seeded(port, keys)
    before = peak_rss(proc.pid)

    frame = 256 << 20  # one frame of 256 MiB from a peer that holds the secret, announced as a DELTA
    ctx = zmq.Context()
    rogue = transport.client(ctx, keys, "127.0.0.1", port, 1 << 40, 20)
    rogue.setsockopt(zmq.MAXMSGSIZE, -1)  # its own side would refuse it too
    transport.handshake(rogue, transport.endpoint("127.0.0.1", port), 20, "the shard", True)
    head = wire.encode(wire.Message("DELTA", learner=0, incarnation=1, steps=1, name="delta",
                                    tensor=torch.zeros(1)))[0]
    fields = list(wire.HEADER.unpack_from(head))
    fields[12], fields[14] = frame // 4, frame  # shape [n], payload 4n bytes
    rogue.send_multipart([wire.HEADER.pack(*fields) + b"delta", memoryview(bytearray(frame))], copy=False)
    time.sleep(3)  # it has arrived, or been cut, by now
    rogue.close(0)
    ctx.term()

    assert proc.poll() is None, "the shard went down"
    a.send(a.mine("GET"))
    got = a.recv("PARAMS", "theta", 1024)
    assert got.version == 0 and torch.equal(got.tensor, theta)
    grew = peak_rss(proc.pid) - before
    assert grew < frame // 8, f"the shard's peak resident memory grew by {grew} bytes for a {frame}-byte frame"
    a.done()


@pytest.mark.timeout(120)
def test_a_payload_of_the_wrong_size_is_refused_on_its_header(shard_process):
    proc, port, keys = shard_process
    a = Link(("127.0.0.1", port), 0, 1, 0, 20, 1 << 30, keys)
    a.open(20)
    a.send(a.mine("INIT", name="theta", tensor=torch.zeros(256)))
    big = a.mine("DELTA", base=0, tokens=1, steps=1, name="delta", tensor=torch.zeros(3 * wire.CHUNK))
    for msg, needle in ((big, f"shape: {12 * wire.CHUNK} bytes of torch.float32 announced in a DELTA, this shard's "
                              f"slice is 256 fp32 values (1024 bytes)"),
                        (wire.text("GET", "x" * 70_000, learner=0, incarnation=1), "payload: 70000 bytes in a GET")):
        a.send(msg)
        with pytest.raises(wire.Refused, match=re.escape(needle)):
            a.recv("ACK")
    a.send(a.mine("GET"))
    assert torch.equal(a.recv("PARAMS", "theta", 256).tensor, torch.zeros(256))
    a.done()


@pytest.mark.timeout(120)
def test_a_message_of_many_frames_is_held_whole_then_refused_on_its_frame_count(shard_process):
    proc, port, keys = shard_process
    a, theta = seeded(port, keys)
    before = peak_rss(proc.pid)

    # A peer that holds the secret sends messages of 64 frames of 1 MiB (each frame within ZMQ_MAXMSGSIZE), under
    # the header of a DELTA of this shard's slice (1024 fp32 values: one payload frame of 4096 bytes).
    frames = 64
    ctx = zmq.Context()
    rogue = transport.client(ctx, keys, "127.0.0.1", port, 1 << 40, 20)
    transport.handshake(rogue, transport.endpoint("127.0.0.1", port), 20, "the shard", True)
    head = wire.encode(wire.Message("DELTA", learner=0, incarnation=1, steps=1, name="delta",
                                    tensor=torch.zeros(1024)))[0]
    for _ in range(3):  # one after the other: they do not pile up
        rogue.send_multipart([head] + [bytearray(wire.CHUNK)] * frames, copy=False)
        assert rogue.poll(30_000), "the shard did not answer"
        answer = wire.decode(rogue.recv_multipart(), 1 << 20)
        assert answer.kind == "ERROR" and answer.text == f"refused message: frames: {frames} payload frames, 4096 " \
                                                         f"bytes travel in 1", answer.text
    rogue.close(0)
    ctx.term()

    assert proc.poll() is None, "the shard went down"
    a.send(a.mine("GET"))
    got = a.recv("PARAMS", "theta", 1024)
    assert got.version == 0 and torch.equal(got.tensor, theta)
    # Each held whole (libzmq bounds a frame, not the frames of a message), and let go once refused: one at a time.
    grew = peak_rss(proc.pid) - before
    assert frames * wire.CHUNK * 3 // 4 < grew < 3 * frames * wire.CHUNK // 2, f"peak resident memory grew by {grew}"
    a.done()
