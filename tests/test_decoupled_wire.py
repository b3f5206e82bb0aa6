"""The messages and one syncer shard of ``"mode": "decoupled"``, in this process (no DeepSpeed, no ranks):
messages round-trip as raw bytes in ZeroMQ frames under a checked header; a malformed, oversized, truncated or
out-of-turn message is refused by name and changes nothing (also under a hypothesis fuzz); a shard merges by the
rule of the float64 simulator, weighting by tokens in float64."""

import pickle
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acco_ds.runtime.outer.decoupled import transport, wire
from acco_ds.runtime.outer.decoupled.link import Link
from acco_ds.runtime.outer.decoupled.syncer import Shard
from acco_ds.testing.decoupled import OuterRule

SETTINGS = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, merge="tokens", staleness="none", nesterov_delay=1)
KEYS = transport.Keys(b"a test secret of at least 32 bytes!")
MB = 1 << 20


def roundtrip(msg):
    return wire.decode([bytes(f) for f in wire.encode(msg)], MB)


def test_a_tensor_round_trips_as_raw_bytes():
    t = torch.randn(37)
    got = roundtrip(wire.Message("DELTA", learner=3, incarnation=99, base=5, tokens=12, steps=4, name="delta",
                                 tensor=t))
    assert (got.kind, got.learner, got.incarnation, got.base, got.tokens, got.steps, got.name) == \
        ("DELTA", 3, 99, 5, 12, 4, "delta")
    assert torch.equal(got.tensor, t)
    frames = wire.encode(wire.Message("GET", learner=1))
    assert len(frames) == 1 and wire.decode(frames, MB).tensor is None


def header(name=b"delta", **over):
    fields = dict(magic=wire.MAGIC, protocol=wire.PROTOCOL, kind=6, learner=0, incarnation=0, version=0, base=0,
                  tokens=0, steps=0, dtype=1, ndim=1, name_len=len(name), d0=4, d1=0, payload=16, boot=0)
    fields.update(over)
    return wire.HEADER.pack(*fields.values()) + name


@pytest.mark.parametrize("over, field", [
    (dict(magic=b"PICK"), "magic"), (dict(protocol=9), "protocol"), (dict(kind=77), "kind"), (dict(dtype=42), "dtype"),
    (dict(ndim=3), "ndim"), (dict(name_len=999), "name"), (dict(payload=15), "payload"), (dict(d1=3), "shape"),
    (dict(name=b"del\xffa"), "name"),
    (dict(d0=1 << 40, payload=4 << 40), "payload"),  # oversized: refused before the payload is looked at
])
def test_a_malformed_header_is_refused_by_name(over, field):
    with pytest.raises(wire.WireError) as err:
        wire.parse_header(header(**over), MB)
    assert err.value.field == field and f"refused message: {field}" in str(err.value)


@pytest.mark.parametrize("frames, field", [
    ([header()], "frames"),  # the payload frame is missing
    ([header(), b"\0" * 15], "payload"),  # truncated
    ([header(), b"\0" * 17], "payload"),  # longer than announced
    ([header(), b"\0" * 16, b"x"], "frames"),
    ([header()[:50]], "header"),
])
def test_a_truncated_or_padded_message_is_refused_by_name(frames, field):
    with pytest.raises(wire.WireError) as err:
        wire.decode(frames, MB)
    assert err.value.field == field


class Exploding:
    ran = False

    def __reduce__(self):
        return (setattr, (Exploding, "ran", True))


def test_a_pickle_is_never_loaded():
    with pytest.raises(wire.WireError, match="magic"):
        wire.decode([pickle.dumps(Exploding()) + b"\0" * 100], MB)
    assert not Exploding.ran


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=3), st.integers(0, wire.HEADER.size))
def test_fuzz_random_frames_are_refused_by_name_or_decoded(frames, cut):
    """Random frames, and a valid header cut short or with random bytes appended: a ``WireError`` or a message
    whose payload has exactly the announced size, never another exception."""
    for candidate in (frames, [header()[:cut]] + frames[:1], [header() + b"".join(frames[:1])] + frames[1:]):
        try:
            msg = wire.decode(candidate, MB)
        except wire.WireError:
            continue
        assert msg.tensor is None or msg.tensor.numel() * msg.tensor.element_size() == len(candidate[1])


