"""acco_ds: ACCO ("Accumulate While You Communicate") for DeepSpeed.

    pip install .                      # ops are JIT-built on first use (ninja)
    ACCO_BUILD_OPS=1 pip install .     # build the native ops ahead of time, as DeepSpeed's DS_BUILD_OPS
    ACCO_BUILD_OPS=1 ACCO_BUILD_CUDA=1 pip install .   # also the CUDA op without a visible GPU
"""

import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package so that an installed acco_ds can JIT-build its ops."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "acco_ds" / "ops" / "csrc"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(ROOT / "csrc", target)


def native_extensions():
    if os.environ.get("ACCO_BUILD_OPS", "0") != "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension

    from acco_ds.ops.builder import ACCOCPUOpBuilder, ACCOCUDAOpBuilder
    builders = [ACCOCPUOpBuilder()]
    if torch.cuda.is_available() or os.environ.get("ACCO_BUILD_CUDA", "0") == "1":
        builders.append(ACCOCUDAOpBuilder())
    extensions = []
    for builder in builders:
        ext = builder.builder()
        ext.sources = [os.path.relpath(s, ROOT) for s in ext.sources]  # setuptools wants relative paths
        extensions.append(ext)
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = native_extensions()
cmdclass["build_py"] = BuildPyWithSources

setup(
    name="acco_ds",
    version="0.1.0",
    description="ACCO (Accumulate While You Communicate) for DeepSpeed ZeRO-1",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["acco_ds", "acco_ds.*"]),
    python_requires=">=3.9",
    install_requires=["deepspeed>=0.19,<0.20", "pydantic>=2", "ninja", "hjson", "tqdm"],
    entry_points={"console_scripts": ["acco-ds-run=acco_ds.run:main", "acco-ds=acco_ds.report:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
