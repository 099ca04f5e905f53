"""Where the GPU engine's kernels come from: the prebuilt fatbin, else compiled on demand.

`function(name)` returns the CuPy ``RawKernel`` of a kernel of `kernel_table` on the current
device, loading it the first time it is asked for in this process:

1. **Prebuilt**: ``prebuilt/kernels.fatbin`` of the package (the wheel carries it; in a checkout
   ``make kernels`` writes it), or of the folder ``ECHONCCL_KERNEL_DIR`` names (``python -m
   echonccl.build --out DIR``, e.g. for another GPU architecture or every kernel of the table),
   if its ``manifest.json`` lists the kernel and was built from the sources beside it
   (`kernel_table.fingerprint`). A folder without them, a stale one, or a fatbin that does not
   load on this GPU or driver (another architecture, a driver older than the toolkit that built
   it) is set aside with one line on stderr.
2. **On demand**: that one kernel's source (`kernel_table.source`) compiled by NVRTC through
   ``cupy.RawModule``, which keeps the result in CuPy's kernel cache (``CUPY_CACHE_DIR``). A lock
   file in ``ECHONCCL_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/echonccl``, ``~/.cache/echonccl``)
   lets one process of a node compile while the others wait and then load its result; the
   process that compiles prints one line saying what and how long.

Nothing here runs on the hot path: a kernel is looked up once per prepared call.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

from . import kernel_table as kt
from . import settings

PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
FATBIN, MANIFEST = "kernels.fatbin", "manifest.json"


def cache_dir() -> Path:
    """Where the locks and records of kernels compiled on demand live (`settings`)."""
    d = settings.get("ECHONCCL_KERNEL_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "echonccl"


def _log(msg: str) -> None:
    print(f"echonccl: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _node_lock(path: Path):
    """An exclusive lock on ``path`` (fcntl): one process of the node at a time; none if the
    folder cannot be written (then every process compiles for itself)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
    except (ImportError, OSError):
        yield False
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prebuilt_dir() -> Path:
    """The prebuilt folder a process loads: ``ECHONCCL_KERNEL_DIR`` if set, else the package's."""
    d = settings.get("ECHONCCL_KERNEL_DIR")
    return Path(d) if d else PREBUILT_DIR


class _FromSetting:
    """`KernelLoader`'s default folder: `prebuilt_dir()`, read when the first kernel is looked up."""


class KernelLoader:
    """Kernels by name for this process (see the module docstring). ``prebuilt_dir``: a prebuilt
    folder; None: none; left out: `prebuilt_dir()`, read when the first kernel is looked up."""

    def __init__(self, prebuilt_dir: Path | None | _FromSetting = _FromSetting()):
        self._lock = threading.Lock()
        self._functions: dict = {}
        self._prebuilt_arg = prebuilt_dir
        self._prebuilt_dir: Path | None = None      # the folder, once `_read_manifest` resolved it
        self._manifest: dict | None = None
        self._module = None          # the prebuilt RawModule, once loaded
        self._checked = False
        self.origins: dict[str, str] = {}   # name -> "prebuilt PATH" / "nvrtc"

    def function(self, name: str):
        """The ``RawKernel`` called ``name`` (`kernel_table.lookup`), loaded or compiled once."""
        fn = self._functions.get(name)
        if fn is None:
            with self._lock:
                fn = self._functions.get(name)
                if fn is None:
                    kernel = kt.lookup(name)
                    fn = self._prebuilt(kernel)
                    if fn is None:
                        fn = self._compile(kernel)
                    self._functions[name] = fn
        return fn

    def prebuilt_names(self) -> list[str]:
        """The kernels the usable prebuilt fatbin holds (empty without one)."""
        m = self._valid_manifest()
        return [] if m is None else list(m["kernels"])

    # -- prebuilt ---------------------------------------------------------------------------
    def _valid_manifest(self) -> dict | None:
        if not self._checked:
            self._checked = True
            self._manifest = self._read_manifest()
        return self._manifest

    def _read_manifest(self) -> dict | None:
        arg = self._prebuilt_arg
        d = self._prebuilt_dir = prebuilt_dir() if isinstance(arg, _FromSetting) else arg
        chosen = isinstance(arg, _FromSetting) and d != PREBUILT_DIR     # named by the setting
        if d is None or not (d / MANIFEST).is_file() or not (d / FATBIN).is_file():
            if chosen:
                _log(f"ECHONCCL_KERNEL_DIR={d} holds no {FATBIN} and {MANIFEST}: compiling on demand")
            return None
        try:
            m = json.loads((d / MANIFEST).read_text())
            kernels = [kt.lookup(n) for n in m["kernels"]]
            fresh = m["fingerprint"] == kt.fingerprint(kernels)
        except (OSError, ValueError, KeyError) as exc:
            _log(f"prebuilt kernels in {d} are unreadable ({exc}): compiling on demand")
            return None
        if not fresh:
            _log(f"prebuilt kernels in {d} were built from other sources than those installed: "
                 "compiling on demand (rebuild them: python -m echonccl.build)")
            return None
        return m

    def _prebuilt(self, kernel):
        m = self._valid_manifest()
        d = self._prebuilt_dir
        if m is None or d is None or kernel.name not in m["kernels"]:
            return None
        import cupy

        try:
            module = self._module
            if module is None:
                module = self._module = cupy.RawModule(path=str(d / FATBIN))
            fn = module.get_function(kernel.name)
        except cupy.cuda.driver.CUDADriverError as exc:
            _log(f"the prebuilt kernels ({', '.join(m['archs'])}, {m['ptx']} PTX, nvcc {m['nvcc']}) do not load "
                 f"on this GPU or driver ({exc}): compiling on demand")
            self._manifest = None
            return None
        self.origins[kernel.name] = f"prebuilt {d / FATBIN}"
        return fn

    # -- on demand --------------------------------------------------------------------------
    def _compile(self, kernel):
        import cupy

        code = kt.source([kernel])
        dev = cupy.cuda.Device()
        arch = f"sm_{dev.compute_capability}"
        nvrtc = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
        key = kt.fingerprint([kernel], (*kt.NVRTC_OPTIONS, arch, nvrtc))[:24]
        cache = cache_dir()
        record = cache / f"{kernel.name}-{key}.done"
        with _node_lock(cache / f"{kernel.name}.lock") as locked:
            t0 = time.perf_counter()
            fn = cupy.RawModule(code=code, options=kt.NVRTC_OPTIONS).get_function(kernel.name)
            seconds = time.perf_counter() - t0
            if not (locked and record.exists()):
                _log(f"compiled {kernel.name} for {arch} with NVRTC {nvrtc} in {seconds:.1f} s "
                     f"(not among the prebuilt kernels; kept in CuPy's kernel cache)")
                if locked:
                    with contextlib.suppress(OSError):
                        record.touch()
        self.origins[kernel.name] = "nvrtc"
        return fn


LOADER = KernelLoader()


def function(name: str):
    """`KernelLoader.function` of the process's loader."""
    return LOADER.function(name)
