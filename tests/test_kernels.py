"""The native kernels against their pure-torch references, and the references against torch.optim."""

import pytest
import torch

from acco_ds import ops
from acco_ds.ops import reference

SIZES = [1, 7, 4096 + 3, 2**20 + 5]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def native():
    # A build failure must fail the suite (CI has a compiler), not skip it.
    return ops.load_kernels("native", "cpu")


def adam_inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 3
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    return master, grad, m, v


def close(a, b, what):
    # The fused kernel rounds like torch.optim up to an ulp or two (torch's own
    # vectorized and scalar paths differ by as much).
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-6, atol=1e-7, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_fused_adam_matches_reference(native, n, out_dtype):
    for seed, (adamw, weight_decay, step, commit) in enumerate([(True, 0.1, 1, True), (True, 0.0, 10, False),
                                                                (False, 0.05, 10, True), (False, 0.0, 3, False)]):
        want = adam_inputs(n, seed)
        got = [t.clone() for t in want]
        before = [t.clone() for t in want]
        out_want = torch.full((n, ), float("nan"), dtype=out_dtype)
        out_got = out_want.clone()  # poisoned: every element must be overwritten
        kw = dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, grad_scale=0.25,
                  commit=commit, adamw=adamw)
        reference.adamw_update(*want, out_want, **kw)
        native.adamw_update(*got, out_got, **kw)
        assert not torch.isnan(out_got).any()
        for name, a, b in zip(["master", "grad", "exp_avg", "exp_avg_sq"], got, want):
            close(a, b, name)
        close(out_got, out_want, "out")
        if not commit:
            for name, a, b in zip(["master", "grad", "exp_avg", "exp_avg_sq"], got, before):
                assert torch.equal(a, b), f"peek changed {name}"


def test_commit_without_output_and_peek_writes_only_output(native):
    master, grad, m, v = adam_inputs(1000, 3)
    want = [t.clone() for t in (master, grad, m, v)]
    kw = dict(step=2, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_scale=1.0)
    native.adamw_update(master, grad, m, v, None, commit=True, **kw)
    reference.adamw_update(*want, None, commit=True, **kw)
    close(master, want[0], "master")


@pytest.mark.parametrize("adamw", [True, False])
def test_reference_is_torch_optim(adamw):
    """The reference (and so the kernel) computes what torch.optim.AdamW / Adam compute."""
    master, grad, m, v = adam_inputs(4096 + 3, 11)
    p = torch.nn.Parameter(master.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([p], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    opt.state[p] = {"step": torch.tensor(4.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    p.grad = grad * 0.125
    opt.step()
    out = torch.empty_like(master)
    reference.adamw_update(master, grad, m, v, out, step=5, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                           weight_decay=0.1, grad_scale=0.125, commit=True, adamw=adamw)
    assert torch.equal(master, p.detach()) and torch.equal(out, master)
    assert torch.equal(m, opt.state[p]["exp_avg"]) and torch.equal(v, opt.state[p]["exp_avg_sq"])


def test_non_finite_inputs_propagate_as_in_torch(native):
    master, grad, m, v = adam_inputs(64, 5)
    grad[3], grad[10], grad[20] = float("nan"), float("inf"), -float("inf")
    want = [t.clone() for t in (master, grad, m, v)]
    got = [t.clone() for t in (master, grad, m, v)]
    out_w, out_g = torch.empty(64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=1.0, commit=True)
    reference.adamw_update(*want, out_w, **kw)
    native.adamw_update(*got, out_g, **kw)
    for a, b in zip(got + [out_g], want + [out_w]):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b))
        close(a, b, "non-finite")
    assert torch.isnan(got[0][3]) and torch.isnan(out_g[3])


def mixed_tensors(n, seed):
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    sizes = [n, 3, n // 2 + 1, 1]
    tensors = [torch.randn(s, generator=g).to(dtypes[i % 3]) for i, s in enumerate(sizes)]
    tensors[1] = tensors[1].reshape(3, 1)
    offsets, o = [], 5
    for t in tensors:
        offsets.append(o)
        o += t.numel() + 3  # gaps stay untouched
    return tensors, offsets, o + 2


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("accumulate", [True, False])
def test_pack_and_unpack_match_reference(native, n, accumulate):
    tensors, offsets, total = mixed_tensors(n, n)
    flat = torch.randn(total)
    want, got = flat.clone(), flat.clone()
    reference.pack(tensors, want, offsets, 0.37, accumulate)
    native.pack(tensors, got, offsets, 0.37, accumulate)
    assert torch.equal(got, want)
    outs_w = [torch.full_like(t, float("nan")) for t in tensors]
    outs_g = [torch.full_like(t, float("nan")) for t in tensors]
    reference.unpack(got, outs_w, offsets)
    native.unpack(got, outs_g, offsets)
    for a, b in zip(outs_g, outs_w):
        assert torch.equal(a, b)


def test_pack_rejects_what_does_not_fit(native):
    with pytest.raises(RuntimeError, match="does not fit"):
        native.pack([torch.ones(10)], torch.zeros(8), [0], 1.0, True)
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        native.pack([torch.ones(4, dtype=torch.float64)], torch.zeros(8), [0], 1.0, True)


def test_selection():
    assert ops.load_kernels("torch").name == "torch"
    assert ops.load_kernels("native", "cpu").name == "native-cpu"
    assert ops.load_kernels("auto", "cpu").name == "native-cpu"
    with pytest.raises(ValueError, match="kernels must be"):
        ops.load_kernels("fast")
    rows = {r["op"]: r for r in ops.op_report()}
    assert rows["acco_cpu_ops"]["loadable"] and rows["acco_cpu_ops"]["auto_uses"] == "native-cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_cuda_kernels_match_reference(out_dtype):
    cuda = ops.load_kernels("native", "cuda")
    for n in SIZES:
        for commit in (True, False):
            want = [t.cuda() for t in adam_inputs(n, 7)]
            got = [t.clone() for t in want]
            before = [t.clone() for t in want]
            ow = torch.full((n, ), float("nan"), dtype=out_dtype, device="cuda")
            og = ow.clone()
            kw = dict(step=4, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.5,
                      commit=commit, adamw=True)
            reference.adamw_update(*want, ow, **kw)
            cuda.adamw_update(*got, og, **kw)
            torch.testing.assert_close(og.float(), ow.float(), rtol=1e-5, atol=1e-6)
            if not commit:
                assert all(torch.equal(a, b) for a, b in zip(got, before))
        tensors, offsets, total = mixed_tensors(n, 1)
        tensors = [t.cuda() for t in tensors]
        fw, fg = torch.randn(total, device="cuda"), None
        fg = fw.clone()
        reference.pack(tensors, fw, offsets, 0.5, True)
        cuda.pack(tensors, fg, offsets, 0.5, True)
        assert torch.equal(fg, fw)
