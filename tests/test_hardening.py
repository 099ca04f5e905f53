"""Hardening on the CPU engine: bad input, mismatches between ranks, failing peers, determinism,
feedback state that survives a restart, the soak tool.

Multi-rank checks live in tests/mpi/hardening.py (run under mpiexec); the rest run here in
one process (MPI.COMM_SELF).

Failing peers and the launcher. MPICH's hydra kills every rank as soon as one exits without
MPI_Finalize; ``-disable-auto-cleanup`` stops that for a rank that *exits* (any status), which
is what ``peer_exit`` does, so the survivors live on to raise PeerTimeoutError. A rank killed
by a *signal* is different: hydra 5's proxy then kills the other ranks of its node anyway, at
a random moment, even with that option (seen here in about half the runs), so a SIGKILLed
peer cannot be tested reliably under hydra on one node; ``peer_hang`` (the peer freezes with
SIGSTOP, as a hung process or a stalled node would) covers the silent peer instead.
"""
from __future__ import annotations

import io
import pickle
import re
import time

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import echonccl
from echonccl import EchoncclError, MismatchError, PeerTimeoutError
from echonccl.schedules import SCHEDULES
from echonccl.transport_mpi import MpiTransport, wait_all

import launch
from conftest import run_mpi

SURVIVOR_EXIT = 42
UNFINALIZED_EXIT = 43      # tests/mpi/hardening.py: checks that end without MPI_Finalize


# -- launching ----------------------------------------------------------------------------------
def launcher_keeps_survivors() -> list[str] | None:
    """mpiexec options under which a rank may exit early without the launcher killing the
    others; None when this launcher has none we know of."""
    mpiexec = launch.find_mpiexec()
    return ["-disable-auto-cleanup"] if mpiexec and launch.flavor(mpiexec) == "hydra" else None


def run_fault(n: int, check: str, engine: str, timeout_env: str | None = None, wall_limit: float = 120):
    """Launch a fault check (without ``-m mpi4py``: its ranks die on purpose); return
    (CompletedProcess, wall seconds)."""
    if launch.find_mpiexec() is None:
        pytest.skip("no mpiexec")
    extra = launcher_keeps_survivors()
    if extra is None and check != "peer_hang":
        pytest.skip(f"{launch.find_mpiexec()} is not MPICH's hydra: no known option keeps the survivors "
                    f"of an exit alive")
    t0 = time.monotonic()
    res = run_mpi(n, ["tests/mpi/hardening.py", check, engine], timeout=wall_limit, launcher_args=extra or (),
                  extra_env={"ECHONCCL_TIMEOUT": timeout_env}, abort_on_error=False)
    return res, time.monotonic() - t0


SURVIVOR_LINE = re.compile(r"SURVIVOR rank=(\d+) PeerTimeoutError after ([\d.]+) s: (.*)")
REFUSAL_LINE = re.compile(r"REFUSAL rank=(\d+) then CommunicatorFailedError after ([\d.]+) s")


def assert_failed_communicators_refuse(res, survivors: list[int]) -> None:
    """After its PeerTimeoutError every survivor's next call was refused at once."""
    found = {int(r): float(t) for r, t in REFUSAL_LINE.findall(res.stdout)}
    assert sorted(found) == survivors, f"refusals: {found}\n{res.stdout}"
    assert all(t < 1.0 for t in found.values()), found


def assert_survivors_timed_out(res, wall: float, n: int, check: str, engine: str, timeout: float,
                               where: str) -> None:
    out = res.stdout + res.stderr
    found = {int(r): (float(t), msg) for r, t, msg in SURVIVOR_LINE.findall(res.stdout)}
    assert sorted(found) == [r for r in range(n) if r != 1], f"survivors that reported: {sorted(found)}\n{out}"
    for r, (t, msg) in found.items():
        assert timeout - 0.05 <= t <= timeout + 2, f"rank {r} raised after {t} s\n{out}"
        assert f"within {timeout:g} s (a peer died or hangs)" in msg, msg
        assert where in msg, msg
    assert_failed_communicators_refuse(res, [r for r in range(n) if r != 1])
    assert f"OK {check} ranks={n} engine={engine}" in res.stdout, out
    assert res.returncode == SURVIVOR_EXIT, f"exit status {res.returncode}\n{out}"
    assert wall < timeout + 25, f"took {wall:.1f} s"


