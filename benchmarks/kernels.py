"""Microbenchmark of the acco_ds kernels: fused vs the unfused torch sequence.

    python benchmarks/kernels.py                       # CPU: AdamW 1M..64M, quantization 1M..16M elements
    python benchmarks/kernels.py --section quant       # CPU: the quantization section only
    python benchmarks/kernels.py --device cuda         # GPU: 1M..256M elements

(The CPU default stops at 64M: 256M would need ~10 GB and minutes per size;
pass --sizes to choose, for both sections.) ``--section`` picks ``adam``,
``quant`` or ``all`` (the default).

Section ``adam``: for each size it times

* peek:   fused ``adamw_update(commit=False)`` into a bf16 send buffer, vs the
          unfused sequence: clone θ, m, v; AdamW step with torch ops; cast-copy
          θ into the send buffer; copy the clones back (restore);
* commit: fused ``adamw_update(commit=True)`` (state and bf16 out) vs the same
          step with torch ops and a cast-copy;

and reports the time (median), the effective bandwidth (bytes that must move /
time: peek reads θ, g, m, v and writes out; commit also writes θ, m, v), its ratio to this
machine's copy bandwidth (``dst.copy_(src)`` on a large tensor, 2 x 4 bytes per
element), and the memory each variant allocates beyond its inputs (CUDA: peak
allocation; CPU: bytes allocated during the call, from the torch profiler).
Results: ``benchmarks/results/kernels_<device>.json`` and ``.md``.

Section ``quant`` (compressed communication; sizes 1M, 4M, 16M on CPU, 1M..256M
on GPU), blocks of 256, native op vs the torch reference
(``acco_ds.ops.reference``), each against ``dst.copy_(src)`` of an fp32 tensor
of the same size (reads and writes 8 bytes per element):

* quantize int8 / fp8: ``quantize_pack`` of an fp32 gradient with an fp32
  error-feedback residual: reads x and the residual, writes the values, the
  scales and the residual (13 bytes per element + 4 per block);
* dequantize: ``dequantize_accumulate`` of int8 values into fp32: reads the
  values, the scales and out, writes out (9 bytes per element + 4 per block).

It reports time (median), GB/s (those bytes / time) and the ratio to the copy's
GB/s at that size. Results: ``benchmarks/results/kernels_quant_<device>.json``
and ``.md`` (``--out`` names the adam file; the quant file goes next to it).

Section ``sparse`` (sparse outer communication; 64M elements by default, 64M and
256M on GPU), chunks of 4096, top 64 per chunk, 2-bit values: the native
``sparse_pack`` (select, quantize, pack, residual in one pass per chunk) and
``sparse_unpack_accumulate`` vs the torch path a user would write: ``torch.topk``
of ``|e|`` on a [chunks, 4096] view, the kept indices sorted, quantized and packed
4 codes a byte with torch ops, the residual scattered back; unpack: codes shifted
out, levels, ``scatter_add_``. Also the receiver's whole step at a sync of two
replicas, ``sparse_average`` of two payloads (weights 4096 and 2048) against the
torch path ``out.zero_()``, unpack, unpack, ``out.div_``. Before timing, both
paths pack the same data and their indices, codes and residuals are compared
(equal on these tie-free values), and their averages too.
Also timed: ``dst.copy_(src)`` of the fp32 tensor. Results:
``benchmarks/results/kernels_sparse_<device>.json`` and ``.md``.
"""

import argparse
import csv
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAM = dict(step=10, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.5, adamw=True)


def parse_size(text):
    text = text.strip().upper()
    for suffix, mult in (("K", 2**10), ("M", 2**20), ("G", 2**30)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * mult)
    return int(text)


def sync(device):
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def timeit(fn, device, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def copy_time(n, device, repeats):
    """Median time of ``dst.copy_(src)`` for fp32 tensors of ``n`` elements (reads and writes 4 bytes each)."""
    import torch
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    return timeit(lambda: dst.copy_(src), device, repeats)


def extra_memory(fn, device):
    """Bytes a call allocates beyond what exists before it."""
    import torch
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def machine(device, threads):
    import torch
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
                 platform.processor())
    return f"{model}, {os.cpu_count()} cores, {threads} threads (torch {torch.__version__})"


