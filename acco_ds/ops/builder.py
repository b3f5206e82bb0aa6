"""Builders of the native ops, in the manner of DeepSpeed's ``op_builder``.

JIT: ``AccoCPUOpBuilder().load()`` compiles ``csrc/`` with ninja through
DeepSpeed's ``OpBuilder.jit_load`` (cached under torch's extension directory,
``~/.cache/torch_extensions`` unless ``TORCH_EXTENSIONS_DIR`` is set, so a
later process only loads the .so). AOT: ``ACCO_BUILD_OPS=1 pip install
--no-build-isolation .`` builds the same sources through ``builder()`` in
setup.py; ``load()`` imports that module first and JIT-builds only without it.

JIT builds cannot hang on torch's build lock: see ``jit_lock.JitBuildLock``.

This module imports nothing from acco_ds, so that setup.py can load it alone.
"""

import contextlib
import importlib
import os
import re
import threading
from pathlib import Path

# The one DeepSpeed import outside acco_ds/deepspeed/: setup.py loads this file alone, without the
# package. deepspeed/compat.py lists (and checks at start-up) the same names.
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

try:
    from .jit_lock import *  # noqa: F401,F403 - re-exported: the lock is part of how ops load
    from .jit_lock import JitBuildLock
except ImportError:  # loaded alone by setup.py (no package): load the sibling file the same way
    import importlib.util as _util
    _spec = _util.spec_from_file_location("acco_ds_jit_lock", Path(__file__).with_name("jit_lock.py"))
    _jit_lock = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_jit_lock)
    JitBuildLock = _jit_lock.JitBuildLock

_baton_patch = threading.RLock()


@contextlib.contextmanager
def bounded_torch_baton():
    """Within: torch's JIT builds take their lock through ``JitBuildLock`` (owner record, bounded wait).

    ``torch.utils.cpp_extension`` looks ``FileBaton`` up at build time, so swapping that name covers the
    race where another process takes the lock between our own ``JitBuildLock.wait`` and torch's
    ``try_acquire``; torch then waits through ``JitBuildLock.wait`` instead of forever.
    """
    import torch.utils.cpp_extension as cpp_extension
    original = getattr(cpp_extension, "FileBaton", None)
    if original is None:  # a torch that builds differently: our own wait before the build still applies
        yield
        return

    class BoundedFileBaton(original):

        def __init__(self, lock_file_path, *args, **kwargs):
            super().__init__(lock_file_path, *args, **kwargs)
            self._acco_lock = JitBuildLock(os.path.dirname(lock_file_path))

        def try_acquire(self):
            acquired = super().try_acquire()
            if acquired:
                self._acco_lock.record_owner()
            return acquired

        def release(self):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._acco_lock.owner_path)
            super().release()

        def wait(self):
            self._acco_lock.wait()

    with _baton_patch:
        cpp_extension.FileBaton = BoundedFileBaton
        try:
            yield
        finally:
            cpp_extension.FileBaton = original


_MARKER = "acco_common.h"


def csrc_dir() -> Path:
    """The kernel sources: copied into the package by setup.py, or ``csrc/`` of a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parents[1] / "csrc"):
        if (candidate / _MARKER).is_file():
            return candidate
    raise FileNotFoundError(f"acco_ds kernel sources (csrc/{_MARKER}) not found in {here / 'csrc'} "
                            f"or {here.parents[1] / 'csrc'}")


class _AccoOpBuilder:
    """What both builders share: module names, include path, AOT-first ``load()``."""

    NAME = None

    def absolute_name(self):
        return f"acco_ds.ops.{self.NAME}_op"

    def include_paths(self):
        return [str(csrc_dir())]

    def aot_module(self):
        """The module setup.py built ahead of time, or None."""
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError:  # not built, or built against another torch (undefined symbols)
            return None

    def load(self, verbose=False):
        # DeepSpeed's load() consults its own installed_ops table, which knows nothing of
        # acco_ds; import our AOT module directly and JIT-build only if it is absent.
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = self.aot_module()
        if module is None:
            return self.guarded_jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module

    def guarded_jit_load(self, verbose=False):
        """``jit_load`` that cannot hang on torch's build lock (see ``JitBuildLock``): a stale lock is
        cleared, a live build by another process (another rank) is waited for at most
        ``ACCO_JIT_WAIT_S`` seconds, then ``JitLockTimeout``."""
        JitBuildLock.for_op(self.name).wait()
        with bounded_torch_baton():
            return self.jit_load(verbose)


class AccoCPUOpBuilder(_AccoOpBuilder, CPUOpBuilder):
    BUILD_VAR = "ACCO_BUILD_OPS"
    NAME = "acco_cpu_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def sources(self):
        return [str(csrc_dir() / "bindings" / "acco_cpu_ops.cpp"), str(csrc_dir() / "cpu" / "acco_cpu.cpp"),
                str(csrc_dir() / "cpu" / "acco_sparse_cpu.cpp")]

    def cxx_args(self):
        # -ffp-contract=off: fuse no multiply-add that torch does not fuse (bit-exact m, v).
        # -fno-math-errno: sqrtf need not set errno, so the AdamW loop vectorizes.
        return super().cxx_args() + ["-ffp-contract=off", "-fno-math-errno"]


class AccoCUDAOpBuilder(_AccoOpBuilder, CUDAOpBuilder):
    BUILD_VAR = "ACCO_BUILD_OPS"
    NAME = "acco_cuda_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def sources(self):
        return [str(csrc_dir() / "bindings" / "acco_cuda_ops.cpp"), str(csrc_dir() / "cuda" / "acco_cuda_kernels.cu"),
                str(csrc_dir() / "cuda" / "acco_sparse_kernels.cu")]

    def nvcc_args(self):
        # DeepSpeed builds with --use_fast_math (approximate sqrt and division, flushed
        # denormals); the update must round like torch, so drop it and fuse only the
        # explicit fmaf calls (-fmad=false).
        args = [a for a in super().nvcc_args() if a != "--use_fast_math"]
        return args + ["-fmad=false"] if args else args

    def jit_load(self, verbose=True):
        with plain_arch_list():
            return super().jit_load(verbose)

    def builder(self):
        with plain_arch_list():
            return super().builder()

    def is_compatible(self, verbose=False):
        import torch
        if not torch.cuda.is_available() and os.environ.get("ACCO_BUILD_CUDA", "0") != "1":
            self.error_log = "torch.cuda.is_available() is False (set ACCO_BUILD_CUDA=1 to build anyway)"
            return False
        return super().is_compatible(verbose)


@contextlib.contextmanager
def plain_arch_list():
    """``TORCH_CUDA_ARCH_LIST`` without arch-specific suffixes ("9.0a" -> "9.0") while DeepSpeed reads it.

    torch accepts "9.0a" (sm_90a, for Hopper-only instructions) and CUDA images set it; DeepSpeed 0.19 parses
    each entry as integers and fails on it ("invalid literal for int() with base 10: '0a'"). These kernels use
    no arch-specific instruction, so the plain architecture builds the same code."""
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if saved:
        plain = []
        for entry in saved.replace(" ", ";").split(";"):
            m = re.fullmatch(r"(\d+)\.(\d+)[a-z]*(\+PTX)?", entry.strip())
            cc = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}" if m else entry.strip()
            if cc and cc not in plain:
                plain.append(cc)
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(plain)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


BUILDERS = {"cpu": AccoCPUOpBuilder, "cuda": AccoCUDAOpBuilder}

