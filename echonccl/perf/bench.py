"""The driver every echonccl-perf tool shares, modelled on nccl-tests' common.cu.

A collective's module (`echonccl.perf.all_reduce`) describes the collective
as a `Collective` (its `Variant` list, bus factor and exact reference) and
calls `run`, which parses the options (`echonccl.perf.options`), opens a
communicator and runs a `Bench`. Per size, on every rank: fresh random
non-zero inputs in several rotated buffers (`echonccl.perf.arrays`); a
correctness run, separate from the timing, against the exact float64
reference (`echonccl.perf.check`); then, for the baselines and each echonccl
algorithm in turn, a warm-up and a timed loop over the same buffers (a
variant with memory of its own, NCCL on symmetric windows, over copies of
them there); the median per-call time, combined across ranks per ``-a``
(`combine_time`). echonccl's speedups divide by the baseline that runs, or by
each size's fastest when several do (`echonccl.perf.check.speedup_baseline`).
Rank 0 prints the header, table and footer (`echonccl.perf.table`) and
writes the files (`echonccl.perf.report`).

Exit status: 0 when every check passed (or ``-c 0``), 1 when an output was
wrong (#wrong > 0) or its relative error exceeded ``MAX_RELERR``, 2 on a
usage error.
"""
from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .. import dtypes
from ..transport_mpi import node_rank_and_size
from .arrays import buffer_count, make_arrays, seed_for
from .check import Result, Row, accuracy_stats, divergence_mask, speedup_baseline, speedup_of, worst
from .options import (EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, element_counts, format_size,
                      parse_options)
from .report import summary, write_outputs
from .table import Progress, footer_lines, header_lines, run_info, table_header, table_row


