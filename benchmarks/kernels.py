"""Microbenchmarks of the acco_ds kernels: fused vs the unfused torch sequence.

    python benchmarks/kernels.py                       # CPU: 1M..64M elements
    python benchmarks/kernels.py --device cuda         # GPU: 1M..256M elements

For each size it times
* peek:   fused ``adamw_update(commit=False)`` into a bf16 send buffer, vs the
          naive sequence (clone θ, m, v; AdamW step on the clones; cast-copy into
          the send buffer; the originals stay as they were = restore);
* commit: fused ``adamw_update(commit=True)`` vs the same step with torch ops;
* pack:   one multi-tensor ``pack`` of 64 bf16 gradients into a flat fp32
          accumulator, vs a per-tensor ``flat[o:o+n].add_(t.float() * s)`` loop;
and reports the time, the effective bandwidth (bytes that must move / time),
its ratio to the machine's copy bandwidth measured here
(``dst.copy_(src)``, 2 x 4 bytes per element), and the memory each variant
allocates on top of its inputs (CUDA: peak allocation; CPU: bytes allocated
during the call, from the torch profiler).
"""

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from acco_ds import ops  # noqa: E402
from acco_ds.ops import reference  # noqa: E402

ADAM = dict(step=10, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.5, adamw=True)


def timeit(fn, device, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def extra_memory(fn, device):
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


def machine(device):
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    model = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/ *Model name: *//'"], capture_output=True,
                           text=True).stdout.strip() or platform.processor()
    return f"{model}, {torch.get_num_threads()} threads (torch {torch.__version__})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default=None, help="comma-separated element counts, e.g. 1M,4M,64M")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = args.device
    default = "1M,4M,16M,64M,256M" if dev == "cuda" else "1M,4M,16M,64M"
    sizes = [int(float(s[:-1]) * 2**20) if s.endswith("M") else int(s) for s in (args.sizes or default).split(",")]
    native = ops.load_kernels("native", dev)
    rows = []
    for n in sizes:
        g = torch.Generator(device=dev).manual_seed(0)
        master, grad = torch.randn(n, device=dev, generator=g), torch.randn(n, device=dev, generator=g)
        m, v = torch.zeros(n, device=dev), torch.rand(n, device=dev, generator=g) * 1e-3
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
        src, dst = torch.randn(n, device=dev, generator=g), torch.empty(n, device=dev)
        copy_bw = 8 * n / timeit(lambda: dst.copy_(src), dev, args.repeats)
        sizes_t = [n // 64 + (1 if i < n % 64 else 0) for i in range(64)]
        grads = [torch.randn(s, device=dev, generator=g).bfloat16() for s in sizes_t]
        offsets = [sum(sizes_t[:i]) for i in range(64)]
        flat = torch.zeros(n, device=dev)
        cases = {
            # name: (fused, unfused, bytes that must move)
            "peek": (lambda: native.adamw_update(master, grad, m, v, out, commit=False, **ADAM),
                     lambda: reference.adamw_update(master, grad, m, v, out, commit=False, **ADAM), 16 * n + 2 * n),
            "commit": (lambda: native.adamw_update(master, grad, m, v, out, commit=True, **ADAM),
                       lambda: reference.adamw_update(master, grad, m, v, out, commit=True, **ADAM), 28 * n + 2 * n),
            "pack": (lambda: native.pack(grads, flat, offsets, 0.5, True),
                     lambda: reference.pack(grads, flat, offsets, 0.5, True), 2 * n + 8 * n),
        }
        for name, (fused, unfused, nbytes) in cases.items():
            row = {"size": n, "kernel": name, "copy_GBps": copy_bw / 1e9}
            for variant, fn in (("fused", fused), ("torch", unfused)):
                t = timeit(fn, dev, args.repeats)
                row[f"{variant}_ms"] = 1e3 * t
                row[f"{variant}_GBps"] = nbytes / t / 1e9
                row[f"{variant}_extra_MB"] = extra_memory(fn, dev) / 2**20
            rows.append(row)
            print(f"{n / 2**20:6.0f}M {name:<7} fused {row['fused_ms']:9.2f} ms {row['fused_GBps']:7.1f} GB/s "
                  f"({100 * row['fused_GBps'] / row['copy_GBps']:3.0f}% of copy) | torch {row['torch_ms']:9.2f} ms "
                  f"{row['torch_GBps']:7.1f} GB/s | extra MB fused {row['fused_extra_MB']:.1f} torch "
                  f"{row['torch_extra_MB']:.1f}", flush=True)
    command = "python benchmarks/kernels.py " + " ".join(sys.argv[1:])
    header = f"{machine(dev)}; kernels {native.name}; median of {args.repeats}. Command: `{command}`"
    table = ["| size | kernel | fused ms | fused GB/s | % of copy bw | torch ms | torch GB/s | speedup | "
             "extra MB fused / torch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['size'] / 2**20:.0f}M | {r['kernel']} | {r['fused_ms']:.2f} | {r['fused_GBps']:.1f} | "
                     f"{100 * r['fused_GBps'] / r['copy_GBps']:.0f}% | {r['torch_ms']:.2f} | {r['torch_GBps']:.1f} | "
                     f"{r['torch_ms'] / r['fused_ms']:.1f}x | {r['fused_extra_MB']:.1f} / {r['torch_extra_MB']:.1f} |")
    text = header + f"\n\nCopy bandwidth measured here: {rows[-1]['copy_GBps']:.1f} GB/s (largest size).\n\n" + \
        "\n".join(table) + "\n"
    print("\n" + text)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"kernels_{dev}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