def run_check(n: int, check: str, engine: str = "cpu", env_extra: dict | None = None, timeout: float = 300):
    """Launch a check with ECHONCCL_TIMEOUT unset (the checks time themselves) plus ``env_extra``."""
    # these checks end without MPI_Finalize: keep hydra from killing ranks still writing
    extra = (launcher_keeps_survivors() or []) if check in UNFINALIZED else []
    return run_mpi(n, ["tests/mpi/hardening.py", check, engine], timeout=timeout, launcher_args=extra,
                   extra_env={"ECHONCCL_TIMEOUT": None, **(env_extra or {})})


UNFINALIZED = ("local_error", "out_of_step", "after_failure")


# -- multi-rank checks --------------------------------------------------------------------------
# The checks that end normally share one launch a rank count (conftest.CheckLaunches), and so does
# ``properties``, whose test is tests/test_properties.py's; the others (UNFINALIZED, the faults,
# determinism across launches) launch on their own below.
SHARED = ("bad_input", "empty", "mismatch", "nonfinite", "subnormal", "close_reopen", "resume", "cache", "replay",
          "prepared_memory")
SHARED_LAUNCH = SHARED + ("properties",)
SIMPLE = [(c, n) for n in (2, 3) for c in SHARED]


@pytest.mark.mpi
@pytest.mark.parametrize("check,n", SIMPLE)
def test_check(check_launches, check, n):
    """``check`` of tests/mpi/hardening.py (its docstring says what it asserts) passes on ``n``
    ranks, with ECHONCCL_TIMEOUT unset, and no warning of its own (or of nobody's) on stderr."""
    res = check_launches.run(n, "tests/mpi/hardening.py", SHARED_LAUNCH, check, extra_env={"ECHONCCL_TIMEOUT": None})
    assert res.returncode == 0, res.output
    assert f"OK {check} ranks={n} engine=cpu" in res.stdout
    assert not res.warnings(), res.stderr[-2000:]


# A rank that fails or goes silent is noticed in the next call's metadata check, before any
# schedule runs (the same code at any world size); 3 ranks check it with two survivors at once in
# every CI run, 2 ranks (one survivor) only in make test-all (`slow`: seconds of waiting that tell
# nothing new).
FAULT_RANKS = [pytest.param(2, marks=pytest.mark.slow), 3]


@pytest.mark.mpi
@pytest.mark.parametrize("n", FAULT_RANKS)
def test_argument_error_on_one_rank_times_out_the_others(n):
    t0 = time.monotonic()
    res = run_check(n, "local_error", timeout=60)
    assert res.returncode == UNFINALIZED_EXIT, res.stdout + res.stderr
    assert "RANK 1 known signature: ValueError at once; new signature: TypeError at once" in res.stdout
    for r in range(n):
        if r != 1:   # the delay's bounds (timeout .. timeout + LATE) are the check's own assertion
            assert re.search(rf"RANK {r} known signature: PeerTimeoutError after [\d.]+ s; "
                             rf"new signature: PeerTimeoutError after [\d.]+ s", res.stdout), res.stdout
    assert time.monotonic() - t0 < 20


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_out_of_step_raise_mismatch_not_garbage(n):
    res = run_check(n, "out_of_step", timeout=60)
    assert res.returncode == UNFINALIZED_EXIT, res.stdout + res.stderr
    assert f"OK out_of_step ranks={n} engine=cpu" in res.stdout
    assert res.stdout.count("MismatchError after") == n


@pytest.mark.mpi
@pytest.mark.parametrize("n", FAULT_RANKS)
def test_every_call_is_checked_and_a_failed_communicator_refuses(n):
    """The sequences of issue 15 that used to time out and then compute garbage: now a
    MismatchError on every rank (the next call is right), and after a timeout every later
    call raises CommunicatorFailedError."""
    res = run_check(n, "after_failure", timeout=120)
    assert res.returncode == UNFINALIZED_EXIT, res.stdout + res.stderr
    assert f"OK after_failure ranks={n} engine=cpu" in res.stdout, res.stdout + res.stderr
    assert res.stdout.count("MismatchError on every rank, then right") == 2 * n, res.stdout
    assert res.stdout.count("then CommunicatorFailedError") == n, res.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("n", FAULT_RANKS)
