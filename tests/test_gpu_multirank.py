"""The GPU engine across two GPUs under mpirun: bit-exact with the reference, graph replay,
and the CPU checks repeated on CUDA + NCCL. Skipped without two GPUs."""
import pytest

from conftest import needs_gpus
from echonccl import codec

pytestmark = needs_gpus(2)

CHECKS = ["fused", "matches_reference", "pipelined_matches_two_shot", "rounds", "graph_replay", "torch_interop",
          "identical_and_bounded", "special_values", "telescoping", "depth"]


@pytest.mark.parametrize("check", CHECKS)
def test_gpu_check(mpirun, check, monkeypatch):
    monkeypatch.setenv("ECHONCCL_DEV_PIPELINE_MIN_CHUNK", "512")    # two_shot_pipelined chunks test sizes
    res = mpirun(2, ["tests/mpi/checks.py", check, "gpu"], timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert f"OK {check} ranks=2 engine=gpu" in res.stdout



@pytest.mark.parametrize("codec_name", [c for c in codec.CODECS if c != codec.DEFAULT_CODEC])
@pytest.mark.parametrize("check", ["fused", "matches_reference", "special_values", "rounds"])
def test_gpu_check_other_codec(mpirun, check, codec_name, monkeypatch):
    """The codecs that are not the default (int4, and the 8-bit int7-h32), through ECHONCCL_CODEC."""
    monkeypatch.setenv("ECHONCCL_CODEC", codec_name)
    res = mpirun(2, ["tests/mpi/checks.py", check, "gpu"], timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert f"OK {check} ranks=2 engine=gpu" in res.stdout
