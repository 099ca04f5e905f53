"""What the multi-rank test programs share (tests/mpi/checks.py, tests/mpi/hardening.py).

Each program runs as ``python tests/mpi/PROGRAM.py CHECK[,CHECK...] [ENGINE]``; ENGINE (``cpu``,
the default, or ``gpu``) is read here from the command line, and `run_checks` runs the checks
named, one after the other in one process (one MPI start-up for several checks).
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from echonccl import dtypes
from echonccl.schedules import SCHEDULES

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()
# The schedules the checks loop over; two_shot_pipelined is bitwise two_shot and has its own
# check (pipelined_matches_two_shot).
ALGOS = tuple(a for a in SCHEDULES if a != "two_shot_pipelined")
ENGINE = sys.argv[2] if len(sys.argv) > 2 else "cpu"


def to_engine(a: np.ndarray):
    """The engine's copy of a host array (cupy on the GPU engine, the array itself on CPU)."""
    if ENGINE == "gpu":
        import cupy

        return cupy.asarray(a)
    return a


def to_host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def rank_data(n: int, dtype, seed: int, scale=1.0, rank=None) -> np.ndarray:
    """Normal data of ``dtype``, different on every rank, the same on every run."""
    rng = np.random.default_rng([seed, RANK if rank is None else rank])
    return (rng.standard_normal(n) * scale).astype(dtypes.numpy_dtype(dtype))


def run_checks(checks: dict, names: str, *, alone=(), watchdog: float | None = None) -> None:
    """Run the comma-separated checks ``names`` (``checks[name]()`` each) one after the other in
    this process, as ``CHECKS`` lists them on the command line: ``rounds`` or
    ``identical_and_bounded,special_values,rounds``. After each check passes on every rank (a
    barrier), rank 0 prints ``OK <check> ranks=N engine=E``, so the launcher's output holds one
    line per check that passed.

    A check that raises stops the run: a rank that fails cannot tell how far its peers got in
    their collectives, so nothing can safely run after it. The rank writes ``FAILED <check>
    rank=R engine=E: <exception>`` to stderr and re-raises (the traceback follows; under ``-m
    mpi4py`` the job aborts with a non-zero status); the checks after it print no OK line.

    Python warnings are recorded per check and written to stderr, one line each, as ``Warning in
    check <check> (rank R): FILE:LINE: CATEGORY: MESSAGE`` (each check sees its warnings afresh,
    as in a process of its own).
    ``alone``: checks that end the process themselves (special exit statuses, killed or frozen
    ranks); they are refused in a list with others. ``watchdog``: seconds one check may take
    before faulthandler dumps every thread's stack and exits (restarted for each check; the
    last one's also covers MPI_Finalize)."""
    import faulthandler
    import os
    import warnings

    todo = names.split(",")
    unknown = [n for n in todo if n not in checks]
    if unknown:
        raise SystemExit(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(checks)}")
    if len(todo) != len(set(todo)):
        raise SystemExit(f"a check is listed twice: {names}")
    lonely = [n for n in todo if n in alone]
    if lonely and len(todo) > 1:
        raise SystemExit(f"{', '.join(lonely)} must run alone (it ends the process itself), not in {names}")
    for name in todo:
        if watchdog:
            faulthandler.dump_traceback_later(watchdog, exit=True)
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                checks[name]()
        except BaseException as e:
            os.write(2, f"FAILED {name} rank={RANK} engine={ENGINE}: {type(e).__name__}: {e}\n".encode())
            raise
        finally:
            for w in caught:
                text = f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}".replace("\n", "\\n")
                os.write(2, f"Warning in check {name} (rank {RANK}): {text}\n".encode())
        WORLD.Barrier()
        if RANK == 0:
            print(f"OK {name} ranks={P} engine={ENGINE}", flush=True)
