"""The driver every echonccl-perf tool shares, modelled on nccl-tests' common.cu.

A collective's module (`echonccl.perf.all_reduce`) describes the collective
as a `Collective` and calls `run`; this module does the rest:

* options: nccl-tests' flags (``-b -e -i -f -n -w -c -d -G -a -J``) and
  echonccl's own (``--algo --group-size --no-feedback --no-baseline
  --engine --csv --plot --quiet``), see `build_parser`;
* the size sweep (`parse_size`, `size_sweep`, `element_counts`);
* per size, on every rank: fresh random non-zero inputs in several buffers
  rotated across iterations (`buffer_count`); a correctness run, separate
  from the timing, against the collective's exact float64 reference
  (`accuracy_stats`, `divergence_mask`); then, for the baseline and each
  echonccl algorithm in turn, a warm-up and a timed loop over the same
  buffers; the median per-call time, combined across ranks per ``-a``;
* on rank 0: header, table and footer on stdout, JSON (``-J``), CSV
  (``--csv``), a PNG plot (``--plot``), a progress bar on stderr.

Arrays live where the engine computes: numpy for the CPU engine
(`HostArrays`), cupy for the GPU engine (`CudaArrays`, the only code here
that imports cupy, and only when the engine is ``gpu``).

Exit status: 0 when every check passed (or ``-c 0``), 1 when an output was
wrong (#wrong > 0) or its relative error exceeded `MAX_RELERR`, 2 on a usage
error.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import json
import math
import os
import platform
import re
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import ml_dtypes
import numpy as np

from .. import __version__, dtypes
from ..codec import GROUP_SIZES

MAX_RELERR = 0.5              # sanity bound on the relative error of any output
ROTATE_BYTES = 256 << 20      # rotate enough input buffers to cover this many bytes ...
MIN_BUFFERS, MAX_BUFFERS = 2, 8   # ... within these bounds (fewer if memory is short)
CHUNK_ELEMS = 1 << 24         # host-side checks work in chunks of this many elements
BASE_SEED = 0x45434E43        # mixed with (rank, size, buffer) for every input buffer
AVERAGE_MODES = {0: "rank 0", 1: "avg", 2: "min", 3: "max"}   # nccl-tests' -a
ALGORITHM_CHOICES = ("two_shot", "ring", "both", "auto")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad option or combination of options: rank 0 reports it, every rank exits with status 2."""


