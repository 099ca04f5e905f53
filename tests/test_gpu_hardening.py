"""The hardening checks on the GPU engine (CUDA kernels + NCCL) across two GPUs, under mpiexec.
Skipped without two GPUs. See tests/test_hardening.py for the CPU versions and the launcher notes.

On the GPU a dead or frozen peer hangs the stream, not the call: the survivors' all_reduce
returns, and ``synchronize(timeout)`` polls, aborts the NCCL communicator and raises
PeerTimeoutError. ``out_of_step`` is not run here: NCCL send/recv of mismatched sizes is
undefined (no size check on the wire), so on GPU the guarantee stops at the first-call
metadata check (MismatchError) and the timeout.
"""
import re
import time

import pytest

from conftest import needs_gpus

pytestmark = needs_gpus(2)

from conftest import run_mpi  # noqa: E402
from test_hardening import (HASH_LINES, SURVIVOR_EXIT, SURVIVOR_LINE, UNFINALIZED_EXIT,  # noqa: E402
                            _hashes, assert_failed_communicators_refuse, run_check, run_fault)

CHECKS = ["bad_input", "empty", "mismatch", "nonfinite", "subnormal", "close_reopen", "resume", "cache", "device",
          "replay", "prepared_memory"]


@pytest.mark.parametrize("check", CHECKS)
def test_gpu_check(check):
    res = run_check(2, check, "gpu", timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert f"OK {check} ranks=2 engine=gpu" in res.stdout


def test_gpu_properties():
    pytest.importorskip("hypothesis")
    res = run_check(2, "properties", "gpu", timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "OK properties ranks=2 engine=gpu" in res.stdout


def test_gpu_determinism_matches_the_cpu_reference():
    """Bitwise the same outputs and residuals on every rank, in two launches, and equal to the
    CPU engine's (the GPU engine is bit-exact with the reference; NaN payloads canonicalized)."""
    runs = {eng: [run_check(2, "determinism", eng, timeout=600) for _ in range(2 if eng == "gpu" else 1)]
            for eng in ("gpu", "cpu")}
    hashes = {}
    for eng, results in runs.items():
        for res in results:
            assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        got = [_hashes(r.stdout) for r in results]
        assert all(g == got[0] for g in got) and len(got[0]) == HASH_LINES, got
        hashes[eng] = got[0]
    assert hashes["gpu"] == hashes["cpu"], hashes


def test_gpu_argument_error_on_one_rank_times_out_the_others():
    res = run_check(2, "local_error", "gpu", timeout=300)
    assert res.returncode == UNFINALIZED_EXIT, res.stdout + res.stderr
    assert "RANK 1 known signature: ValueError at once; new signature: TypeError at once" in res.stdout
    assert re.search(r"RANK 0 known signature: PeerTimeoutError after [\d.]+ s; new signature: PeerTimeoutError",
                     res.stdout), res.stdout


def test_gpu_failed_communicator_refuses_later_calls():
    """A call that timed out (rank 1 skipped it) aborts NCCL; every later call of that
    communicator, on every rank, raises CommunicatorFailedError instead of running."""
    res = run_check(2, "after_failure", "gpu", timeout=300)
    assert res.returncode == UNFINALIZED_EXIT, res.stdout + res.stderr
    assert "OK after_failure ranks=2 engine=gpu" in res.stdout, res.stdout + res.stderr
    assert res.stdout.count("then CommunicatorFailedError") == 2, res.stdout


@pytest.mark.parametrize("check", ["peer_exit", "peer_hang"])
def test_gpu_dead_or_frozen_peer_raises_in_synchronize(check):
    res, wall = run_fault(2, check, "gpu", wall_limit=300)
    found = SURVIVOR_LINE.findall(res.stdout)
    assert [int(r) for r, _, _ in found] == [0], res.stdout + res.stderr
    t, msg = float(found[0][1]), found[0][2]
    assert 2.95 <= t <= 3 + 10, t                       # 3 s, plus the NCCL abort
    assert "GPU work did not finish within 3 s (a peer died or hangs); NCCL communicator aborted" in msg, msg
    assert_failed_communicators_refuse(res, [0])
    assert res.returncode == SURVIVOR_EXIT, res.stdout + res.stderr
    assert wall < 120


def test_gpu_peer_dead_before_first_call():
    res, wall = run_fault(2, "peer_exit_first", "gpu", timeout_env="3", wall_limit=300)
    found = SURVIVOR_LINE.findall(res.stdout)
    assert [int(r) for r, _, _ in found] == [0], res.stdout + res.stderr
    assert "metadata check" in found[0][2]
    assert_failed_communicators_refuse(res, [0])
    assert res.returncode == SURVIVOR_EXIT


def test_gpu_soak():
    t0 = time.monotonic()
    res = run_mpi(
        2, ["tools/soak.py", "--engine", "gpu", "--calls", "300", "--max-bytes", "64M", "--seed", "2"], timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert re.search(r"engine=gpu .*errors=0", res.stdout), res.stdout
    assert time.monotonic() - t0 < 600