def serve(shard):
    shard.start()
    t = threading.Thread(target=shard.serve, daemon=True)
    t.start()
    return shard, t


@pytest.fixture
def shard(tmp_path):
    s, t = serve(Shard(0, "127.0.0.1", 0, SETTINGS, min_quorum=2, grace_s=0.0, state_dir=str(tmp_path), keys=KEYS,
                       say=lambda _: None))
    yield s
    s.stop()
    t.join(5)


def learner(shard, i, incarnation, tokens_per_step=1, keys=KEYS):
    link = Link(("127.0.0.1", shard.port), i, incarnation, 0, 5, 1 << 30, keys, tokens_per_step)
    return link, link.open(5)


def exchange(link, base, delta, steps, tokens=None):
    link.send(link.mine("DELTA", base=base, tokens=steps if tokens is None else tokens, steps=steps, name="delta",
                        tensor=delta))
    link.recv("ACK")
    link.send(link.mine("READY", base=base, steps=steps))
    link.waiting_base = base


def refused(link, msg) -> str:
    link.send(msg)
    with pytest.raises(wire.Refused) as err:
        link.recv("ACK")
    return str(err.value)


def test_a_shard_merges_by_the_rule_and_refuses_bad_messages_without_changing(shard, tmp_path):
    theta0 = torch.randn(10)
    a, version = learner(shard, 0, 11)
    assert version == wire.NO_VERSION
    a.send(a.mine("INIT", name="theta", tensor=theta0))
    a.send(a.mine("GET"))
    got = a.recv("PARAMS", "theta", 10)
    assert got.version == 0 and torch.equal(got.tensor, theta0)
    b, version = learner(shard, 1, 22, tokens_per_step=3)
    assert version == 0
    bad = [(b.mine("DELTA", name="delta", tensor=torch.ones(11), steps=1), "shape"),
           (b.mine("DELTA", name="weights", tensor=torch.ones(10), steps=1), "name"),
           (b.mine("DELTA", name="delta", tensor=torch.ones(10, dtype=torch.float64), steps=1), "shape"),
           (b.mine("DELTA", base=7, name="delta", tensor=torch.ones(10), steps=1), "base"),
           (b.mine("DELTA", name="delta", tensor=torch.full((10,), float("nan")), steps=1), "delta"),
           (b.mine("DELTA", name="delta", tensor=torch.ones(10), steps=2, tokens=7), "tokens"),  # 3 per step
           (b.mine("DELTA", name="delta", tensor=torch.ones(10), steps=1, tokens=(1 << 64) - 1), "tokens"),
           (wire.Message("DELTA", learner=0, incarnation=11, name="delta", tensor=torch.ones(10), steps=1),
            "learner"),  # a forged learner id: learner 1's connection speaks for learner 0
           (b.mine("READY", base=0), "base")]  # READY without a Δ
    for msg, field in bad:
        assert f"refused message: {field}" in refused(b, msg)
    assert shard.state.version == 0 and torch.equal(shard.state.x, theta0) and not shard.pending
    # The real exchange: two learners (K=2), 1 token per step for 1 step, 3 tokens per step for 1 step.
    d0, d1 = torch.randn(10), torch.randn(10)
    exchange(a, 0, d0, 1)
    exchange(b, 0, d1, 1, tokens=3)
    pa, pb = a.recv_params(10), b.recv_params(10)
    rule = OuterRule(theta0.double(), outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    rule.step(rule.mean([d0.double(), d1.double()], [1, 3]))
    assert pa.version == pb.version == 1
    torch.testing.assert_close(pa.tensor.double(), rule.x, rtol=1e-6, atol=1e-6)
    assert torch.equal(pa.tensor, pb.tensor)
    merges = tmp_path / "merges.jsonl"  # written on the shard's save thread, after the learners have θ_g
    deadline = time.monotonic() + 30
    while not (merges.exists() and merges.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.02)
    log = merges.read_text().splitlines()
    assert len(log) == 1 and '"learners": [0, 1]' in log[0] and '"tokens": [1, 3]' in log[0]
    assert (tmp_path / "decisions.jsonl").read_text().count("\n") == 1
    # A learner that says DONE leaves the quorum: the other merges alone (K capped by the learners live).
    b.send(b.mine("DONE"))
    exchange(a, 1, d0, 1)
    assert a.recv_params(10).version == 2 and shard.log[-1]["learners"] == [0]
    assert shard.refused == len(bad)
    # A restarted shard resumes from its checkpoint (written right after the learners received θ_g).
    deadline = time.monotonic() + 5
    while torch.load(tmp_path / "shard0.pt", weights_only=True)["version"] != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    again = Shard(0, "127.0.0.1", 0, SETTINGS, state_dir=str(tmp_path), say=lambda _: None)
    assert again.state.version == 2 and torch.equal(again.state.x, shard.state.x)
    again.close()


def test_unequal_tokens_are_weighed_in_float64():
    from acco_ds.runtime.outer.decoupled.state import ShardState
    s = ShardState(**SETTINGS)
    d = [torch.full((4,), 1.0), torch.full((4,), 2.0)]
    big = (1 << 60, 1)
    assert torch.equal(s.mean(d, list(big)), torch.full((4,), 1.0))  # fp32 weights would round 2^60 + 1 away too
    torch.testing.assert_close(s.mean(d, [1, 3]), torch.full((4,), 1.75), rtol=0, atol=0)


def test_a_delta_re_sent_to_a_restarted_shard_is_not_merged_twice(tmp_path):
    """A learner whose syncer restarted after merging its Δ (before the learner got θ_g) sends it again: the
    resumed shard recognises it (learner, incarnation, base) and answers with the current θ_g, merging nothing.
    The learner sees the restart: the shard's boot changed."""
    first, t = serve(Shard(0, "127.0.0.1", 0, SETTINGS, state_dir=str(tmp_path), keys=KEYS, say=lambda _: None))
    a, _ = learner(first, 0, 5)
    theta0, d = torch.randn(6), torch.randn(6)
    a.send(a.mine("INIT", name="theta", tensor=theta0))
    exchange(a, 0, d, 2)
    merged = a.recv_params(6)
    port = first.port
    first.stop()
    t.join(5)
    again, t = serve(Shard(0, "127.0.0.1", port, SETTINGS, state_dir=str(tmp_path), keys=KEYS, say=lambda _: None))
    assert again.state.version == 1 and again.merged == {0: (5, 0)}
    a.waiting_base = 0
    with pytest.raises(wire.Closed, match="restarted|does not hold"):
        a.recv_params(6)  # the PONG of the new shard
    a.reopen(time.monotonic() + 5, RuntimeError("restart"))
    a.send(a.mine("DELTA", base=0, tokens=2, steps=2, name="delta", tensor=d))
    a.recv("ACK")
    got = a.recv_params(6)
    a.send(a.mine("READY", base=0, tokens=2, steps=2))
    assert got.version == 1 and torch.equal(got.tensor, merged.tensor)
    time.sleep(0.3)
    assert again.state.version == 1 and again.resent == 1 and not again.pending
    again.stop()
    t.join(5)


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
    frames = wire.encode(msg)
    assert wire.size(frames) == wire.HEADER.size + len("delta") + 4 * 5 + 37  # 5 fp32 scales, 37 one-byte values
    got = wire.decode([bytes(f) for f in frames], MB)
    assert got.extra == {"quantized": dtype, "numel": 37, "block": 8} and got.tensor.dtype == torch.uint8
    ref = Quantizer(dtype, 8)
    want = ref.send(v.double(), key=0)
    torch.testing.assert_close(wire.dequantize(got).tensor.double(), want, rtol=0, atol=0)
    torch.testing.assert_close(up.compression.residuals["uplink"].double(), ref.residuals[0], rtol=0, atol=1e-7)
    w = torch.randn(37)  # error feedback: the next send carries what this one left out
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
        wire.parse_header(header(**over), MB)
    assert err.value.field == field


def test_a_shard_merges_a_quantized_delta_as_its_dequantized_values(shard):
    theta0 = torch.randn(37)
    a, _ = learner(shard, 0, 7)
    a.send(a.mine("INIT", name="theta", tensor=theta0))
    shard.K = 1
    _, msg = quantize(torch.randn(37))
    a.send(msg)
    a.recv("ACK")
    a.send(a.mine("READY", base=0, tokens=1, steps=1))
    got = a.recv_params(37)
    rule = OuterRule(theta0.double(), outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    rule.step(wire.dequantize(msg).tensor.double())
    torch.testing.assert_close(got.tensor.double(), rule.x, rtol=1e-6, atol=1e-6)
    assert "refused message: shape" in refused(a, quantize(torch.randn(36))[1])  # the wrong length
    assert shard.state.version == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=120), min_size=1, max_size=3), cut=st.integers(0, 200))
