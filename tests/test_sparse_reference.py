"""The pure-torch reference of sparse outer communication (``ops.reference.sparse_pack`` and
``sparse_unpack_accumulate``) against a plain per-chunk loop written from the wire-format contract."""

import pytest
import torch

from acco_ds.ops import reference as R
from acco_ds.ops.sparse_codec import pack_indices


def contract(e, offsets, topk, bits):
    """Per chunk, in plain Python: the kept indices (ties: lower index), their dequantized values."""
    out = []
    for c in range(offsets.numel() - 1):
        a, b = int(offsets[c]), int(offsets[c + 1])
        seg = [float(x) for x in e[a:b]]
        keep = sorted(sorted(range(b - a), key=lambda i: (-abs(seg[i]), i))[:min(topk, b - a)])
        v = torch.tensor([seg[i] for i in keep], dtype=torch.float32)
        if bits:
            m = v.abs().max()
            top = float(2**bits - 1)
            levels = m * ((2.0 * torch.arange(2**bits, dtype=torch.float32)) / top - 1.0)
            v = levels[(v[:, None] - levels[None, :]).abs().argmin(dim=1)] if m > 0 else torch.zeros_like(v)
        out.append((keep, v))
    return out


@pytest.mark.parametrize("bits", [0, 2, 4, 8])
@pytest.mark.parametrize("numels,chunk,topk", [([10, 3, 9000, 5], 4096, 4), ([300], 64, 64), ([7, 1], 3, 2)])
def test_pack_matches_contract(bits, numels, chunk, topk):
    torch.manual_seed(bits + chunk)
    offsets = R.chunk_offsets(numels, chunk)
    assert offsets.tolist()[-1] == sum(numels) and all(0 < int(x) <= chunk for x in offsets.diff())
    e = torch.randn(sum(numels))
    e[1] = e[2] = e.abs().max() + 1  # a tie at the top: the lower index goes first
    original = e.clone()
    indices, values, scales = R.sparse_pack(e, offsets, topk=topk, value_bits=bits)
    expected = contract(original, offsets, topk, bits)
    _, entry_starts, _ = R.sparse_layout(offsets, topk, bits)
    got = torch.zeros_like(original)
    R.sparse_unpack_accumulate(got, offsets, indices, values, scales, topk=topk, value_bits=bits)
    for c, (keep, q) in enumerate(expected):
        mine = [int(i) & 0xFFFF for i in indices[int(entry_starts[c]):int(entry_starts[c + 1])]]
        assert mine == keep
        a = int(offsets[c])
        pos = torch.tensor(keep) + a
        torch.testing.assert_close(got[pos], q, rtol=0, atol=1e-6 * max(1.0, float(q.abs().max())))
        torch.testing.assert_close(e[pos], original[pos] - got[pos], rtol=0, atol=0)  # residual keeps the rest
    untouched = got == 0
    assert torch.equal(e[untouched], original[untouched])
    # on the wire (``sparse_codec``, packed): a tag byte, the indices at their chunk's bits, the codes, the scales
    assert 1 + pack_indices(indices, offsets, topk).numel() + values.numel() * values.element_size() + \
        scales.numel() * 4 == R.sparse_payload_bytes(offsets, topk, bits)


def test_weight_and_refusals():
    offsets = R.chunk_offsets([8], 8)
    e = torch.arange(8, dtype=torch.float32)
    packed = R.sparse_pack(e, offsets, topk=2, value_bits=2)
    out = torch.ones(8)
    R.sparse_unpack_accumulate(out, offsets, *packed, topk=2, value_bits=2, weight=0.5)
    assert out.tolist() == [1, 1, 1, 1, 1, 1, 4.5, 4.5]  # m = 7, levels ±7/3, ±7: 6 and 7 both become 7, halved
    with pytest.raises(ValueError, match="chunk must be in"):
        R.chunk_offsets([10], 70000)
    with pytest.raises(ValueError, match="value_bits must be one of"):
        R.sparse_layout(offsets, 2, 3)
