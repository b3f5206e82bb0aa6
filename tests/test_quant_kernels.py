"""The native block-quantization kernels against their pure-torch references, bit for bit, and the
references' own properties (``ops.reference.quantize_pack``, ``dequantize_accumulate``)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from acco_ds import ops
from acco_ds.ops import reference as R

X_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RESIDUALS = [None, torch.float32, torch.bfloat16]
WIRES = ["int8", "fp8"]


@pytest.fixture(scope="module")
def native():
    return ops.load_kernels("native", "cpu", jit=True)  # a build failure fails these tests (CI has a compiler)


# torch's vectorized CPU casts (AVX2/AVX-512) write every NaN as bf16 0xFFFF; the CPU kernels do the same, so
# there even NaNs agree bit for bit. Elsewhere (the scalar build of torch, CUDA) only NaN-ness is compared.
STRICT_NAN = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def same(a, b, strict_nan=STRICT_NAN):
    """Bit for bit (with ``strict_nan=False``, any NaN equals any NaN: the NaN torch writes depends on
    the cast it runs; a NaN residual is zeroed by the engine either way)."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_floating_point() and a.element_size() > 1 and not strict_nan:
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a[~nan], b[~nan]
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def values(n, seed, dtype=torch.float32):
    """Gradient-like values: several magnitudes, exact zeros, negative zeros, one all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    x[::7] = 0.0
    x[3::11] = -0.0
    if n > 600:
        x[256:512] = 0.0  # a block of zeros: scale 0
    return x.to(dtype)


def run(kern, x, residual_dtype, wire, block, seed=0):
    n = x.numel()
    res = None if residual_dtype is None else (torch.randn(n, generator=torch.Generator().manual_seed(seed)) *
                                               1e-3).to(residual_dtype).to(x.device)
    q = torch.full((n,), 0x55, dtype=torch.uint8, device=x.device).view(R.WIRE_DTYPES[wire])  # all get written
    scales = torch.full((R.num_blocks(n, block),), 12345.0, device=x.device)
    kern.quantize_pack(x, res, q, scales, block_size=block)
    return q, scales, res


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("residual_dtype", RESIDUALS, ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("n, block", [(0, 256), (1, 256), (255, 256), (1000, 256), (2**20 + 5, 256), (777, 8),
                                      (4096, 4096), (5000, 1 << 20)])
def test_quantize_pack_matches_the_reference_bit_for_bit(native, n, block, x_dtype, residual_dtype, wire):
    x = values(n, n + block, x_dtype)
    want = run(ops.TORCH, x, residual_dtype, wire, block)
    got = run(native, x, residual_dtype, wire, block)
    for name, a, b in zip(("q", "scales", "residual"), got, want):
        assert same(a, b), f"{name} differs: n={n} block={block} {x_dtype} residual={residual_dtype} {wire}"


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("out_dtype", X_DTYPES, ids=str)
def test_dequantize_accumulate_matches_the_reference_bit_for_bit(native, out_dtype, wire):
    for n, block in ((1, 256), (1000, 256), (2**20 + 5, 256), (777, 8)):
        x = values(n, n)
        if n > 700:
            x[650] = float("nan")  # a NaN scale: that block adds NaN
        q, scales, _ = run(ops.TORCH, x, None, wire, block)
        base = values(n, n + 1, out_dtype)
        if n > 700:
            base[3], base[4], base[5] = float("nan"), -float("inf"), float("inf")
        want, got = base.clone(), base.clone()
        R.dequantize_accumulate(q, scales, want, block_size=block)
        native.dequantize_accumulate(q, scales, got, block_size=block)
        assert same(got, want), (n, block, out_dtype, wire)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("residual_dtype", RESIDUALS, ids=str)
def test_non_finite_blocks_send_nan_scales_and_zero_values(native, residual_dtype, wire):
    x = values(1000, 3)
    x[5], x[300], x[700] = float("nan"), float("inf"), -float("inf")  # blocks 0, 1 and 2 of 4
    for kern in (ops.TORCH, native):
        q, scales, res = run(kern, x, residual_dtype, wire, 256)
        assert scales[:3].isnan().all() and scales[3].isfinite()
        assert (q.view(torch.uint8)[:768] == 0).all()
        if res is not None:
            assert res[:768].float().isnan().all() and res[768:].float().isfinite().all()
        out = torch.zeros(1000)
        kern.dequantize_accumulate(q, scales, out, block_size=256)
        assert out[:768].isnan().all() and out[768:].isfinite().all()  # the receiver sees it: the step is skipped
    want, got = run(ops.TORCH, x, residual_dtype, wire, 256), run(native, x, residual_dtype, wire, 256)
    assert all(same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("residual_dtype", RESIDUALS, ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=str)
def test_edge_values_bit_for_bit(native, x_dtype, residual_dtype, wire):
    """Signed zeros (v = -0.0 keeps its sign in the residual), ties of the int8 rounding, values at +-qmax,
    fp8 subnormals, a block whose max / qmax underflows to a zero scale, and extreme magnitudes."""
    block = 16
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.0, -127.0, 3.0, 0.25, -0.25,
                         1e-3, -1e-3, 127.0])
    rows = [
        ties,  # int8 ties to even (scale 1)
        ties * 448 / 127,  # fp8: 448 exactly, and values between e4m3 steps
        torch.tensor([-0.0, 0.0] * 7 + [1.0, -1.0]),  # signed zeros in a quantized block
        torch.full((16,), -0.0),  # an all -0.0 block: scale 0
        torch.tensor([1e-45, -1e-45] * 8),  # max / qmax underflows: scale 0 though values are not 0
        torch.tensor([3e-44, -2e-44] * 8),  # subnormal scale
        torch.tensor([3.4e38, -3.4e38, 1.0, -1e30] * 4),  # huge, still finite
        torch.tensor([2.0**-9 * k for k in range(16)]) * 448 / 127 * 127,  # fp8 subnormal range after scaling
    ]
    x = torch.cat(rows).to(x_dtype)
    n = x.numel()
    for res_init in (None, "neg_zero", "random"):
        if residual_dtype is None and res_init is not None:
            continue
        got_want = []
        for kern in (native, ops.TORCH):
            q = torch.full((n,), 0x55, dtype=torch.uint8).view(R.WIRE_DTYPES[wire])
            scales = torch.full((n // block,), 12345.0)
            res = None
            if residual_dtype is not None:
                res = torch.full((n,), -0.0) if res_init == "neg_zero" else \
                    torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-2
                res = res.to(residual_dtype)
            kern.quantize_pack(x, res, q, scales, block_size=block)
            got_want.append((q, scales, res))
        for name, a, b in zip(("q", "scales", "residual"), *got_want):
            assert same(a, b), f"{name} differs: {x_dtype} residual={residual_dtype} ({res_init}) {wire}"


def test_signed_zero_residual_is_kept(native):
    """v = -0.0 in a quantized block: the reference's residual is -0.0 - (0 * scale) = -0.0 (int8 has no
    -0, so the value sent is +0.0), not +0.0."""
    x = torch.tensor([-0.0, 1.0])
    for kern in (native, ops.TORCH):
        res = torch.tensor([-0.0, 0.0])
        kern.quantize_pack(x, res, torch.empty(2, dtype=torch.int8), torch.empty(1), block_size=2)
        assert torch.equal(res.view(torch.int32), torch.tensor([-0.0, 0.0]).view(torch.int32)), kern


@pytest.mark.parametrize("wire", WIRES)
def test_reference_properties(wire):
    qmax = R.QMAX[wire]
    x = values(5000, 9)
    res = torch.zeros(5000)
    q, scales, _ = run(ops.TORCH, x, None, wire, 256)
    q2, scales2, _ = (torch.empty_like(q), torch.empty_like(scales), None)
    R.quantize_pack(x, res, q2, scales2, block_size=256)
    sent = torch.zeros(5000)
    R.dequantize_accumulate(q2, scales2, sent, block_size=256)
    # Error feedback keeps exactly what was left out: sent + residual == x (fp32 residual).
    assert torch.equal(sent + res, x)
    # One scale per block: max |x| / qmax; the largest value of each block is sent exactly (up to the scale).
    blocks = torch.nn.functional.pad(x, (0, 5120 - 5000)).view(-1, 256)
    assert torch.equal(scales, blocks.abs().amax(1) / qmax)
    err = (sent - x).abs().view(-1)
    bound = torch.repeat_interleave(scales, 256)[:5000]
    if wire == "int8":
        assert (err <= bound / 2 * (1 + 1e-6)).all()  # round to nearest: at most half a step
    else:
        assert (err <= x.abs() / 16 + bound * 2**-9).all()  # e4m3: 3 mantissa bits, subnormals in steps of 2^-9
    # Values already on the grid go through exactly.
    grid = torch.arange(-127, 128, dtype=torch.float32) * 0.5
    q3, s3, _ = run(ops.TORCH, grid, None, "int8", 255)
    back = torch.zeros(255)
    R.dequantize_accumulate(q3, s3, back, block_size=255)
    assert torch.equal(back, grid)


@settings(max_examples=60, deadline=None, database=None)
@given(n=st.integers(0, 3000), block=st.sampled_from([8, 13, 64, 256, 1000]), wire=st.sampled_from(WIRES),
       x_dtype=st.sampled_from(X_DTYPES), residual_dtype=st.sampled_from(RESIDUALS), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 3e38]))
def test_native_equals_reference_on_random_inputs(n, block, wire, x_dtype, residual_dtype, seed, scale):
    native = ops.load_kernels("native", "cpu")
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(x_dtype)
    want = run(ops.TORCH, x, residual_dtype, wire, block, seed)
    got = run(native, x, residual_dtype, wire, block, seed)
    assert all(same(a, b) for a, b in zip(got, want))
    # ... and adding those values back into a tensor of x's dtype.
    out_want, out_got = x.clone(), x.clone()
    R.dequantize_accumulate(want[0], want[1], out_want, block_size=block)
    native.dequantize_accumulate(want[0], want[1], out_got, block_size=block)
    assert same(out_got, out_want)


def test_bad_arguments_are_refused_with_the_reason(native):
    x = torch.zeros(10)
    q = torch.zeros(10, dtype=torch.int8)
    cases = [
        (dict(q=torch.zeros(9, dtype=torch.int8)), "q has 9 elements, x has 10"),
        (dict(scales=torch.zeros(2)), "scales has 2 elements, 1 blocks of 256 expected"),
        (dict(scales=torch.zeros(1, dtype=torch.float64)), "scales must be float32"),
        (dict(q=torch.zeros(10, dtype=torch.float32)), "quantized values must be int8 or float8_e4m3fn"),
        (dict(q=torch.zeros(10, dtype=torch.float8_e5m2)), "quantized values must be int8 or float8_e4m3fn"),
        (dict(residual=torch.zeros(10, dtype=torch.float16)), "residual must be float32 or bfloat16"),
        (dict(residual=torch.zeros(11)), "residual has 11 elements, x has 10"),
        (dict(residual=torch.zeros(20)[::2]), "residual must be contiguous"),
        (dict(x=torch.zeros(20)[::2]), "x must be contiguous"),
        (dict(x=torch.zeros(10, dtype=torch.float64)), "float32, bfloat16 and float16"),
        (dict(block=0), "block_size must be positive"),
    ]
    for change, needle in cases:
        args = {**dict(x=x, residual=None, q=q, scales=torch.zeros(1), block=256), **change}
        with pytest.raises(RuntimeError, match=needle):
            native.quantize_pack(args["x"], args["residual"], args["q"], args["scales"], block_size=args["block"])
    for (q_, scales, out, block), needle in [
        ((q, torch.zeros(1), torch.zeros(11), 256), "q has 10 elements, out has 11"),
        ((q, torch.zeros(2), torch.zeros(10), 4), "scales has 2 elements, 3 blocks of 4 expected"),
        ((q, torch.zeros(1), torch.zeros(10, dtype=torch.int32), 256), "float32, bfloat16 and float16"),
        ((q, torch.zeros(1), torch.zeros(10), -1), "block_size must be positive"),
    ]:
        with pytest.raises(RuntimeError, match=needle):
            native.dequantize_accumulate(q_, scales, out, block_size=block)


def test_any_shape_and_the_module_functions(native):
    """Contiguous tensors of any shape are flat buffers (as in the reference)."""
    x = values(6 * 50, 4).view(6, 50)
    want = (torch.empty(6, 50, dtype=torch.int8), torch.empty(3), torch.zeros(6, 50))
    got = (torch.empty(300, dtype=torch.int8), torch.empty(3), torch.zeros(300))
    R.quantize_pack(x, want[2], want[0], want[1], block_size=100)
    native.quantize_pack(x, got[2], got[0], got[1], block_size=100)
    assert all(same(a.reshape(-1), b.reshape(-1)) for a, b in zip(got, want))


def test_stale_module_is_reported(monkeypatch):
    """A module built from older sources (an old AOT build) is refused with the way out, not used."""
    import types
    monkeypatch.setattr(ops, "load_native", lambda device_type, jit=True: types.SimpleNamespace(adamw_update=None,
                                                                                     __file__="/x/old.so"))
    with pytest.raises(RuntimeError, match=r"has no quantize_pack, dequantize_accumulate.*ACCO_BUILD_OPS=1"):
        ops._native_kernels("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("wire, x_dtype, residual_dtype", list(itertools.product(WIRES, X_DTYPES, RESIDUALS)))
def test_cuda_kernels_match_the_reference(wire, x_dtype, residual_dtype):
    cuda = ops.load_kernels("native", "cuda", jit=True)
    # Blocks of 128..1024 take the warp-per-block kernel (whole blocks) and the block kernel (a shorter last
    # block); other sizes, and a misaligned start (offset 1), the block kernel alone.
    for n, block, offset in ((1000, 256, 0), (2**20 + 5, 256, 0), (777, 8, 0), (3 * 128 + 5, 128, 0),
                             (2**16 + 100, 1024, 0), (4 * 512, 512, 0), (2**12 + 9, 256, 1)):
        x_dev = values(n + offset, n, x_dtype).cuda()[offset:]  # offset 1: x starts off a 16-byte boundary
        if n > 2000:
            x_dev[1100] = float("nan") if x_dtype != torch.float16 else float("inf")  # a non-finite block
        want = run(ops.TORCH, x_dev.cpu(), residual_dtype, wire, block)
        got = [None if t is None else t.cpu() for t in run(cuda, x_dev, residual_dtype, wire, block)]
        for name, a, b in zip(("q", "scales", "residual"), got, want):
            assert same(a, b, strict_nan=False), f"{name} differs: n={n} block={block} offset={offset}"
