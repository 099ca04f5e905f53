"""Shared test helpers: launching multi-rank programs (through tools/launch.py), several checks
of tests/mpi/*.py in one launch (`CheckLaunches`), GPU marks."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
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


# -- several checks in one launch -----------------------------------------------------------------
@dataclass
class CheckRun:
    """One check's part of a shared launch (`CheckLaunches`): the ``stdout`` and ``stderr`` of the
    launch that ran it, and the ``returncode`` the check earns: 0 when it passed on every rank
    (its ``OK`` line is there) and whatever failed in that launch came after it, in another
    check (which then has its own verdict); else the launch's own status (None: killed, with
    the reason at the end of ``stderr``)."""
    check: str
    returncode: int | None
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """The ends of both streams, for an assertion message."""
        return f"exit status {self.returncode}\n{self.stdout[-4000:]}\n{self.stderr[-4000:]}"

    def warnings(self) -> list[str]:
        """The stderr lines that say "Warning" and are this check's or nobody's: run_checks
        (tests/mpi/mpi_common.py) writes each Python warning as one ``Warning in check NAME``
        line; anything else (a launcher's, a C library's) cannot be told apart and counts for
        every check of the launch."""
        return [ln for ln in self.stderr.splitlines() if "Warning" in ln and
                (ln.startswith(f"Warning in check {self.check} ") or not ln.startswith("Warning in check "))]


class CheckLaunches:
    """Runs the checks of a multi-rank program (tests/mpi/checks.py, tests/mpi/hardening.py) a
    group at a time: ``mpiexec -n N python -m mpi4py PROGRAM CHECK1,CHECK2,... ENGINE`` once per
    (program, ranks, engine, environment, group) in a pytest session, the first time a test asks
    for one of the group's checks, which saves the MPI and Python start-up of every other one.
    Each test then reads its own check's verdict (`CheckRun`).

    A check that fails ends its launch (mpi_common.run_checks): the checks before it have
    passed, the failing one gets the launch's status and output, and the checks after it run
    again in a new launch, so every check still gets a verdict of its own. ``timeout`` holds for
    each check: a launch that prints no new ``OK`` line for that long is killed (its whole
    process group), and the check it was running fails."""

    def __init__(self) -> None:
        self._done: dict[tuple, dict[str, CheckRun]] = {}

    def run(self, n: int, program: str, group, check: str, *, engine: str = "cpu", extra_env=None,
            launcher_args=(), timeout: float = 300) -> CheckRun:
        """``check``'s verdict from the launch of ``group`` (which holds it) on ``n`` ranks;
        ``extra_env`` as `launch.environment` takes it."""
        group = tuple(group)
        assert check in group, (check, group)
        if launch.find_mpiexec() is None:
            pytest.skip("no mpiexec (install the mpich wheel: make test does)")
        key = (program, n, engine, group, tuple(sorted((extra_env or {}).items())), tuple(launcher_args))
        if key not in self._done:
            self._done[key] = self._run_group(n, program, group, engine, extra_env, tuple(launcher_args), timeout)
        return self._done[key][check]

    @staticmethod
    def _run_group(n, program, group, engine, extra_env, launcher_args, timeout) -> dict[str, CheckRun]:
        runs: dict[str, CheckRun] = {}
        todo = list(group)
        while todo:
            rc, out, err = _launch_checks(n, [program, ",".join(todo), engine], extra_env, launcher_args, timeout)
            passed = 0
            while passed < len(todo) and f"OK {todo[passed]} ranks={n} engine={engine}" in out:
                passed += 1
            if passed == len(todo):                # every check passed: a bad status is everyone's
                runs.update((c, CheckRun(c, rc, out, err)) for c in todo)
                break
            runs.update((c, CheckRun(c, 0, out, err)) for c in todo[:passed])
            runs[todo[passed]] = CheckRun(todo[passed], rc, out, err)
            todo = todo[passed + 1:]               # not run, or cut short: again, in a launch of their own
        return runs


def _launch_checks(n: int, args: list, extra_env, launcher_args, timeout: float) -> tuple[int | None, str, str]:
    """`launch.run`'s command (with ``-m mpi4py``), killed with its process group when ``timeout``
    seconds pass without a new ``OK`` line on stdout: (status or None, stdout, stderr)."""
    env = launch.environment(extra_env)
    cmd = launch.command(n, args, env, mpiexec=launch.find_mpiexec(), launcher_args=launcher_args)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    last_ok = [time.monotonic()]

    def read_out():
        for line in proc.stdout:
            out.append(line)
            if "OK " in line:
                last_ok[0] = time.monotonic()

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)]
    for t in readers:
        t.start()
    killed = None
    while proc.poll() is None:
        if time.monotonic() - last_ok[0] > timeout:
            killed = f"\n[conftest] {' '.join(map(str, cmd))}: no new OK line for {timeout:g} s: killed\n"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.05)
    for t in readers:
        t.join(10)
    return (None if killed else proc.returncode), "".join(out), "".join(err) + (killed or "")


@pytest.fixture(scope="session")
def check_launches() -> CheckLaunches:
    return CheckLaunches()


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