def unfused_peek(master, grad, m, v, out):
    """What a Peek costs without the fused kernel: save, step in place, cast-copy, restore."""
    from acco_ds.ops import reference
    saved = master.clone(), m.clone(), v.clone()
    reference.adamw_update(master, grad, m, v, out, commit=True, **ADAM)
    master.copy_(saved[0])
    m.copy_(saved[1])
    v.copy_(saved[2])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default=None,
                   help="comma-separated element counts, e.g. 1M,4M,64M, for both sections (default: adam 1M..64M, "
                        "quant 1M..16M on CPU; 1M..256M on GPU)")
    p.add_argument("--section", default="all", choices=["all", "adam", "quant", "sparse"],
                   help="adam: the AdamW kernels; quant: quantize_pack / dequantize_accumulate; sparse: sparse_pack / "
                        "sparse_unpack_accumulate; all: the three")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch and the op's OpenMP)")
    p.add_argument("--out", default=None, help="results file, .json or .csv (default: "
                   "benchmarks/results/kernels_<device>.json, with the table next to it as .md)")
    args = p.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before the op's OpenMP runtime starts

    import torch
    sys.path.insert(0, str(ROOT))
    from acco_ds import ops

    dev = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    default_sizes = "1M,4M,16M,64M,256M" if dev == "cuda" else "1M,4M,16M,64M"
    sizes = [parse_size(s) for s in (args.sizes or default_sizes).split(",")]
    native = ops.load_kernels("native", dev)
    command = shlex.join(["python", "benchmarks/kernels.py", *sys.argv[1:]])
    path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"kernels_{dev}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.section in ("all", "adam"):
        adam_section(args, dev, threads, sizes, native, command, path)
    if args.section in ("all", "quant"):
        quant_sizes = [parse_size(s) for s in (args.sizes or ("1M,4M,16M,64M,256M" if dev == "cuda" else "1M,4M,16M"))
                       .split(",")]
        quant_section(args, dev, threads, quant_sizes, native, command,
                      path.with_name(f"{path.stem.replace('kernels', 'kernels_quant', 1)}{path.suffix}"))
    if args.section in ("all", "sparse"):
        sparse_sizes = [parse_size(s) for s in (args.sizes or ("64M,256M" if dev == "cuda" else "64M")).split(",")]
        sparse_section(args, dev, threads, sparse_sizes, native, command,
                       path.with_name(f"{path.stem.replace('kernels', 'kernels_sparse', 1)}{path.suffix}"))


def write_results(path, rows, text, meta):
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    path.with_suffix(".md").write_text(text)
    print(f"results: {path} (table: {path.with_suffix('.md')})")


def adam_section(args, dev, threads, sizes, native, command, path):
    import torch
    from acco_ds.ops import reference

    # The machine's copy bandwidth, on tensors far larger than any cache.
    big = (256 if dev == "cuda" else 64) * 2**20
    copy_bw = 8 * big / copy_time(big, dev, args.repeats)

    rows = []
    for n in sizes:
        g = torch.Generator(device=dev).manual_seed(0)
        master, grad = torch.randn(n, device=dev, generator=g), torch.randn(n, device=dev, generator=g)
        m, v = torch.zeros(n, device=dev), torch.rand(n, device=dev, generator=g) * 1e-3
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
        cases = {
            # name: (fused, unfused, bytes that must move)
            "peek": (lambda: native.adamw_update(master, grad, m, v, out, commit=False, **ADAM),
                     lambda: unfused_peek(master, grad, m, v, out), (16 + 2) * n),
            "commit": (lambda: native.adamw_update(master, grad, m, v, out, commit=True, **ADAM),
                       lambda: reference.adamw_update(master, grad, m, v, out, commit=True, **ADAM), (28 + 2) * n),
        }
        for name, (fused, unfused, nbytes) in cases.items():
            row = {"size": n, "kernel": name, "bytes": nbytes, "copy_GBps": copy_bw / 1e9}
            for variant, fn in (("fused", fused), ("torch", unfused)):
                t = timeit(fn, dev, args.repeats)
                row[f"{variant}_ms"] = 1e3 * t
                row[f"{variant}_GBps"] = nbytes / t / 1e9
                row[f"{variant}_pct_copy"] = 100 * nbytes / t / copy_bw
                row[f"{variant}_extra_MB"] = extra_memory(fn, dev) / 2**20
            rows.append(row)
            print(f"{n / 2**20:6.0f}M {name:<7} fused {row['fused_ms']:9.2f} ms {row['fused_GBps']:6.1f} GB/s "
                  f"({row['fused_pct_copy']:3.0f}% of copy) | torch {row['torch_ms']:9.2f} ms "
                  f"{row['torch_GBps']:6.1f} GB/s | extra MB fused {row['fused_extra_MB']:.1f} torch "
                  f"{row['torch_extra_MB']:.1f}", flush=True)

    header = (f"{machine(dev, threads)}; kernels {native.name}; median of {args.repeats}.\n"
              f"Copy bandwidth (`dst.copy_(src)`, {big // 2**20}M fp32): {copy_bw / 1e9:.1f} GB/s.\n"
              f"Command: `{command}`")
    table = ["| size | kernel | native ms | native GB/s | % of copy | torch ms | torch GB/s | % of copy | speedup | "
             "extra MB fused / torch |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['size'] / 2**20:g}M | {r['kernel']} | {r['fused_ms']:.2f} | {r['fused_GBps']:.1f} | "
                     f"{r['fused_pct_copy']:.0f}% | {r['torch_ms']:.2f} | {r['torch_GBps']:.1f} | "
                     f"{r['torch_pct_copy']:.0f}% | {r['torch_ms'] / r['fused_ms']:.1f}x | "
                     f"{r['fused_extra_MB']:.0f} / {r['torch_extra_MB']:.0f} |")
    text = header + "\n\n" + "\n".join(table) + "\n"
    print("\n" + text)

    write_results(path, rows, text, {"machine": machine(dev, threads), "command": command, "copy_GBps": copy_bw / 1e9,
                                     "repeats": args.repeats, "kernels": native.name})


