"""Hardening checks across ranks, run as ``mpiexec -n N python tests/mpi/hardening.py CHECK[,CHECK...] [ENGINE]``.

Same pattern as checks.py: every rank asserts, rank 0 prints ``OK <check> ranks=N engine=E``;
several comma-separated checks run in one launch (mpi_common.run_checks), except the `ALONE`
ones below; ENGINE is ``cpu`` (default) or ``gpu``. The pytest wrappers are tests/test_hardening.py
(CPU) and tests/test_gpu_hardening.py (GPU).

Two kinds of checks end differently, by design:

* fault checks (``peer_exit``, ``peer_exit_first``, ``peer_hang``): rank 1 dies (exits
  without MPI_Finalize) or freezes (SIGSTOP) before an all-reduce; every other rank must
  raise `PeerTimeoutError` within the timeout, then `CommunicatorFailedError` on its next
  call, prints ``SURVIVOR rank=R ...`` and exits with status `SURVIVOR_EXIT` (42) without
  finalizing MPI. Under MPICH's hydra they need ``mpiexec -disable-auto-cleanup``
  (otherwise the launcher kills the survivors first).
* ``local_error``, ``out_of_step`` and ``after_failure`` leave an MPI communicator with
  requests that never complete on purpose: every rank reports and exits with status
  `UNFINALIZED_EXIT` (43) without finalizing.

Exit statuses are chosen for both launchers. Open MPI's mpirun (4.1) returns the status of
the first process that ends abnormally and kills the rest: a process that exits with 0
without MPI_Finalize counts as abnormal and makes mpirun return 1, whatever the others do;
a non-zero status is returned as is. MPICH's mpiexec (with ``-disable-auto-cleanup``) lets
every rank finish and returns the highest status. So every rank of a check that ends
unfinalized exits non-zero, rank 0 (which reports for all) first, and a frozen peer, once
released, waits for the survivors to be gone before it exits.

Environment: ``HARDENING_EXAMPLES`` (hypothesis examples of ``properties``, default 30);
``ECHONCCL_TIMEOUT`` is honoured (``peer_exit_first`` relies on it).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import signal
import sys
import time

for _var in ("ECHONCCL_ENGINE", "ECHONCCL_ALGO", "ECHONCCL_CODEC", "ECHONCCL_CROSSOVER_BYTES"):
    os.environ.pop(_var, None)      # these checks choose their options themselves

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import echonccl  # noqa: E402
from echonccl import CommunicatorFailedError, EchoncclError, MismatchError, PeerTimeoutError, dtypes  # noqa: E402
from mpi_common import ALGOS, ENGINE, P, RANK, WORLD, rank_data, run_checks, to_engine, to_host  # noqa: E402
import support  # noqa: E402
from support import ONE_HOP, exact_sum  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
SURVIVOR_EXIT = 42
UNFINALIZED_EXIT = 43
FAULT_TIMEOUT = 3.0
LATE = 2.0 if ENGINE == "cpu" else 10.0     # how late a PeerTimeoutError may come (GPU: + NCCL abort)


# -- helpers ----------------------------------------------------------------------------------
def new_comm(comm=None, **kw):
    # two_shot unless told otherwise: on the GPU engine "auto" sends small sizes to plain NCCL,
    # which would bypass the 4-bit path (and the feedback binding) these checks are about
    kw.setdefault("algorithm", "two_shot")
    # int4 unless told otherwise: these checks pin that codec's extremes (the dtype's max kept
    # exactly, exact subnormal sums); the rotated int4-h32's range and NaN rules are checked in
    # tests/test_codec_rotated.py, tests/test_properties.py and tests/mpi/checks.py.
    kw.setdefault("codec", "int4")
    return echonccl.Communicator(comm, engine=ENGINE, **kw)


def canonical_f32(y) -> np.ndarray:
    """float32 copy (exact for every supported dtype) with one NaN bit pattern."""
    f = np.array(to_host(y), dtype=np.float32)
    f[np.isnan(f)] = np.float32("nan")
    return f


def digest(y) -> str:
    return hashlib.sha256(canonical_f32(y).tobytes()).hexdigest()


def assert_identical_across_ranks(y, what: str) -> None:
    """Engine arrays too; NaNs of any payload compare equal (`canonical_f32`)."""
    support.assert_identical_across_ranks(canonical_f32(y), what)


def expect_raises(exc_type, match: str, fn, *args, **kw) -> BaseException:
    try:
        fn(*args, **kw)
    except exc_type as e:
        assert match.lower() in str(e).lower(), f"{exc_type.__name__} without {match!r}: {e}"
        return e
    except Exception as e:
        raise AssertionError(f"expected {exc_type.__name__} ({match!r}), got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {exc_type.__name__} ({match!r}), nothing raised")


def check_within_bound(y, x, algo, group, dtype, what, mask=None) -> None:
    """``y`` is within `support.error_bound` of the exact sum of ``x`` (where ``mask``)."""
    exact = exact_sum(x)
    bound = support.error_bound(exact, support.amax_sum(x, group), algo, P, dtype)
    err = np.abs(np.asarray(to_host(y), dtype=np.float64) - exact)
    if mask is not None:
        err, bound = err[mask], bound[mask]
    worst = float(np.max(err / bound)) if err.size else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3f} of the bound"


def _report(line: str) -> None:
    """One write per line, so the launcher forwards it whole even if the process dies next."""
    os.write(1, (line + "\n").encode())


def _exit_unfinalized() -> None:
    """Leave without MPI_Finalize (spent duplicates hold requests that never complete), all
    ranks together, with `UNFINALIZED_EXIT` (see the module docstring): rank 0, which has
    reported for every rank, first; a launcher that kills the rest when one rank exits then
    cuts off nothing that matters."""
    WORLD.Barrier()      # WORLD itself is untouched: echonccl ran on duplicates
    time.sleep(0.5 if RANK == 0 else 2.0)
    os._exit(UNFINALIZED_EXIT)


# -- 1. bad input -----------------------------------------------------------------------------
def check_bad_input():
    """Every argument error is raised locally, with a precise message, before any
    communication; afterwards the communicator and the feedback state are intact."""
    comm = new_comm()
    n = 1000
    x = to_engine(rank_data(n, "float32", 1))
    expect = to_host(comm.all_reduce(x, feedback=False))
    fb = comm.new_feedback()
    comm.all_reduce(x, feedback=fb)
    before = fb.state_dict()

    for dt in (np.int8, np.uint8, np.int32, np.int64, np.float64, np.complex64, np.bool_):
        expect_raises(TypeError, "float16, bfloat16 and float32", comm.all_reduce, to_engine(np.zeros(64, dt)))
    big = to_engine(np.zeros((64, 64), np.float32))
    expect_raises(ValueError, "C-contiguous", comm.all_reduce, big[:, ::2])            # strided
    expect_raises(ValueError, "C-contiguous", comm.all_reduce, big[:, :32].T)          # transposed
    expect_raises(ValueError, "C-contiguous", comm.all_reduce, to_engine(np.zeros((64, 32), np.float32)),
                  big[:, ::2])                                                          # out strided
    buf = to_engine(np.zeros(4096, np.float32))
    expect_raises(ValueError, "overlaps x partly", comm.all_reduce, buf[:2048], buf[1024:3072])
    expect_raises(ValueError, "overlaps x partly", comm.all_reduce, buf[1:2049], buf[:2048])
    expect_raises(ValueError, "must match", comm.all_reduce, x, to_engine(np.zeros(n - 1, np.float32)))
    expect_raises(ValueError, "must match", comm.all_reduce, x, to_engine(np.zeros((10, 100), np.float32)))
    expect_raises(ValueError, "must match", comm.all_reduce, x, to_engine(np.zeros(n, ml_dtypes.bfloat16)))
    expect_raises(TypeError, "float16, bfloat16 and float32", comm.all_reduce, x, to_engine(np.zeros(n, np.int32)))
    expect_raises(ValueError, "algorithm", comm.all_reduce, x, algorithm="tree")
    expect_raises(TypeError, "feedback must be", comm.all_reduce, x, feedback="yes")
    expect_raises(TypeError, "", comm.all_reduce, [1.0, 2.0])
    expect_raises(EchoncclError, "bound to", comm.all_reduce, to_engine(rank_data(2 * n, "float32", 2)),
                  feedback=fb)                                                          # another shape
    expect_raises(EchoncclError, "bound to", comm.all_reduce, to_engine(rank_data(n, "bfloat16", 2)),
                  feedback=fb)                                                          # another dtype
    expect_raises(EchoncclError, "bound to", comm.all_reduce, to_engine(np.zeros(0, np.float32)),
                  feedback=fb)
    # read-only output memory: refused before the exchange, the feedback state untouched
    expect_raises(ValueError, "algorithm", comm.all_reduce, x, feedback=fb, algorithm="")
    if ENGINE == "cpu":
        ro = rank_data(n, "float32", 1)
        ro.flags.writeable = False
        expect_raises(ValueError, "read-only", comm.all_reduce, x, ro, feedback=fb)
        expect_raises(ValueError, "read-only", comm.all_reduce, ro, ro, feedback=fb)
    if ENGINE == "gpu":
        import cupy

        class ReadOnly:                 # device memory exported read-only (CAI data = (ptr, True))
            def __init__(self, a):
                self.a = a
                cai = dict(a.__cuda_array_interface__)
                cai["data"] = (cai["data"][0], True)
                self.__cuda_array_interface__ = cai

        ro = cupy.asarray(rank_data(n, "float32", 1))
        expect_raises(ValueError, "read-only", comm.all_reduce, x, ReadOnly(ro), feedback=fb)
        ro_x = ReadOnly(ro)
        expect_raises(ValueError, "read-only", comm.all_reduce, ro_x, ro_x, feedback=fb)
        expect_raises(TypeError, "host", comm.all_reduce, np.zeros(64, np.float32))
        ndev = cupy.cuda.runtime.getDeviceCount()
        if ndev > 1:
            with cupy.cuda.Device((comm.engine.device.id + 1) % ndev):
                other = cupy.zeros(64, cupy.float32)
            expect_raises(ValueError, "device", comm.all_reduce, other)
            with cupy.cuda.Device((comm.engine.device.id + 1) % ndev):
                other_out = cupy.zeros(n, cupy.float32)
            expect_raises(ValueError, "device", comm.all_reduce, x, other_out)
    else:
        class FakeDevice:
            __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}

        expect_raises(TypeError, "numpy", comm.all_reduce, FakeDevice())

    after = fb.state_dict()
    assert after["key"] == before["key"]
    assert after["inputs"].tobytes() == before["inputs"].tobytes(), "a rejected call changed the feedback state"
    assert after["output"].tobytes() == before["output"].tobytes(), "a rejected call changed the feedback state"
    got = to_host(comm.all_reduce(x, feedback=False))
    assert got.tobytes() == expect.tobytes(), "the communicator changed after rejected calls"
    # a writable view of x's exact memory is in place, not an overlap
    y = to_engine(rank_data(n, "float32", 1))
    comm.all_reduce(y, y.reshape(10, 100).reshape(-1), feedback=False)
    assert to_host(y).tobytes() == expect.tobytes()
    comm.close()


def check_local_error():
    """An argument error on ONE rank: that rank raises it at once, without communicating; the
    others raise PeerTimeoutError after the timeout (a signature already checked: in the
    exchange; a new one: in the metadata check). Never a hang."""
    timeout = 2.0
    x = None
    results = []
    for what in ("known signature", "new signature"):
        comm = new_comm(WORLD.Dup(), timeout=timeout)   # spent afterwards: requests never complete
        if x is None:     # after the communicator, which makes its GPU current (README "Use")
            x = to_engine(rank_data(4096, "float32", 3))
        if what == "known signature":
            comm.all_reduce(x)
            comm.synchronize()
            good, bad = x, to_engine(np.zeros((64, 128), np.float32))[:, ::2]
        else:
            good, bad = to_engine(rank_data(5000, "float32", 4)), to_engine(np.zeros(77, np.int32))
        t0 = time.monotonic()
        try:
            if RANK == 1:
                comm.all_reduce(bad)
            else:
                comm.all_reduce(good)
                comm.synchronize(timeout)
            results.append(f"{what}: no error")
        except PeerTimeoutError:
            dt = time.monotonic() - t0
            assert RANK != 1 and timeout - 0.05 <= dt <= timeout + LATE, f"{what}: PeerTimeoutError after {dt:.2f} s"
            results.append(f"{what}: PeerTimeoutError after {dt:.1f} s")
        except (TypeError, ValueError) as e:
            dt = time.monotonic() - t0
            assert RANK == 1 and dt < 0.5, f"{what}: local error after {dt:.2f} s"
            results.append(f"{what}: {type(e).__name__} at once")
    _report(f"RANK {RANK} " + "; ".join(results))
    WORLD.Barrier()
    if RANK == 0:
        _report(f"OK local_error ranks={P} engine={ENGINE}")
    _exit_unfinalized()


# -- empty arrays -----------------------------------------------------------------------------
def check_empty():
    """Empty arrays of any shape give empty results of the same shape and dtype on every rank,
    through every algorithm and feedback mode; the communicator stays usable."""
    comm = new_comm()
    for algo in ALGOS + ("nccl", "auto"):
        for dt in DTYPES:
            for shape in ((0,), (0, 7), (3, 0)):
                x = to_engine(np.zeros(shape, dtypes.numpy_dtype(dt)))
                for fb in (None, False, comm.new_feedback(), comm.new_feedback("input")):
                    y = comm.all_reduce(x, feedback=fb, algorithm=algo)
                    assert y.shape == shape and y.dtype == x.dtype and y.size == 0, (algo, dt, shape)
                assert comm.all_reduce(x, x, algorithm=algo) is x
                out = to_engine(np.zeros(shape, dtypes.numpy_dtype(dt)))
                assert comm.all_reduce(x, out, algorithm=algo) is out
    comm.synchronize()
    x = rank_data(1000, "float32", 5)
    y = to_host(comm.all_reduce(to_engine(x), feedback=False))
    check_within_bound(y, x, "two_shot", comm.group_size, "float32", "after empty calls")
    comm.close()


# -- mismatches between ranks -----------------------------------------------------------------
def _mismatch(comm, what: str, x, **kw) -> None:
    try:
        comm.all_reduce(x, **kw)
        msg = None
    except MismatchError as e:
        msg = str(e)
    msgs = WORLD.allgather(msg)
    missing = [r for r, m in enumerate(msgs) if m is None]
    assert not missing, f"{what}: no MismatchError on ranks {missing}"
    assert all(m == msgs[0] for m in msgs), f"{what}: the ranks raised different messages: {msgs}"
    if RANK == 0:
        print(f"{what}: {msgs[0]}")


def check_mismatch():
    """Sizes, shapes, dtypes, options that differ between ranks on a signature's first call:
    the same MismatchError on every rank, at once; the communicator stays usable."""
    comm = new_comm(timeout=30)
    G = comm.group_size
    n = 1000
    last = P - 1
    f32 = lambda m, s=0: to_engine(rank_data(m, "float32", s))      # noqa: E731
    _mismatch(comm, "count", f32(n + 1 if RANK == last else n))
    _mismatch(comm, "dtype", to_engine(rank_data(n, "bfloat16" if RANK == last else "float32", 1)))
    _mismatch(comm, "dtype fp16/bf16", to_engine(rank_data(n, "float16" if RANK == last else "bfloat16", 1)))
    if P >= 3:
        arg = (to_engine(rank_data(n + 7, "float32", 2)) if RANK == 1 else
               to_engine(rank_data(n, "float16", 2)) if RANK == 2 else f32(n, 2))
        _mismatch(comm, "count on rank 1, dtype on rank 2", arg)
    _mismatch(comm, "empty on rank 0 only", f32(0 if RANK == 0 else n, 3))
    _mismatch(comm, "empty on all but rank 0", f32(n if RANK == 0 else 0, 3))
    _mismatch(comm, "shape (same count)", f32(n, 4).reshape((10, 100)) if RANK == last else f32(n, 4))
    _mismatch(comm, "algorithm", f32(n, 5), algorithm="ring" if RANK == 0 else "two_shot")
    _mismatch(comm, "feedback off on one rank", f32(n, 6), feedback=False if RANK == last else None)
    _mismatch(comm, "baseline on one rank", f32(n, 7), algorithm="nccl" if RANK == 0 else "two_shot")
    with new_comm(codec="int4-h32" if RANK == last else "int4") as other:
        _mismatch(other, "codec", f32(n, 8))
    # the same signatures now agree: every call works and is right
    for algo in ALGOS:
        x = rank_data(n, "float32", 9)
        y = to_host(comm.all_reduce(to_engine(x), feedback=False, algorithm=algo))
        assert_identical_across_ranks(y, f"{algo} after mismatches")
        check_within_bound(y, x, algo, G, "float32", f"{algo} after mismatches")
    comm.close()


def check_out_of_step():
    """Ranks out of step on signatures each had already checked (rank 0 replays the other
    size): the exchange sees the size difference and raises MismatchError on every rank,
    never a silent wrong result (CPU engine; on GPU, NCCL gives no such guarantee)."""
    comm = new_comm(WORLD.Dup(), timeout=5, algorithm="two_shot")
    a, b = to_engine(rank_data(1000, "float32", 1)), to_engine(rank_data(100_000, "float32", 2))
    comm.all_reduce(a)
    comm.all_reduce(b)
    t0 = time.monotonic()
    try:
        comm.all_reduce(a if RANK == 0 else b)
        result = "no error"
    except MismatchError as e:
        result = f"MismatchError after {time.monotonic() - t0:.1f} s: {e}"
    except PeerTimeoutError as e:
        result = f"PeerTimeoutError after {time.monotonic() - t0:.1f} s: {e}"
    results = WORLD.allgather(result)
    for r, res in enumerate(results):
        assert res.startswith("MismatchError"), f"rank {r}: {res}"
    if RANK == 0:   # rank 0 reports for all: output of ranks that os._exit may be lost in forwarding
        for r, res in enumerate(results):
            _report(f"RANK {r} {res}")
        _report(f"OK out_of_step ranks={P} engine={ENGINE}")
    _exit_unfinalized()


def _outcome(fn) -> str:
    t0 = time.monotonic()
    try:
        fn()
        return "no error"
    except EchoncclError as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}"


def check_after_failure():
    """The issue-15 sequences. (a) CPU engine, every call checked: rank 0 repeating a
    signature it used before while rank 1 calls a new one, or an empty call it made before
    against 256 elements, raises MismatchError on every rank, and the next agreed call is
    right. (b) Both engines: a call that times out (rank 1 skipped it) marks the communicator
    failed: rank 0's next call and synchronize raise CommunicatorFailedError at once, rank 1's
    next call fails (never returns a result) and its later ones are refused too."""
    timeout = 2.0
    lines = []
    comm = new_comm(WORLD.Dup(), timeout=timeout)
    G = comm.group_size
    a, b = rank_data(256, "float32", 51), rank_data(512, "float32", 52)
    empty = np.zeros(0, np.float32)
    if ENGINE == "cpu":           # the GPU engine checks a signature's first call only (README)
        for what, mine, first in (("repeat vs new count", a if RANK == 0 else b, a),
                                  ("empty vs 256", empty if RANK == 0 else a, empty)):
            comm.all_reduce(to_engine(first))
            got = _outcome(lambda: comm.all_reduce(to_engine(mine)))
            outs = WORLD.allgather(got)
            assert all(o.startswith("MismatchError") for o in outs), f"{what}: {outs}"
            y = to_host(comm.all_reduce(to_engine(a), feedback=False))
            assert_identical_across_ranks(y, f"{what}: the next call")
            check_within_bound(y, a, "two_shot", G, "float32", f"{what}: the next call")
            y = to_host(comm.all_reduce(to_engine(a)))              # default feedback state too
            assert_identical_across_ranks(y, f"{what}: the next call with feedback")
            lines.append(f"{what}: MismatchError on every rank, then right")
    comm.all_reduce(to_engine(a))
    comm.synchronize()
    WORLD.Barrier()
    if RANK != 1:                 # rank 1 skips this call
        first = _outcome(lambda: (comm.all_reduce(to_engine(a)), comm.synchronize(timeout)))
        assert first.startswith("PeerTimeoutError"), f"rank {RANK}: {first}"
        again = _outcome(lambda: comm.all_reduce(to_engine(a)))
        sync = _outcome(lambda: comm.synchronize())
        for o in (again, sync):
            assert o.startswith("CommunicatorFailedError after 0.0 s") and "create a new Communicator" in o, o
        lines.append("skipped call: PeerTimeoutError, then CommunicatorFailedError")
    WORLD.Barrier()
    if RANK == 1:                 # now calls what rank 0 called: the others have given up
        late = _outcome(lambda: (comm.all_reduce(to_engine(a)), comm.synchronize(timeout)))
        assert late.startswith("PeerTimeoutError"), f"rank 1: {late}"
        again = _outcome(lambda: comm.all_reduce(to_engine(a)))
        assert again.startswith("CommunicatorFailedError after 0.0 s"), again
        lines.append("late call: PeerTimeoutError, then CommunicatorFailedError")
    t0 = time.monotonic()
    comm.close()                  # a failed communicator closes at once (GPU: NCCL aborted, not drained)
    assert time.monotonic() - t0 < 1.0, f"closing a failed communicator took {time.monotonic() - t0:.1f} s"
    expect_raises(EchoncclError, "closed", comm.all_reduce, to_engine(a))
    reports = WORLD.gather(f"RANK {RANK} " + "; ".join(lines), root=0)
    if RANK == 0:
        for line in reports:
            _report(line)
        _report(f"OK after_failure ranks={P} engine={ENGINE}")
    _exit_unfinalized()


# -- special values ---------------------------------------------------------------------------
def check_nonfinite():
    """NaN, +Inf, -Inf, Inf-Inf: their group of every rank's output is NaN (codec.py), the other
    groups are finite and within the bound; the residuals stay finite; the next call is clean.
    Values at the dtype's maximum: kept on one rank; a sum that overflows gives +Inf in the
    overflowing elements (float16) or a NaN group (float32, bfloat16: the float32 sum overflows)."""
    comm = new_comm()
    G = comm.group_size
    n = 8 * G * P
    for algo in ALGOS:
        for dt in DTYPES:
            what = f"{algo} {dt}"
            npdt = dtypes.numpy_dtype(dt)
            fb = comm.new_feedback()
            x = rank_data(n, dt, seed=11)
            if RANK == 0:
                x[5] = np.nan
                x[2 * G + 3] = -np.inf
            if RANK == P - 1:
                x[G + 1] = np.inf
                x[2 * G + 3] = np.inf
            y = to_host(comm.all_reduce(to_engine(x), feedback=fb, algorithm=algo))
            assert_identical_across_ranks(y, what)
            y32 = y.astype(np.float32)
            assert np.isnan(y32[: 3 * G]).all(), f"{what}: NaN/Inf groups are not all NaN"
            assert np.isfinite(y32[3 * G:]).all(), f"{what}: non-finite outside the NaN/Inf groups"
            st = fb.state_dict()
            assert np.isfinite(st["inputs"].astype(np.float32)).all(), f"{what}: residual not finite"
            assert np.isfinite(st["output"].astype(np.float32)).all(), f"{what}: residual not finite"
            x2 = rank_data(n, dt, seed=12)
            y2 = to_host(comm.all_reduce(to_engine(x2), feedback=fb, algorithm=algo))
            assert np.isfinite(y2.astype(np.float32)).all(), f"{what}: NaN poisoned the next call"

            allnan = np.full(n, np.nan, npdt) if RANK == 0 else rank_data(n, dt, 13)
            y3 = to_host(comm.all_reduce(to_engine(allnan), feedback=False, algorithm=algo))
            assert np.isnan(y3.astype(np.float32)).all(), f"{what}: all-NaN input"

            dmax = float(ml_dtypes.finfo(npdt).max)
            m = np.zeros(n, npdt)
            m[G:2 * G] = rank_data(G, dt, 14) * 0.5
            if RANK == 0:
                m[0:G] = dmax           # group 0: +max on one rank only
                m[G] = -dmax            # group 1: -max among normal values
            m[2 * G] = dmax             # group 2: +max on every rank: the sum overflows
            m[2 * G + 1:3 * G] = 0.5
            m[3 * G:4 * G] = dmax if RANK % 2 == 0 else -dmax      # group 3: +max and -max
            if P % 2:
                m[3 * G:4 * G] = 0 if RANK == P - 1 else m[3 * G:4 * G]
            ym = to_host(comm.all_reduce(to_engine(m), feedback=False, algorithm=algo)).astype(np.float64)
            assert_identical_across_ranks(ym, f"{what} max")
            assert np.all(ym[:G] == dmax), f"{what}: max on one rank not kept"
            assert np.isfinite(ym[G:2 * G]).all() and ym[G] < -0.99 * dmax, f"{what}: -max group"
            if dt == "float16":
                assert ym[2 * G] == np.inf, f"{what}: overflowing float16 sum is not +Inf"
                assert np.isfinite(ym[2 * G + 1:3 * G]).all(), f"{what}: overflow spread in its group"
            else:
                assert np.isnan(ym[2 * G:3 * G]).all(), f"{what}: float32 overflow is not a NaN group"
            keep = np.ones(n, bool)
            keep[2 * G:3 * G] = False
            assert np.isfinite(ym[keep]).all(), f"{what}: non-finite outside the overflowing group"
            check_within_bound(ym, m, algo, G, dt, f"{what} max", mask=keep)
    comm.close()


def check_subnormal():
    """Subnormal inputs survive: float32 2**-149 (1e-45) sums exactly, 1e-40 and mixed groups
    stay within the bound and non-zero; bfloat16 and float16 subnormals likewise."""
    comm = new_comm()
    G = comm.group_size
    n = 8 * G
    assert P <= 7, "exactness of 2**-149 sums needs at most 7 ranks"
    for algo in ALGOS:
        for fb in (False, comm.new_feedback()):
            what = f"{algo} feedback={fb is not False}"
            x = np.zeros(n, np.float32)
            x[0:G] = np.float32(1e-45)                      # rounds to 2**-149
            x[G:2 * G] = np.float32(1e-40)
            x[2 * G:3 * G] = np.float32(1e-40) if RANK == 0 else np.float32(1e-45)
            x[3 * G:4 * G] = rank_data(G, "float32", 21) * np.float32(1e-39)
            x[4 * G:5 * G] = np.float32(-1e-45) if RANK % 2 else np.float32(1e-45)
            y = to_host(comm.all_reduce(to_engine(x), feedback=fb, algorithm=algo))
            assert_identical_across_ranks(y, what)
            assert np.all(y[:G] == np.float32(P * 2.0 ** -149)), f"{what}: 2**-149 sum not exact: {y[:4]}"
            assert np.all(y[G:2 * G] > 0), f"{what}: 1e-40 collapsed"
            exp5 = (P + 1) // 2 - P // 2
            assert np.all(y[4 * G:5 * G] == np.float32(exp5 * 2.0 ** -149)), f"{what}: +-2**-149 sum"
            if fb is False:
                check_within_bound(y, x, algo, G, "float32", what)
            for dt, tiny in (("bfloat16", 1e-40), ("float16", 1e-6)):
                npdt = dtypes.numpy_dtype(dt)
                smallest = float(ml_dtypes.finfo(npdt).smallest_subnormal)
                z = np.zeros(n, npdt)
                z[0:G] = smallest
                z[G:2 * G] = tiny
                z[2 * G:3 * G] = (rank_data(G, "float32", 22) * tiny).astype(npdt)
                yz = to_host(comm.all_reduce(to_engine(z), feedback=False, algorithm=algo)).astype(np.float64)
                assert_identical_across_ranks(yz, f"{what} {dt}")
                assert np.all(yz[:G] == P * smallest), f"{what} {dt}: smallest subnormal sum {yz[:2]}"
                assert np.all(yz[G:2 * G] > 0), f"{what} {dt}: subnormals collapsed"
                check_within_bound(yz, z, algo, G, dt, f"{what} {dt}")
    comm.close()


# -- faults -----------------------------------------------------------------------------------
def _survive(check: str, call, t0: float, timeout: float, survivors, pids=None) -> None:
    """Run ``call`` on a surviving rank: it must raise PeerTimeoutError after about ``timeout`` s,
    and then ``call`` again must raise CommunicatorFailedError at once (the communicator's ranks
    may be out of step: it must refuse, never compute). ``survivors``: the MPI communicator of
    the surviving ranks, to leave together once all have reported."""
    code = 1
    try:
        call()
    except PeerTimeoutError as e:
        dt = time.monotonic() - t0
        t1 = time.monotonic()
        try:
            call()
            refused = "NOT REFUSED: the next call ran"
        except CommunicatorFailedError as e2:
            refused = (f"then CommunicatorFailedError after {time.monotonic() - t1:.2f} s"
                       if "create a new Communicator" in str(e2) else f"then a vague refusal: {e2}")
        except BaseException as e2:  # noqa: BLE001 - reported below
            refused = f"then {type(e2).__name__}: {e2}"
        refused_ok = refused.startswith("then CommunicatorFailedError") and time.monotonic() - t1 < 1.0
        _report(f"SURVIVOR rank={RANK} PeerTimeoutError after {dt:.2f} s: {e}")
        _report(f"REFUSAL rank={RANK} {refused}")
        for pid in pids or ():
            try:
                os.kill(pid, signal.SIGCONT)     # let the frozen peer go (it exits once we are gone)
            except ProcessLookupError:
                pass                             # another survivor's SIGCONT already let it go
        ok = timeout - 0.05 <= dt <= timeout + LATE and refused_ok
        if RANK == 0 and ok:
            _report(f"OK {check} ranks={P} engine={ENGINE}")
        code = SURVIVOR_EXIT if ok else 3
    except BaseException as e:  # noqa: BLE001 - reported, then a distinct exit status
        _report(f"SURVIVOR rank={RANK} unexpected {type(e).__name__}: {e}")
        code = 2
    else:
        _report(f"SURVIVOR rank={RANK} NO ERROR after {time.monotonic() - t0:.2f} s")
    _leave_together(survivors)
    os._exit(code)


def _leave_together(comm, limit: float = 30.0) -> None:
    """Wait (at most ``limit`` s) until every rank of ``comm`` is here, so that a launcher that
    kills the job when the first rank exits cuts off no rank's report."""
    req = comm.Ibarrier()
    deadline = time.monotonic() + limit
    while not req.Test() and time.monotonic() < deadline:
        time.sleep(0.01)


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped by the
    launcher's proxy, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _wait_until_gone(pids, limit: float = 60.0) -> None:
    """Wait (at most ``limit`` s) until the processes ``pids`` (on this node) have exited."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not [pid for pid in pids if _running(pid)]:
            return
        time.sleep(0.05)


def _fault(check: str, how: str, warm: bool) -> None:
    timeout = float(os.environ["ECHONCCL_TIMEOUT"]) if not warm else FAULT_TIMEOUT
    comm = new_comm(timeout=None if not warm else timeout, algorithm="two_shot")    # the 4-bit path
    assert comm.config.timeout == timeout, comm.config.timeout
    x = to_engine(rank_data(50_000, "bfloat16", 31))
    pids = WORLD.allgather(os.getpid())
    survivors = WORLD.Split(0 if RANK != 1 else MPI.UNDEFINED)
    if warm:
        comm.all_reduce(x)                     # the signature is checked: the hang is in the data path
        comm.synchronize()
    WORLD.Barrier()
    if RANK == 1:
        if how == "exit":
            os._exit(0)                        # dies: no MPI_Finalize, no goodbye
        os.kill(os.getpid(), signal.SIGSTOP)   # freezes, until a survivor sends SIGCONT
        # Released: leave only after the survivors, so that their status is the job's (Open MPI's
        # mpirun reports the first rank to end abnormally, and ending unfinalized is abnormal).
        _wait_until_gone([p for r, p in enumerate(pids) if r != 1])
        os._exit(0)

    def call():
        comm.all_reduce(x)
        comm.synchronize(timeout)              # GPU: the wait is here (polls, then aborts NCCL)

    _survive(check, call, time.monotonic(), timeout, survivors, [pids[1]] if how == "stop" else None)


def check_peer_exit():
    """Rank 1 exits after a warm-up call; the others' next all-reduce raises PeerTimeoutError
    after Communicator(timeout=3) seconds (GPU: in synchronize)."""
    _fault("peer_exit", "exit", warm=True)


def check_peer_exit_first():
    """Rank 1 exits before the first call; the others raise PeerTimeoutError in the metadata
    check, after ECHONCCL_TIMEOUT seconds (set by the launcher's environment)."""
    _fault("peer_exit_first", "exit", warm=False)


def check_peer_hang():
    """Rank 1 freezes (SIGSTOP) after a warm-up call; the others raise PeerTimeoutError."""
    _fault("peer_hang", "stop", warm=True)


# -- lifecycle --------------------------------------------------------------------------------
def check_close_reopen():
    """Communicators close and reopen in one process (explicit engine and ``auto``), several
    times, two at once; results are bitwise the same; a closed one refuses calls. The input
    is made after the first communicator (README "Use") and serves all the later ones."""
    x = None
    ref = None
    for engine in (ENGINE, "auto"):
        for _ in range(3):
            comm = echonccl.Communicator(engine=engine, codec="int4")
            if x is None:
                x = to_engine(rank_data(20_000, "bfloat16", 41))
            fb = comm.new_feedback()
            y = canonical_f32(comm.all_reduce(x, feedback=False, algorithm="two_shot"))
            comm.all_reduce(x, feedback=fb, algorithm="ring")
            ref = y if ref is None else ref
            assert y.tobytes() == ref.tobytes(), f"engine={engine}: a reopened communicator differs"
            comm.close()
            comm.close()                                   # idempotent
            expect_raises(EchoncclError, "closed", comm.all_reduce, x)
    with new_comm() as a, new_comm(WORLD.Dup()) as b:      # two at once, on two MPI communicators
        ya = canonical_f32(a.all_reduce(x, feedback=False, algorithm="two_shot"))
        yb = canonical_f32(b.all_reduce(x, feedback=False, algorithm="two_shot"))
        assert ya.tobytes() == yb.tobytes() == ref.tobytes()
    assert a._closed and b._closed
    if ENGINE == "gpu":
        import cupy

        pool = cupy.get_default_memory_pool()
        used0 = pool.used_bytes()
        for _ in range(3):
            with new_comm() as c:
                c.all_reduce(x, feedback=c.new_feedback())
                c.synchronize()
        import gc

        gc.collect()
        assert pool.used_bytes() <= used0 + (1 << 20), f"device memory grew: {used0} -> {pool.used_bytes()}"


def check_cache():
    """Memory stays bounded under changing sizes: 1000 distinct sizes (two dtypes, default
    feedback states and none) through a communicator whose cache is bounded by 256 KiB; after
    every call the cached bytes stay under the bound plus what that call uses, and the
    entries stay few. Nearby sizes share one workspace, and a shared (larger) workspace gives
    bitwise the outputs of a communicator that never evicts. GPU: a call captured into a CUDA
    graph pins its workspace, which then survives the churn, and the graph replays right.
    The cache holds the NCCL path's workspaces: the fused path has none (its registered
    regions are bounded apart, README "Fused path memory"), so the GPU runs this check with
    ECHONCCL_FUSED=0."""
    import os

    cap = 256 << 10
    os.environ["ECHONCCL_FUSED"] = "0"
    try:
        small, big = new_comm(cache_bytes=cap), new_comm(WORLD.Dup(), cache_bytes=1 << 40)
    finally:
        del os.environ["ECHONCCL_FUSED"]
    G = small.group_size
    rng = np.random.default_rng(7)             # the same sizes on every rank
    counts = rng.choice(np.arange(1, 60_000), size=1000, replace=False)
    most = 0
    for i, n in enumerate(counts):
        n = int(n)
        dt = "float32" if i % 2 else "bfloat16"
        x = to_engine(rank_data(n, dt, seed=i))
        fb = None if i % 3 else False
        y = small.all_reduce(x, feedback=fb)
        L = small._layout(n)
        in_use = (3 * P - 2) * ((L.slice_bytes * 5) // 4 + 4096) + (4 * (L.padded + L.slice_elems) if fb is None else 0)
        assert small.cached_bytes() <= cap + in_use, f"call {i} n={n}: {small.cached_bytes()} cached, bound {cap}"
        most = max(most, len(small._cache))
        if i % 10 == 0:
            yb = big.all_reduce(x, feedback=False)
            ys = small.all_reduce(x, feedback=False)
            assert canonical_f32(ys).tobytes() == canonical_f32(yb).tobytes(), f"n={n}: shared workspace differs"
            assert_identical_across_ranks(y, f"n={n}")
    assert most <= 40, f"{most} cache entries for a {cap} byte bound"
    assert small._cache.evictions > 900, small._cache.evictions
    # an evicted default state comes back fresh (its residuals are gone: README "Memory")
    assert small.default_feedback(int(counts[1]), "float32").key is None
    # nearby sizes share a workspace
    before = sum(1 for k in big._cache._entries if k[0] == "ws")
    for n in range(200_000, 200_400, 7):
        big.all_reduce(to_engine(rank_data(n, "float32", seed=n)), feedback=False)
    assert sum(1 for k in big._cache._entries if k[0] == "ws") <= before + 2
    if ENGINE == "gpu":
        _check_captured_calls_are_pinned(small)
    small.close()
    big.close()


def _check_captured_calls_are_pinned(comm) -> None:
    import cupy

    n = 300_000
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = to_engine(rank_data(n, "float32", seed=99))
        out = cupy.empty_like(x)
        comm.all_reduce(x, out, feedback=False)         # warm-up: allocations happen outside the capture
        stream.synchronize()
        expect = out.get()
        out.fill(0)
        stream.begin_capture()
        comm.all_reduce(x, out, feedback=False)
        graph = stream.end_capture()
    pinned = {k: e.obj for k, e in comm._cache._entries.items() if e.pinned}
    assert pinned and comm._cache.pinned_bytes() > 0, "a captured call pinned nothing"
    for i, m in enumerate(range(1000, 400_000, 9973)):  # churn: every other workspace is evicted
        comm.all_reduce(to_engine(rank_data(m, "float32", seed=i)), feedback=False)
    for key, obj in pinned.items():
        e = comm._cache._entries.get(key)
        assert e is not None and e.obj is obj, f"the pinned entry {key} was evicted"
    graph.launch(stream)
    stream.synchronize()
    assert out.get().tobytes() == expect.tobytes(), "the replayed graph differs from the eager call"
    del graph
    comm.unpin_all()
    assert comm._cache.pinned_bytes() == 0


def check_prepared_memory():
    """Prepared calls (``out`` given: later calls with the same buffers replay them) hold nothing
    the caller or the cache gave up: a `Feedback` the caller dropped is collected, and once a new
    call is prepared no kept call refers to it, to its residuals or to an evicted cache entry
    (workspace, default state). Sizes change every call, as a soak's do (tools/soak.py found
    gigabytes held so on two GPUs)."""
    import gc
    import weakref

    def weak(obj):
        try:
            return weakref.ref(obj)
        except TypeError:           # an engine array without weak references: not checked
            return None

    comm = new_comm(cache_bytes=256 << 10)
    states, residuals = [], []
    for i in range(40):
        n = 1000 + 37 * i
        x, out = to_engine(rank_data(n, "float32", seed=i)), to_engine(np.zeros(n, np.float32))
        fb = comm.new_feedback()
        comm.all_reduce(x, out, feedback=fb)
        comm.all_reduce(x, out, feedback=fb)        # replayed
        comm.all_reduce(x, out)                     # the default state, in the cache
        states.append(weakref.ref(fb))
        residuals.append(weak(fb.residuals.inputs))
        del fb
    x, out = to_engine(rank_data(5000, "float32", seed=99)), to_engine(np.zeros(5000, np.float32))
    comm.all_reduce(x, out, feedback=False)         # a new prepared call
    gc.collect()
    assert comm._cache.evictions > 0, "nothing was evicted: the check needs a smaller cache"
    assert all(r() is None for r in states), "a Feedback the caller dropped is still referenced"
    assert all(r is None or r() is None for r in residuals), "a dropped Feedback's residuals are held"
    for prep in comm._prepared.values():
        assert prep.ready(), "a prepared call that can no longer replay is kept"
        assert all(e.live for e in prep.entries), "a prepared call holds an evicted cache entry"
    comm.all_reduce(x, out, feedback=False)         # the survivor still replays, and matches
    assert_identical_across_ranks(out, "replayed after the sweep")
    comm.close()


def check_replay():
    """A call whose buffers the communicator has seen replays its prepared work (no checks,
    lookups or argument conversion again: the host's fast path) and must give bitwise what the
    full path gives: every algorithm, default, explicit and no feedback, rounds 1 and 2, new
    data in the same buffers, in place, a state reloaded mid-way (new residual buffers), a
    cache small enough to evict the default states between calls. The full path is forced on
    a twin communicator with ``out=None`` (a new array each call: never replayed). Then: a
    read-only view of a replayed ``out`` is still refused, and on the CPU engine (signatures
    compared on every call) a rank that replays while another calls differently gets the
    MismatchError."""
    algos = ALGOS + ("nccl", "one_shot", "auto")
    for cache in (1 << 40, 64 << 10):
        fast, full = new_comm(cache_bytes=cache), new_comm(WORLD.Dup(), cache_bytes=cache)
        for algo in algos:
            for fb_kind in ("default", "explicit", "off"):
                for rounds in (1, 2):
                    if rounds == 2 and (fb_kind == "off" or algo in ("nccl", "one_shot")):
                        continue
                    for n, dt in ((3000, "bfloat16"), (777, "float32")):
                        _replay_sequence(fast, full, algo, fb_kind, rounds, n, dt, cache)
        assert len(fast._prepared) > 0, "nothing was prepared"
        fast.close()
        full.close()
    comm = new_comm()
    x = to_engine(rank_data(512, "float32", 1))
    out = to_engine(np.zeros(512, np.float32))
    comm.all_reduce(x, out)
    comm.all_reduce(x, out)
    if ENGINE == "cpu":
        ro = out.view()
        ro.flags.writeable = False
        expect_raises(ValueError, "read-only", comm.all_reduce, x, ro)
        y = to_engine(rank_data(1024 if RANK == P - 1 else 512, "float32", 2))
        o2 = to_engine(np.zeros(y.size, np.float32))
        e = expect_raises(MismatchError, "different arguments", comm.all_reduce, y if RANK == P - 1 else x,
                          o2 if RANK == P - 1 else out)
        assert "count=1024" in str(e) and "count=512" in str(e), e
        comm.all_reduce(x, out)        # still usable, and in step
    comm.close()


def _replay_sequence(fast, full, algo, fb_kind, rounds, n, dt, cache) -> None:
    what = f"{algo} feedback={fb_kind} rounds={rounds} n={n} {dt} cache={cache}"
    states = {"explicit": (fast.new_feedback(), full.new_feedback()), "off": (False, False),
              "default": (None, None)}[fb_kind]
    x = to_engine(np.zeros(n, dtypes.numpy_dtype(dt)))
    out = to_engine(np.zeros(n, dtypes.numpy_dtype(dt)))
    for step in range(6):
        data = rank_data(n, dt, seed=100 * step + 7)
        x[...] = to_engine(data)
        if step == 3 and fb_kind == "explicit":            # reload: new residual buffers on both
            for c, st in zip((fast, full), states):
                sd = st.state_dict()
                st.load_state_dict({**sd, "key": None, "inputs": None, "output": None})
                st.load_state_dict(sd, zeros=c.engine.zeros)
        if cache < (1 << 20) and fb_kind == "default":       # evict the default states
            for c in (fast, full):
                c.all_reduce(to_engine(rank_data(40_000, "float32", step)), feedback=None, algorithm="two_shot")
        in_place = step == 5
        if in_place:
            y = fast.all_reduce(x, x, feedback=states[0], algorithm=algo, rounds=rounds if rounds > 1 else None)
        else:
            y = fast.all_reduce(x, out, feedback=states[0], algorithm=algo, rounds=rounds if rounds > 1 else None)
        z = full.all_reduce(to_engine(data), None, feedback=states[1], algorithm=algo,
                            rounds=rounds if rounds > 1 else None)
        assert canonical_f32(y).tobytes() == canonical_f32(z).tobytes(), f"{what} step {step}: replay differs"
    if fb_kind == "explicit":
        for a, b in zip(_residual_arrays(states[0]), _residual_arrays(states[1])):
            assert a.tobytes() == b.tobytes(), f"{what}: residuals differ"


def _residual_arrays(fb):
    sd = fb.state_dict()
    return [np.asarray(sd[k]) for k in ("inputs", "output") if sd.get(k) is not None]


def check_device():
    """GPU: the communicator and the arrays agree on the device without the caller picking it.
    Arrays made after creating a communicator, after closing it, after creating another, are
    on its device and accepted; a call made while another device is current runs on the
    communicator's device and leaves the caller's current device as it was; an array on
    another device is refused with a message that says what to do. CPU: nothing to check."""
    if ENGINE != "gpu":
        return
    import cupy

    ndev = cupy.cuda.runtime.getDeviceCount()
    comm = new_comm()
    d = comm.device
    assert d == comm.engine.device.id and cupy.cuda.runtime.getDevice() == d
    x = to_engine(rank_data(5000, "float32", 61))               # no cupy.cuda.Device(...).use()
    assert x.device.id == d, f"an array made after the communicator is on device {x.device.id}, not {d}"
    y = to_host(comm.all_reduce(x, feedback=False))
    assert_identical_across_ranks(y, "after creation")
    comm.synchronize()
    comm.close()
    x2 = to_engine(rank_data(5000, "float32", 61))              # after close(): still the same device
    assert x2.device.id == d, f"after close() arrays land on device {x2.device.id}, not {d}"
    with new_comm() as a, new_comm(WORLD.Dup()) as b:           # two communicators, one device
        x3 = to_engine(rank_data(5000, "float32", 61))
        assert x3.device.id == d == a.device == b.device
        assert to_host(a.all_reduce(x3, feedback=False)).tobytes() == y.tobytes()
        assert to_host(b.all_reduce(x2, feedback=False)).tobytes() == y.tobytes()
        if ndev > 1:
            other = (d + 1) % ndev
            with cupy.cuda.Device(other):     # the caller works on another device meanwhile
                got = to_host(a.all_reduce(x3, feedback=False, algorithm="ring"))
                a.synchronize()
                assert cupy.cuda.runtime.getDevice() == other, "a call changed the caller's device"
                wrong = cupy.zeros(64, cupy.float32)
            ref = to_host(a.all_reduce(x3, feedback=False, algorithm="ring"))
            assert got.tobytes() == ref.tobytes(), "a call made under another current device differs"
            e = expect_raises(ValueError, f"cupy.cuda.Device({d}).use()", a.all_reduce, wrong)
            assert f"on device {other}" in str(e) and "torch.cuda.set_device" in str(e), str(e)


# -- determinism ------------------------------------------------------------------------------
def _sequence_hash(comm, algo: str) -> tuple[str, str]:
    """(hash of every output, hash of every rank's final residuals) of a fixed call sequence."""
    h_out, h_state = hashlib.sha256(), hashlib.sha256()
    for dt in DTYPES:
        for mode in ("off", "float32", "input"):
            for n in (1, 777, 5000, 65_537):
                fb = False if mode == "off" else comm.new_feedback(mode)
                for t in range(3):
                    x = rank_data(n, dt, seed=1000 + 10 * n + t)
                    if t == 1 and n > 100:
                        x[:: 97] = np.nan if RANK == 0 else x[:: 97]
                    y = comm.all_reduce(to_engine(x), feedback=fb, algorithm=algo)
                    assert_identical_across_ranks(y, f"{algo} {dt} {mode} n={n}")
                    h_out.update(canonical_f32(y).tobytes())
                if fb is not False:
                    st = fb.state_dict()
                    h_state.update(st["inputs"].tobytes() + st["output"].tobytes())
    states = WORLD.allgather(h_state.hexdigest())
    return h_out.hexdigest(), hashlib.sha256("".join(states).encode()).hexdigest()


def check_determinism():
    """Same inputs, same outputs, bitwise: on every rank, twice in one process (fresh
    communicators); rank 0 prints HASH lines that separate launches must reproduce."""
    for algo in ALGOS:
        first = None
        for _ in range(2):
            with new_comm() as comm:
                got = _sequence_hash(comm, algo)
            first = got if first is None else first
            assert got == first, f"{algo}: a second run in the same process differs"
        if RANK == 0:
            print(f"HASH {algo} outputs={first[0]} residuals={first[1]}")


# -- state that survives ----------------------------------------------------------------------
def _roundtrip(sd: dict, how: str) -> dict:
    if how == "pickle":
        return pickle.loads(pickle.dumps(sd))
    buf = io.BytesIO()              # a typical checkpoint: arrays in an .npz, the rest as JSON
    meta = {k: list(v) if k == "key" else v for k, v in sd.items() if k not in ("inputs", "output")}
    np.savez(buf, inputs=sd["inputs"], output=sd["output"], meta=json.dumps(meta))
    buf.seek(0)
    z = np.load(buf)
    return {**json.loads(str(z["meta"])), "inputs": z["inputs"], "output": z["output"]}


def check_resume():
    """A run interrupted at step k and resumed from Feedback.state_dict (pickle and .npz
    round trips, Communicator.load_feedback, or loading into a bound or default state) gives
    bitwise the outputs and final residuals of the uninterrupted run; resuming with fresh
    residuals does not."""
    T, k, n = 8, 3, 3001
    comm = new_comm()
    for algo in ALGOS:
        for dt in ("float32", "bfloat16"):
            for rdt in ("float32", "input"):
                what = f"{algo} {dt} residual={rdt}"
                xs = [rank_data(n, dt, seed=500 + t) for t in range(T)]
                fb = comm.new_feedback(rdt)
                outs, saved = [], None
                for t in range(T):
                    if t == k:
                        saved = fb.state_dict()
                    outs.append(to_host(comm.all_reduce(to_engine(xs[t]), feedback=fb, algorithm=algo)))
                final = fb.state_dict()

                def replay(state, feedback_arg=None, c=comm):
                    for t in range(k, T):
                        y = to_host(c.all_reduce(to_engine(xs[t]), feedback=feedback_arg, algorithm=algo))
                        if y.tobytes() != outs[t].tobytes():
                            return False
                    st = state.state_dict()
                    return (st["inputs"].tobytes() == final["inputs"].tobytes()
                            and st["output"].tobytes() == final["output"].tobytes())

                for how in ("pickle", "npz"):
                    with new_comm() as resumed:
                        restored = resumed.load_feedback(_roundtrip(saved, how))
                        assert replay(restored, restored, resumed), f"{what} ({how}): resumed run differs"
                bound = comm.new_feedback(rdt)             # loading into an already bound state
                comm.all_reduce(to_engine(xs[0]), feedback=bound, algorithm=algo)
                bound.load_state_dict(_roundtrip(saved, "npz"))
                assert replay(bound, bound), f"{what}: loading into a bound state differs"
                with new_comm() as resumed:                # the communicator's default state
                    default = resumed.default_feedback(n, dt)
                    default.load_state_dict(_roundtrip(saved, "pickle"), zeros=resumed.engine.zeros)
                    assert replay(default, None, resumed), f"{what}: default state differs"
                fresh = comm.new_feedback(rdt)
                assert not replay(fresh, fresh), f"{what}: fresh residuals reproduce the run (test is void)"
    comm.close()


# -- properties (hypothesis, every rank drawing the same examples) ---------------------------
def check_properties():
    """Hypothesis-driven (derandomized: every rank draws the same examples, verified each
    time): sizes, dtypes, schedules, scales, NaN/Inf/max/subnormal injections,
    feedback on or off. Invariants: identical outputs on every rank; NaN exactly in the groups
    with a non-finite input; without feedback, the bound against the exact sum; with feedback,
    telescoping (sum of outputs - sum of exact sums == -residuals) and finite residuals."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    comm = new_comm(timeout=60)
    special = st.tuples(st.integers(0, P - 1), st.floats(0, 1, exclude_max=True),
                        st.sampled_from(["nan", "inf", "-inf", "max", "-max", "subnormal", "zero-group"]))
    case = st.fixed_dictionaries({
        "n": st.one_of(st.integers(1, 4000), st.sampled_from([1, 2, 31, 32, 33, 511, 512, 513, 1024 * P + 1,
                                                                 512 * P, 512 * P - 1])),
        "dtype": st.sampled_from(DTYPES),
        "algo": st.sampled_from(ALGOS),
        "feedback": st.sampled_from(["off", "float32", "input"]),
        "calls": st.integers(1, 3),
        "exp": st.integers(-30, 30),
        "seed": st.integers(0, 2 ** 31 - 1),
        "specials": st.lists(special, max_size=4),
    })
    examples = int(os.environ.get("HARDENING_EXAMPLES", "30"))
    counter = {"n": 0}

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
              print_blob=False)
    @given(c=case)
    def prop(c):
        counter["n"] += 1
        reprs = WORLD.allgather(repr(sorted(c.items())))
        if any(r != reprs[0] for r in reprs):
            raise RuntimeError("ranks drew different hypothesis examples: the program is not SPMD")
        failure = None
        try:
            _property_case(comm, c)
        except AssertionError as e:
            failure = f"rank {RANK}: {e}"
        failures = [f for f in WORLD.allgather(failure) if f]
        assert not failures, "; ".join(failures)      # the same verdict on every rank

    prop()
    comm.close()
    if RANK == 0:
        print(f"properties: {counter['n']} examples")


def _property_case(comm, c) -> None:
    n, G, dt, algo, T = c["n"], comm.group_size, c["dtype"], c["algo"], c["calls"]
    npdt = dtypes.numpy_dtype(dt)
    exp = max(min(c["exp"], 10), -12) if dt == "float16" else c["exp"]
    scale = 2.0 ** exp
    dmax = float(ml_dtypes.finfo(npdt).max)
    tiny = float(ml_dtypes.finfo(npdt).smallest_subnormal)
    fb = False if c["feedback"] == "off" else comm.new_feedback(c["feedback"])
    ngroups = -(-n // G)
    ever_bad = np.zeros(ngroups, bool)
    acc_out, acc_exact, xmax = np.zeros(n), np.zeros(n), 0.0
    for t in range(T):
        x = rank_data(n, dt, seed=c["seed"] + t, scale=scale)
        bad = np.zeros(ngroups, bool)           # groups that must come out NaN
        big = np.zeros(ngroups, bool)           # groups holding +-max: no bound check there
        specials = sorted(c["specials"], key=lambda s: s[2] != "zero-group")   # zeroing first
        for rank, where, kind in specials if t == T - 1 or fb is False else ():
            i = int(where * n)
            g = i // G
            if kind in ("nan", "inf", "-inf"):
                bad[g] = True
                if rank == RANK:
                    x[i] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
            elif kind in ("max", "-max") and rank == 0 and fb is False:
                big[g] = True                   # +-max on rank 0, 0 elsewhere: the sum cannot overflow
                x[i] = (dmax if kind == "max" else -dmax) if RANK == 0 else 0
            elif kind == "subnormal" and rank == RANK:
                x[i] = tiny
            elif kind == "zero-group" and rank == RANK:
                x[g * G:(g + 1) * G] = 0
        big &= ~bad
        y = comm.all_reduce(to_engine(x), feedback=fb, algorithm=algo)
        y64 = to_host(y).astype(np.float64)
        what = f"call {t}"
        assert_identical_across_ranks(y, what)
        elem_bad = np.repeat(bad, G)[:n]
        assert np.isnan(y64[elem_bad]).all(), f"{what}: a group with NaN/Inf input is not all NaN"
        assert np.isfinite(y64[~elem_bad]).all(), f"{what}: non-finite output outside the NaN/Inf groups"
        if fb is False:
            ok = ~(elem_bad | np.repeat(big, G)[:n])
            check_within_bound(y64, x, algo, G, dt, what, mask=ok)
            if t == 0:
                xi = to_engine(x.copy())
                comm.all_reduce(xi, xi, feedback=False, algorithm=algo)
                assert canonical_f32(xi).tobytes() == canonical_f32(y).tobytes(), "in place differs"
        else:
            ever_bad |= bad
            acc_out += np.where(elem_bad, 0, y64)
            acc_exact += exact_sum(np.where(elem_bad, 0, x.astype(np.float64)))
            xmax = max(xmax, float(WORLD.allreduce(np.max(np.abs(np.where(elem_bad, 0, x.astype(np.float64)))),
                                                   op=MPI.MAX)))
    if fb is False:
        return
    state = fb.state_dict()
    assert np.isfinite(state["inputs"].astype(np.float32)).all() and np.isfinite(
        state["output"].astype(np.float32)).all(), "residuals not finite"
    e_in = WORLD.allreduce(state["inputs"].astype(np.float64))
    e_out = np.concatenate(WORLD.allgather(state["output"].astype(np.float64)))
    residual = (e_in + e_out)[:n]
    good = ~np.repeat(ever_bad, G)[:n]
    gap = np.abs(acc_out - acc_exact + residual)[good]
    tol = 2.0 ** -20 * T * (P + 1) * xmax * 4
    if c["feedback"] == "input" and dt != "float32":
        tol += 2.0 ** -6 * T * (P + 1) * xmax * P           # residuals rounded to the input dtype
    tol += 8 * T * (P + 1) * (2.0 ** -149 + tiny)
    if (algo in ONE_HOP or not fb.rounding) and dt != "float32":     # its output's rounding is not fed back
        tol += 2.0 ** -7 * T * (P + 1) * xmax
    worst = float(gap.max()) if gap.size else 0.0
    assert worst <= tol, f"telescoping gap {worst:.3g} > {tol:.3g}"


CHECKS = {f.__name__[len("check_"):]: f for f in
          (check_bad_input, check_local_error, check_empty, check_mismatch, check_out_of_step, check_after_failure,
           check_nonfinite, check_subnormal, check_peer_exit, check_peer_exit_first, check_peer_hang,
           check_close_reopen, check_cache, check_device, check_determinism, check_resume, check_properties,
           check_replay, check_prepared_memory)}

# They end the process themselves (exit statuses 42 and 43, a rank killed or frozen): one a launch.
ALONE = ("local_error", "out_of_step", "after_failure", "peer_exit", "peer_exit_first", "peer_hang")

if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1], alone=ALONE)
