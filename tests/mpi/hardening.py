"""Hardening checks across ranks, run as ``mpiexec -n N python tests/mpi/hardening.py CHECK [ENGINE]``.

Same pattern as checks.py: every rank asserts, rank 0 prints ``OK <check> ranks=N engine=E``;
ENGINE is ``cpu`` (default) or ``gpu``. The pytest wrappers are tests/test_hardening.py
(CPU) and tests/test_gpu_hardening.py (GPU).

Two kinds of checks end differently, by design:

* fault checks (``peer_exit``, ``peer_exit_first``, ``peer_hang``): rank 1 dies (exits
  without MPI_Finalize) or freezes (SIGSTOP) before an all-reduce; every other rank must
  raise `PeerTimeoutError` within the timeout, prints ``SURVIVOR rank=R ...`` and exits
  with status `SURVIVOR_EXIT` (42) without finalizing MPI. Under MPICH's hydra they need
  ``mpiexec -disable-auto-cleanup`` (otherwise the launcher kills the survivors first).
* ``local_error`` and ``out_of_step`` leave the MPI communicator unusable on purpose: every
  rank prints ``RANK r ...`` and exits with status 0 without finalizing.

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

for _var in ("ECHONCCL_ENGINE", "ECHONCCL_ALGO", "ECHONCCL_GROUP_SIZE", "ECHONCCL_CROSSOVER_BYTES"):
    os.environ.pop(_var, None)      # these checks choose their options themselves

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import echonccl  # noqa: E402
from echonccl import EchoncclError, MismatchError, PeerTimeoutError, dtypes  # noqa: E402
from mpi_common import ALGOS, ENGINE, P, RANK, WORLD, rank_data, to_engine, to_host  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
SURVIVOR_EXIT = 42
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
    hashes = WORLD.allgather(digest(y))
    assert all(h == hashes[0] for h in hashes), f"{what}: outputs differ between ranks"


def expect_raises(exc_type, match: str, fn, *args, **kw) -> BaseException:
    try:
        fn(*args, **kw)
    except exc_type as e:
        assert match.lower() in str(e).lower(), f"{exc_type.__name__} without {match!r}: {e}"
        return e
    except Exception as e:
        raise AssertionError(f"expected {exc_type.__name__} ({match!r}), got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {exc_type.__name__} ({match!r}), nothing raised")


def exact_sum(x: np.ndarray) -> np.ndarray:
    return WORLD.allreduce(np.asarray(x, dtype=np.float64))


def group_amax(x64: np.ndarray, group: int) -> np.ndarray:
    pad = -(-x64.size // group) * group
    v = np.zeros(pad)
    v[: x64.size] = np.abs(x64)
    return np.repeat(v.reshape(-1, group).max(axis=1), group)[: x64.size]


def error_bound(x: np.ndarray, algo: str, group: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(exact fp64 sum, per-element bound) of a feedback-free 4-bit all-reduce of ``x``
    (the README bound, with the ring's extra hops, plus a few units of the smallest float32 and
    output-dtype subnormals: groups below ~1e-44 can clip to +-7, see test_properties)."""
    x64 = np.asarray(x, dtype=np.float64)
    exact = exact_sum(x64)
    amax_sum = WORLD.allreduce(group_amax(np.where(np.isfinite(x64), x64, 0), group))
    hops = 2 if algo == "two_shot" else P
    tiny = float(ml_dtypes.finfo(dtypes.numpy_dtype(dtype)).smallest_subnormal)
    bound = (hops * (1 + 1 / 7) ** P * amax_sum / 14 + np.abs(exact) * 2.0 ** -7
             + 8 * (P + 1) * (2.0 ** -149 + tiny))
    return exact, bound