def quant_section(args, dev, threads, sizes, native, command, path):
    """quantize_pack (int8, fp8; fp32 residual) and dequantize_accumulate (into fp32), native vs the torch
    reference, each against a plain fp32 copy of the same size."""
    import torch
    from acco_ds.ops import reference

    block = 256
    rows = []
    for n in sizes:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, device=dev, generator=g)
        residual = torch.randn(n, device=dev, generator=g) * 1e-3
        out = torch.zeros(n, device=dev)
        scales = torch.empty(reference.num_blocks(n, block), device=dev)
        copy_s = copy_time(n, dev, args.repeats)
        copy_bw = 8 * n / copy_s
        nb = reference.num_blocks(n, block)
        cases = {}
        qs = {}
        for wire in ("int8", "fp8"):
            qs[wire] = q = torch.empty(n, dtype=reference.WIRE_DTYPES[wire], device=dev)
            cases[f"quantize {wire}"] = (
                lambda q=q: native.quantize_pack(x, residual, q, scales, block_size=block),
                lambda q=q: reference.quantize_pack(x, residual, q, scales, block_size=block), 13 * n + 4 * nb)
        native.quantize_pack(x, residual, qs["int8"], scales, block_size=block)  # realistic values to add
        cases["dequantize int8"] = (
            lambda: native.dequantize_accumulate(qs["int8"], scales, out, block_size=block),
            lambda: reference.dequantize_accumulate(qs["int8"], scales, out, block_size=block), 9 * n + 4 * nb)
        rows.append({"size": n, "kernel": "copy", "bytes": 8 * n, "copy_ms": 1e3 * copy_s,
                     "copy_GBps": copy_bw / 1e9})
        print(f"{n / 2**20:6.0f}M copy            {1e3 * copy_s:9.2f} ms {copy_bw / 1e9:6.1f} GB/s", flush=True)
        for name, (fused, unfused, nbytes) in cases.items():
            row = {"size": n, "kernel": name, "bytes": nbytes, "copy_ms": 1e3 * copy_s, "copy_GBps": copy_bw / 1e9}
            for variant, fn in (("native", fused), ("torch", unfused)):
                t = timeit(fn, dev, args.repeats)
                row[f"{variant}_ms"] = 1e3 * t
                row[f"{variant}_GBps"] = nbytes / t / 1e9
                row[f"{variant}_vs_copy"] = nbytes / t / copy_bw
                row[f"{variant}_extra_MB"] = extra_memory(fn, dev) / 2**20
            rows.append(row)
            print(f"{n / 2**20:6.0f}M {name:<15} native {row['native_ms']:9.2f} ms {row['native_GBps']:6.1f} GB/s "
                  f"({row['native_vs_copy']:.2f}x copy) | torch {row['torch_ms']:9.2f} ms "
                  f"{row['torch_GBps']:6.1f} GB/s ({row['torch_vs_copy']:.2f}x copy)", flush=True)

    header = (f"{machine(dev, threads)}; kernels {native.name}; median of {args.repeats}; blocks of {block}.\n"
              f"GB/s: bytes that must move / time (quantize: 13 B/element + 4 B/block, dequantize: 9 B/element "
              f"+ 4 B/block, copy: 8 B/element); x copy: that over `dst.copy_(src)` of an fp32 tensor of the "
              f"same size.\nCommand: `{command}`")
    table = ["| size | kernel | native ms | native GB/s | x copy | torch ms | torch GB/s | x copy | speedup | "
             "extra MB native / torch |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kernel"] == "copy":
            table.append(f"| {r['size'] / 2**20:g}M | copy (`dst.copy_(src)`, fp32) | {r['copy_ms']:.2f} | "
                         f"{r['copy_GBps']:.1f} | 1.00 | | | | | |")
            continue
        table.append(f"| {r['size'] / 2**20:g}M | {r['kernel']} | {r['native_ms']:.2f} | {r['native_GBps']:.1f} | "
                     f"{r['native_vs_copy']:.2f} | {r['torch_ms']:.2f} | {r['torch_GBps']:.1f} | "
                     f"{r['torch_vs_copy']:.2f} | {r['torch_ms'] / r['native_ms']:.1f}x | "
                     f"{r['native_extra_MB']:.0f} / {r['torch_extra_MB']:.0f} |")
    text = header + "\n\n" + "\n".join(table) + "\n"
    print("\n" + text)
    write_results(path, rows, text, {"machine": machine(dev, threads), "command": command, "block_size": block,
                                     "repeats": args.repeats, "kernels": native.name})


