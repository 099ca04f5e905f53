"""The schedules across real MPI ranks on the CPU engine (tests/mpi/checks.py under mpiexec)."""
import pytest

CASES = [(check, n) for check in ("identical_and_bounded", "special_values", "depth") for n in (2, 3, 4)]
CASES += [("telescoping", n) for n in (2, 3, 4, 8)]
CASES += [("pipelined_matches_two_shot", n) for n in (2, 3, 4)]
CASES += [("rounds", n) for n in (2, 3, 4)]


@pytest.mark.mpi
@pytest.mark.parametrize("check,n", CASES)
def test_check(mpirun, check, n, monkeypatch):
    monkeypatch.setenv("ECHONCCL_PIPELINE_MIN_CHUNK", "512")    # chunks even at test sizes
    res = mpirun(n, ["tests/mpi/checks.py", check, "cpu"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"OK {check} ranks={n} engine=cpu" in res.stdout