def check_within_bound(y, x, algo, group, dtype, what, mask=None) -> None:
    exact, bound = error_bound(x, algo, group, dtype)
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
    ranks together: MPICH's launcher kills the rest as soon as one rank exits, which could
    cut off output another rank has not had forwarded yet."""
    WORLD.Barrier()      # WORLD itself is untouched: echonccl ran on duplicates
    time.sleep(0.5)
    os._exit(0)


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
    if ENGINE == "gpu":
        import cupy

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
    x = to_engine(rank_data(4096, "float32", 3))
    results = []
    for what in ("known signature", "new signature"):
        comm = new_comm(WORLD.Dup(), timeout=timeout)   # spent afterwards: requests never complete
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
    check_within_bound(y, x, "two_shot", comm.config.group_size, "float32", "after empty calls")
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
    G = comm.config.group_size
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
    with new_comm(group_size=64 if RANK == last else G) as other:
        _mismatch(other, "group size", f32(n, 8))
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


# -- special values ---------------------------------------------------------------------------
def check_nonfinite():
    """NaN, +Inf, -Inf, Inf-Inf: their group of every rank's output is NaN (codec.py), the other
    groups are finite and within the bound; the residuals stay finite; the next call is clean.
    Values at the dtype's maximum: kept on one rank; a sum that overflows gives +Inf in the
    overflowing elements (float16) or a NaN group (float32, bfloat16: the float32 sum overflows)."""
    comm = new_comm()
    G = comm.config.group_size
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
    G = comm.config.group_size
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
def _survive(check: str, call, t0: float, timeout: float, pids=None) -> None:
    """Run ``call`` on a surviving rank: it must raise PeerTimeoutError after about ``timeout`` s."""
    try:
        call()
    except PeerTimeoutError as e:
        dt = time.monotonic() - t0
        _report(f"SURVIVOR rank={RANK} PeerTimeoutError after {dt:.2f} s: {e}")
        for pid in pids or ():
            try:
                os.kill(pid, signal.SIGCONT)     # let the frozen peer go (it exits at once)
            except ProcessLookupError:
                pass                             # another survivor's SIGCONT already let it go
        ok = timeout - 0.05 <= dt <= timeout + LATE
        if RANK == 0 and ok:
            _report(f"OK {check} ranks={P} engine={ENGINE}")
        os._exit(SURVIVOR_EXIT if ok else 3)
    except BaseException as e:  # noqa: BLE001 - reported, then a distinct exit status
        _report(f"SURVIVOR rank={RANK} unexpected {type(e).__name__}: {e}")
        os._exit(2)
    _report(f"SURVIVOR rank={RANK} NO ERROR after {time.monotonic() - t0:.2f} s")
    os._exit(1)


def _fault(check: str, how: str, warm: bool) -> None:
    timeout = float(os.environ["ECHONCCL_TIMEOUT"]) if not warm else FAULT_TIMEOUT
    comm = new_comm(timeout=None if not warm else timeout, algorithm="two_shot")    # the 4-bit path
    assert comm.config.timeout == timeout, comm.config.timeout
    x = to_engine(rank_data(50_000, "bfloat16", 31))
    pids = WORLD.allgather(os.getpid())
    if warm:
        comm.all_reduce(x)                     # the signature is checked: the hang is in the data path
        comm.synchronize()
    WORLD.Barrier()
    if RANK == 1:
        if how == "exit":
            os._exit(0)                        # dies: no MPI_Finalize, no goodbye
        os.kill(os.getpid(), signal.SIGSTOP)   # freezes, until a survivor sends SIGCONT
        os._exit(0)

    def call():
        comm.all_reduce(x)
        comm.synchronize(timeout)              # GPU: the wait is here (polls, then aborts NCCL)

    _survive(check, call, time.monotonic(), timeout, [pids[1]] if how == "stop" else None)


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
    times, two at once; results are bitwise the same; a closed one refuses calls."""
    x = to_engine(rank_data(20_000, "bfloat16", 41))
    ref = None
    for engine in (ENGINE, "auto"):
        for _ in range(3):
            comm = echonccl.Communicator(engine=engine, codec="int4")
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
    meta = {"residual_dtype": sd["residual_dtype"], "enabled": sd["enabled"], "key": list(sd["key"])}
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
    time): sizes, group sizes, dtypes, schedules, scales, NaN/Inf/max/subnormal injections,
    feedback on or off. Invariants: identical outputs on every rank; NaN exactly in the groups
    with a non-finite input; without feedback, the bound against the exact sum; with feedback,
    telescoping (sum of outputs - sum of exact sums == -residuals) and finite residuals."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    comms = {G: new_comm(group_size=G, timeout=60) for G in echonccl.GROUP_SIZES}
    special = st.tuples(st.integers(0, P - 1), st.floats(0, 1, exclude_max=True),
                        st.sampled_from(["nan", "inf", "-inf", "max", "-max", "subnormal", "zero-group"]))
    case = st.fixed_dictionaries({
        "n": st.one_of(st.integers(1, 4000), st.sampled_from([1, 2, 31, 32, 33, 511, 512, 513, 1024 * P + 1,
                                                                 512 * P, 512 * P - 1])),
        "group": st.sampled_from(echonccl.GROUP_SIZES),
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
            _property_case(comms[c["group"]], c)
        except AssertionError as e:
            failure = f"rank {RANK}: {e}"
        failures = [f for f in WORLD.allgather(failure) if f]
        assert not failures, "; ".join(failures)      # the same verdict on every rank

    prop()
    for c in comms.values():
        c.close()
    if RANK == 0:
        print(f"properties: {counter['n']} examples")


def _property_case(comm, c) -> None:
    n, G, dt, algo, T = c["n"], c["group"], c["dtype"], c["algo"], c["calls"]
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
    worst = float(gap.max()) if gap.size else 0.0
    assert worst <= tol, f"telescoping gap {worst:.3g} > {tol:.3g}"


CHECKS = {f.__name__[len("check_"):]: f for f in
          (check_bad_input, check_local_error, check_empty, check_mismatch, check_out_of_step,
           check_nonfinite, check_subnormal, check_peer_exit, check_peer_exit_first, check_peer_hang,
           check_close_reopen, check_determinism, check_resume, check_properties)}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    WORLD.Barrier()
    if RANK == 0:
        print(f"OK {sys.argv[1]} ranks={P} engine={ENGINE}", flush=True)