# ---------------------------------------------------------------------------------------------
# Collective description (filled in by the collective's module)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One implementation the tool times at every size.

    ``start()`` returns a fresh ``call(x, out, stream)`` that runs it once on
    engine arrays (``stream`` None: the current stream); each call of
    ``start`` gets its own state (its own error-feedback residuals).

    ``memory(arrays, bufs, out)``, when given, is collective and returns the
    buffers this variant runs on instead: an object with ``bufs`` and ``out``
    (copies of the inputs, an output) and a collective ``close()`` (called
    once the size is measured). ``unavailable``: why the variant cannot run
    here (its columns read n/a, the reason is in the header). ``note``: what
    it is, for the header.
    """

    label: str
    baseline: bool
    start: Callable[[], Callable]
    memory: Optional[Callable] = None
    unavailable: Optional[str] = None
    note: Optional[str] = None


@dataclass(frozen=True)
class Collective:
    """What the driver needs to know about one collective.

    ``bus_factor(nranks)``: busbw = algbw * bus_factor (nccl-tests' convention).
    ``variants(comm, opts)``: the `Variant` list (collective), baselines (if any) first,
    the one speedups divide by last among them.
    ``reference(mpi, x_host)``: collective over the mpi4py communicator; the
    exact result of the collective over every rank's host input ``x_host``
    as float64 on rank 0, None on the other ranks.
    """

    name: str
    bus_factor: Callable[[int], float]
    variants: Callable[..., list]
    reference: Callable[..., Optional[np.ndarray]]


def bus_bandwidth(algbw: float, nranks: int, bus_factor: Callable[[int], float]) -> float:
    """nccl-tests' bus bandwidth: the algorithm bandwidth times the collective's bus factor."""
    return algbw * bus_factor(nranks)


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
        self.running = [v for v in self.variants if not v.unavailable]
        self.speedup_label = speedup_baseline(self.variants)
        self.dtype = dtypes.numpy_dtype(opts.datatype)
        self.points = element_counts(opts.sizes, self.dtype.itemsize)
        copies = any(v.memory for v in self.running)       # memory of its own: half the budget each
        self.budget = arrays.memory_budget(node_rank_and_size(mpi)[1]) // (2 if copies else 1)

    # -- per size ------------------------------------------------------------------------------
    def inputs(self, nbytes: int, count: int) -> list:
        """Fresh random input buffers for one size; as many on every rank (`buffer_count`)."""
        from mpi4py import MPI

        k = self.mpi.allreduce(buffer_count(nbytes, self.budget), op=MPI.MIN)
        return [self.arrays.random(count, self.dtype, seed_for(self.rank, nbytes, i)) for i in range(k)]

    def measure(self, nbytes: int, count: int) -> Row:
        """Check, then time, every variant that runs at one size."""
        bufs = self.inputs(nbytes, count)
        out = self.arrays.empty(count, self.dtype)
        own = {v.label: v.memory(self.arrays, bufs, out) for v in self.running if v.memory}
        self.arrays.synchronize()                       # the copies into them are done
        where = {v.label: (own[v.label].bufs, own[v.label].out) if v.label in own else (bufs, out)
                 for v in self.running}
        errors = self.check(bufs, where) if self.opts.check else {}
        times = {v.label: self.time_variant(v, *where[v.label]) for v in self.running}
        k = len(bufs)
        del bufs, out, where
        for mem in own.values():        # no `finally`: a rank that failed must not wait in a collective
            mem.close()
        self.arrays.release()
        return self.row(nbytes, count, k, times, errors)

    def check(self, bufs, where: dict) -> dict:
        """``label -> (relerr, maxerr, wrong)``, the worst over ``-c`` correctness runs. Each variant
        starts a fresh state (feedback) for these runs; run ``j`` reads input ``j % len(bufs)`` (of
        ``where[label]``: ``(bufs, out)`` per variant, ``bufs`` or copies of them)."""
        calls = {v.label: v.start() for v in self.running}
        errors: dict = {}
        for j in range(self.opts.check):
            ref = self.collective.reference(self.mpi, self.arrays.to_host(bufs[j % len(bufs)]))
            for v in self.running:
                ins, out = where[v.label]
                calls[v.label](ins[j % len(ins)], out, None)
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
        """Seconds per call of ``variant``: warm-up (``-w``, and two calls of each input at least:
        a buffer set's first call prepares it, its second captures an NCCL-path schedule), then
        the timed loop (or graph replays); the median over iterations, combined across ranks per
        ``-a``."""
        call = variant.start()
        warmup = max(self.opts.warmup_iters, 2 * len(bufs))
        for i in range(warmup):
            call(bufs[i % len(bufs)], out, None)
        if self.opts.cudagraph:
            secs = self.arrays.time_graph(call, bufs, out, self.opts.iters, self.opts.cudagraph,
                                          self.mpi.Barrier)
        else:
            secs = self.arrays.time_calls(call, bufs, out, self.opts.iters, self.mpi.Barrier)
        return combine_time(self.mpi, float(np.median(secs)), self.opts.average)

    def row(self, nbytes: int, count: int, buffers: int, times: dict, errors: dict) -> Row:
        """The `Row` of one size from the combined times (none for a variant that cannot run)
        and the check's errors."""
        bases = {v.label: times[v.label] for v in self.running if v.baseline}
        results = [self._result(v, nbytes, times.get(v.label), bases, errors.get(v.label))
                   for v in self.variants]
        return Row(nbytes, count, self.opts.datatype, buffers, results)

    def _result(self, v: Variant, nbytes: int, seconds: Optional[float], bases: dict, error) -> Result:
        if seconds is None:
            return Result(v.label, v.baseline, None, None, None)
        algbw = nbytes / seconds / 1e9
        speedups = None if v.baseline or not bases else {b: t / seconds for b, t in bases.items()}
        speedup = speedup_of(speedups, self.speedup_label)
        relerr, maxerr, wrong = error or (None, None, None)
        return Result(v.label, v.baseline, seconds * 1e6, algbw,
                      bus_bandwidth(algbw, self.nranks, self.collective.bus_factor),
                      speedup, relerr, maxerr, wrong, speedups)

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
        summ = summary(rows, self.variants, self.speedup_label)
        if root:
            print("\n".join(footer_lines(summ, bool(self.opts.check))), flush=True)
            write_outputs(self.opts, info, rows, summ)
        return EXIT_OK if summ["ok"] else EXIT_FAILED


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
    comm = Communicator(mpi, engine=opts.engine, codec=opts.codec)
    try:
        _agree(mpi, _engine_problem(opts, comm.engine))
        arrays = make_arrays(comm.engine)
        bench = Bench(collective, opts, mpi, comm, arrays)
        info = run_info(opts, collective, mpi, comm, arrays, bench.variants)
        return bench.sweep(info)
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
