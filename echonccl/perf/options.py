"""The command line of the echonccl-perf tools: nccl-tests' flags and echonccl's own.

* `build_parser` and `parse_options`: nccl-tests' flags (``-b -e -i -f -n
  -w -c -d -G -a -J``, same letters and long names) and echonccl's own
  (``--algo --no-feedback --no-baseline --no-nccl-sym --engine --csv --plot
  --quiet``); argparse's messages print on rank 0 only;
* sizes: `parse_size` (``64K``, ``1G``), `format_size`, the sweep
  (`size_sweep`, as nccl-tests' ``-b -e -i -f``) and `element_counts`;
* `UsageError` and the exit statuses (`EXIT_OK`, `EXIT_FAILED`, `EXIT_USAGE`).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re

from .. import dtypes
from ..codec import CODECS, RESIDUAL_FORMATS
from ..feedback import DEFAULT_RESIDUAL
from ..config import ALGORITHMS
from .check import MAX_RELERR

AVERAGE_MODES = {0: "rank 0", 1: "avg", 2: "min", 3: "max"}   # nccl-tests' -a
# echonccl's algorithms but the baseline (always timed); "both": two_shot,ring
ALGORITHM_CHOICES = tuple(a for a in ALGORITHMS if a != "nccl")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad option or combination of options: rank 0 reports it, every rank exits with status 2."""


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
    points: list[tuple[int, int]] = []
    for size in sizes:
        count = max(1, size // itemsize)
        if not points or points[-1][1] != count:
            points.append((count * itemsize, count))
    return points


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
        "the baselines: on GPU NCCL (column NCCL) and, with NCCL >= 2.27, NCCL on symmetric "
        "windows (NCCL_sym: buffers from ncclMemAlloc registered with NCCL_WIN_COLL_SYMMETRIC, "
        "its fastest at small sizes); on CPU MPI. Launch with mpirun -np N.",
        epilog="Each echonccl variant's speedup is a baseline's time over its own: with NCCL and "
        "NCCL_sym the faster of the two at each size (unit line vs fastest), else the one that runs "
        "(vs NCCL, vs MPI); the footer gives the geometric means against every baseline. A "
        "baseline NCCL refuses here shows n/a, the reason in the header; NCCL_sym is left out "
        "under NCCL_P2P_DISABLE=1, where its kernels would still reach the peers over NVLink. "
        "Sizes take K, M, G suffixes (powers of 1024). "
        "Exit status: 0 all checks passed, "
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
                   help="warm-up iterations per size and variant (default 5; at least two per "
                   "rotated input, so that no timed call is a buffer set's first, which prepares it, "
                   "or second, which captures an NCCL-path schedule as a CUDA graph)")
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
    e.add_argument("--algo", type=_algo_arg, default="both",
                   help=f"echonccl algorithm(s) to time, comma-separated from {', '.join(ALGORITHM_CHOICES)} "
                   "(default both: two_shot,ring)")
    e.add_argument("--residual", choices=RESIDUAL_FORMATS, default=DEFAULT_RESIDUAL,
                   help=f"feedback residual format (default {DEFAULT_RESIDUAL}, echonccl's: int8 blocks for "
                   "16-bit data, float32 for float32; input: the data's dtype)")
    e.add_argument("--codec", choices=CODECS, default=None,
                   help="wire codec (default: the communicator's, int4-h32/int7-h32 unless ECHONCCL_CODEC says)")
    e.add_argument("--no-feedback", action="store_true", help="time echonccl without error feedback")
    e.add_argument("--rounds", type=_int_arg(1), default=1, metavar="R",
                   help="4-bit rounds per all-reduce (default 1; R > 1 also sends the residuals, "
                   "R times the traffic, needs feedback)")
    e.add_argument("--no-baseline", action="store_true", help="do not run the baselines")
    e.add_argument("--no-nccl-sym", action="store_true",
                   help="GPU engine: do not time NCCL on symmetric windows (NCCL_sym, on by default; "
                   "speedups then divide by plain NCCL at every size)")
    e.add_argument("--engine", choices=("cpu", "gpu", "auto"), default="auto",
                   help="echonccl engine (default auto: gpu when cupy sees one)")
    e.add_argument("--csv", metavar="FILE", help="write the results as CSV, one row per size and variant")
    e.add_argument("--plot", metavar="FILE.png", help="plot bus bandwidth and speedup vs size (matplotlib)")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _algo_arg(text: str) -> str:
    names = algorithms(text)
    bad = [a for a in names if a not in ALGORITHM_CHOICES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown algorithm {','.join(bad) or text!r}: "
                                         f"choose from {', '.join(ALGORITHM_CHOICES)} or both")
    return text


def algorithms(choice: str) -> tuple:
    """The echonccl algorithms an ``--algo`` choice stands for ("both": two_shot and ring)."""
    return ("two_shot", "ring") if choice == "both" else tuple(a for a in choice.split(",") if a)


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
    if opts.rounds > 1 and opts.no_feedback:
        raise UsageError(f"--rounds {opts.rounds} sends the feedback residuals: drop --no-feedback")
    return opts


@contextlib.contextmanager
def _silenced(active: bool):
    """Swallow stdout and stderr while ``active`` (the non-root ranks' copies of messages)."""
    if not active:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield

