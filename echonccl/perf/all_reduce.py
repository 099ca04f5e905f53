"""echonccl-perf for the all-reduce: the baseline against echonccl's 4-bit algorithms.

    mpirun -np 8 echonccl-perf -b 1K -e 1G -f 2 --algo both -J out.json --plot out.png
    mpirun -np 2 python -m echonccl.perf.all_reduce --engine cpu -b 1K -e 64K -f 4

Variants: the baseline (``Communicator.baseline_all_reduce``: NCCL on GPU,
MPI on CPU), then each algorithm of ``--algo`` (``Communicator.all_reduce``
with its own `Feedback`, or ``feedback=False`` with ``--no-feedback``).
Reference: the exact float64 sum of every rank's input. Everything else is
the shared driver, `echonccl.perf.bench`.
"""
from __future__ import annotations

import sys
from functools import partial
from typing import Optional

import numpy as np

from .bench import Collective, Variant, run
from .check import chunks

GATHER_LIMIT_BYTES = 64 << 20   # up to this many input bytes in all, rank 0 gathers the inputs


def bus_factor(nranks: int) -> float:
    """nccl-tests' all-reduce bus factor, 2 (P-1) / P: the share of the data each rank's link
    carries in a bandwidth-optimal all-reduce."""
    return 2.0 * (nranks - 1) / nranks


def _baseline(comm, x, out, stream) -> None:
    comm.baseline_all_reduce(x, out, stream=stream)


def _echonccl(comm, algorithm: str, feedback: bool, residual: str = "float32", rounds: int = 1):
    """A ``call(x, out, stream)`` of ``algorithm`` with a fresh `Feedback` (or none) of its own."""
    state = comm.new_feedback(residual) if feedback else False

    def call(x, out, stream) -> None:
        comm.all_reduce(x, out, feedback=state, algorithm=algorithm, rounds=rounds, stream=stream)
    return call


def variants(comm, opts) -> list:
    """The baseline (unless ``--no-baseline``), then each echonccl algorithm of ``--algo``."""
    found = []
    if not opts.no_baseline:
        found.append(Variant(comm.engine.baseline_name, True, lambda: partial(_baseline, comm)))
    for algo in opts.algorithms:
        found.append(Variant(algo, False, partial(_echonccl, comm, algo, not opts.no_feedback, opts.residual,
                                                  opts.rounds)))
    return found


def _gathered_sum(mpi, x: np.ndarray) -> Optional[np.ndarray]:
    """Rank 0 gathers every rank's raw input and sums it in float64 (independent of MPI's sum)."""
    raw = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    recv = np.empty((mpi.Get_size(), raw.size), dtype=np.uint8) if mpi.Get_rank() == 0 else None
    mpi.Gather(raw, recv, root=0)
    return None if recv is None else recv.view(x.dtype).astype(np.float64).sum(axis=0)


def _reduced_sum(mpi, x: np.ndarray) -> Optional[np.ndarray]:
    """An MPI float64 sum to rank 0, in chunks so no rank holds a float64 copy of its input."""
    from mpi4py import MPI

    flat = x.reshape(-1)
    ref = np.empty(flat.size, dtype=np.float64) if mpi.Get_rank() == 0 else None
    for lo, hi in chunks(flat.size):
        part = flat[lo:hi].astype(np.float64)
        mpi.Reduce(part, None if ref is None else ref[lo:hi], op=MPI.SUM, root=0)
    return ref


def exact_sum(mpi, x: np.ndarray) -> Optional[np.ndarray]:
    """Collective: the sum over ranks of every rank's host array ``x`` in float64 on rank 0 (None
    elsewhere). Exact for float16/bfloat16 inputs (and for float32 ones of similar magnitudes):
    a float64 holds every such sum of a few terms. Small inputs are gathered, large ones reduced."""
    if x.nbytes * mpi.Get_size() <= GATHER_LIMIT_BYTES:
        return _gathered_sum(mpi, x)
    return _reduced_sum(mpi, x)


ALL_REDUCE = Collective("all_reduce", bus_factor, variants, exact_sum)


def main(argv=None) -> int:
    """Console script ``echonccl-perf``: run the all-reduce sweep; the exit status."""
    return run(ALL_REDUCE, argv)


if __name__ == "__main__":
    sys.exit(main())