# ---------------------------------------------------------------------------------------------
# Collective description (filled in by the collective's module)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One implementation the tool times at every size.

    ``start()`` returns a fresh ``call(x, out, stream)`` that runs it once on
    engine arrays (``stream`` None: the current stream); each call of
    ``start`` gets its own state (its own error-feedback residuals).
    """

    label: str
    baseline: bool
    start: Callable[[], Callable]


@dataclass(frozen=True)
class Collective:
    """What the driver needs to know about one collective.

    ``bus_factor(nranks)``: busbw = algbw * bus_factor (nccl-tests' convention).
    ``variants(comm, opts)``: the `Variant` list, baseline (if any) first.
    ``reference(mpi, x_host)``: collective over the mpi4py communicator; the
    exact result of the collective over every rank's host input ``x_host``
    as float64 on rank 0, None on the other ranks.
    """

    name: str
    bus_factor: Callable[[int], float]
    variants: Callable[..., list]
    reference: Callable[..., Optional[np.ndarray]]


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional K, M, G or T suffix (powers of 1024, any case,
    optionally followed by B or iB), as nccl-tests' -b/-e/-i. `ValueError` otherwise."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"invalid size {text!r}: use a number with an optional K, M, G or T suffix")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit it reaches (``64 KiB``, ``1.5 MiB``, ``512 B``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def size_sweep(minbytes: int, maxbytes: int, stepfactor: float = 1.0, stepbytes: int = 1 << 20) -> list:
    """Sizes from ``minbytes`` up to ``maxbytes`` inclusive, as nccl-tests: each size is the last
    times ``stepfactor`` when it is > 1, else the last plus ``stepbytes``. `ValueError` on an
    empty or endless sweep."""
    if minbytes < 0 or minbytes > maxbytes:
        raise ValueError(f"need 0 <= minbytes <= maxbytes, got {minbytes} and {maxbytes}")
    if stepfactor <= 1 and stepbytes <= 0:
        raise ValueError("the step (-i) must be positive when the step factor (-f) is 1")
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(size)
        nxt = int(size * stepfactor) if stepfactor > 1 else size + stepbytes
        size = max(nxt, size + 1)
    return sizes


def element_counts(sizes, itemsize: int) -> list:
    """``(nbytes, count)`` per size: at least one element, whole elements, duplicates dropped."""
    points = []
    for size in sizes:
        count = max(1, size // itemsize)
        if not points or points[-1][1] != count:
            points.append((count * itemsize, count))
    return points


def bus_bandwidth(algbw: float, nranks: int, bus_factor: Callable[[int], float]) -> float:
    """nccl-tests' bus bandwidth: the algorithm bandwidth times the collective's bus factor."""
    return algbw * bus_factor(nranks)


def buffer_count(nbytes: int, budget_bytes: int) -> int:
    """How many input buffers of ``nbytes`` to rotate: enough to cover `ROTATE_BYTES`, between
    `MIN_BUFFERS` and `MAX_BUFFERS`, fewer (at least 1) when ``budget_bytes`` cannot hold them
    plus the output buffer."""
    want = max(MIN_BUFFERS, min(MAX_BUFFERS, -(-ROTATE_BYTES // max(nbytes, 1))))
    fit = budget_bytes // max(nbytes, 1) - 1
    return int(max(1, min(want, fit)))


def seed_for(rank: int, nbytes: int, index: int) -> int:
    """The 32-bit seed of input buffer ``index`` of size ``nbytes`` on ``rank``."""
    return int(np.random.SeedSequence([BASE_SEED, rank, nbytes, index]).generate_state(1)[0])


def chunks(n: int, step: int = CHUNK_ELEMS):
    """``(lo, hi)`` bounds covering ``range(n)`` in pieces of at most ``step``."""
    return ((lo, min(lo + step, n)) for lo in range(0, n, step))


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------
def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_arg(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _dtype_arg(text: str) -> str:
    try:
        return dtypes.canonical(text)
    except TypeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser(prog: str, collective: str) -> argparse.ArgumentParser:
    """The command line: nccl-tests' flags (same letters and long names) and echonccl's own."""
    p = argparse.ArgumentParser(
        prog=prog, description=f"Bandwidth and accuracy of echonccl's 4-bit {collective} against "
        "the baseline (NCCL on GPU, MPI on CPU). Launch with mpirun -np N.",
        epilog="Sizes take K, M, G suffixes (powers of 1024). Exit status: 0 all checks passed, "
        f"1 a wrong result or a relative error above {MAX_RELERR}, 2 usage error.")
    g = p.add_argument_group("sweep and method (as nccl-tests)")
    g.add_argument("-b", "--minbytes", type=_size_arg, default=32 << 20, metavar="SIZE",
                   help="smallest size in bytes (default 32M)")
    g.add_argument("-e", "--maxbytes", type=_size_arg, default=32 << 20, metavar="SIZE",
                   help="largest size in bytes (default 32M)")
    g.add_argument("-i", "--stepbytes", type=_size_arg, default=1 << 20, metavar="SIZE",
                   help="size increment when the step factor is 1 (default 1M)")
    g.add_argument("-f", "--stepfactor", type=float, default=1.0, metavar="F",
                   help="multiply the size by F (> 1) at each step; 1 steps by -i (default 1)")
    g.add_argument("-n", "--iters", type=_int_arg(1), default=20, metavar="N",
                   help="timed iterations per size and variant (default 20)")
    g.add_argument("-w", "--warmup_iters", type=_int_arg(0), default=5, metavar="N",
                   help="warm-up iterations per size and variant (default 5)")
    g.add_argument("-c", "--check", type=_int_arg(0), default=1, metavar="N",
                   help="correctness runs per size and variant, 0 disables the check (default 1)")
    g.add_argument("-d", "--datatype", type=_dtype_arg, default="bfloat16", metavar="TYPE",
                   help="float16, bfloat16 or float32 (default bfloat16)")
    g.add_argument("-G", "--cudagraph", type=_int_arg(0), default=0, metavar="N",
                   help="GPU engine: capture the -n calls in a CUDA graph and time N graph "
                   "launches (default 0: no graph)")
    g.add_argument("-a", "--average", type=int, choices=sorted(AVERAGE_MODES), default=1,
                   help="combine the per-rank median times: 0 rank 0's, 1 average, 2 minimum, "
                   "3 maximum (default 1)")
    g.add_argument("-J", "--json", metavar="FILE", help="write the results as JSON")
    e = p.add_argument_group("echonccl")
    e.add_argument("--algo", choices=ALGORITHM_CHOICES, default="both",
                   help="echonccl algorithm(s) to time (default both: two_shot and ring)")
    e.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="elements per 4-bit scale (default: the communicator's)")
    e.add_argument("--no-feedback", action="store_true", help="time echonccl without error feedback")
    e.add_argument("--no-baseline", action="store_true", help="do not run the baseline")
    e.add_argument("--engine", choices=("cpu", "gpu", "auto"), default="auto",
                   help="echonccl engine (default auto: gpu when cupy sees one)")
    e.add_argument("--csv", metavar="FILE", help="write the results as CSV, one row per size and variant")
    e.add_argument("--plot", metavar="FILE.png", help="plot bus bandwidth and speedup vs size (matplotlib)")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def algorithms(choice: str) -> tuple:
    """The echonccl algorithms an ``--algo`` choice stands for."""
    return ("two_shot", "ring") if choice == "both" else (choice,)


def parse_options(argv, prog: str, collective: str, rank: int) -> argparse.Namespace:
    """Parsed and checked options; argparse's messages (and ``-h``) print on rank 0 only.

    Adds ``sizes`` (the requested sweep) and ``algorithms`` (a tuple).
    """
    parser = build_parser(prog, collective)
    with _silenced(rank != 0):
        opts = parser.parse_args(argv)
    try:
        opts.sizes = size_sweep(opts.minbytes, opts.maxbytes, opts.stepfactor, opts.stepbytes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    opts.algorithms = algorithms(opts.algo)
    return opts


@contextlib.contextmanager
def _silenced(active: bool):
    """Swallow stdout and stderr while ``active`` (the non-root ranks' copies of messages)."""
    if not active:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


# ---------------------------------------------------------------------------------------------
# Engine arrays: numpy (CPU engine) and cupy (GPU engine)
# ---------------------------------------------------------------------------------------------
def _nonzero_cast(xp, a, dtype):
    """``a`` (float32) cast to ``dtype`` with every magnitude raised to the dtype's smallest normal,
    so no element is zero or subnormal in ``dtype``. ``xp``: numpy or cupy."""
    mag = xp.abs(a)
    xp.maximum(mag, np.float32(ml_dtypes.finfo(dtype).tiny), out=mag)
    xp.copysign(mag, a, out=mag)
    return mag.astype(dtype)


def _ms_to_s(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64) * 1e-3


class HostArrays:
    """Engine arrays for the CPU engine: numpy, timed with `time.perf_counter`."""

    def random(self, count: int, dtype, seed: int) -> np.ndarray:
        """``count`` standard-normal, non-zero values of ``dtype`` drawn from ``seed``."""
        a = np.random.default_rng(seed).standard_normal(count, dtype=np.float32)
        return _nonzero_cast(np, a, dtype)

    def empty(self, count: int, dtype) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return a

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        pass

    def memory_budget(self, local_ranks: int) -> int:
        """Bytes of input and output buffers one rank may hold: a quarter of its share of free RAM."""
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = 64 << 30
        return free // (4 * max(local_ranks, 1))

    def time_calls(self, call, bufs, out, iters: int, barrier) -> np.ndarray:
        """Seconds of each of ``iters`` calls, input ``i`` being ``bufs[i % len(bufs)]``; the ranks
        start together (``barrier``)."""
        times = np.empty(iters)
        barrier()
        for i in range(iters):
            t0 = time.perf_counter()
            call(bufs[i % len(bufs)], out, None)
            times[i] = time.perf_counter() - t0
        return times

    def time_graph(self, call, bufs, out, iters: int, launches: int, barrier) -> np.ndarray:
        raise UsageError("-G (CUDA-graph replay) needs the GPU engine")

    def device(self) -> tuple:
        """(index or None, description) of this rank's device."""
        return None, f"cpu {platform.machine()}".strip()

    def cuda_version(self) -> Optional[str]:
        return None


class CudaArrays:
    """Engine arrays for the GPU engine: cupy on the current device, timed with CUDA events
    recorded on the current stream, or replayed as a CUDA graph (``-G``)."""

    def __init__(self):
        import cupy

        self.cp = cupy

    def random(self, count: int, dtype, seed: int):
        """``count`` standard-normal, non-zero values of ``dtype`` drawn on the device from ``seed``."""
        a = self.cp.random.default_rng(seed).standard_normal(count, dtype=self.cp.float32)
        return _nonzero_cast(self.cp, a, dtype)

    def empty(self, count: int, dtype):
        return self.cp.empty(count, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return self.cp.asnumpy(a)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def release(self) -> None:
        """Return the freed blocks of cupy's pool to the device (between sizes)."""
        self.cp.get_default_memory_pool().free_all_blocks()

    def memory_budget(self, local_ranks: int) -> int:
        """A quarter of the device's free memory (the communicator needs workspace and residuals)."""
        free, _total = self.cp.cuda.runtime.memGetInfo()
        return free // 4

    def _events(self, n: int) -> list:
        return [(self.cp.cuda.Event(), self.cp.cuda.Event()) for _ in range(n)]

    def time_calls(self, call, bufs, out, iters: int, barrier) -> np.ndarray:
        """Seconds of each of ``iters`` calls by event pairs on the current stream, synchronized
        once after the loop; the ranks start together (device idle, then ``barrier``)."""
        stream = self.cp.cuda.get_current_stream()
        events = self._events(iters)
        stream.synchronize()
        barrier()
        for i, (start, end) in enumerate(events):
            start.record(stream)
            call(bufs[i % len(bufs)], out, stream)
            end.record(stream)
        events[-1][1].synchronize()
        return _ms_to_s([self.cp.cuda.get_elapsed_time(s, e) for s, e in events])

    def time_graph(self, call, bufs, out, iters: int, launches: int, barrier) -> np.ndarray:
        """Seconds per call for each of ``launches`` replays of a graph capturing ``iters`` calls
        (the replay's time divided by ``iters``). The calls must have run before (warm-up)."""
        self.synchronize()              # the warm-up, on the current stream, is done
        graph, stream = self._capture(call, bufs, out, iters)
        graph.launch(stream)            # first replay uploads the graph: not timed
        events = self._events(launches)
        stream.synchronize()
        barrier()
        for start, end in events:
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
        events[-1][1].synchronize()
        return _ms_to_s([self.cp.cuda.get_elapsed_time(s, e) for s, e in events]) / iters

    def _capture(self, call, bufs, out, iters: int):
        """A CUDA graph of ``iters`` calls captured on a new non-blocking stream, and that stream."""
        stream = self.cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                for i in range(iters):
                    call(bufs[i % len(bufs)], out, stream)
            except BaseException:
                with contextlib.suppress(Exception):
                    stream.end_capture()
                raise
            graph = stream.end_capture()
        return graph, stream

    def device(self) -> tuple:
        """(index, name) of the current device."""
        index = self.cp.cuda.Device().id
        name = self.cp.cuda.runtime.getDeviceProperties(index)["name"]
        return index, name.decode() if isinstance(name, bytes) else str(name)

    def cuda_version(self) -> str:
        rt = self.cp.cuda.runtime
        fmt = lambda v: f"{v // 1000}.{v % 1000 // 10}"  # noqa: E731
        return f"runtime {fmt(rt.runtimeGetVersion())}, driver {fmt(rt.driverGetVersion())}"


def make_arrays(engine):
    """`CudaArrays` for the GPU engine (imports cupy), `HostArrays` otherwise."""
    return CudaArrays() if engine.name == "gpu" else HostArrays()


# ---------------------------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------------------------
def _nanmax(a: float, b: float) -> float:
    """max that propagates NaN."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def accuracy_stats(out: np.ndarray, ref: np.ndarray, diverged: Optional[np.ndarray] = None) -> tuple:
    """``(relerr, maxerr, wrong)`` of the host array ``out`` against the exact float64 ``ref``.

    relerr: ||out - ref||_2 / ||ref||_2; maxerr: max |out - ref| (both NaN or
    inf when ``out`` holds non-finite values); wrong: the elements that are
    non-finite in ``out`` where ``ref`` is finite, or set in the boolean mask
    ``diverged`` (elements that differ between ranks). Works in chunks, so
    the float64 temporaries stay small.
    """
    out, ref = out.reshape(-1), ref.reshape(-1)
    err2 = ref2 = maxerr = 0.0
    wrong = 0
    with np.errstate(invalid="ignore", over="ignore"):
        for lo, hi in chunks(out.size):
            o, r = out[lo:hi].astype(np.float64), ref[lo:hi]
            e = np.abs(o - r)
            err2, ref2 = err2 + float(e @ e), ref2 + float(r @ r)
            maxerr = _nanmax(maxerr, float(e.max(initial=0.0)))
            bad = np.isfinite(r) & ~np.isfinite(o)
            if diverged is not None:
                bad |= diverged[lo:hi]
            wrong += int(np.count_nonzero(bad))
    relerr = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
    return relerr, maxerr, wrong


def _bits(a: np.ndarray) -> np.ndarray:
    """The elements of ``a`` as unsigned integers of the same width (bitwise comparison)."""
    return a.reshape(-1).view(f"u{a.dtype.itemsize}")


def divergence_mask(mpi, out: np.ndarray) -> Optional[np.ndarray]:
    """Collective. On rank 0, a boolean mask of the elements in which some rank's host array
    ``out`` differs bitwise from rank 0's, or None when every rank holds the same bytes (one
    hash per rank is compared first; the arrays travel only when hashes differ). None on the
    other ranks."""
    from mpi4py import MPI

    bits = _bits(np.ascontiguousarray(out))
    digest = hashlib.blake2b(bits.view(np.uint8), digest_size=16).digest()
    if len(set(mpi.allgather(digest))) == 1:
        return None
    root_bits = bits.copy() if mpi.Get_rank() == 0 else np.empty_like(bits)
    mpi.Bcast(root_bits.view(np.uint8), root=0)
    diff = (bits != root_bits).view(np.uint8)
    mask = np.empty_like(diff) if mpi.Get_rank() == 0 else None
    mpi.Reduce(diff, mask, op=MPI.MAX, root=0)
    return mask.view(bool) if mask is not None else None


def combine_time(mpi, seconds: float, mode: int) -> float:
    """Collective: this rank's time combined over the ranks per ``-a`` (0 rank 0's, 1 mean,
    2 min, 3 max)."""
    from mpi4py import MPI

    if mode == 0:
        return mpi.bcast(seconds, root=0)
    op = {1: MPI.SUM, 2: MPI.MIN, 3: MPI.MAX}[mode]
    total = mpi.allreduce(seconds, op=op)
    return total / mpi.Get_size() if mode == 1 else total


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    """One variant at one size. ``speedup`` = baseline time / this time (None for the baseline or
    without one); ``relerr``, ``maxerr``, ``wrong``: None when the check is off (``-c 0``)."""

    label: str
    baseline: bool
    time_us: float
    algbw: float
    busbw: float
    speedup: Optional[float] = None
    relerr: Optional[float] = None
    maxerr: Optional[float] = None
    wrong: Optional[int] = None

    def ok(self) -> bool:
        """True unless the check found a wrong element or a relative error above `MAX_RELERR`."""
        if self.wrong is None:
            return True
        return self.wrong == 0 and self.relerr <= MAX_RELERR   # NaN fails


@dataclass
class Row:
    """One size: its bytes, element count, type, rotated buffers and one `Result` per variant."""

    size: int
    count: int
    dtype: str
    buffers: int
    results: list


def worst(a: Optional[tuple], b: tuple) -> tuple:
    """The worse of two ``(relerr, maxerr, wrong)`` triples, element by element (NaN wins)."""
    if a is None:
        return b
    return _nanmax(a[0], b[0]), _nanmax(a[1], b[1]), max(a[2], b[2])


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------
class Bench:
    """One rank's run: the collective's variants on one communicator over the sweep.

    Every method that touches ``mpi`` or the communicator is collective:
    every rank calls it in the same order.
    """

    def __init__(self, collective: Collective, opts, mpi, comm, arrays):
        self.collective, self.opts, self.mpi, self.comm, self.arrays = collective, opts, mpi, comm, arrays
        self.rank, self.nranks = mpi.Get_rank(), mpi.Get_size()
        self.variants = collective.variants(comm, opts)
        self.dtype = dtypes.numpy_dtype(opts.datatype)
        self.points = element_counts(opts.sizes, self.dtype.itemsize)
        self.budget = arrays.memory_budget(_local_ranks(mpi))

    # -- per size ------------------------------------------------------------------------------
    def inputs(self, nbytes: int, count: int) -> list:
        """Fresh random input buffers for one size; as many on every rank (`buffer_count`)."""
        from mpi4py import MPI

        k = self.mpi.allreduce(buffer_count(nbytes, self.budget), op=MPI.MIN)
        return [self.arrays.random(count, self.dtype, seed_for(self.rank, nbytes, i)) for i in range(k)]

    def measure(self, nbytes: int, count: int) -> Row:
        """Check, then time, every variant at one size."""
        bufs = self.inputs(nbytes, count)
        out = self.arrays.empty(count, self.dtype)
        errors = self.check(bufs, out) if self.opts.check else {}
        times = {v.label: self.time_variant(v, bufs, out) for v in self.variants}
        k = len(bufs)
        del bufs, out
        self.arrays.release()
        return self.row(nbytes, count, k, times, errors)

    def check(self, bufs, out) -> dict:
        """``label -> (relerr, maxerr, wrong)``, the worst over ``-c`` correctness runs. Each variant
        starts a fresh state (feedback) for these runs; run ``j`` reads ``bufs[j % len(bufs)]``."""
        calls = {v.label: v.start() for v in self.variants}
        errors = {}
        for j in range(self.opts.check):
            x = bufs[j % len(bufs)]
            ref = self.collective.reference(self.mpi, self.arrays.to_host(x))
            for v in self.variants:
                calls[v.label](x, out, None)
                self.arrays.synchronize()
                errors[v.label] = worst(errors.get(v.label), self._compare(out, ref))
        return errors

    def _compare(self, out, ref) -> tuple:
        """``(relerr, maxerr, wrong)`` of this output, computed on rank 0, known to every rank."""
        host = self.arrays.to_host(out)
        diverged = divergence_mask(self.mpi, host)
        stats = accuracy_stats(host, ref, diverged) if self.rank == 0 else None
        return self.mpi.bcast(stats, root=0)

    def time_variant(self, variant: Variant, bufs, out) -> float:
        """Seconds per call of ``variant``: warm-up, then the timed loop (or graph replays); the
        median over iterations, combined across ranks per ``-a``."""
        call = variant.start()
        warmup = max(self.opts.warmup_iters, 1 if self.opts.cudagraph else 0)  # a graph needs warm state
        for i in range(warmup):
            call(bufs[i % len(bufs)], out, None)
        if self.opts.cudagraph:
            secs = self.arrays.time_graph(call, bufs, out, self.opts.iters, self.opts.cudagraph,
                                          self.mpi.Barrier)
        else:
            secs = self.arrays.time_calls(call, bufs, out, self.opts.iters, self.mpi.Barrier)
        return combine_time(self.mpi, float(np.median(secs)), self.opts.average)

    def row(self, nbytes: int, count: int, buffers: int, times: dict, errors: dict) -> Row:
        """The `Row` of one size from the combined times and the check's errors."""
        base = next((times[v.label] for v in self.variants if v.baseline), None)
        results = [self._result(v, nbytes, times[v.label], base, errors.get(v.label))
                   for v in self.variants]
        return Row(nbytes, count, self.opts.datatype, buffers, results)

    def _result(self, v: Variant, nbytes: int, seconds: float, base, error) -> Result:
        algbw = nbytes / seconds / 1e9
        speedup = None if v.baseline or base is None else base / seconds
        relerr, maxerr, wrong = error or (None, None, None)
        return Result(v.label, v.baseline, seconds * 1e6, algbw,
                      bus_bandwidth(algbw, self.nranks, self.collective.bus_factor),
                      speedup, relerr, maxerr, wrong)

    # -- whole run -----------------------------------------------------------------------------
    def sweep(self, info: dict) -> int:
        """Measure every size, print the table on rank 0 as rows complete, then the footer and
        the files; the exit status (the same on every rank: times and errors are agreed)."""
        root = self.rank == 0
        if root:
            print("\n".join(header_lines(info) + table_header(self.variants)), flush=True)
        progress = Progress(len(self.points), root and not self.opts.quiet and sys.stderr.isatty())
        rows = []
        for i, (nbytes, count) in enumerate(self.points):
            progress.show(i, format_size(nbytes))
            rows.append(self.measure(nbytes, count))
            progress.clear()
            if root:
                print(table_row(rows[-1]), flush=True)
        summ = summary(rows, self.variants)
        if root:
            print("\n".join(footer_lines(summ, bool(self.opts.check))), flush=True)
            write_outputs(self.opts, info, rows, summ)
        return EXIT_OK if summ["ok"] else EXIT_FAILED


def _local_ranks(mpi) -> int:
    """Ranks sharing this node (they share its memory)."""
    from mpi4py import MPI

    node = mpi.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


# ---------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------
def _opt(value, spec: str) -> str:
    return "N/A" if value is None else format(value, spec)


def _fmt_time(us: float) -> str:
    """nccl-tests' precision: fewer decimals as the time grows."""
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


@dataclass(frozen=True)
class Column:
    """A table column: its name, unit line, width and how a `Result` (or a `Row`) renders in it."""

    name: str
    unit: str
    width: int
    render: Callable


SIZE = Column("size", "(B)", 12, lambda row: str(row.size))
COUNT = Column("count", "(elements)", 12, lambda row: str(row.count))
TYPE = Column("type", "", 9, lambda row: row.dtype)
TIME = Column("time", "(us)", 9, lambda r: _fmt_time(r.time_us))
ALGBW = Column("algbw", "(GB/s)", 7, lambda r: f"{r.algbw:.2f}")
BUSBW = Column("busbw", "(GB/s)", 7, lambda r: f"{r.busbw:.2f}")
SPEEDUP = Column("speedup", "(x)", 7, lambda r: _opt(r.speedup, ".2f"))
RELERR = Column("relerr", "", 8, lambda r: _opt(r.relerr, ".2e"))
MAXERR = Column("maxerr", "", 8, lambda r: _opt(r.maxerr, ".2e"))
WRONG = Column("#wrong", "", 6, lambda r: _opt(r.wrong, "d"))
PREFIX = (SIZE, COUNT, TYPE)


def variant_columns(baseline: bool, has_baseline: bool) -> list:
    """The columns of one variant's group: speedup only for echonccl's variants against a baseline."""
    speed = [SPEEDUP] if has_baseline and not baseline else []
    return [TIME, ALGBW, BUSBW] + speed + [RELERR, MAXERR, WRONG]


def _cells(columns, texts) -> str:
    return " ".join(f"{t:>{c.width}}" for c, t in zip(columns, texts))


def _line(lead: str, prefix: str, groups) -> str:
    return lead + prefix + "".join("   " + g for g in groups)


def _groups(flags) -> list:
    """Column lists per variant, from ``(baseline?)`` flags in table order."""
    has_baseline = any(flags)
    return [variant_columns(b, has_baseline) for b in flags]


def table_header(variants) -> list:
    """Three ``#`` lines: variant labels centred over their groups, column names, units."""
    groups = _groups([v.baseline for v in variants])
    width = lambda cols: sum(c.width for c in cols) + len(cols) - 1  # noqa: E731
    blank = " " * width(PREFIX)
    labels = [v.label.center(width(cols)) for v, cols in zip(variants, groups)]
    names = [_cells(cols, [c.name for c in cols]) for cols in groups]
    units = [_cells(cols, [c.unit for c in cols]) for cols in groups]
    return [_line("#", blank, labels).rstrip(),
            _line("#", _cells(PREFIX, [c.name for c in PREFIX]), names),
            _line("#", _cells(PREFIX, [c.unit for c in PREFIX]), units).rstrip()]


def table_row(row: Row) -> str:
    """One size's line of the table."""
    groups = _groups([r.baseline for r in row.results])
    cells = [_cells(cols, [c.render(r) for c in cols]) for r, cols in zip(row.results, groups)]
    return _line(" ", _cells(PREFIX, [c.render(row) for c in PREFIX]), cells)


# ---------------------------------------------------------------------------------------------
# Summary and footer
# ---------------------------------------------------------------------------------------------
def _series(rows, label: str, field: str) -> list:
    return [getattr(r, field) for row in rows for r in row.results if r.label == label]


def geometric_mean(values) -> Optional[float]:
    """Geometric mean of the finite positive ``values``; None when there are none."""
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def failures(rows) -> list:
    """One line per (size, variant) whose check failed (`Result.ok`)."""
    return [f"{format_size(row.size)} {r.label}: #wrong {r.wrong}, relerr {r.relerr:.2e}"
            for row in rows for r in row.results if not r.ok()]


def summary(rows, variants) -> dict:
    """Per variant: the average bus bandwidth (nccl-tests' footer), the geometric-mean speedup and
    the largest relative error over the sweep; the failed checks; ``ok``."""
    labels = [v.label for v in variants]
    fails = failures(rows)
    relerrs = {k: [e for e in _series(rows, k, "relerr") if e is not None] for k in labels}
    return {
        "avg_busbw": {k: float(np.mean(_series(rows, k, "busbw"))) for k in labels},
        "geomean_speedup": {v.label: geometric_mean(_series(rows, v.label, "speedup"))
                            for v in variants if not v.baseline and any(w.baseline for w in variants)},
        "max_relerr": {k: (max(relerrs[k], key=lambda e: (math.isnan(e), e)) if relerrs[k] else None)
                       for k in labels},
        "failures": fails,
        "ok": not fails,
    }


def footer_lines(summ: dict, checked: bool) -> list:
    """nccl-tests-style footer lines from a `summary`."""
    bw = "  ".join(f"{k} {v:.2f}" for k, v in summ["avg_busbw"].items())
    lines = [f"# Avg bus bandwidth    : {bw}  (GB/s)"]
    if summ["geomean_speedup"]:
        sp = "  ".join(f"{k} {_opt(v, '.2f')}x" for k, v in summ["geomean_speedup"].items())
        lines.append(f"# Geomean speedup      : {sp}")
    lines.append(f"# Check                : {_check_text(summ, checked)}")
    return lines + ["#"]


def _check_text(summ: dict, checked: bool) -> str:
    if not checked:
        return "disabled (-c 0)"
    if summ["ok"]:
        errs = ", ".join(f"{k} {_opt(v, '.2e')}" for k, v in summ["max_relerr"].items())
        return f"OK (max relerr: {errs})"
    shown = summ["failures"][:5]
    more = len(summ["failures"]) - len(shown)
    return "FAILED: " + "; ".join(shown) + (f"; and {more} more" if more else "")


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
CSV_FIELDS = ("size", "count", "dtype", "buffers", "label", "baseline", "time_us", "algbw", "busbw",
              "speedup", "relerr", "maxerr", "wrong")


def _finite(obj):
    """``obj`` with non-finite floats replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: str, info: dict, rows, summ: dict) -> None:
    """The run's metadata, one entry per size (``results``: one per variant) and the summary."""
    doc = dict(info, results=[asdict(row) for row in rows], summary=summ)
    with open(path, "w") as f:
        json.dump(_finite(doc), f, indent=1)
        f.write("\n")


def write_csv(path: str, rows) -> None:
    """One line per (size, variant), columns `CSV_FIELDS`; empty cells for missing values."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for row in rows:
            for r in row.results:
                rec = dict(asdict(r), size=row.size, count=row.count, dtype=row.dtype, buffers=row.buffers)
                w.writerow({k: ("" if rec[k] is None else rec[k]) for k in CSV_FIELDS})


def write_plot(path: str, info: dict, rows) -> None:
    """A PNG with two panels over size (log2 axis): bus bandwidth of every variant, and the
    speedup of echonccl's variants over the baseline with a line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (bw, sp) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    sizes = [row.size for row in rows]
    for label, baseline in [(r.label, r.baseline) for r in rows[0].results]:
        bw.plot(sizes, _series(rows, label, "busbw"), marker="o", label=label)
        if not baseline and info["baseline_run"]:
            sp.plot(sizes, _series(rows, label, "speedup"), marker="o", label=label)
    sp.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    _log_if_wide(bw)
    for ax, ylabel in ((bw, "bus bandwidth (GB/s)"), (sp, f"speedup over {info['baseline']} (x)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(int(v))))
        ax.tick_params(axis="x", labelrotation=45)
        ax.set(xlabel="size", ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(f"echonccl {info['collective']}: {_ranks(info['nranks'])}, {info['dtype']}, "
                 f"{info['engine']} engine, feedback {'on' if info['feedback'] else 'off'}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _log_if_wide(ax) -> None:
    """A log y-axis when the plotted positive values span more than two decades."""
    ys = np.concatenate([line.get_ydata() for line in ax.get_lines()] or [np.zeros(0)])
    ys = ys[np.isfinite(ys) & (ys > 0)]
    if ys.size and ys.max() > 100 * ys.min():
        ax.set_yscale("log")


def write_outputs(opts, info: dict, rows, summ: dict) -> None:
    """The files asked for with -J, --csv and --plot."""
    if opts.json:
        write_json(opts.json, info, rows, summ)
    if opts.csv:
        write_csv(opts.csv, rows)
    if opts.plot:
        write_plot(opts.plot, info, rows)


# ---------------------------------------------------------------------------------------------
# Header
# ---------------------------------------------------------------------------------------------
def mpi_library_version() -> str:
    """The first line of the MPI library's version string, spaces collapsed."""
    from mpi4py import MPI

    lines = MPI.Get_library_version().strip().splitlines() or ["unknown"]
    return " ".join(lines[0].split())[:80]


def format_nccl_version(v) -> str:
    """NCCL's version code (22805, or 2804 before 2.9) or anything else, as text."""
    if isinstance(v, int):
        major, rest = (v // 10000, v % 10000) if v >= 10000 else (v // 1000, v % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def baseline_version(engine) -> str:
    """NCCL's version when the engine reports it, the MPI library's on the CPU engine."""
    if hasattr(engine, "nccl_version"):
        return format_nccl_version(engine.nccl_version())
    return mpi_library_version() if engine.name == "cpu" else "unknown"


def run_info(opts, collective: Collective, mpi, comm, arrays) -> dict:
    """Collective: the run's metadata (JSON's top level); ``ranks`` (one entry per rank: pid,
    host, device) on rank 0 only."""
    engine = comm.engine
    index, desc = arrays.device()
    if hasattr(engine, "device_description"):
        desc = engine.device_description()
    me = {"rank": mpi.Get_rank(), "pid": os.getpid(), "host": socket.gethostname().split(".")[0],
          "device": index, "description": desc}
    return {
        "tool": opts.prog, "collective": collective.name, "echonccl_version": __version__,
        "nranks": mpi.Get_size(), "engine": engine.name, "engine_description": engine.describe(),
        "baseline": getattr(engine, "baseline_name", "baseline"), "baseline_version": baseline_version(engine),
        "baseline_run": not opts.no_baseline, "mpi_version": mpi_library_version(),
        "cuda": arrays.cuda_version(), "dtype": opts.datatype, "group_size": comm.config.group_size,
        "feedback": not opts.no_feedback, "algorithms": list(opts.algorithms),
        "max_relerr_bound": MAX_RELERR, "units": {"time_us": "us", "algbw": "GB/s", "busbw": "GB/s"},
        "options": {k: v for k, v in vars(opts).items() if k not in ("sizes", "prog")},
        "ranks": mpi.gather(me, root=0),
    }


def header_lines(info: dict) -> list:
    """The ``#`` lines before the table: versions, engine, options, one line per rank."""
    o = info["options"]
    step = f"{o['stepfactor']:g}(factor)" if o["stepfactor"] > 1 else f"{o['stepbytes']}(bytes)"
    lines = [f"# {info['tool']} {info['collective']}: echonccl {info['echonccl_version']}, "
             f"{_ranks(info['nranks'])}",
             f"# engine   : {info['engine_description']}",
             f"# baseline : {info['baseline']} ({info['baseline_version']})"
             + ("" if info["baseline_run"] else " (not run: --no-baseline)")]
    if info["engine"] != "cpu":
        lines.append(f"# MPI      : {info['mpi_version']}")
    if info["cuda"]:
        lines.append(f"# CUDA     : {info['cuda']}")
    lines += [f"# echonccl : {info['dtype']}, group size {info['group_size']}, feedback "
              f"{'on' if info['feedback'] else 'off'}, algorithms {' '.join(info['algorithms'])}",
              f"# minBytes {o['minbytes']} maxBytes {o['maxbytes']} step: {step} warmup iters: "
              f"{o['warmup_iters']} iters: {o['iters']} check iters: {o['check']} cudagraph: "
              f"{o['cudagraph']} average: {o['average']} ({AVERAGE_MODES[o['average']]})",
              "#", "# Using devices"]
    lines += [rank_line(r) for r in info["ranks"]]
    return lines + ["#"]


def _ranks(n: int) -> str:
    return f"{n} rank" + ("" if n == 1 else "s")


def rank_line(r: dict) -> str:
    """nccl-tests' per-rank line: ``#  Rank  0 Group  0 Pid   1234 on  host device  0 [name]``."""
    dev = "-" if r["device"] is None else r["device"]
    return (f"#  Rank {r['rank']:2d} Group  0 Pid {r['pid']:6d} on {r['host']:>10} "
            f"device {dev:>2} [{r['description']}]")


# ---------------------------------------------------------------------------------------------
# Progress bar
# ---------------------------------------------------------------------------------------------
class Progress:
    """A one-line bar on stderr, ``[#####     ] 3/7 64 KiB``; does nothing unless ``enabled``."""

    def __init__(self, total: int, enabled: bool, width: int = 30, stream=None):
        self.total, self.enabled, self.width = max(total, 1), enabled, width
        self.stream = stream or sys.stderr
        self._shown = 0

    def show(self, done: int, label: str) -> None:
        """Draw the bar with ``done`` of ``total`` steps finished, working on ``label``."""
        if not self.enabled:
            return
        filled = self.width * done // self.total
        text = f"[{'#' * filled}{' ' * (self.width - filled)}] {done}/{self.total} {label}"
        self.stream.write("\r" + text.ljust(self._shown))
        self.stream.flush()
        self._shown = len(text)

    def clear(self) -> None:
        """Erase the bar (before a table line is printed)."""
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------
def _agree(mpi, problem: Optional[str]) -> None:
    """Collective: raise `UsageError` on every rank if any rank found a ``problem``."""
    problems = [p for p in mpi.allgather(problem) if p]
    if problems:
        raise UsageError(problems[0])


def _plot_problem(opts) -> Optional[str]:
    import importlib.util

    if opts.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install 'echonccl[plot]')"
    return None


def _engine_problem(opts, engine) -> Optional[str]:
    if opts.cudagraph and engine.name != "gpu":
        return (f"-G (CUDA-graph replay) needs the GPU engine; this run uses the {engine.name} "
                "engine (drop -G, or pass --engine gpu on a machine with a GPU)")
    return None


def _fail(mpi, prog: str) -> int:
    """Report the exception being handled (a one-line message for echonccl's own errors, a
    traceback otherwise) and end the job: MPI_Abort when other ranks may be waiting."""
    from ..errors import EchoncclError

    exc = sys.exc_info()[1]
    text = f"{prog}: error: {exc}\n" if isinstance(exc, EchoncclError) else traceback.format_exc()
    sys.stderr.write("".join(f"[rank {mpi.Get_rank()}] {line}\n" for line in text.splitlines()))
    sys.stderr.flush()
    if mpi.Get_size() > 1:
        mpi.Abort(EXIT_FAILED)
    return EXIT_FAILED


def _run(collective: Collective, opts, mpi) -> int:
    from .. import Communicator

    _agree(mpi, _plot_problem(opts))
    comm = Communicator(mpi, engine=opts.engine, group_size=opts.group_size)
    try:
        _agree(mpi, _engine_problem(opts, comm.engine))
        arrays = make_arrays(comm.engine)
        info = run_info(opts, collective, mpi, comm, arrays)
        return Bench(collective, opts, mpi, comm, arrays).sweep(info)
    finally:
        comm.close()


def run(collective: Collective, argv=None, prog: str = "echonccl-perf") -> int:
    """The tool's main: parse ``argv`` (default ``sys.argv[1:]``), run on ``MPI.COMM_WORLD``
    and return the exit status (`EXIT_OK`, `EXIT_FAILED`, `EXIT_USAGE`)."""
    from mpi4py import MPI

    mpi = MPI.COMM_WORLD
    try:
        opts = parse_options(argv, prog, collective.name, mpi.Get_rank())
        opts.prog = prog
        return _run(collective, opts, mpi)
    except UsageError as exc:
        if mpi.Get_rank() == 0:
            print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception:
        return _fail(mpi, prog)
