"""tools/launch.py, the one launcher: the environment it builds and the command it runs."""
from __future__ import annotations

import mmap
import os

import pytest

import launch
from launch import ROOT, TOOLS


def test_environment_puts_the_checkout_first_and_keeps_nvls_off(monkeypatch):
    monkeypatch.delenv("ECHONCCL_DEV_INSTALLED", raising=False)
    monkeypatch.setenv("PYTHONPATH", f"/elsewhere{os.pathsep}{ROOT}")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("ECHONCCL_TIMEOUT", "7")
    env = launch.environment({"EXTRA": 3, "ECHONCCL_ALGO": None})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(TOOLS), "/elsewhere"]
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["PYTHONUNBUFFERED"] == "1"
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["EXTRA"] == "3"
    assert env["ECHONCCL_TIMEOUT"] == "7" and "ECHONCCL_ALGO" not in env
    assert "ECHONCCL_TIMEOUT" not in launch.environment(clean=True)


def test_installed_mode_leaves_the_checkout_off_the_path(monkeypatch):
    monkeypatch.setenv("ECHONCCL_DEV_INSTALLED", "1")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert launch.environment()["PYTHONPATH"] == str(TOOLS)


def test_command_runs_mpi4py_and_forwards_variables_to_open_mpi(monkeypatch):
    env = launch.environment({"NCCL_P2P_DISABLE": "1"})
    monkeypatch.setattr(launch, "flavor", lambda exe: "hydra")
    cmd = launch.command(2, ["tools/soak.py", "--calls", 5], env, mpiexec="mpiexec")
    assert cmd[:3] == ["mpiexec", "-n", "2"] and cmd[4:] == ["-m", "mpi4py", "tools/soak.py", "--calls", "5"]
    assert launch.command(2, ["x.py"], env, mpiexec="m", abort_on_error=False)[4:] == ["x.py"]
    monkeypatch.setattr(launch, "flavor", lambda exe: "openmpi")
    cmd = launch.command(2, ["x.py"], env, mpiexec="mpirun", launcher_args=["--tag-output"])
    forwarded = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"}
    assert {"PYTHONPATH", "NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE", "PYTHONUNBUFFERED"} <= forwarded
    assert cmd[1:3] == ["--bind-to", "none"] and cmd.index("--tag-output") < cmd.index("-n")


def test_cli_usage_error():
    assert launch.main(["soak.py"]) == 2


def test_segments_no_process_maps_are_removed(tmp_path):
    (tmp_path / "mpich_shm_1_0").write_bytes(b"\0" * 4096)
    (tmp_path / "mpich_shm_2_0").write_bytes(b"\0" * 4096)
    (tmp_path / "mpich_shm_3_0").write_bytes(b"\0" * 4096)
    (tmp_path / "other").write_bytes(b"x")
    with open(tmp_path / "mpich_shm_2_0", "r+b") as f, mmap.mmap(f.fileno(), 4096):   # a live job's
        removed = launch.remove_orphan_segments({"mpich_shm_3_0"}, shm=tmp_path)       # 3: not this job's
    assert removed == [str(tmp_path / "mpich_shm_1_0")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_2_0", "mpich_shm_3_0", "other"]


def test_a_job_whose_rank_dies_leaves_no_segment(tmp_path):
    mpiexec = launch.find_mpiexec()
    if mpiexec is None or launch.flavor(mpiexec) != "hydra" or not launch.SHM.is_dir():
        pytest.skip("MPICH's segments in /dev/shm: needs the mpich launcher")
    prog = tmp_path / "dies.py"
    prog.write_text("import os\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
                    "if MPI.COMM_WORLD.rank == 1:\n    os._exit(3)\n")
    before = launch.mpich_segments()
    r = launch.run(2, [prog], abort_on_error=False, timeout=120)
    assert r.returncode != 0
    assert not launch.mpich_segments() - before, "the dead job's segment is still in /dev/shm"
