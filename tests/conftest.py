"""Shared test helpers: launching multi-rank programs under mpiexec."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def mpi_env() -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", NCCL_NVLS_ENABLE="0",
               PYTHONUNBUFFERED="1")
    return env


def run_mpi(n: int, args: list[str], timeout: float = 300, launcher_args=()) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python -m mpi4py args...`` from the repo root; fail the test on a timeout."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (install the mpich wheel: make test does)")
    # python -m mpi4py: an exception on one rank aborts the whole job instead of hanging the others
    cmd = [mpiexec, *launcher_args, "-n", str(n), sys.executable, "-m", "mpi4py", *args]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s\n{exc.stdout}\n{exc.stderr}")


def visible_gpus() -> int:
    """CUDA devices cupy sees here (0 without cupy or a driver)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def needs_gpus(n: int):
    """Marks for a test that needs ``n`` GPUs: skipped with the reason on smaller machines."""
    return [pytest.mark.gpu, pytest.mark.skipif(visible_gpus() < n, reason=f"needs {n} GPU" + ("s" if n > 1 else ""))]


@pytest.fixture
def mpirun():
    return run_mpi
