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
    ``dequantize_accumulate``): native against the CPU reference on the same data (bit for bit), then timed
    against a device copy of the same bytes; and the fused Peek against torch's own fused AdamW step
    (``torch.optim.AdamW(fused=True)``: it commits, so it writes m, v and θ; the Peek writes only its bf16
    output)."""
    from acco_ds import ops
    from acco_ds.ops import reference
    native = ops.load_kernels("native", dev)
    # The contract is the reference on the CPU (tests/test_quant_kernels.py); the reference run on the device
    # (torch's own CUDA kernels) is compared too, and reported apart.
    block, cases = 256, []
    names = ("q", "scales", "residual", "dequantized")
    for wire in (torch.int8, torch.float8_e4m3fn):
        for n, blk in ((1000, block), (65536 + 7, block), (4096 * 3 + 5, 1024), (5000, 100)):
            g = torch.Generator().manual_seed(n)
            x, res0 = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.01
            outs = {}
            for label, impl, where in (("native", native, dev), ("reference", reference, "cpu"),
                                       ("reference_on_device", reference, dev)):
                res, q = res0.clone().to(where), torch.empty(n, dtype=wire, device=where)
                scales = torch.empty(-(-n // blk), device=where)
                impl.quantize_pack(x.to(where), res, q, scales, block_size=blk)
                acc = torch.ones(n, device=where)
                impl.dequantize_accumulate(q, scales, acc, block_size=blk)
                outs[label] = (q.view(torch.uint8).cpu(), scales.cpu(), res.cpu(), acc.cpu())

            def differing(a, b):  # elements that differ, per output
                return {k: int((u != v).sum()) for k, u, v in zip(names, a, b) if not torch.equal(u, v)}

            vs_cpu, vs_dev = differing(outs["native"], outs["reference"]), differing(outs["native"],
                                                                                    outs["reference_on_device"])
            cases.append({"wire": str(wire)[6:], "numel": n, "block": blk, "bit_exact": not vs_cpu,
                          "differing_vs_cpu_reference": vs_cpu, "differing_vs_reference_on_device": vs_dev,
                          "reference_on_device_equals_cpu": not differing(outs["reference_on_device"],
                                                                         outs["reference"])})
    log(f"quantize/dequantize ({native.name}) vs the CPU reference: {sum(c['bit_exact'] for c in cases)}/"
        f"{len(cases)} bit-exact; differing: {[c['differing_vs_cpu_reference'] for c in cases]}")
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
# ------------------------------------------------------------------ sparse outer communication
SPARSE_LAYOUTS = [([10, 3, 9000, 5], 4096, 64),  # short chunks
                  ([5000, 4096], 4096, 4096),    # topk == chunk
                  ([70000], 65536, 700),         # the largest chunk and its tail
                  ([65536], 65536, 65536),       # the largest chunk, all kept
                  ([1, 1, 2], 3, 2),
                  ([2**20 + 3], 4096, 64)]       # many chunks (the production shape)


def guarded(fn, *args):
    """fn's result, or its error and traceback (a failed part of a section is recorded; the rest runs)."""
    import traceback
    try:
        return {"ok": True, **fn(*args)}
    except Exception as err:  # noqa: BLE001 - every failure is a result here
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def sparse_errors(n, seed):
    """Error-buffer-like fp32 values with many exact ties, zeros, -0.0 and an all-zero stretch."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    ties = torch.randint(-3, 4, (n,), generator=g).float() * 0.37
    e = torch.where(torch.rand(n, generator=g) < 0.3, ties, e)
    e[::13], e[5::17], e[:3] = 0.0, -0.0, 0.0
    return e


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


def sparse_correctness(native, device, tiny, log):
    """native sparse_pack / sparse_unpack_accumulate / sparse_average on ``device`` vs the reference on the CPU,
    same data, bit for bit: indices, codes, scales, the residual left in e, out after unpacking (weight 1/3), and
    the average of three payloads (weights 2, 0, 1)."""
    from acco_ds.ops import reference as R
    cases = []
    for numels, chunk, topk in SPARSE_LAYOUTS[:-1] if tiny else SPARSE_LAYOUTS:
        offsets = R.chunk_offsets(numels, chunk)
        for bits in (0, 2, 4, 8):
            e = sparse_errors(sum(numels), len(cases))
            want_e, got_e = e.clone(), e.to(device)
            want = R.sparse_pack(want_e, offsets, topk=topk, value_bits=bits)
            got = native.sparse_pack(got_e, offsets, topk=topk, value_bits=bits)
            base = torch.randn(e.numel(), generator=torch.Generator().manual_seed(1))
            want_out, got_out = base.clone(), base.to(device)
            R.sparse_unpack_accumulate(want_out, offsets, *want, topk=topk, value_bits=bits, weight=1 / 3)
            native.sparse_unpack_accumulate(got_out, offsets, *got, topk=topk, value_bits=bits, weight=1 / 3)
            # the receiver's average of this payload and the residual's (weights 2, 0 and 1)
            want_avg, got_avg = torch.empty_like(want_out), torch.empty_like(got_out)
            more = R.sparse_pack(want_e.clone(), offsets, topk=topk, value_bits=bits)
            R.sparse_average(want_avg, offsets, [want, want, more], [2.0, 0.0, 1.0], topk=topk, value_bits=bits)
            native.sparse_average(got_avg, offsets, [got, got, [t.to(device) for t in more]], [2.0, 0.0, 1.0],
                                  topk=topk, value_bits=bits)
            same = {name: bits_equal(a, b) for name, a, b in
                    zip(("indices", "values", "scales", "residual", "out", "average"), (*got, got_e, got_out, got_avg),
                        (*want, want_e, want_out, want_avg))}
            cases.append({"numels": numels, "chunk": chunk, "topk": topk, "value_bits": bits, "equal": same,
                          "pass": all(same.values())})
    n_pass = sum(c["pass"] for c in cases)
    log(f"sparse_pack / sparse_unpack_accumulate / sparse_average ({native.name}) vs reference: {n_pass}/{len(cases)} cases bit-exact")
    return {"cases": cases, "all_pass": n_pass == len(cases)}


def sparse_timing(native, device, tiny, repeats, log):
    """chunk 4096, top 64, 2 bits: native vs the torch path (benchmarks/kernels.py), each against
    ``dst.copy_(src)`` of the same bytes (pack: the fp32 tensor; unpack: the payload)."""
    from acco_ds.ops import reference as R
    from kernels import SPARSE, torch_sparse_pack, torch_sparse_unpack
    cuda = device == "cuda"
    chunk, topk, bits = SPARSE["chunk"], SPARSE["topk"], SPARSE["value_bits"]
    kw = dict(topk=topk, value_bits=bits)
    rows = []
    for n in ([2**20] if tiny else [2**26, 2**30] if cuda else [2**26]):
        offsets = R.chunk_offsets([n], chunk)
        e, out = torch.randn(n, device=device), torch.zeros(n, device=device)
        payload = native.sparse_pack(e.clone(), offsets, **kw)
        ref = torch_sparse_pack(e.clone(), chunk, topk, bits)
        nbytes = R.sparse_payload_bytes(offsets, topk, bits)
        e_copy, p_copy = torch.empty_like(e), torch.empty(nbytes, dtype=torch.uint8, device=device)
        p_src = torch.zeros_like(p_copy)
        cases = {"sparse_pack": (lambda: native.sparse_pack(e, offsets, **kw),
                                 lambda: torch_sparse_pack(e, chunk, topk, bits), lambda: e_copy.copy_(e), 4 * n),
                 "sparse_unpack_accumulate": (
                     lambda: native.sparse_unpack_accumulate(out, offsets, *payload, **kw, weight=0.5),
                     lambda: torch_sparse_unpack(out, *ref, chunk, topk, bits, weight=0.5),
                     lambda: p_copy.copy_(p_src), nbytes)}
        for name, (fused, torch_path, copy, copy_bytes) in cases.items():
            t_native, t_torch, t_copy = (timeit(fn, repeats, cuda) for fn in (fused, torch_path, copy))
            row = {"numel": n, "kernel": name, "native_ms": 1e3 * t_native, "torch_ms": 1e3 * t_torch,
                   "copy_ms": 1e3 * t_copy, "copy_bytes": copy_bytes, "speedup": t_torch / t_native,
                   "native_vs_copy": t_copy / t_native}
            rows.append(row)
            log(f"{n >> 20}M {name:<24} native {row['native_ms']:8.3f} ms | torch {row['torch_ms']:8.3f} ms "
                f"({row['speedup']:.1f}x) | copy of {copy_bytes / 2**20:.1f} MiB {row['copy_ms']:.3f} ms")
    return {"chunk": chunk, "topk": topk, "value_bits": bits, "rows": rows}


def sparse_summary_rows(sections, verdict):
    """The summary's rows of the sparse kernels: (check, result, target, verdict)."""
    c = sections["correctness"].get("sparse") or {}
    rows = [("sparse kernels vs reference", f"{sum(x['pass'] for x in c.get('cases', []))}/{len(c.get('cases', []))}"
             f" cases bit-exact" if c.get("ok") else f"FAILED: {c.get('error')}", "all",
             verdict(c.get("all_pass", False)))]
    for r in (sections["timing"].get("sparse") or {}).get("rows", []):
        big = r["numel"] >= 2**26
        rows.append((f"{r['kernel']} @ {r['numel'] / 2**20:g}M", f"{r['native_ms']:.3f} ms, {r['speedup']:.1f}x torch, "
                     f"{100 * r['native_vs_copy']:.0f}% of a copy of {r['copy_bytes'] / 2**20:.1f} MiB",
                     ">= 3x torch" if big else "-", verdict(r["speedup"] >= 3 if big else None)))
    return rows
