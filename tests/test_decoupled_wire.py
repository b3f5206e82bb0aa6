"""The wire and one syncer shard of ``"mode": "decoupled"``, in this process (no DeepSpeed, no ranks): messages
round-trip as raw bytes under a checked header; a malformed, oversized or out-of-turn message is refused by
name and changes nothing; a shard merges by the rule of the float64 simulator."""

import socket
import struct
import threading
import time

import pytest
import torch

from acco_ds.runtime.outer.decoupled import wire
from acco_ds.runtime.outer.decoupled.syncer import Shard
from acco_ds.testing.decoupled import OuterRule

SETTINGS = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, merge="tokens", staleness="none", nesterov_delay=1)


def pair():
    a, b = socket.socketpair()
    return a, b


def test_a_tensor_round_trips_as_raw_bytes():
    a, b = pair()
    t = torch.randn(37)
    wire.send(a, wire.Message("DELTA", learner=3, incarnation=99, base=5, tokens=12, steps=4, name="delta", tensor=t))
    got = wire.recv(b, 1 << 20)
    assert (got.kind, got.learner, got.incarnation, got.base, got.tokens, got.steps, got.name) == \
        ("DELTA", 3, 99, 5, 12, 4, "delta")
    assert torch.equal(got.tensor, t)
    wire.send(a, wire.Message("GET", learner=1))
    assert wire.recv(b, 1 << 20).tensor is None


def header(**over):
    fields = dict(magic=wire.MAGIC, protocol=wire.PROTOCOL, kind=6, learner=0, incarnation=0, version=0, base=0,
                  tokens=0, steps=0, dtype=1, ndim=1, name_len=5, d0=4, d1=0, payload=16)
    fields.update(over)
    return wire.HEADER.pack(*fields.values())


@pytest.mark.parametrize("over, field", [
    (dict(magic=b"PICK"), "magic"), (dict(protocol=9), "protocol"), (dict(kind=77), "kind"), (dict(dtype=42), "dtype"),
    (dict(ndim=3), "ndim"), (dict(name_len=999), "name"), (dict(payload=15), "payload"), (dict(d1=3), "shape"),
    (dict(d0=1 << 40, payload=4 << 40), "payload"),  # oversized: refused before a byte is allocated
])
def test_a_malformed_header_is_refused_by_name(over, field):
    with pytest.raises(wire.WireError) as err:
        wire.parse_header(header(**over), 1 << 20)
    assert err.value.field == field and f"refused message: {field}" in str(err.value)


def test_a_pickle_is_never_loaded():
    """A pickle that would run code if unpickled arrives as payload bytes of a uint8 tensor, or is refused."""
    import pickle
    evil = pickle.dumps(Exploding())
    a, b = pair()
    a.sendall(evil + b"\0" * 100)
    with pytest.raises(wire.WireError, match="magic"):
        wire.recv(b, 1 << 20)
    assert not Exploding.ran


class Exploding:
    ran = False

    def __reduce__(self):
        return (setattr, (Exploding, "ran", True))


@pytest.fixture
def shard(tmp_path):
    s = Shard(0, "127.0.0.1", 0, SETTINGS, min_quorum=2, grace_s=0.0, state_dir=str(tmp_path), say=lambda _: None)
    s.start()
    t = threading.Thread(target=s.serve, daemon=True)
    t.start()
    yield s
    s.stop()
    t.join(5)


def learner(shard, i, incarnation):
    sock = wire.connect(("127.0.0.1", shard.port), 5, "shard")
    wire.send(sock, wire.Message("HELLO", learner=i, incarnation=incarnation))
    state = wire.recv(sock, 1 << 20)
    return sock, state


def exchange(sock, i, s, base, delta, tokens):
    wire.send(sock, wire.Message("DELTA", learner=i, incarnation=s, base=base, tokens=tokens, steps=tokens, name="delta",
                                 tensor=delta))
    wire.expect(wire.recv(sock, 1 << 20), "ACK")
    wire.send(sock, wire.Message("READY", learner=i, incarnation=s, base=base, tokens=tokens, steps=tokens))


