"""Builders of the native ops, as DeepSpeed builds its own (``ops/op_builder``).

JIT: ``ACCOCPUOpBuilder().load()`` compiles ``csrc/`` with ninja through
DeepSpeed's ``OpBuilder.jit_load`` (cached in torch's extension directory,
so a later run only loads it). AOT: ``ACCO_BUILD_OPS=1 pip install .`` builds
the same sources through ``builder()`` in setup.py; ``load()`` imports that
module first.
"""

import importlib
import os
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder


def csrc_dir() -> Path:
    """``csrc/`` next to the package in a checkout, or inside it when installed."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "csrc", here / "csrc"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"acco_ds kernel sources (csrc/) not found next to {here}")


class _AOTFirst:
    """``load()`` that prefers a module built ahead of time by setup.py."""

    def absolute_name(self):
        return f"acco_ds.ops.{self.NAME}_op"

    def load(self, verbose=False):
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        try:
            module = importlib.import_module(self.absolute_name())
        except ImportError:
            return self.jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module

    def include_paths(self):
        return [str(csrc_dir())]


class ACCOCPUOpBuilder(_AOTFirst, CPUOpBuilder):
    NAME = "acco_cpu_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def sources(self):
        return [str(csrc_dir() / "bindings" / "acco_cpu_ops.cpp")]

    def cxx_args(self):
        # No FMA contraction: keep torch.optim's rounding of each operation.
        return super().cxx_args() + ["-ffp-contract=off", "-std=c++17"]

    def is_compatible(self, verbose=False):
        return super().is_compatible(verbose)


class ACCOCUDAOpBuilder(_AOTFirst, CUDAOpBuilder):
    NAME = "acco_cuda_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def sources(self):
        return [str(csrc_dir() / "bindings" / "acco_cuda_ops.cpp"), str(csrc_dir() / "cuda" / "acco_cuda_kernels.cu")]

    def is_compatible(self, verbose=False):
        import torch
        if not torch.cuda.is_available() and os.environ.get("ACCO_BUILD_CUDA", "0") != "1":
            self.warning(f"{self.NAME}: no CUDA device (set ACCO_BUILD_CUDA=1 to build anyway)")
            return False
        return super().is_compatible(verbose)


BUILDERS = {"cpu": ACCOCPUOpBuilder, "cuda": ACCOCUDAOpBuilder}
