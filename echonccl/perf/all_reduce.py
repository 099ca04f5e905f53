"""echonccl-perf for the all-reduce: the baseline against echonccl's 4-bit algorithms.

    mpirun -np 8 echonccl-perf -b 1K -e 1G -f 2 --algo both -J out.json --plot out.png
    mpirun -np 2 python -m echonccl.perf.all_reduce --engine cpu -b 1K -e 64K -f 4

Variants: the baseline (``Communicator.baseline_all_reduce``: NCCL on GPU,
MPI on CPU); on GPU, unless ``--no-nccl-sym``, the same call on buffers in
a symmetric NCCL window (``NCCL_sym``: NCCL >= 2.27 runs its symmetric
kernels there; `symmetric_problem` says why not where NCCL cannot, and the
column reads n/a); then each algorithm of ``--algo``
(``Communicator.all_reduce`` with its own `Feedback`, or ``feedback=False``
with ``--no-feedback``). echonccl's speedups divide by the faster of NCCL
and NCCL_sym at each size when both run, else by the plain baseline.
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
SYMMETRIC = "NCCL_sym"          # the label of NCCL's all-reduce on symmetric windows
SYMMETRIC_NOTE = ("NCCL's all-reduce on symmetric windows (buffers from ncclMemAlloc registered "
                  "with NCCL_WIN_COLL_SYMMETRIC)")
PROBE_BYTES = 1 << 16           # the window `symmetric_problem` registers


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


def symmetric_problem(engine) -> Optional[str]:
    """Collective over the GPU engine's ranks: why NCCL's all-reduce on symmetric windows cannot
    run here, or is not this regime's baseline (NCCL older than 2.27; ``NCCL_P2P_DISABLE=1``,
    under which NCCL's symmetric kernels still reach the peers over NVLink: 231 GB/s against
    plain NCCL's 29 through host memory on two H200s, BENCHMARKS.md section 1; NCCL refusing,
    or registering no window for, a small symmetric window that this registers and frees), None
    when it can. The same on every rank."""
    from ..nccl import NcclError, p2p_disabled

    ncomm, lib = engine.nccl, engine.nccl.lib
    if p2p_disabled():
        return ("left out under NCCL_P2P_DISABLE=1: NCCL's symmetric kernels would still reach the "
                "peers over NVLink, not this regime's path")
    if not lib.supports_windows():
        return (f"NCCL {'.'.join(map(str, lib.version()))} has no symmetric windows "
                "(ncclCommWindowRegister: NCCL 2.27 or newer)")
    problem = None
    try:
        ptr = lib.mem_alloc(PROBE_BYTES)
        try:
            win = ncomm.register_window(ptr, PROBE_BYTES, symmetric=True)
            ncomm.deregister_window(win)
        finally:
            lib.mem_free(ptr)
        if win is None:
            problem = ("NCCL registered no window: no symmetric memory on this communicator (CUMEM off, "
                       "NCCL_WIN_ENABLE=0 or no CUDA P2P between the ranks; NCCL_DEBUG=INFO says which)")
    except NcclError as exc:
        problem = f"NCCL refused a symmetric window: {exc}"
    return next((p for p in engine.allgather_object(problem) if p), None)


def _symmetric_window(ncomm, arrays, bufs, out):
    return arrays.nccl_window(ncomm, bufs, out)


def variants(comm, opts) -> list:
    """Collective. The baseline and, on the GPU engine, NCCL_sym (unless ``--no-baseline``; NCCL_sym
    unless ``--no-nccl-sym``; n/a where `symmetric_problem` finds one), then each echonccl
    algorithm of ``--algo``."""
    found = []
    if not opts.no_baseline:
        found.append(Variant(comm.engine.baseline_name, True, lambda: partial(_baseline, comm)))
        ncomm = getattr(comm.engine, "nccl", None)
        if ncomm is not None and not opts.no_nccl_sym:
            found.append(Variant(SYMMETRIC, True, lambda: partial(_baseline, comm),
                                 memory=partial(_symmetric_window, ncomm),
                                 unavailable=symmetric_problem(comm.engine), note=SYMMETRIC_NOTE))
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
