"""tools/launch.py, the one launcher: the environment it builds and the command it runs."""
from __future__ import annotations

import os

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
