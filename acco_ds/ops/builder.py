"""Builders of the native ops, in the manner of DeepSpeed's ``op_builder``.

JIT: ``AccoCPUOpBuilder().load()`` compiles ``csrc/`` with ninja through
DeepSpeed's ``OpBuilder.jit_load`` (cached under torch's extension directory,
``~/.cache/torch_extensions`` unless ``TORCH_EXTENSIONS_DIR`` is set, so a
later process only loads the .so). AOT: ``ACCO_BUILD_OPS=1 pip install
--no-build-isolation .`` builds the same sources through ``builder()`` in
setup.py; ``load()`` imports that module first and JIT-builds only without it.

This module imports nothing from acco_ds, so that setup.py can load it alone.
"""

import importlib
import os
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

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
            return self.jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module


class AccoCPUOpBuilder(_AccoOpBuilder, CPUOpBuilder):
    BUILD_VAR = "ACCO_BUILD_OPS"
    NAME = "acco_cpu_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def sources(self):
        return [str(csrc_dir() / "bindings" / "acco_cpu_ops.cpp"), str(csrc_dir() / "cpu" / "acco_cpu.cpp")]

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
        return [str(csrc_dir() / "bindings" / "acco_cuda_ops.cpp"), str(csrc_dir() / "cuda" / "acco_cuda_kernels.cu")]

    def nvcc_args(self):
        # DeepSpeed builds with --use_fast_math (approximate sqrt and division, flushed
        # denormals); the update must round like torch, so drop it and fuse only the
        # explicit fmaf calls (-fmad=false).
        args = [a for a in super().nvcc_args() if a != "--use_fast_math"]
        return args + ["-fmad=false"] if args else args

    def is_compatible(self, verbose=False):
        import torch
        if not torch.cuda.is_available() and os.environ.get("ACCO_BUILD_CUDA", "0") != "1":
            self.error_log = "torch.cuda.is_available() is False (set ACCO_BUILD_CUDA=1 to build anyway)"
            return False
        return super().is_compatible(verbose)


BUILDERS = {"cpu": AccoCPUOpBuilder, "cuda": AccoCUDAOpBuilder}

