"""Host (CPU) memory: return freed gradient buffers to the operating system.

Each backward allocates every parameter's gradient, ACCO adds it into the flat
accumulator and frees it at once. glibc's malloc serves large blocks with
mmap, but raises its mmap threshold after each such free (up to 32 MiB), so
later gradients of that size come from the heap and their pages stay resident
after the free: on a CPU rank the process grows by about one model-sized set
of gradients that no tensor holds (measured: benchmarks/memory.py --workload
states). Pinning the threshold keeps large blocks on mmap, so a free returns
them. Stock ZeRO-1 keeps its gradients alive instead, so it does not churn.

Only for CPU training on glibc, and only when the user has not chosen a
threshold (``MALLOC_MMAP_THRESHOLD_``); GPU tensors do not live in this heap.
"""

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
DEFAULT_THRESHOLD = 4 << 20  # blocks of 4 MiB and more go to mmap: gradients, not small activations


def pin_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold; returns whether it was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or os.name != "posix":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to pin
        return False


__all__ = ["pin_mmap_threshold"]
