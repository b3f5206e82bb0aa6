"""The native kernels against their pure-torch references, and the references against torch.optim.

Numerics: exp_avg and exp_avg_sq match torch bit for bit. The parameters match
to a few ulps: torch's vectorized CPU sqrt is MKL's (not correctly
rounded, 1 ulp off for ~15% of inputs) while the kernels use IEEE sqrtf. The cast into
``out`` is bit-exact (round to nearest even, as ``Tensor.to``).
"""

import itertools
import logging
import re
from pathlib import Path

import pytest
import torch

from acco_ds import ops
from acco_ds.ops import reference

SIZES = [1, 7, 4096 + 3, 2**20 + 5]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (adamw, weight_decay, step)
ADAM_CASES = list(itertools.product([True, False], [0.0, 0.1], [1, 10]))
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, grad_scale=0.25)


@pytest.fixture(scope="module")
def native():
    # A build failure must fail these tests (CI has a compiler), not skip them.
    return ops.load_kernels("native", "cpu", jit=True)


def adam_inputs(n, seed, device="cpu"):
    """master, grad (a sum over micro-batches), exp_avg, exp_avg_sq."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 3
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    return [t.to(device) for t in (master, grad, m, v)]


def assert_update_close(got, want, before, what="", ulps=4):
    """``got`` and ``want`` agree to a few ulps of the larger of the new and the old value.

    (The old value sets the scale: when the update cancels most of it, a 1-ulp
    difference in the denominator is many ulps of the small result.)
    """
    assert torch.equal(got.isnan(), want.isnan()), what
    finite = want.isfinite()
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()]), what
    bound = ulps * torch.finfo(torch.float32).eps * torch.maximum(want.abs(), before.abs())
    excess = ((got - want).abs() - bound)[finite]
    assert excess.numel() == 0 or excess.max() <= 0, f"{what}: {int((excess > 0).sum())} elements beyond {ulps} ulps"


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "peek"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_adamw_update_matches_reference(native, n, out_dtype, commit):
    for seed, (adamw, weight_decay, step) in enumerate(ADAM_CASES):
        kw = dict(HYPER, step=step, weight_decay=weight_decay, adamw=adamw)
        want = adam_inputs(n, seed)
        got = [t.clone() for t in want]
        before = [t.clone() for t in want]
        out_want = torch.full((n, ), float("nan"), dtype=out_dtype)
        out_got = out_want.clone()  # poisoned: every element must be overwritten
        reference.adamw_update(*want, out_want, commit=commit, **kw)
        native.adamw_update(*got, out_got, commit=commit, **kw)
        case = f"adamw={adamw} wd={weight_decay} step={step}"

        assert not out_got.isnan().any(), case
        torch.testing.assert_close(out_got.float(), out_want.float(), msg=lambda m: f"out, {case}: {m}")
        if commit:
            assert torch.equal(got[2], want[2]), f"exp_avg not bit-exact, {case}"
            assert torch.equal(got[3], want[3]), f"exp_avg_sq not bit-exact, {case}"
            assert_update_close(got[0], want[0], before[0], f"master, {case}")
            assert torch.equal(out_got, got[0].to(out_dtype)), f"out is not master cast to {out_dtype}, {case}"
        else:
            for name, a, b in zip(["master", "grad", "exp_avg", "exp_avg_sq"], got, before):
                assert torch.equal(a, b), f"peek changed {name}, {case}"
            # A peek writes exactly what a commit would have written.
            committed = [t.clone() for t in before]
            out_commit = torch.empty_like(out_got)
            native.adamw_update(*committed, out_commit, commit=True, **kw)
            assert torch.equal(out_got, out_commit), case
        assert torch.equal(got[1], before[1]), "grad must never change"


def test_commit_without_out_and_peek_without_out(native):
    kw = dict(HYPER, step=3, weight_decay=0.01, adamw=True)
    state = adam_inputs(5000, 3)
    with_out = [t.clone() for t in state]
    native.adamw_update(*state, None, commit=True, **kw)
    native.adamw_update(*with_out, torch.empty(5000), commit=True, **kw)
    for a, b in zip(state, with_out):
        assert torch.equal(a, b)
    before = [t.clone() for t in state]
    native.adamw_update(*state, None, commit=False, **kw)  # nothing to write: a no-op
    for a, b in zip(state, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_reference_is_torch_optim(adamw):
    """The reference computes exactly what torch.optim.AdamW / Adam compute (foreach=False)."""
    for weight_decay, step in itertools.product([0.0, 0.1], [1, 10]):
        master, grad, m, v = adam_inputs(4096 + 3, step)
        p = torch.nn.Parameter(master.clone())
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        opt = cls([p], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=False)
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        p.grad = grad * 0.125  # the gradient sum times grad_scale
        opt.step()
        out = torch.empty_like(master)
        reference.adamw_update(master, grad, m, v, out, step=step, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                               weight_decay=weight_decay, grad_scale=0.125, commit=True, adamw=adamw)
        assert torch.equal(master, p.detach()) and torch.equal(out, master)
        assert torch.equal(m, opt.state[p]["exp_avg"]) and torch.equal(v, opt.state[p]["exp_avg_sq"])


def test_native_is_torch_optim(native):
    """The same for the fused kernel, at the precision stated at the top of this file."""
    for adamw, weight_decay, step in ADAM_CASES:
        master, grad, m, v = adam_inputs(2**16 + 1, step)
        before = master.clone()
        p = torch.nn.Parameter(master.clone())
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        opt = cls([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, foreach=False)
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        p.grad = grad * 0.25
        opt.step()
        native.adamw_update(master, grad, m, v, None, step=step, weight_decay=weight_decay, adamw=adamw, commit=True,
                            **HYPER)
        assert torch.equal(m, opt.state[p]["exp_avg"]) and torch.equal(v, opt.state[p]["exp_avg_sq"])
        assert_update_close(master, p.detach(), before)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_non_finite_inputs_propagate_as_in_torch(native, out_dtype):
    master, grad, m, v = adam_inputs(64, 5)
    grad[3], grad[10], grad[20] = float("nan"), float("inf"), -float("inf")
    master[30], m[40], v[50] = float("inf"), float("nan"), float("inf")
    for adamw, commit in itertools.product([True, False], [True, False]):
        kw = dict(HYPER, step=2, weight_decay=0.1, adamw=adamw, commit=commit)
        want = [t.clone() for t in (master, grad, m, v)]
        got = [t.clone() for t in (master, grad, m, v)]
        out_w, out_g = torch.zeros(64, dtype=out_dtype), torch.zeros(64, dtype=out_dtype)
        reference.adamw_update(*want, out_w, **kw)
        native.adamw_update(*got, out_g, **kw)
        for a, b in zip(got + [out_g], want + [out_w]):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
            assert torch.equal(a[a.isinf()], b[b.isinf()])  # same signs
            torch.testing.assert_close(a, b, equal_nan=True)
        assert out_g[3].isnan() and out_g[10].isnan()


def test_argument_checks(native):
    master, grad, m, v = adam_inputs(10, 0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        native.adamw_update(master, grad, m, v, torch.zeros(10, dtype=torch.float64), step=1, weight_decay=0.0,
                            commit=True, **HYPER)
    with pytest.raises(RuntimeError, match="contiguous"):
        native.adamw_update(master, grad, m, v, torch.zeros(20)[::2], step=1, weight_decay=0.0, commit=True, **HYPER)
    with pytest.raises(RuntimeError, match="elements"):
        native.adamw_update(master, grad[:5], m, v, None, step=1, weight_decay=0.0, commit=True, **HYPER)
    with pytest.raises(RuntimeError, match="float32"):
        native.adamw_update(master.double(), grad, m, v, None, step=1, weight_decay=0.0, commit=True, **HYPER)


def test_selection(native, monkeypatch, caplog):
    assert ops.load_kernels("torch").name == "torch"
    assert native.name == "native-cpu"
    assert ops.load_kernels("auto", "cpu").name == "native-cpu"
    assert ops.load_kernels("auto", torch.device("cpu")) is ops.load_kernels("auto", "cpu")  # cached
    with pytest.raises(ValueError, match="kernels must be"):
        ops.load_kernels("fast")

    # The module-level functions dispatch to the native op for CPU tensors.
    master, grad, m, v = adam_inputs(100, 1)
    want = [t.clone() for t in (master, grad, m, v)]
    ops.adamw_update(master, grad, m, v, None, step=1, weight_decay=0.0, commit=True, **HYPER)
    native.adamw_update(*want, None, step=1, weight_decay=0.0, commit=True, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip((master, grad, m, v), want))

    # When the op cannot be built: "auto" falls back with one warning, "native" raises.
    def broken(device_type, jit=True):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(ops, "_cache", {})
    monkeypatch.setattr(ops, "_native_kernels", broken)
    with caplog.at_level(logging.WARNING, logger="acco_ds"):
        assert ops.load_kernels("auto", "cpu").name == "torch"
        assert ops.load_kernels("auto", "cpu").name == "torch"
    assert len([r for r in caplog.records if "no compiler" in r.getMessage()]) == 1
    with pytest.raises(RuntimeError, match="no compiler.*kernels.*torch"):
        ops.load_kernels("native", "cpu")


def test_op_report(native):
    rows = {r["op"]: r for r in ops.op_report()}
    assert set(rows) == {"acco_cpu_ops", "acco_cuda_ops"}
    cpu = rows["acco_cpu_ops"]
    assert cpu["compatible"] and cpu["loadable"] and cpu["auto_uses"] == "native-cpu"
    cuda = rows["acco_cuda_ops"]
    assert cuda["auto_uses"] == ("native-cuda" if cuda["loadable"] else "torch")
    for row in rows.values():
        assert {"op", "device", "compatible", "aot_built", "loadable", "auto_uses"} <= set(row)


# ---------------------------------------------------------------- CUDA (skipped without a GPU)
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda_only
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_cuda_adamw_update_matches_reference(out_dtype):
    cuda = ops.load_kernels("native", "cuda", jit=True)
    for n, commit, (adamw, weight_decay, step) in itertools.product(SIZES, [True, False], ADAM_CASES):
        kw = dict(HYPER, step=step, weight_decay=weight_decay, adamw=adamw, commit=commit)
        want = adam_inputs(n, step, "cuda")
        got = [t.clone() for t in want]
        before = [t.clone() for t in want]
        ow = torch.full((n, ), float("nan"), dtype=out_dtype, device="cuda")
        og = ow.clone()
        reference.adamw_update(*want, ow, **kw)
        cuda.adamw_update(*got, og, **kw)
        assert not og.isnan().any()
        torch.testing.assert_close(og.float(), ow.float())
        if commit:
            # On CUDA torch's sqrt is IEEE too: everything can match bit for bit; allow an ulp.
            for a, b, c in zip(got, want, before):
                assert_update_close(a, b, c)
            assert torch.equal(og, got[0].to(out_dtype))
        else:
            assert all(torch.equal(a, b) for a, b in zip(got, before))


# What a TORCH_CHECK message may stream: string literals and text, and torch's own types (streamed as their names).
# A number streamed into it crashed the process (SIGSEGV, not an error) where the op was built by the system g++
# against a torch wheel built by another toolchain (an H200 image: g++ 13.3, torch 2.11): numbers go in as
# ``num(...).text`` / ``num_real(...).text``.
_SAFE_MESSAGE_PART = re.compile(r'^(".*"|.*\.text|.*scalar_type\(\)|.*device\(\)|device|dtype|name|x_name|'
                                r'pair\.second)$', re.S)


def _torch_checks(text):
    """(line, [condition, message parts...]) of every TORCH_CHECK call in C++ source ``text``."""
    for m in re.finditer(r"\bTORCH_CHECK\(", text):
        i, depth, start, quoted, parts = m.end(), 1, m.end(), False, []
        while depth:
            c = text[i]
            if c == '"' and text[i - 1] != "\\":
                quoted = not quoted
            elif not quoted and c in "([{":
                depth += 1
            elif not quoted and c in ")]}":
                depth -= 1
            elif not quoted and c == "," and depth == 1:
                parts.append(text[start:i])
                start = i + 1
            i += 1
        parts.append(text[start:i - 1])
        yield text.count("\n", 0, m.start()) + 1, [" ".join(p.split()) for p in parts]


def test_error_messages_stream_no_bare_numbers():
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    found, bad = 0, []
    for path in sorted(csrc.rglob("*")):
        if path.suffix in (".h", ".cpp", ".cu"):
            for line, parts in _torch_checks(path.read_text()):
                found += 1
                bad += [f"{path.name}:{line}: {p}" for p in parts[1:] if not _SAFE_MESSAGE_PART.match(p.strip())]
    assert found > 20, "the scan found no TORCH_CHECK calls: csrc moved?"
    assert not bad, "stream numbers as num(x).text or num_real(x).text:\n" + "\n".join(bad)
    # the scan itself catches a bare number
    assert [p for _, parts in _torch_checks('TORCH_CHECK(w >= 0, "got ", w);') for p in parts[1:]
            if not _SAFE_MESSAGE_PART.match(p)] == ["w"]