def test_fuzz_a_shard_stays_up_and_unchanged(shard, frames, cut):
    """Random and forged messages from a peer that holds the secret: each is refused, θ_g stays as it was, and
    a real learner is still served."""
    if shard.state.empty:
        a, _ = learner(shard, 0, 7)
        a.send(a.mine("INIT", name="theta", tensor=torch.ones(8)))
        a.send(a.mine("GET"))
        a.recv("PARAMS", "theta", 8)
        shard.fuzzer = learner(shard, 1, 9)[0]
    fuzzer = shard.fuzzer
    forged = wire.encode(wire.Message("DELTA", learner=1, incarnation=9, steps=1, name="delta", tensor=torch.ones(8)))
    for candidate in (frames, [bytes(forged[0])[:cut]] + frames[:1], [bytes(forged[0]), bytes(forged[1])[:cut % 32]]):
        fuzzer.sock.send_multipart(candidate)
    fuzzer.send(fuzzer.mine("GET"))
    while fuzzer._next("PARAMS").kind == "ERROR":  # each refused message is answered ERROR, then the GET
        pass
    assert shard.state.version == 0 and torch.equal(shard.state.x, torch.ones(8)) and not shard.pending


def test_a_large_payload_travels_in_chunks_and_a_bad_chunking_is_refused(monkeypatch):
    monkeypatch.setattr(wire, "CHUNK", 16)
    t = torch.randn(37)  # 148 bytes: 9 frames of 16 and one of 4
    frames = [bytes(f) for f in wire.encode(wire.Message("PARAMS", name="theta", tensor=t))]
    assert [len(f) for f in frames[1:]] == [16] * 9 + [4]
    assert torch.equal(wire.decode(frames, MB).tensor, t)
    with pytest.raises(wire.WireError, match="frames"):
        wire.decode(frames[:-1], MB)
    with pytest.raises(wire.WireError, match="payload"):
        wire.decode(frames[:1] + [frames[1][:8], frames[2] + frames[1][8:]] + frames[3:], MB)


