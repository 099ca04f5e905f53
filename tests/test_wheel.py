"""The built wheel is a working package: the CUDA sources travel inside it, and an installed
(non-editable) copy finds them in site-packages; the accuracy studies stay out of it.

Builds the wheel from a copy of this checkout, installs it with ``--no-deps`` into a fresh
venv (which borrows this environment's numpy and ml_dtypes through a .pth line, after its own
site-packages) and asks the installed copy, from outside the checkout, where its sources are.
No GPU, nvcc or cupy needed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from launch import ROOT

pytestmark = pytest.mark.wheel

JUNK = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".hypothesis", "out", "*.fatbin", "*.fatbin.sha256")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=JUNK)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        str(src), "-w", str(tmp / "dist")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("echonccl-*.whl")
    return whl


def test_wheel_holds_every_cuda_source_and_no_study(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    sources = sorted(p.name for p in (ROOT / "cuda_src").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources and "codec.cuh" in sources and "echo_kernels.cu" in sources
    assert sorted(n.split("/")[-1] for n in names if n.startswith("echonccl/cuda_src/")) == sources
    modules = {n for n in names if n.endswith(".py")}
    for p in (ROOT / "echonccl").rglob("*.py"):
        assert p.relative_to(ROOT).as_posix() in modules, f"{p} is not in the wheel"
    assert not [n for n in names if "study" in n or n.startswith(("studies/", "tools/", "tests/"))]


def test_installed_copy_finds_its_sources(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    # numpy, ml_dtypes, mpi4py from this environment, behind the venv's own site-packages
    (purelib / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    probe = textwrap.dedent("""
        import json
        import echonccl, echonccl.perf, echonccl.schedules
        from echonccl import kernels_cuda as kc
        d = kc.source_dir()
        src = kc.module_source()
        print(json.dumps({"package": echonccl.__file__, "source_dir": str(d),
                          "inlined": "#define ECHO_CODEC_CUH" in src and '#include "codec.cuh"' not in src,
                          "macros": "ECHO_RQ_COMBOS" in src}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py), "-I", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout)
    assert Path(got["package"]).is_relative_to(purelib), got     # the installed copy, not the checkout
    assert Path(got["source_dir"]) == purelib / "echonccl" / "cuda_src", got
    assert got["inlined"] and got["macros"], got
