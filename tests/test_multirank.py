"""The schedules across real MPI ranks on the CPU engine (tests/mpi/checks.py under mpiexec).

Every check of a rank count runs in one launch (conftest.CheckLaunches: the MPI and Python
start-up once, not once per check); each test asserts that its own check passed on every rank.
"""
import pytest

from echonccl import codec

PROGRAM = "tests/mpi/checks.py"
# two_shot_pipelined cuts even test sizes into chunks
ENV = {"ECHONCCL_DEV_PIPELINE_MIN_CHUNK": "512"}
CHECKS = ("identical_and_bounded", "special_values", "depth", "telescoping", "pipelined_matches_two_shot",
          "rounds")
# Every check at 2 and 3 ranks (the smallest world, and an odd one: slices that do not divide
# evenly) in every CI run. `slow` (make test-all): the same checks at 4 ranks (a second P > 2,
# oversubscribing the 2 CI cores twice over: depth alone takes four times its 2-rank time) and
# telescoping at 8.
CASES = [(check, n) for n in (2, 3) for check in CHECKS]
CASES += [pytest.param(check, n, marks=pytest.mark.slow) for n, checks in ((4, CHECKS), (8, ("telescoping",)))
          for check in checks]


def _group(n):
    """The checks that share the launch of ``n`` ranks."""
    return ("telescoping",) if n == 8 else CHECKS


@pytest.mark.mpi
@pytest.mark.parametrize("check,n", CASES)
def test_check(check_launches, check, n):
    """``check`` of tests/mpi/checks.py (its docstring says what it asserts) passes on ``n`` ranks."""
    res = check_launches.run(n, PROGRAM, _group(n), check, extra_env=ENV)
    assert res.returncode == 0, res.output
    assert f"OK {check} ranks={n} engine=cpu" in res.stdout


OTHER_CODEC = [c for c in codec.CODECS if c != codec.DEFAULT_CODEC]
CODEC_CHECKS = ("identical_and_bounded", "special_values", "telescoping", "rounds")
# The codecs' blocks lay out slices that do not divide evenly each their own way: 3 ranks in every
# CI run, 2 in make test-all (`slow`).
CODEC_CASES = [pytest.param(check, n, c, marks=[pytest.mark.slow] if n == 2 else [])
               for c in OTHER_CODEC for n in (2, 3) for check in CODEC_CHECKS]


@pytest.mark.mpi
@pytest.mark.parametrize("check,n,codec_name", CODEC_CASES)
def test_check_other_codec(check_launches, check, n, codec_name):
    """The same checks with the codec that is not the default (ECHONCCL_CODEC)."""
    res = check_launches.run(n, PROGRAM, CODEC_CHECKS, check, extra_env={**ENV, "ECHONCCL_CODEC": codec_name})
    assert res.returncode == 0, res.output
    assert f"OK {check} ranks={n} engine=cpu" in res.stdout
