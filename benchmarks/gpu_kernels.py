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
