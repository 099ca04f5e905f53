"""The correctness check and the records one size's measurements fill.

* `accuracy_stats`: relative error, largest error and wrong elements of an
  output against the collective's exact float64 reference (host arrays,
  in chunks of `CHUNK_ELEMS`, `chunks`);
* `divergence_mask`: the elements in which some rank's output differs from
  rank 0's, bitwise;
* `worst`: the worse of two checks' ``(relerr, maxerr, wrong)``;
* `Result` (one variant at one size, `Result.ok` against `MAX_RELERR`) and
  `Row` (one size); the JSON (``-J``) holds ``asdict(row)`` per size;
* `speedup_baseline`: which baseline echonccl's ``speedup`` divides by (`FASTEST`: at each
  size the fastest of several).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

MAX_RELERR = 0.5              # sanity bound on the relative error of any output
CHUNK_ELEMS = 1 << 24         # host-side checks work in chunks of this many elements
FASTEST = "fastest"           # the speedup baseline when several run: the fastest at each size


def chunks(n: int, step: Optional[int] = None):
    """``(lo, hi)`` bounds covering ``range(n)`` in pieces of at most ``step`` (default
    `CHUNK_ELEMS`, read at call time)."""
    step = step or CHUNK_ELEMS
    return ((lo, min(lo + step, n)) for lo in range(0, n, step))


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
    digest = hashlib.blake2b(bits.view(np.uint8).data, digest_size=16).digest()
    if len(set(mpi.allgather(digest))) == 1:
        return None
    root_bits = bits.copy() if mpi.Get_rank() == 0 else np.empty_like(bits)
    mpi.Bcast(root_bits.view(np.uint8), root=0)
    diff = (bits != root_bits).view(np.uint8)
    mask = np.empty_like(diff) if mpi.Get_rank() == 0 else None
    mpi.Reduce(diff, mask, op=MPI.MAX, root=0)
    return mask.view(bool) if mask is not None else None


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    """One variant at one size. ``speedup`` = the speedup baseline's time / this time (the
    baseline `speedup_baseline` names; None for a baseline or without one); ``speedups``: the
    same against every baseline that ran, by label (None for a baseline). ``relerr``,
    ``maxerr``, ``wrong``: None when the check is off (``-c 0``). A variant that could not run
    (n/a, its reason in the run's header) has every measurement None."""

    label: str
    baseline: bool
    time_us: Optional[float]
    algbw: Optional[float]
    busbw: Optional[float]
    speedup: Optional[float] = None
    relerr: Optional[float] = None
    maxerr: Optional[float] = None
    wrong: Optional[int] = None
    speedups: Optional[dict] = None

    def ok(self) -> bool:
        """True unless the check found a wrong element or a relative error above `MAX_RELERR`."""
        if self.wrong is None:
            return True
        return self.wrong == 0 and self.relerr is not None and self.relerr <= MAX_RELERR   # NaN fails


@dataclass
class Row:
    """One size: its bytes, element count, type, rotated buffers and one `Result` per variant."""

    size: int
    count: int
    dtype: str
    buffers: int
    results: list


def speedup_baseline(variants) -> Optional[str]:
    """The label echonccl's ``speedup`` divides by: the one baseline of ``variants`` that runs,
    `FASTEST` when several do (each size's fastest: on two H200s NCCL on symmetric windows beats
    plain NCCL up to a few MiB and loses from 8 MiB, BENCHMARKS.md section 1); None without one.
    ``variants``: anything with ``label``, ``baseline`` and, optionally, ``unavailable`` (the
    reason it cannot run)."""
    labels = [v.label for v in variants if v.baseline and not getattr(v, "unavailable", None)]
    if not labels:
        return None
    return labels[0] if len(labels) == 1 else FASTEST


def speedup_of(speedups: Optional[dict], label: Optional[str]) -> Optional[float]:
    """The speedup over baseline ``label`` from ``speedups`` (baseline label -> its time / this
    time): for `FASTEST` the smallest, the fastest baseline's."""
    if not speedups or not label:
        return None
    return min(speedups.values()) if label == FASTEST else speedups.get(label)


def worst(a: Optional[tuple], b: tuple) -> tuple:
    """The worse of two ``(relerr, maxerr, wrong)`` triples, element by element (NaN wins)."""
    if a is None:
        return b
    return _nanmax(a[0], b[0]), _nanmax(a[1], b[1]), max(a[2], b[2])