@pytest.mark.parametrize("check", ["peer_exit", "peer_hang"])
def test_dead_or_frozen_peer_raises_peer_timeout(check, n):
    """Rank 1 exits (or freezes) after a warm-up call; with Communicator(timeout=3) every other
    rank raises PeerTimeoutError about 3 s later (in the per-call signature check, which is the
    first message of every call), names the silent rank, prints it and exits with status 42:
    no hang."""
    res, wall = run_fault(n, check, "cpu")
    assert_survivors_timed_out(res, wall, n, check, "cpu", 3.0, "metadata check")
    assert "no answer from ranks [1]" in res.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("n", FAULT_RANKS)
def test_peer_dead_before_first_call_times_out_via_environment(n):
    """ECHONCCL_TIMEOUT=2: the metadata check of the first call times out."""
    res, wall = run_fault(n, "peer_exit_first", "cpu", timeout_env="2")
    assert_survivors_timed_out(res, wall, n, "peer_exit_first", "cpu", 2.0, "metadata check")


HASH_LINES = len(SCHEDULES) - 1      # one per schedule check_determinism runs (tests/mpi/mpi_common.ALGOS)


def _hashes(stdout: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if line.startswith("HASH "))


# as the faults: 3 ranks in every CI run, 2 in make test-all (7 s of a 2-core runner; the same code)
@pytest.mark.mpi
@pytest.mark.parametrize("n", FAULT_RANKS)
def test_deterministic_across_ranks_runs_and_launches(n):
    runs = [run_check(n, "determinism") for _ in range(2)]
    for res in runs:
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    first, second = (_hashes(r.stdout) for r in runs)
    assert len(first) == HASH_LINES and first == second, f"launches differ:\n{first}\n{second}"


# -- single process -----------------------------------------------------------------------------
@pytest.fixture
def comm():
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as c:
        yield c


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.int64, np.float64, np.complex64,
                                   np.bool_, ml_dtypes.float8_e4m3fn])
def test_non_float_dtypes_name_the_supported_ones(comm, dtype):
    with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
        comm.all_reduce(np.zeros(8, dtype))


