"""sparseloco's wire format (``ops/sparse_codec.py``): indices packed at ⌈log2 L⌉ bits, the zlib coding of the
index gaps, codes and scales where it pays, lossless both ways, bit for bit, on every layout the kernels take
(short chunks, chunks of one element, chunks whose entries are all kept, chunks of 65536, fp32 and b-bit values),
with the native kernels' payloads as with the reference's; and refusals that name the problem."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from acco_ds import ops
from acco_ds.ops import reference as R
from acco_ds.ops import sparse_codec as C
from test_sparse_kernels import errors, same


def roundtrip(payload, offsets, topk, bits, coding, pad=0):
    wire = C.encode(payload, offsets, topk=topk, value_bits=bits, coding=coding)
    assert wire.dtype == torch.uint8 and wire.numel() <= R.sparse_payload_bytes(offsets, topk, bits)
    padded = torch.cat([wire, torch.full((pad,), 0xAB, dtype=torch.uint8)])  # the all-gather pads to the longest
    back = C.decode(padded, offsets, topk=topk, value_bits=bits)
    for got, want in zip(back, payload):
        assert same(got, want), (got, want)
    return wire


def test_index_bits_are_ceil_log2_of_the_chunk_and_none_when_everything_is_kept():
    lengths = torch.tensor([1, 2, 3, 4, 5, 16, 17, 4096, 4097, 65536])
    assert C.index_bits(lengths, lengths.clamp(max=0) + 1).tolist() == [0, 1, 2, 2, 3, 4, 5, 12, 13, 16]
    assert C.index_bits(lengths, lengths).tolist() == [0] * 10


def test_the_packed_layout_bit_by_bit():
    """Entry j of a chunk at bit j·w of its bytes, little-endian, each chunk on a byte: indices 1 and 4095 of a
    chunk of 4096 (w = 12) are 0x001 in bits 0-11 and 0xFFF in bits 12-23; a chunk of 5 with 2 kept (w = 3)
    starts on the next byte."""
    offsets = torch.tensor([0, 4096, 4101])
    packed = C.pack_indices(torch.tensor([1, 4095, 4, 2], dtype=torch.int16), offsets, 2)
    assert packed.tolist() == [0x01, 0xF0, 0xFF, 0b010100]
    assert C.unpack_indices(packed, offsets, 2).tolist() == [1, 4095, 4, 2]
    # the defaults: 64 of 4096 at 12 bits (96 bytes), 2-bit codes (16), a scale (4): 116 bytes a chunk, not 148
    assert R.sparse_payload_bytes(R.chunk_offsets([4096 * 10], 4096), 64, 2) == 1 + 10 * 116
    # indices above 32767 (negative as int16) keep their 16 bits
    big = torch.tensor([0, 65536])
    idx = torch.tensor([0, 40000, 65535], dtype=torch.int64).to(torch.int16)
    assert same(C.unpack_indices(C.pack_indices(idx, big, 3), big, 3), idx)


LAYOUTS = [([4096 * 3 + 17, 5, 1, 64, 65], 4096, 64), ([100, 7], 16, 3), ([65536, 70000], 65536, 64), ([10], 16, 10),
           ([1, 1, 2], 4, 1), ([300], 256, 256)]


@pytest.mark.parametrize("numels, chunk, topk", LAYOUTS)
@pytest.mark.parametrize("bits", [0, 2, 4, 8])
def test_encode_decode_is_lossless_on_every_layout(numels, chunk, topk, bits):
    offsets = R.chunk_offsets(numels, chunk)
    payload = R.sparse_pack(errors(sum(numels), 3), offsets, topk=topk, value_bits=bits)
    for coding in (None, "zlib"):
        wire = roundtrip(payload, offsets, topk, bits, coding, pad=5)
        if coding is None:
            assert int(wire[0]) == 0 and wire.numel() == R.sparse_payload_bytes(offsets, topk, bits)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=6), st.integers(1, 64), st.integers(1, 80),
       st.sampled_from([0, 2, 4, 8]), st.integers(0, 2**31 - 1))
def test_encode_decode_is_lossless_on_random_layouts(numels, chunk, topk, bits, seed):
    offsets = R.chunk_offsets(numels, chunk)
    payload = R.sparse_pack(errors(sum(numels), seed), offsets, topk=topk, value_bits=bits)
    for coding in (None, "zlib"):
        roundtrip(payload, offsets, topk, bits, coding)


def test_zlib_is_used_where_it_pays_and_the_native_payload_encodes_to_the_same_bytes():
    """1M elements at the defaults: the gaps of 64 sorted indices of 4096 code to about 60 bytes a chunk against
    96 packed, so the zlib coding is sent; a tiny payload stays packed (zlib's header costs more)."""
    numel = 1 << 20
    offsets = R.chunk_offsets([numel], 4096)
    e = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    payload = R.sparse_pack(e.clone(), offsets, topk=64, value_bits=2)
    wire = roundtrip(payload, offsets, 64, 2, "zlib")
    packed = R.sparse_payload_bytes(offsets, 64, 2)
    assert int(wire[0]) == 1 and wire.numel() < 0.75 * packed, (wire.numel(), packed)
    native = ops.load_kernels("native", "cpu", jit=True)
    theirs = native.sparse_pack(e.clone(), offsets, topk=64, value_bits=2)
    assert same(C.encode(theirs, offsets, topk=64, value_bits=2, coding="zlib"), wire)
    small = R.chunk_offsets([40], 16)
    assert int(roundtrip(R.sparse_pack(torch.randn(40), small, topk=4, value_bits=2), small, 4, 2, "zlib")[0]) == 0


def test_bad_wires_are_refused_by_name():
    offsets = R.chunk_offsets([100], 16)
    payload = R.sparse_pack(torch.randn(100), offsets, topk=4, value_bits=2)
    wire = C.encode(payload, offsets, topk=4, value_bits=2, coding=None)
    with pytest.raises(ValueError, match="unknown coding tag 7"):
        C.decode(torch.cat([torch.tensor([7], dtype=torch.uint8), wire[1:]]), offsets, topk=4, value_bits=2)
    with pytest.raises(ValueError, match="bytes after the tag, these offsets, topk=4 and value_bits=2 need"):
        C.decode(wire[:-3], offsets, topk=4, value_bits=2)
    with pytest.raises(ValueError, match="the payload does not belong to these offsets"):
        C.pack_indices(payload[0][:-1], offsets, 4)
    with pytest.raises(ValueError, match='entropy_coding must be null or "zlib"'):
        C.encode(payload, offsets, topk=4, value_bits=2, coding="lz4")
    big = R.chunk_offsets([1 << 16], 4096)
    z = C.encode(R.sparse_pack(torch.randn(1 << 16), big, topk=64, value_bits=2), big, topk=64, value_bits=2,
                 coding="zlib")
    assert int(z[0]) == 1
    with pytest.raises(ValueError, match="the zlib body holds"):
        C.decode(z, R.chunk_offsets([1 << 15], 4096), topk=64, value_bits=2)


def test_covenant_72b_bytes_per_round_in_the_plan():
    """Covenant-72B's setting (72B, 64 of 4096 at 2 bits): published 146x against fp32; the plan counts acco_ds's
    packed payload at 141x (12-bit indices + codes + an fp32 scale: 116 bytes a chunk) and its zlib coding, at
    the indices' information bound, above 146x."""
    from acco_ds.plan import literature as lit
    rows = lit.covenant_bytes()
    assert rows["published"][1] == pytest.approx(146)
    assert rows["packed"][0] == 1 + 72e9 // 4096 * 116 and rows["packed"][1] == pytest.approx(141.2, abs=0.05)
    assert rows["zlib"][1] > 146 and rows["zlib"][0] < rows["packed"][0]
