"""Helpers of ``gpu_check.py``'s kernel sections: the optimizer-state inputs, the error measure and the timer."""

import statistics
import time

import torch


def adam_inputs(n, seed, device):
    """master, grad (a sum over micro-batches), exp_avg, exp_avg_sq."""
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 3, torch.randn(n, generator=g) * 0.1,
          torch.rand(n, generator=g) * 0.01]
    return [t.to(device) for t in ts]


def rel_err(got, want, before):
    """Max error relative to the larger of new and old value (an update that cancels most of a value leaves a
    small result whose own ulps are the wrong scale)."""
    scale = torch.maximum(want.float().abs(), before.float().abs()).clamp_min(1e-30)
    return ((got.float() - want.float()).abs() / scale).max().item()


def timeit(fn, repeats, cuda, warmup=3):
    """Median seconds per call: CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def quantization(dev, cuda, tiny, log):
    """The compressed-communication kernels (``quantize_pack`` with an error-feedback residual, then
    ``dequantize_accumulate``): native against the reference on the same data (bit for bit), then timed
    against a device copy of the same bytes; and the fused Peek against torch's own fused AdamW step
    (``torch.optim.AdamW(fused=True)``: it commits, so it writes m, v and θ; the Peek writes only its bf16
    output)."""
    from acco_ds import ops
    from acco_ds.ops import reference
    native = ops.load_kernels("native", dev)
    block, cases = 256, []
    for wire in (torch.int8, torch.float8_e4m3fn):
        for n in (1000, 65536 + 7):
            g = torch.Generator().manual_seed(n)
            x, res0 = torch.randn(n, generator=g).to(dev), (torch.randn(n, generator=g) * 0.01).to(dev)
            outs = []
            for impl in (native, reference):
                res, q = res0.clone(), torch.empty(n, dtype=wire, device=dev)
                scales = torch.empty(-(-n // block), device=dev)
                impl.quantize_pack(x, res, q, scales, block_size=block)
                acc = torch.ones(n, device=dev)
                impl.dequantize_accumulate(q, scales, acc, block_size=block)
                outs.append((q.view(torch.uint8).cpu(), scales.cpu(), res.cpu(), acc.cpu()))
            same = all(torch.equal(a, b) for a, b in zip(*outs))
            cases.append({"wire": str(wire)[6:], "numel": n, "bit_exact": same})
    log(f"quantize/dequantize ({native.name}) vs reference: {sum(c['bit_exact'] for c in cases)}/{len(cases)} "
        f"bit-exact")
    repeats = 20 if cuda else 3
    n = (4 if tiny else 256) * 2**20
    src, dst = torch.randn(n, device=dev), torch.empty(n, device=dev)
    copy_bw = 2 * 4 * n / timeit(lambda: dst.copy_(src), repeats, cuda)
    res, q = torch.zeros(n, device=dev), torch.empty(n, dtype=torch.int8, device=dev)
    scales = torch.empty(-(-n // block), device=dev)
    rows = []
    for name, nbytes, fn in (
            ("quantize_pack int8 + residual", 13 * n, lambda: native.quantize_pack(src, res, q, scales, block_size=block)),
            ("dequantize_accumulate int8", 9 * n, lambda: native.dequantize_accumulate(q, scales, dst, block_size=block))):
        t = timeit(fn, repeats, cuda)
        rows.append({"kernel": name, "numel": n, "ms": 1e3 * t, "GBps": nbytes / t / 1e9,
                     "pct_copy": 100 * nbytes / t / copy_bw})
        log(f"{name:<32} {rows[-1]['ms']:8.3f} ms {rows[-1]['GBps']:7.1f} GB/s ({rows[-1]['pct_copy']:3.0f}% of copy)")
    del src, dst, res, q, scales
    m = (1 if tiny else 64) * 2**20
    master, grad, ea, eas = adam_inputs(m, 1, dev)
    out = torch.empty(m, dtype=torch.bfloat16, device=dev)
    kw = dict(step=10, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=1.0)
    peek = timeit(lambda: native.adamw_update(master, grad, ea, eas, out, commit=False, **kw), repeats, cuda)
    p = torch.nn.Parameter(master.clone())
    p.grad = grad.clone()
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True)
    fused = timeit(opt.step, repeats, cuda)
    log(f"peek {1e3 * peek:.3f} ms vs torch fused AdamW step {1e3 * fused:.3f} ms at {m >> 20}M: "
        f"{100 * fused / peek:.0f}% (peek speed relative to the fused step)")
    return {"kernels": native.name, "cases": cases, "all_pass": all(c["bit_exact"] for c in cases),
            "copy_GBps": copy_bw / 1e9, "rows": rows, "peek_ms": 1e3 * peek, "torch_fused_adamw_ms": 1e3 * fused,
            "peek_speed_vs_fused_pct": 100 * fused / peek, "numel_adam": m}
