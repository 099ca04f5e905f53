"""Shared test helpers: launching multi-rank programs (through tools/launch.py), GPU marks."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import launch
from launch import ROOT  # noqa: F401  (re-exported for the tests)


def run_mpi(n: int, args: list[str], timeout: float = 300, launcher_args=(), *, extra_env=None,
            clean: bool = False, abort_on_error: bool = True, cwd=ROOT) -> subprocess.CompletedProcess:
    """`launch.run` for a test: ``mpiexec -n n python -m mpi4py args...`` from ``cwd`` (the repo
    root); skipped without an mpiexec, failed (with its output) when it runs past ``timeout``."""
    if launch.find_mpiexec() is None:
        pytest.skip("no mpiexec (install the mpich wheel: make test does)")
    try:
        return launch.run(n, args, extra_env=extra_env, clean=clean, launcher_args=launcher_args,
                          abort_on_error=abort_on_error, cwd=cwd, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(map(str, exc.cmd))} hung for {timeout} s\n{exc.stdout}\n{exc.stderr}")


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


def _echonccl_dir() -> tuple[Path, bool]:
    """Where the imported echonccl is, and whether that is this checkout."""
    import echonccl

    where = Path(echonccl.__file__).resolve().parent
    return where, where.is_relative_to(ROOT)


def pytest_configure(config):
    # NVLink multicast off in this process too, as in everything the launcher starts
    os.environ["NCCL_NVLS_ENABLE"] = launch.FIXED["NCCL_NVLS_ENABLE"]
    # one nvcc compile per run, shared by the compile tests and the wheel they build (echonccl.build)
    os.environ.setdefault("ECHONCCL_DEV_NVCC_CACHE", str(ROOT / "build" / "nvcc-cache"))
    where, inside = _echonccl_dir()
    if launch.installed_mode() and inside:
        raise pytest.UsageError(f"ECHONCCL_DEV_INSTALLED=1 but echonccl is imported from the checkout ({where}): "
                                f"run pytest from outside {ROOT} (tools/gpu_suite.sh does)")


def pytest_report_header(config):
    where, inside = _echonccl_dir()
    return f"echonccl: {where} ({'this checkout' if inside else 'installed'})"
