"""What the tests and the tools share to check all-reduce results: the README's error bound and
the multi-rank helpers (tests/mpi/*.py, tests/test_properties.py, tools/soak.py).

Not installed: tools/launch.py puts ``tools/`` on the import path of what it launches, pytest
has it on its ``pythonpath``, and scripts in ``tools/`` find it beside them. Functions that talk
across ranks take an mpi4py communicator (``comm``, default ``MPI.COMM_WORLD``); mpi4py is
imported only then.
"""
from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

from echonccl import codec, dtypes

TWO_HOP = ("two_shot", "two_shot_pipelined")     # quantized twice per element; ring: once per rank
ONE_HOP = ("one_shot_q",)                         # each contribution quantized once, the sum never


def _world(comm):
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return comm


def codec_factor(codec_name: str) -> int:
    """int4-h32: an element's error is the inverse transform of 32 rotated errors, each at most
    half a step of a scale no larger than its block's amax / 7: 32 times int4's, at worst."""
    return 32 if codec.rotated(codec_name) else 1


def readme_bound(amax_sum, algo: str, nranks: int, codec_name: str = "int4"):
    """The README's per-element error bound of a feedback-free all-reduce, without the output
    dtype's rounding: (sum over ranks of the group's max |input| + the sum's group max) / 2L
    per quantizing hop (two-shot: 2; one_shot_q: 1; ring: one per rank), ``amax_sum`` being the first sum and
    L the codes' largest magnitude (7; int7-h32: 63, its groups' max taken over their block).
    The sum's group max is at most ``amax_sum`` grown by 1/L per hop: (1 + 1/L)^P covers it.
    The rotated codecs' is 32 times that (`codec_factor`). A pair of codecs (`codec.MIXED`):
    the last hop, the owner's sum, at the sums' L."""
    hops = 1 if algo in ONE_HOP else 2 if algo in TWO_HOP else nranks
    first, last = (63 if codec.wide(c) else 7 for c in codec.parts(codec_name))
    if algo in ONE_HOP:
        last = first
    per_hop = [first] * (hops - 1) + [last]
    grown = (1 + 1 / min(first, last)) ** nranks
    return codec_factor(codec_name) * grown * np.asarray(amax_sum) * sum(1 / (2 * lv) for lv in per_hop)


def error_bound(exact, amax_sum, algo: str, nranks: int, dtype, codec_name: str = "int4"):
    """`readme_bound` plus the output's rounding (bf16's 2^-7, relative) and a few units of the
    smallest scale (float32's smallest subnormal; the rotated codecs': bfloat16's, 2^-133) and the
    output dtype's smallest subnormal (groups below ~1e-44 can clip to +-L)."""
    tiny = float(ml_dtypes.finfo(dtypes.numpy_dtype(dtype)).smallest_subnormal)
    smallest_scale = 2.0 ** -133 if codec.bf16_scales(codec.parts(codec_name)[0]) else 2.0 ** -149
    return (readme_bound(amax_sum, algo, nranks, codec_name) + np.abs(exact) * 2.0 ** -7
            + 8 * (nranks + 1) * codec_factor(codec_name) * (smallest_scale + tiny))


def group_amax(x64: np.ndarray, group: int) -> np.ndarray:
    """Per element: the max |x| of its group of ``group`` elements (non-finite values count as 0)."""
    x64 = np.asarray(x64, dtype=np.float64).reshape(-1)
    v = np.zeros(-(-x64.size // group) * group)
    v[: x64.size] = np.abs(np.where(np.isfinite(x64), x64, 0.0))
    return np.repeat(v.reshape(-1, group).max(axis=1), group)[: x64.size]


def exact_sum(x, comm=None) -> np.ndarray:
    """The float64 sum over ranks of this rank's ``x`` (host array)."""
    return _world(comm).allreduce(np.asarray(x, dtype=np.float64))


def amax_sum(x, group: int, comm=None) -> np.ndarray:
    """Per element: the sum over ranks of its group's max |x|."""
    return _world(comm).allreduce(group_amax(x, group))


def assert_identical_across_ranks(y: np.ndarray, what: str, comm=None) -> None:
    """Every rank's host array ``y`` has the same bytes."""
    digests = _world(comm).allgather(hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest())
    assert all(d == digests[0] for d in digests), f"{what}: outputs differ between ranks"