@pytest.mark.timeout(60)
def test_a_frame_above_the_chunk_size_never_reaches_the_shard(shard):
    """ZeroMQ closes a connection whose frame is larger than a payload piece (``wire.CHUNK``) before allocating it:
    the shard never sees the message, and the peer's messages on its new connection are served (one sent while the
    old connection goes may go with it: the peer asks again)."""
    a, _ = learner(shard, 0, 7)
    a.send(a.mine("INIT", name="theta", tensor=torch.ones(8)))
    n = (wire.CHUNK + (1 << 20)) // 4  # 9 MiB of fp32 in one frame
    head = wire.encode(a.mine("DELTA", base=0, tokens=1, steps=1, name="delta", tensor=torch.zeros(1)))[0]
    fields = list(wire.HEADER.unpack_from(head))
    fields[12], fields[14] = n, 4 * n  # shape [n], payload 4n bytes
    a.sock.send_multipart([wire.HEADER.pack(*fields) + b"delta", bytes(4 * n)])
    got = None
    deadline = time.monotonic() + 30
    while got is None and time.monotonic() < deadline:  # a GET sent while ZeroMQ drops the old connection goes with it
        a.send(a.mine("GET"))
        answer_by = time.monotonic() + 2
        while got is None and time.monotonic() < answer_by:
            msg = a._read() if a.sock.poll(100) else None
            got = msg if msg is not None and msg.kind == "PARAMS" else None
    assert got is not None, "no PARAMS within 30 s of the oversized frame"
    got = wire.expect(got, "PARAMS", "theta", 8)
    assert got.version == 0 and not shard.pending and shard.refused == 0 and shard.bytes_in < 4 * n