def test_bad_arguments_are_rejected_before_anything_runs(comm):
    x = np.ones((4, 256), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.all_reduce(x[:, ::2])
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.all_reduce(x.T)
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.all_reduce(x[:, :128].copy(), x[:, ::2])
    with pytest.raises(ValueError, match="overlaps x partly"):
        comm.all_reduce(x.reshape(-1)[:512], x.reshape(-1)[256:768])
    with pytest.raises(ValueError, match="must match"):
        comm.all_reduce(x, np.zeros((256, 4), np.float32))
    with pytest.raises(ValueError, match="must match"):
        comm.all_reduce(x, np.zeros((4, 256), np.float16))
    with pytest.raises(TypeError, match="numpy"):
        comm.all_reduce(x.tolist())
    with pytest.raises(TypeError, match="feedback must be"):
        comm.all_reduce(x, feedback=object())
    with pytest.raises(ValueError, match="algorithm must be one of"):
        comm.all_reduce(x, algorithm="")                 # not a silent default
    ro = np.ones((4, 256), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        comm.all_reduce(x, ro)
    with pytest.raises(ValueError, match="x is read-only"):
        comm.all_reduce(ro, ro)
    assert comm.all_reduce(ro).flags.writeable          # a read-only x with a new out is fine


def test_empty_algorithm_is_refused_by_the_configuration():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        echonccl.Communicator(MPI.COMM_SELF, engine="cpu", algorithm="")
    with pytest.raises(ValueError, match="cache_bytes"):
        echonccl.Communicator(MPI.COMM_SELF, engine="cpu", cache_bytes=-1)


def test_feedback_bound_elsewhere_is_rejected_even_on_one_rank(comm):
    fb = echonccl.Feedback()
    fb.bind((1024, 2, 32, "float32"), echonccl.Layout(1024, 2), np.dtype(np.float32), np.zeros)
    with pytest.raises(EchoncclError, match="bound to"):
        comm.all_reduce(np.ones(1024, np.float32), feedback=fb)      # world size 1 here, 2 in fb


def test_single_rank_special_values_pass_through(comm):
    x = np.array([np.nan, np.inf, -np.inf, 3.4e38, 1e-45, -0.0], np.float32)
    assert comm.all_reduce(x).tobytes() == x.tobytes()


def test_zero_dimensional_array(comm):
    x = np.array(2.5, np.float32)
    y = comm.all_reduce(x)
    assert y.shape == () and y == 2.5


def test_closed_and_reopened_in_one_process():
    x = np.arange(1000, dtype=np.float32)
    for engine in ("cpu", "auto"):
        for _ in range(3):
            c = echonccl.Communicator(MPI.COMM_SELF, engine=engine)
            assert c.all_reduce(x).tobytes() == x.tobytes()
            c.close()
            c.close()
            with pytest.raises(EchoncclError, match="closed"):
                c.all_reduce(x)


@pytest.mark.parametrize("value", ["0", "-1", "abc"])
def test_bad_timeout_is_named(monkeypatch, value):
    monkeypatch.setenv("ECHONCCL_TIMEOUT", value)
    with pytest.raises(ValueError, match="timeout|ECHONCCL_TIMEOUT"):
        echonccl.Communicator(MPI.COMM_SELF, engine="cpu")


def test_timeout_from_environment(monkeypatch):
    monkeypatch.setenv("ECHONCCL_TIMEOUT", "2.5")
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", timeout=100) as c:
        assert c.config.timeout == 2.5 and c.engine.transport.timeout == 2.5


def test_wait_all_times_out_instead_of_hanging():
    buf = np.empty(16, np.uint8)
    req = MPI.COMM_SELF.Irecv([buf, MPI.BYTE], source=0, tag=999)       # nobody ever sends it
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"within 0.3 s.*no answer from ranks \[0\]"):
        wait_all([req], 0.3, "test", peers=[0])
    assert 0.3 <= time.monotonic() - t0 < 2
    req.Wait()                                   # cancelled by wait_all: completes at once


def test_exchange_detects_messages_of_another_size():
    t = MpiTransport(MPI.COMM_SELF, timeout=5)
    with pytest.raises(MismatchError, match="sent 8 bytes where 16"):
        t.exchange([(0, np.zeros(8, np.uint8))], [(0, np.zeros(16, np.uint8))])
    with pytest.raises(MismatchError, match="did not fit"):
        t.exchange([(0, np.zeros(16, np.uint8))], [(0, np.zeros(8, np.uint8))])
    t.exchange([(0, np.arange(16, dtype=np.uint8))], [(0, out := np.zeros(16, np.uint8))])
    assert np.array_equal(out, np.arange(16))


# -- feedback state: save and load --------------------------------------------------------------
def _bound(residual_dtype, dtype="bfloat16", count=1000, nranks=2):
    fb = echonccl.Feedback(residual_dtype)
    L = echonccl.Layout(count, nranks)
    res = fb.bind((count, nranks, 32, dtype), L, np.dtype(echonccl.dtypes.numpy_dtype(dtype)), np.zeros)
    rng = np.random.default_rng(0)
    res.inputs[:] = rng.standard_normal(res.inputs.size).astype(res.inputs.dtype)
    res.output[:] = rng.standard_normal(res.output.size).astype(res.output.dtype)
    return fb


def _npz(sd):
    buf = io.BytesIO()
    np.savez(buf, inputs=sd["inputs"], output=sd["output"], key=np.array([str(k) for k in sd["key"]]))
    buf.seek(0)
    z = np.load(buf)
    return {"residual_dtype": sd["residual_dtype"], "enabled": sd["enabled"], "key": z["key"],
            "inputs": z["inputs"], "output": z["output"]}


@pytest.mark.parametrize("residual_dtype", ["float32", "input"])
@pytest.mark.parametrize("via", ["pickle", "npz"])
def test_state_dict_round_trips_keep_dtype_and_bits(residual_dtype, via):
    fb = _bound(residual_dtype)
    sd = fb.state_dict()
    back = pickle.loads(pickle.dumps(sd)) if via == "pickle" else _npz(sd)
    if via == "npz" and residual_dtype == "input":
        assert back["inputs"].dtype.kind == "V"          # what np.savez makes of bfloat16
    fresh = echonccl.Feedback()
    fresh.load_state_dict(back, zeros=np.zeros)
    assert fresh.key == (1000, 2, 32, "bfloat16") and fresh.residual_dtype == residual_dtype
    for name in ("inputs", "output"):
        a, b = getattr(fresh.residuals, name), sd[name]
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_loading_another_residual_dtype_into_a_bound_state_reallocates():
    target = _bound("float32")
    target.load_state_dict(_bound("input").state_dict(), zeros=np.zeros)
    assert target.residual_dtype == "input" and target.residuals.inputs.dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("breakage,match", [
    (lambda d: d.update(inputs=d["inputs"][:-1]), "inputs has"),
    (lambda d: d.update(output=np.zeros(3, np.float32)), "output has"),
    (lambda d: d.update(key=(1000, 2)), "key"),
    (lambda d: d.update(residual_dtype="float64"), "residual_dtype"),
    (lambda d: d.update(inputs=d["inputs"].astype(np.int32)), "dtype"),
    (lambda d: d["inputs"].__setitem__(7, np.nan), "NaN or Inf"),
    (lambda d: d["output"].__setitem__(0, np.inf), "NaN or Inf"),
    (lambda d: d["inputs"].__setitem__(3, -np.inf), "NaN or Inf"),
    (lambda d: d.pop("key"), "no 'key' entry"),
    (lambda d: d.pop("inputs"), "no 'inputs' entry"),
    (lambda d: d.pop("output"), "no 'output' entry"),
    (lambda d: d.pop("residual_dtype"), "no 'residual_dtype' entry"),
    (lambda d: d.pop("enabled"), "no 'enabled' entry"),
])
def test_corrupt_state_dicts_are_refused(breakage, match):
    sd = _bound("float32").state_dict()
    breakage(sd)
    with pytest.raises(EchoncclError, match=match):
        echonccl.Feedback().load_state_dict(sd, zeros=np.zeros)
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", codec="int4") as c, \
            pytest.raises(EchoncclError, match=match):     # the state's own codec: only the corruption is wrong
        c.load_feedback(sd)
    target = _bound("float32")                # a bound state refuses it and keeps its residuals
    before = target.state_dict()
    with pytest.raises(EchoncclError, match=match):
        target.load_state_dict(sd)
    assert target.residuals.inputs.tobytes() == before["inputs"].tobytes()


@pytest.mark.parametrize("residual_dtype", ["float32", "input"])
def test_non_finite_residuals_are_refused_in_every_dtype(residual_dtype):
    sd = _bound(residual_dtype).state_dict()
    sd["output"] = sd["output"].copy()
    sd["output"][5] = np.nan
    with pytest.raises(EchoncclError, match="NaN or Inf"):
        echonccl.Feedback().load_state_dict(_npz(sd), zeros=np.zeros)


def test_state_from_another_world_size_is_refused_at_the_first_call():
    sd = _bound("float32", dtype="float32", count=1000, nranks=2).state_dict()
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", codec=sd["codec"]) as comm:
        fb = comm.load_feedback(sd)
        with pytest.raises(EchoncclError, match="bound to"):
            comm.all_reduce(np.ones(1000, np.float32), feedback=fb)


# -- soak ---------------------------------------------------------------------------------------
@pytest.mark.mpi
def test_soak_short():
    res = run_mpi(2, ["tools/soak.py", "--engine", "cpu", "--calls", "50", "--max-bytes", "64K", "--seed", "1"],
                  timeout=120)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert re.search(r"calls=50 .*errors=0", res.stdout), res.stdout
    assert "memory" in res.stdout
