#!/usr/bin/env python3
"""The one launcher of echonccl's multi-rank programs: tests, tools, studies, examples.

    python tools/launch.py -n 4 tools/soak.py --engine cpu --calls 2000
    python tools/launch.py -n 2 -m echonccl.perf.all_reduce -b 64K -e 1G
    python tools/launch.py -n 2 studies/accuracy_depth.py --layers 128

runs ``MPIEXEC -n N PYTHON -m mpi4py ARGS...`` (an exception on one rank then aborts the job
instead of hanging the others) from the repository root, in `environment()`:

* ``PYTHONPATH``: this checkout (so ``echonccl`` imports without being installed), then
  ``tools/`` (`support`, this module), then the caller's. With ``ECHONCCL_DEV_INSTALLED=1`` the
  checkout is left out, so programs use the installed echonccl (``tools/`` stays);
* ``NCCL_NVLS_ENABLE=0``: NVLink multicast stays off in everything we launch;
* ``PYTHONUNBUFFERED=1``; Open MPI may run as root and oversubscribe (MPICH ignores those).

The launcher is ``$MPIEXEC`` if set, else the ``mpiexec`` beside this Python (the mpich wheel's),
else the one on PATH. Open MPI gets ``--bind-to none`` and ``-x`` for every variable set here
and every ``NCCL_*``/``ECHONCCL_*`` one (so they reach other nodes too).

With MPICH, the shared-memory segments a job leaves in /dev/shm when its ranks die before
MPI_Finalize are removed after it (`remove_orphan_segments`).

Tests import it (``pythonpath = ["tools"]`` in pyproject.toml); tests/conftest.py turns a
missing launcher into a skip and a timeout into a failure.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"

#: Set in every launched environment.
FIXED = {"NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1",
         "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
         "OMPI_MCA_rmaps_base_oversubscribe": "1", "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


@functools.lru_cache(maxsize=None)
def _settings():
    """The checkout's `echonccl.settings`, loaded by path: the launcher imports no echonccl (it
    must run where nothing is installed, and choose between the checkout and an installed copy)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_echonccl_settings", ROOT / "echonccl" / "settings.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def installed_mode() -> bool:
    """``ECHONCCL_DEV_INSTALLED=1``: run against the installed echonccl, not this checkout's."""
    return bool(_settings().get("ECHONCCL_DEV_INSTALLED"))


def python_path(base: str | None = None) -> str:
    parts = ([] if installed_mode() else [str(ROOT)]) + [str(TOOLS)]
    return os.pathsep.join(parts + [p for p in (base or "").split(os.pathsep) if p and p not in parts])


def environment(extra: dict | None = None, *, clean: bool = False) -> dict:
    """The environment of a launched program: this process's (without ``ECHONCCL_*`` options
    when ``clean``), plus `FIXED`, the import path (`python_path`) and ``extra`` (a value of
    None removes that variable)."""
    env = {k: v for k, v in os.environ.items() if not (clean and k.startswith("ECHONCCL_"))}
    env.update(FIXED)
    env["PYTHONPATH"] = python_path(env.get("PYTHONPATH"))
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def find_mpiexec() -> str | None:
    """``$MPIEXEC``, else the mpiexec beside this Python (the mpich wheel's), else PATH's."""
    if os.environ.get("MPIEXEC"):
        return shutil.which(os.environ["MPIEXEC"]) or os.environ["MPIEXEC"]
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


@functools.lru_cache(maxsize=None)
def flavor(mpiexec: str) -> str:
    """``hydra`` (MPICH), ``openmpi`` or ``unknown``, from ``mpiexec --version``."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "HYDRA" in text:
        return "hydra"
    return "openmpi" if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text else "unknown"


def command(n: int, args, env: dict, *, mpiexec: str, launcher_args=(), abort_on_error: bool = True) -> list:
    """``mpiexec [flavor options] [launcher_args] -n n python [-m mpi4py] args...``."""
    opts = []
    if flavor(mpiexec) == "openmpi":
        names = sorted(set(FIXED) | {"PYTHONPATH"} | {k for k in env if k.startswith(("NCCL_", "ECHONCCL_"))})
        opts = ["--bind-to", "none", *[a for k in names for a in ("-x", k)]]
    py = [sys.executable, "-m", "mpi4py"] if abort_on_error else [sys.executable]
    return [mpiexec, *opts, *launcher_args, "-n", str(n), *py, *map(str, args)]


def run(n: int, args, *, extra_env: dict | None = None, clean: bool = False, launcher_args=(),
        abort_on_error: bool = True, cwd=ROOT, timeout: float | None = None,
        capture: bool = True) -> subprocess.CompletedProcess:
    """Run ``args`` (a script path relative to ``cwd`` or ``-m module``, then its arguments) on
    ``n`` ranks; `FileNotFoundError` without a launcher, `subprocess.TimeoutExpired` past
    ``timeout`` seconds. ``abort_on_error=False`` runs the script without ``-m mpi4py`` (for
    programs whose ranks are meant to die on their own)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise FileNotFoundError("no mpiexec: set $MPIEXEC, pip install mpich, or install an MPI")
    env = environment(extra_env, clean=clean)
    cmd = command(n, args, env, mpiexec=mpiexec, launcher_args=launcher_args, abort_on_error=abort_on_error)
    before = mpich_segments() if flavor(mpiexec) == "hydra" else None
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=capture, text=True, timeout=timeout)
    finally:
        if before is not None:
            remove_orphan_segments(before)


# MPICH's shared-memory segments: MPI_Finalize unlinks them, so a job whose ranks die before it
# (an abort, os._exit, a kill: the fault tests) leaves 2-3 MB of RAM each in /dev/shm.
SHM, SHM_PREFIX = Path("/dev/shm"), "mpich_shm_"


def mpich_segments(shm: Path = SHM) -> set[str]:
    """The names of the MPICH segments in ``shm`` that this user owns."""
    try:
        entries = list(os.scandir(shm))
    except OSError:
        return set()
    uid, names = os.getuid(), set()
    for e in entries:
        try:   # (another job's MPI_Finalize may unlink it meanwhile)
            if e.name.startswith(SHM_PREFIX) and e.stat().st_uid == uid:
                names.add(e.name)
        except OSError:
            pass
    return names


def _unmapped(paths: set[str]) -> set[str]:
    """Those of ``paths`` that no process this user can see maps (``/proc/PID/maps``)."""
    left = set(paths)
    for pid in os.listdir("/proc"):
        if not left:
            break
        if pid.isdigit():
            try:
                text = Path("/proc", pid, "maps").read_text()
            except OSError:
                continue
            left = {p for p in left if p not in text}
    return left


def remove_orphan_segments(before: set[str], shm: Path = SHM) -> list[str]:
    """Remove the MPICH segments of ``shm`` not in ``before`` (those a job made) that no process
    maps, checked twice 0.2 s apart (a job starting beside it maps its own at once); returns
    their paths."""
    new = {str(shm / name) for name in mpich_segments(shm) - before}
    orphans = _unmapped(new)
    if orphans:
        time.sleep(0.2)
        orphans = _unmapped(orphans)
    for p in orphans:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    return sorted(orphans)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "-n" or not argv[1].isdigit():
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        print("usage: launch.py -n N (SCRIPT | -m MODULE) [ARGS...]", file=sys.stderr)
        return 2
    n, args = int(argv[1]), argv[2:]
    if args[0] == "--":
        args = args[1:]
    try:
        return run(n, args, cwd=Path.cwd(), capture=False).returncode
    except FileNotFoundError as exc:
        print(f"launch.py: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
