"""The schedules across real MPI ranks on the CPU engine (tests/mpi/checks.py under mpiexec)."""
import pytest

from echonccl import codec

CASES = [(check, n) for check in ("identical_and_bounded", "special_values", "depth") for n in (2, 3, 4)]
CASES += [("telescoping", n) for n in (2, 3, 4, 8)]
CASES += [("pipelined_matches_two_shot", n) for n in (2, 3, 4)]
CASES += [("rounds", n) for n in (2, 3, 4)]


@pytest.mark.mpi
@pytest.mark.parametrize("check,n", CASES)
def test_check(mpirun, check, n, monkeypatch):
    monkeypatch.setenv("ECHONCCL_DEV_PIPELINE_MIN_CHUNK", "512")    # chunks even at test sizes
    res = mpirun(n, ["tests/mpi/checks.py", check, "cpu"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"OK {check} ranks={n} engine=cpu" in res.stdout


OTHER_CODEC = [c for c in codec.CODECS if c != codec.DEFAULT_CODEC]
CODEC_CASES = [(check, n, c) for c in OTHER_CODEC
               for check in ("identical_and_bounded", "special_values", "telescoping", "rounds") for n in (2, 3)]


@pytest.mark.mpi
@pytest.mark.parametrize("check,n,codec_name", CODEC_CASES)
def test_check_other_codec(mpirun, check, n, codec_name, monkeypatch):
    """The same checks with the codec that is not the default (ECHONCCL_CODEC)."""
    monkeypatch.setenv("ECHONCCL_DEV_PIPELINE_MIN_CHUNK", "512")
    monkeypatch.setenv("ECHONCCL_CODEC", codec_name)
    res = mpirun(n, ["tests/mpi/checks.py", check, "cpu"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"OK {check} ranks={n} engine=cpu" in res.stdout
