"""What the multi-rank test programs share (tests/mpi/checks.py, tests/mpi/hardening.py).

Each program runs as ``python tests/mpi/PROGRAM.py CHECK [ENGINE]``; ENGINE (``cpu``,
the default, or ``gpu``) is read here from the command line.
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