def test_a_shard_merges_by_the_rule_and_refuses_bad_messages_without_changing(shard, tmp_path):
    theta0 = torch.randn(10)
    a, state = learner(shard, 0, 11)
    assert state.version == wire.NO_VERSION
    wire.send(a, wire.Message("INIT", learner=0, incarnation=11, name="theta", tensor=theta0))
    wire.send(a, wire.Message("GET", learner=0, incarnation=11))
    got = wire.expect(wire.recv(a, 1 << 20), "PARAMS", "theta", 10)
    assert got.version == 0 and torch.equal(got.tensor, theta0)
    b, state = learner(shard, 1, 22)
    assert state.version == 0
    # Bad messages, each on its own connection: refused by name, the state unchanged.
    bad = [wire.Message("DELTA", learner=5, incarnation=1, name="delta", tensor=torch.ones(10)),  # before HELLO
           wire.Message("DELTA", learner=1, incarnation=22, name="delta", tensor=torch.ones(11)),  # wrong shape
           wire.Message("DELTA", learner=1, incarnation=22, name="weights", tensor=torch.ones(10)),  # wrong name
           wire.Message("DELTA", learner=1, incarnation=22, name="delta", tensor=torch.ones(10, dtype=torch.float64)),
           wire.Message("DELTA", learner=1, incarnation=22, base=7, name="delta", tensor=torch.ones(10)),  # future base
           wire.Message("DELTA", learner=1, incarnation=22, name="delta", tensor=torch.full((10,), float("nan"))),
           wire.Message("READY", learner=1, incarnation=22, base=0)]  # READY without a Δ
    for i, msg in enumerate(bad):
        c, _ = learner(shard, 1, 22) if i else (wire.connect(("127.0.0.1", shard.port), 5, "shard"), None)
        wire.send(c, msg)
        reply = wire.recv(c, 1 << 20)
        assert reply.kind == "ERROR" and "refused message" in reply.text, (i, reply.kind, reply.text)
        c.close()
    c = wire.connect(("127.0.0.1", shard.port), 5, "shard")
    c.sendall(header(magic=b"XXXX") + b"\0" * 21)
    assert "magic" in wire.recv(c, 1 << 20).text
    assert shard.state.version == 0 and torch.equal(shard.state.x, theta0) and not shard.pending
    # The real exchange: two learners (K=2), tokens 1 and 3.
    d0, d1 = torch.randn(10), torch.randn(10)
    b, _ = learner(shard, 1, 22)  # live before learner 0's READY: the merge waits for both
    exchange(a, 0, 11, 0, d0, 1)
    exchange(b, 1, 22, 0, d1, 3)
    pa, pb = wire.recv(a, 1 << 20), wire.recv(b, 1 << 20)
    rule = OuterRule(theta0.double(), outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    rule.step(rule.mean([d0.double(), d1.double()], [1, 3]))
    assert pa.version == pb.version == 1
    torch.testing.assert_close(pa.tensor.double(), rule.x, rtol=1e-6, atol=1e-6)
    assert torch.equal(pa.tensor, pb.tensor)
    log = (tmp_path / "merges.jsonl").read_text().splitlines()
    assert len(log) == 1 and '"learners": [0, 1]' in log[0] and '"staleness": [0, 0]' in log[0]
    # A learner that leaves before its merge: its Δ is dropped, and the other merges alone (K capped).
    exchange(b, 1, 22, 1, d1, 3)
    b.close()
    deadline = time.monotonic() + 5
    while (1 in shard.live or shard.pending) and time.monotonic() < deadline:  # the shard saw learner 1 leave
        time.sleep(0.02)
    assert not shard.pending  # learner 1's Δ in flight was dropped with it
    exchange(a, 0, 11, 1, d0, 1)
    msg = wire.recv(a, 1 << 20)
    assert msg.version == 2 and shard.log[-1]["learners"] == [0]
    assert shard.refused == len(bad) + 1
    # A restarted shard resumes from its checkpoint.
    again = Shard(0, "127.0.0.1", 0, SETTINGS, state_dir=str(tmp_path), say=lambda _: None)
    assert again.state.version == 2 and torch.equal(again.state.x, shard.state.x)
    again.server.close()


def test_a_delta_re_sent_to_a_restarted_shard_is_not_merged_twice(tmp_path):
    """A learner whose syncer restarted after merging its Δ (before the learner got θ_g) sends it again: the
    resumed shard recognises it (learner, incarnation, base) and answers with the current θ_g, merging nothing."""
    def serve(s):
        s.start()
        threading.Thread(target=s.serve, daemon=True).start()
        return s

    first = serve(Shard(0, "127.0.0.1", 0, SETTINGS, state_dir=str(tmp_path), say=lambda _: None))
    a, _ = learner(first, 0, 5)
    theta0, d = torch.randn(6), torch.randn(6)
    wire.send(a, wire.Message("INIT", learner=0, incarnation=5, name="theta", tensor=theta0))
    exchange(a, 0, 5, 0, d, 2)
    merged = wire.expect(wire.recv(a, 1 << 20), "PARAMS", "theta", 6)
    first.stop()
    a.close()
    time.sleep(0.6)
    again = serve(Shard(0, "127.0.0.1", 0, SETTINGS, state_dir=str(tmp_path), say=lambda _: None))
    assert again.state.version == 1 and again.merged == {0: (5, 0)}
    b, state = learner(again, 0, 5)
    assert state.version == 1
    wire.send(b, wire.Message("DELTA", learner=0, incarnation=5, base=0, tokens=2, steps=2, name="delta", tensor=d))
    wire.expect(wire.recv(b, 1 << 20), "ACK")
    got = wire.expect(wire.recv(b, 1 << 20), "PARAMS", "theta", 6)
    wire.send(b, wire.Message("READY", learner=0, incarnation=5, base=0, tokens=2, steps=2))
    assert got.version == 1 and torch.equal(got.tensor, merged.tensor)
    time.sleep(0.3)
    assert again.state.version == 1 and again.resent == 1 and not again.pending
    again.stop()


def quantize(v, dtype="int8", block=8):
    """The learner's up-link encoding (``link.Uplink``) of ``v``, with its error-feedback residual."""
    from acco_ds import ops
    from acco_ds.runtime.comm.compression import Codec, OuterCompression
    from acco_ds.runtime.outer.decoupled.link import Uplink
    up = Uplink(OuterCompression(Codec(dtype, block, ops.load_kernels("auto", torch.device("cpu"))), torch.float32))
    return up, up.message(v, learner=0, incarnation=7, base=0, tokens=1, steps=1)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_a_quantized_delta_travels_as_scales_and_bytes_and_is_dequantized_with_error_feedback(dtype):
    from acco_ds.testing.compressed import Quantizer
    torch.manual_seed(0)
    v = torch.randn(37)
    up, msg = quantize(v, dtype)
    a, b = pair()
    sent = wire.send(a, msg)
    assert sent == wire.HEADER.size + len("delta") + 4 * 5 + 37  # 5 fp32 scales (blocks of 8), 37 one-byte values
    got = wire.recv(b, 1 << 20)
    assert got.extra == {"quantized": dtype, "numel": 37, "block": 8} and got.tensor.dtype == torch.uint8
    ref = Quantizer(dtype, 8)
    want = ref.send(v.double(), key=0)
    torch.testing.assert_close(wire.dequantize(got).tensor.double(), want, rtol=0, atol=0)
    torch.testing.assert_close(up.compression.residuals["uplink"].double(), ref.residuals[0], rtol=0, atol=1e-7)
    # Error feedback: the next send carries what this one left out.
    w = torch.randn(37)
    again = wire.dequantize(up.message(w, learner=0, incarnation=7, base=1, tokens=1, steps=1)).tensor
    torch.testing.assert_close(again.double(), ref.send(w.double(), key=0), rtol=0, atol=1e-7)


@pytest.mark.parametrize("over, field", [
    (dict(dtype=7, ndim=1, d0=37, d1=0, payload=57), "shape"),  # no block size
    (dict(dtype=7, ndim=2, d0=37, d1=4, payload=57), "shape"),  # block below 8
    (dict(dtype=7, ndim=2, d0=37, d1=8, payload=56), "payload"),  # one byte short
    (dict(dtype=8, ndim=2, d0=37, d1=8, payload=37 * 4), "payload"),  # fp32-sized
    (dict(dtype=7, ndim=2, d0=1 << 40, d1=8, payload=(1 << 40) + (1 << 39)), "payload"),  # oversized
])
def test_a_malformed_quantized_header_is_refused_by_name(over, field):
    with pytest.raises(wire.WireError) as err:
        wire.parse_header(header(**over), 1 << 20)
    assert err.value.field == field


def test_a_shard_merges_a_quantized_delta_as_its_dequantized_values(shard):
    theta0 = torch.randn(37)
    a, _ = learner(shard, 0, 7)
    wire.send(a, wire.Message("INIT", learner=0, incarnation=7, name="theta", tensor=theta0))
    shard.K = 1
    d = torch.randn(37)
    _, msg = quantize(d)
    wire.send(a, msg)
    wire.expect(wire.recv(a, 1 << 20), "ACK")
    wire.send(a, wire.Message("READY", learner=0, incarnation=7, base=0, tokens=1, steps=1))
    got = wire.expect(wire.recv(a, 1 << 20), "PARAMS", "theta", 37)
    rule = OuterRule(theta0.double(), outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    rule.step(wire.dequantize(msg).tensor.double())
    torch.testing.assert_close(got.tensor.double(), rule.x, rtol=1e-6, atol=1e-6)
    assert shard.bytes_in == 4 * 5 + 37
    # A quantized Δ of the wrong length is refused like an fp32 one.
    c, _ = learner(shard, 0, 7)
    wire.send(c, quantize(torch.randn(36))[1])
    assert "refused message" in wire.recv(c, 1 << 20).text and shard.state.version == 1