SPARSE = dict(chunk=4096, topk=64, value_bits=2)


def torch_sparse_pack(e, chunk, topk, value_bits):
    """The torch path: top-k of |e| per chunk (a [chunks, chunk] view), quantize, pack 8 // b codes a byte,
    residual e[kept] -= q. (torch.topk orders ties as it likes: the contract's tie rule is not kept here.)"""
    import torch
    rows = e.view(-1, chunk)
    idx = rows.abs().topk(topk, dim=1, sorted=False).indices.sort(dim=1).values
    v = rows.gather(1, idx)
    m = v.abs().amax(dim=1, keepdim=True)
    top = float(2**value_bits - 1)
    codes = ((v / m + 1.0) * (0.5 * top)).round_().clamp_(0, top)
    rows.scatter_(1, idx, v - m * ((2.0 * codes) / top - 1.0))
    per_byte = 8 // value_bits
    shifts = torch.arange(0, 8, value_bits, dtype=torch.uint8, device=e.device)
    packed = (codes.to(torch.uint8).view(rows.shape[0], -1, per_byte) << shifts).sum(dim=2, dtype=torch.uint8)
    return idx.to(torch.int16).view(-1), packed.view(-1), m.view(-1)


def torch_sparse_unpack(out, indices, values, scales, chunk, topk, value_bits, weight=1.0):
    import torch
    shifts = torch.arange(0, 8, value_bits, dtype=torch.uint8, device=out.device)
    codes = ((values.view(-1, topk * value_bits // 8, 1) >> shifts) & (2**value_bits - 1)).view(-1, topk)
    m = scales.view(-1, 1)
    q = m * ((2.0 * codes.float()) / float(2**value_bits - 1) - 1.0)
    out.view(-1, chunk).scatter_add_(1, indices.view(-1, topk).long(), q * weight)


def sparse_section(args, dev, threads, sizes, native, command, path):
    """sparse_pack / sparse_unpack_accumulate / sparse_average (chunk 4096, top 64, 2 bits), native vs the torch
    path."""
    import torch
    from acco_ds.ops import reference

    chunk, topk, bits = SPARSE["chunk"], SPARSE["topk"], SPARSE["value_bits"]
    kw = dict(topk=topk, value_bits=bits)
    rows = []
    for n in sizes:
        n -= n % chunk
        offsets = reference.chunk_offsets([n], chunk).to(dev)
        g = torch.Generator(device=dev).manual_seed(0)
        e = torch.randn(n, device=dev, generator=g)
        # The same work: both paths pack the same data to the same payload and residual.
        e_native, e_torch = e.clone(), e.clone()
        got = native.sparse_pack(e_native, offsets, **kw)
        want = torch_sparse_pack(e_torch, chunk, topk, bits)
        agree = all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(e_native, e_torch)
        if not agree:
            raise RuntimeError("the native and torch sparse packs differ on tie-free data: fix before timing")
        del e_native, e_torch
        out = torch.zeros(n, device=dev)
        # The receiver's whole step at a sync of R = 2 replicas: the weighted average of both payloads.
        other = torch.randn(n, device=dev, generator=g)
        got2, want2 = native.sparse_pack(other.clone(), offsets, **kw), torch_sparse_pack(other, chunk, topk, bits)
        del other
        weights = [4096.0, 2048.0]

        def torch_average():
            out.zero_()
            for payload, w in zip((want, want2), weights):
                torch_sparse_unpack(out, *payload, chunk, topk, bits, weight=w)
            out.div_(out.new_tensor(sum(weights)))  # as the reference: a Python scalar is a reciprocal on CUDA

        native.sparse_average(out, offsets, [got, got2], weights, **kw)
        expected = out.clone()
        torch_average()
        if not torch.equal(out, expected):
            raise RuntimeError("the native and torch sparse averages differ: fix before timing")
        del expected
        cases = {
            "sparse_pack": (lambda: native.sparse_pack(e, offsets, **kw),
                            lambda: torch_sparse_pack(e, chunk, topk, bits)),
            "sparse_unpack_accumulate": (
                lambda: native.sparse_unpack_accumulate(out, offsets, *got, **kw, weight=0.5),
                lambda: torch_sparse_unpack(out, *want, chunk, topk, bits, weight=0.5)),
            "sparse_average (2 payloads)": (
                lambda: native.sparse_average(out, offsets, [got, got2], weights, **kw), torch_average),
        }
        copy_s = copy_time(n, dev, args.repeats)
        payload = reference.sparse_payload_bytes(offsets.cpu(), topk, bits)
        rows.append({"size": n, "kernel": "copy", "copy_ms": 1e3 * copy_s})
        print(f"{n / 2**20:6.0f}M copy                     {1e3 * copy_s:9.2f} ms", flush=True)
        for name, (fused, unfused) in cases.items():
            row = {"size": n, "kernel": name, "payload_bytes": payload, "copy_ms": 1e3 * copy_s}
            for variant, fn in (("native", fused), ("torch", unfused)):
                t = timeit(fn, dev, args.repeats)
                row[f"{variant}_ms"] = 1e3 * t
                row[f"{variant}_elements_per_s"] = n / t
                row[f"{variant}_extra_MB"] = extra_memory(fn, dev) / 2**20
            rows.append(row)
            print(f"{n / 2**20:6.0f}M {name:<24} native {row['native_ms']:9.2f} ms | torch {row['torch_ms']:9.2f} ms "
                  f"| {row['torch_ms'] / row['native_ms']:.1f}x", flush=True)

    header = (f"{machine(dev, threads)}; kernels {native.name}; median of {args.repeats}; chunk {chunk}, top {topk}, "
              f"{bits}-bit values (payload {payload / n:.4f} B/element). Before timing, the native and torch packs "
              f"gave the same indices, codes, scales and residual, and the same average of two payloads.\nCommand: `{command}`")
    table = ["| size | kernel | native ms | torch ms | speedup | copy ms | native Melem/s | extra MB native / torch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kernel"] == "copy":
            continue
        table.append(f"| {r['size'] / 2**20:g}M | {r['kernel']} | {r['native_ms']:.2f} | {r['torch_ms']:.2f} | "
                     f"{r['torch_ms'] / r['native_ms']:.1f}x | {r['copy_ms']:.2f} | "
                     f"{r['native_elements_per_s'] / 1e6:.0f} | "
                     f"{r['native_extra_MB']:.0f} / {r['torch_extra_MB']:.0f} |")
    text = header + "\n\n" + "\n".join(table) + "\n"
    print("\n" + text)
    write_results(path, rows, text, {"machine": machine(dev, threads), "command": command, **SPARSE,
                                     "repeats": args.repeats, "kernels": native.name})


if __name__ == "__main__":
    main()
