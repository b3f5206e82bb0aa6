"""CI has no GPU: compile the CUDA kernels with nvcc (compile only) for sm_80 and sm_90."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc"] if os.path.exists(p)), None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_kernels_compile(arch, tmp_path):
    cmd = [NVCC, "-c", "-std=c++17", "-O3", f"-arch={arch}", str(ROOT / "csrc/cuda/acco_cuda_kernels.cu"), "-o",
           str(tmp_path / f"acco_{arch}.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / f"acco_{arch}.o").stat().st_size > 0
