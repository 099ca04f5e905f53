"""cuda_src/staging.cuh's warp-level data movement, run on the CPU: tests/host/staging_check.cpp
compiled with the host C++ compiler against tests/host/warp_host.h (a warp as 32 threads,
`__syncwarp` a barrier), under ThreadSanitizer where the compiler has it, so that a lane reading
shared memory before the warp's barrier is a reported race. What a GPU run adds: the real
`cp.async`, timing, and the kernels around these helpers (tools/gpu_suite.sh)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from echonccl import kernel_table as kt

HERE = Path(__file__).parent / "host"
CUDA_SRC = Path(__file__).parent.parent / "cuda_src"
CXX = shutil.which("g++") or shutil.which("clang++")


def _build(tmp_path: Path, sanitize: bool) -> subprocess.CompletedProcess:
    cmd = [CXX, "-std=c++20", "-O1", "-g", "-pthread", "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Werror",
           f"-I{HERE}", f"-I{CUDA_SRC}", f"-DECHO_BLOCK={kt.BLOCK}", str(HERE / "staging_check.cpp"),
           "-o", str(tmp_path / "staging_check")]
    if sanitize:
        cmd.insert(1, "-fsanitize=thread")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler")
def test_staging_helpers_on_the_host(tmp_path):
    built = _build(tmp_path, sanitize=True)
    sanitized = built.returncode == 0
    if not sanitized:   # a compiler without ThreadSanitizer's runtime: the values are still checked
        built = _build(tmp_path, sanitize=False)
    assert built.returncode == 0, built.stderr[-4000:]
    run = subprocess.run([str(tmp_path / "staging_check")], capture_output=True, text=True, timeout=300)
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert run.stdout.strip().endswith("0 failed"), run.stdout
