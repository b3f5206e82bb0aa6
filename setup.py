"""acco_ds: ACCO ("Accumulate While You Communicate") for DeepSpeed.

    pip install .                      # ops are JIT-built on first use (ninja)
    ACCO_BUILD_OPS=1 pip install --no-build-isolation .   # build the native ops ahead of time,
                                                          # as DeepSpeed's DS_BUILD_OPS (needs torch
                                                          # and deepspeed installed already)
    ACCO_BUILD_OPS=1 ACCO_BUILD_CUDA=1 pip install --no-build-isolation .   # the CUDA op without a visible GPU
"""

import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


# The startup hook: Python runs this .pth's line in every process, which arms a lazy import hook
# that calls acco_ds.patch() when deepspeed is imported (acco_ds/_autopatch.py). It must land in
# site-packages itself, i.e. at the root of the wheel, for regular, wheel and editable installs.
AUTOPATCH_PTH = "acco_ds_autopatch.pth"


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package so that an installed acco_ds can JIT-build its ops, and put
    the startup hook's .pth at the root of build_lib (so at the root of the wheel: site-packages)."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "acco_ds" / "ops" / "csrc"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(ROOT / "csrc", target)
        shutil.copyfile(ROOT / AUTOPATCH_PTH, Path(self.build_lib) / AUTOPATCH_PTH)

    def get_outputs(self, include_bytecode=True):
        return list(super().get_outputs(include_bytecode)) + [str(Path(self.build_lib) / AUTOPATCH_PTH)]


def add_file_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Add ``name`` at the root of ``wheel``, with its line in the wheel's RECORD."""
    import base64
    import hashlib
    import zipfile
    with zipfile.ZipFile(wheel) as zin:
        items = [(info, zin.read(info)) for info in zin.infolist()]
    if any(info.filename == name for info, _ in items):
        return
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    line = f"{name},sha256={digest},{len(data)}\n".encode()
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        zout.writestr(name, data)
        for info, content in items:
            if info.filename.endswith(".dist-info/RECORD"):
                content = line + content
            zout.writestr(info, content)
    os.replace(tmp, wheel)


try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs
    editable_wheel = None
else:
    class EditableWheelWithPth(editable_wheel):
        """``pip install -e .`` (PEP 660): setuptools' editable wheel maps the package to the source
        tree but drops the top-level files of build_lib, so add the startup hook's .pth to it."""

        def run(self):
            wheels = lambda: {p: p.stat().st_mtime_ns for p in Path(self.dist_dir).glob("*.whl")}  # noqa: E731
            before = wheels() if Path(self.dist_dir).is_dir() else {}
            super().run()
            built = [p for p, mtime in wheels().items() if before.get(p) != mtime]
            if not built:
                raise RuntimeError(f"acco_ds: no editable wheel found in {self.dist_dir} to add {AUTOPATCH_PTH} to")
            for wheel in built:
                add_file_to_wheel(wheel, AUTOPATCH_PTH, (ROOT / AUTOPATCH_PTH).read_bytes())


def load_builders():
    """acco_ds/ops/builder.py on its own: importing the acco_ds package is not needed to build it."""
    spec = importlib.util.spec_from_file_location("acco_ds_op_builder", ROOT / "acco_ds" / "ops" / "builder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def want_cuda_op(torch) -> bool:
    """Build the CUDA op too? ACCO_BUILD_CUDA=1 forces it, =0 skips it; otherwise only when torch is a
    CUDA build and nvcc is found (no visible GPU needed: a login node can build for the cluster)."""
    forced = os.environ.get("ACCO_BUILD_CUDA")
    if forced in ("0", "1"):
        return forced == "1"
    from torch.utils.cpp_extension import CUDA_HOME
    return torch.version.cuda is not None and CUDA_HOME is not None \
        and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))


def native_extensions():
    """The ops to build ahead of time: none unless ACCO_BUILD_OPS=1 (they are JIT-built on first use)."""
    if os.environ.get("ACCO_BUILD_OPS", "0") != "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension

    builders = load_builders()
    wanted = [builders.AccoCPUOpBuilder()]
    if want_cuda_op(torch):
        wanted.append(builders.AccoCUDAOpBuilder())
    extensions = []
    for builder in wanted:
        ext = builder.builder()  # CppExtension / CUDAExtension with the builder's sources and flags
        ext.sources = [os.path.relpath(s, ROOT) for s in ext.sources]  # setuptools wants relative paths
        extensions.append(ext)
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = native_extensions()
cmdclass["build_py"] = BuildPyWithSources
if editable_wheel is not None:
    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(
    name="acco_ds",
    version="0.1.0",
    description="ACCO (Accumulate While You Communicate) for DeepSpeed ZeRO-1",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["acco_ds", "acco_ds.*"]),
    python_requires=">=3.9",
    install_requires=["deepspeed>=0.19,<0.20", "pydantic>=2", "ninja", "hjson", "tqdm", "pyzmq>=25"],
    # acco.fault_tolerance (replicas that come and go) runs on torchft; pip install "acco_ds[ft]"
    extras_require={"ft": ["torchft>=0.2,<0.3"]},
    entry_points={"console_scripts": ["acco-ds-run=acco_ds.cli.run:main", "acco-ds=acco_ds.cli.report:main",
                                      "acco-ds-warm=acco_ds.cli.warm:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
