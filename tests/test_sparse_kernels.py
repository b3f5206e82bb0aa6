"""The native kernels of sparse outer communication (``sparse_pack``, ``sparse_unpack_accumulate``,
``sparse_average``) against their pure-torch references in ``ops.reference``, bit for bit: indices, packed
codes, scales, the residual left in ``e``, ``out`` after unpacking and the average of several payloads, on ties,
short chunks, all-zero chunks, weights of 0, every ``value_bits``, ``topk`` up to the chunk length and chunks of
65536. The CUDA kernels compile here with nvcc alone; they run against the
same reference in ``benchmarks/gpu_check.py`` on a GPU."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from acco_ds import ops
from acco_ds.ops import reference as R
from acco_ds.ops.sparse_codec import pack_indices

ROOT = Path(__file__).resolve().parents[1]
BITS = [0, 2, 4, 8]


@pytest.fixture(scope="module")
def native():
    return ops.load_kernels("native", "cpu", jit=True)  # a build failure fails these tests (CI has a compiler)


def same(a, b):
    """Bit for bit: dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def errors(n, seed, ties=True):
    """Error-buffer-like values: several magnitudes, many exact ties (a few levels), zeros and -0.0."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    if ties:
        levels = torch.randint(-3, 4, (n,), generator=g).float() * 0.37
        e = torch.where(torch.rand(n, generator=g) < 0.5, levels, e)
    e[::13] = 0.0
    e[5::17] = -0.0
    return e


def check(native, e, offsets, topk, bits, weight=1.0, device="cpu"):
    """Pack with both, compare the payloads and residuals; unpack both payloads into the same out, compare.
    The reference runs on the CPU; ``native`` on ``device``."""
    want_e, got_e = e.clone(), e.to(device)
    want = R.sparse_pack(want_e, offsets, topk=topk, value_bits=bits)
    got = native.sparse_pack(got_e, offsets, topk=topk, value_bits=bits)
    for name, a, b in zip(("indices", "values", "scales"), got, want):
        assert same(a.cpu(), b), f"{name} differs (topk={topk}, bits={bits})"
    assert same(got_e.cpu(), want_e), f"residual differs (topk={topk}, bits={bits})"
    base = torch.randn(e.numel(), generator=torch.Generator().manual_seed(1))
    want_out, got_out = base.clone(), base.to(device)
    R.sparse_unpack_accumulate(want_out, offsets, *want, topk=topk, value_bits=bits, weight=weight)
    native.sparse_unpack_accumulate(got_out, offsets, *got, topk=topk, value_bits=bits, weight=weight)
    assert same(got_out.cpu(), want_out), f"out after unpack differs (topk={topk}, bits={bits}, weight={weight})"
    return got


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numels, chunk, topk", [
    ([10, 3, 9000, 5], 4096, 64),   # short chunks: fewer elements than topk
    ([5000, 4096], 4096, 4096),     # topk == chunk: everything kept
    ([300, 7], 64, 1),              # one entry per chunk
    ([70000], 65536, 700),          # the largest chunk, and its short tail
    ([65536], 65536, 65536),        # the largest chunk, all kept
    ([1, 1, 2], 3, 2),              # tensors shorter than a chunk
])
def test_pack_and_unpack_match_the_reference_bit_for_bit(native, numels, chunk, topk, bits):
    e = errors(sum(numels), seed=chunk + topk + bits)
    if chunk <= 64:
        e[:chunk] = 0.0  # an all-zero chunk: m = 0
    offsets = R.chunk_offsets(numels, chunk)
    indices, values, scales = check(native, e, offsets, topk, bits, weight=1 / 3)
    # on the wire (``sparse_codec``, packed): a tag byte, the indices at their chunk's bits, the codes, the scales
    assert 1 + pack_indices(indices, offsets, topk).numel() + values.numel() * values.element_size() + \
        scales.numel() * 4 == R.sparse_payload_bytes(offsets, topk, bits)


def test_ties_go_to_the_lower_index_and_zero_chunks_send_zeros(native):
    offsets = R.chunk_offsets([8, 4], 8)
    e = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 0.0, 1.0, 0.0, -0.0, 0.0, 0.0])
    indices, values, scales = check(native, e.clone(), offsets, 3, 2)
    assert indices.tolist() == [1, 2, 4, 0, 1, 2]  # the four 2s: the first three; the zero chunk: its first three
    assert scales.tolist() == [2.0, 0.0]
    assert values.tolist() == [0b001100, 0]  # codes 0, 3, 0 at bits 0, 2, 4; then zeros


@settings(max_examples=150, deadline=None)
@given(numels=st.lists(st.integers(1, 300), min_size=1, max_size=4), chunk=st.integers(1, 128),
       topk=st.integers(1, 130), bits=st.sampled_from(BITS), seed=st.integers(0, 2**16),
       weight=st.sampled_from([1.0, 0.5, 1 / 3, -0.7]))
def test_random_layouts_match_the_reference(native, numels, chunk, topk, bits, seed, weight):
    e = errors(sum(numels), seed, ties=seed % 2 == 0)
    check(native, e, R.chunk_offsets(numels, chunk), topk, bits, weight)


def check_average(kernels, numels, chunk, topk, bits, weights, seed, device="cpu"):
    """``sparse_average`` of one payload per weight into an ``out`` full of NaN (so every element must be
    written), against the reference composed of zero, unpack after unpack, divide: bit for bit."""
    offsets = R.chunk_offsets(numels, chunk)
    payloads = [R.sparse_pack(errors(sum(numels), seed + r, ties=r % 2 == 0), offsets, topk=topk, value_bits=bits)
                for r in range(len(weights))]
    want = torch.full((sum(numels),), float("nan"))
    R.sparse_average(want, offsets, payloads, weights, topk=topk, value_bits=bits)
    got = torch.full((sum(numels),), float("nan"), device=device)
    kernels.sparse_average(got, offsets.to(device), [[t.to(device) for t in p] for p in payloads], weights,
                           topk=topk, value_bits=bits)
    assert same(got.cpu(), want), f"average differs (topk={topk}, bits={bits}, weights={weights})"
    return want


def test_the_cpu_op_has_the_fused_average(native):
    assert native.fused_average  # not the composed fallback: the comparisons below test the one-pass kernel


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("weights", [[1.0], [1.0, 1.0], [3.0, 0.0, 1.5], [0.0, 0.0], [1 / 3, 2.0, 0.25, 7.0]])
def test_average_matches_the_reference_bit_for_bit(native, bits, weights):
    want = check_average(native, [10, 3, 9000, 70000], 4096, 64, bits, weights, seed=bits)
    if sum(weights) == 0:
        assert same(want, torch.zeros_like(want))  # nobody contributed: zeros, never NaN
    else:
        assert bool(torch.isfinite(want).all()) and bool((want != 0).any())


def test_a_large_average_matches_the_reference(native):
    # 4M elements and more: the kernel writes out with streaming stores, from an unaligned start (3 elements in)
    check_average(native, [3, (1 << 22) + 5], 4096, 64, 2, [1.0, 0.5], seed=7)


@settings(max_examples=100, deadline=None)
@given(numels=st.lists(st.integers(1, 300), min_size=1, max_size=4), chunk=st.integers(1, 128),
       topk=st.integers(1, 130), bits=st.sampled_from(BITS), seed=st.integers(0, 2**16),
       weights=st.lists(st.sampled_from([0.0, 1.0, 0.5, 1 / 3, 4096.0]), min_size=1, max_size=4))
def test_random_averages_match_the_reference(native, numels, chunk, topk, bits, seed, weights):
    check_average(native, numels, chunk, topk, bits, weights, seed)


def test_average_refuses_bad_weights_and_payloads(native):
    offsets = R.chunk_offsets([100], 64)
    p = R.sparse_pack(torch.randn(100), offsets, topk=4, value_bits=2)
    for kernels in (native, ops.TORCH):
        with pytest.raises((RuntimeError, ValueError), match="must be finite and >= 0, got -1"):
            kernels.sparse_average(torch.zeros(100), offsets, [p], [-1.0], topk=4, value_bits=2)
    with pytest.raises(RuntimeError, match="values has 1 elements, the layout .* needs 2"):
        native.sparse_average(torch.zeros(100), offsets, [p, (p[0], p[1][:1], p[2])], [1.0, 1.0], topk=4,
                              value_bits=2)
    with pytest.raises(ValueError, match="one weight per payload, got 1 payloads and 2 weights"):
        ops.TORCH.sparse_average(torch.zeros(100), offsets, [p], [1.0, 1.0], topk=4, value_bits=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (gpu_check.py runs the same comparison)")
@pytest.mark.parametrize("bits", BITS)
def test_cuda_kernels_match_the_reference_bit_for_bit(bits):
    cuda = ops.load_kernels("native", "cuda", jit=True)
    for numels, chunk, topk in [([10, 3, 9000, 5], 4096, 64), ([5000, 4096], 4096, 4096), ([70000], 65536, 700),
                                ([65536], 65536, 65536), ([1, 1, 2], 3, 2), ([2**20 + 3], 4096, 64)]:
        e = errors(sum(numels), seed=chunk + topk + bits)
        check(cuda, e, R.chunk_offsets(numels, chunk), topk, bits, weight=1 / 3, device="cuda")
    check_average(cuda, [10, 3, 9000, 70000], 4096, 64, bits, [1.0, 0.0, 0.5], seed=bits, device="cuda")


def test_bad_arguments_are_refused_by_name(native):
    offsets = R.chunk_offsets([100], 64)
    e = torch.randn(100)
    with pytest.raises(RuntimeError, match="value_bits must be one of 2, 4, 8 or 0"):
        native.sparse_pack(e, offsets, topk=4, value_bits=3)
    with pytest.raises(RuntimeError, match="chunk 0 has 70000 elements"):
        native.sparse_pack(torch.zeros(70000), torch.tensor([0, 70000]), topk=4, value_bits=2)
    with pytest.raises(RuntimeError, match=r"offsets must lie in \[0, 100\]"):
        native.sparse_pack(e, torch.tensor([0, 64, 101]), topk=4, value_bits=2)
    with pytest.raises(RuntimeError, match="e must be float32"):
        native.sparse_pack(e.double(), offsets, topk=4, value_bits=2)
    indices, values, scales = native.sparse_pack(e, offsets, topk=4, value_bits=2)
    with pytest.raises(RuntimeError, match="values has 1 elements, the layout .* needs 2"):
        native.sparse_unpack_accumulate(torch.zeros(100), offsets, indices, values[:1], scales, topk=4, value_bits=2)
    indices[7] = 40  # chunk 1 holds 36 elements
    out = torch.zeros(100)
    with pytest.raises(RuntimeError, match="1 indices point past the end of their chunk"):
        native.sparse_unpack_accumulate(out, offsets, indices, values, scales, topk=4, value_bits=2)


NVCC = shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc"] if os.path.exists(p)), None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_cuda_sparse_kernels_compile(tmp_path):
    """As tests/test_nvcc_compile.py, for the H100's sm_90: the kernels, every template instantiated."""
    obj = tmp_path / "acco_sparse_kernels.o"
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "-fmad=false", "-Xcompiler", "-Wall", "-Werror", "all-warnings",
           "-arch=sm_90", "-I", str(ROOT / "csrc"), str(ROOT / "csrc" / "cuda" / "acco_sparse_kernels.cu"), "-o",
           str(obj)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True).stdout
        for name in ("sparse_pack_kernel<0>", "sparse_pack_kernel<2>", "sparse_pack_kernel<4>", "sparse_pack_kernel<8>",
                     "sparse_unpack_kernel", "acco::cuda::sparse_pack(", "acco::cuda::sparse_unpack_accumulate("):
            assert name in symbols, f"{name} missing from {obj.name}"
