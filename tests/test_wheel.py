"""The built wheel is a working package: the CUDA sources and the prebuilt kernels travel inside
it (SASS for each architecture nvcc has of sm_80, sm_90, sm_100, and PTX), an installed
(non-editable) copy finds them in site-packages and takes its prebuilt kernels as fresh; the
accuracy studies stay out of it.

Builds the wheel from a copy of this checkout (its kernel compile is the compile tests' own,
through the nvcc cache), installs it with ``--no-deps`` into a fresh venv (which borrows this
environment's numpy and ml_dtypes through a .pth line, after its own site-packages) and asks the
installed copy, from outside the checkout, where its sources are. No GPU or cupy needed; without
nvcc the wheel carries no kernels (skipped here, a failure under CI=true).
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

from echonccl import build
from echonccl import kernel_table as kt
from launch import ROOT

pytestmark = pytest.mark.wheel

JUNK = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".hypothesis", "out", "prebuilt")


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
    assert sources == sorted(kt.SOURCE_NAMES)
    assert sorted(n.split("/")[-1] for n in names if n.startswith("echonccl/cuda_src/")) == sources
    modules = {n for n in names if n.endswith(".py")}
    for p in (ROOT / "echonccl").rglob("*.py"):
        assert p.relative_to(ROOT).as_posix() in modules, f"{p} is not in the wheel"
    assert not [n for n in names if "study" in n or n.startswith(("studies/", "tools/", "tests/"))]


def test_wheel_carries_the_prebuilt_kernels(wheel):
    nvcc = build.find_nvcc()
    if nvcc is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("nvcc not found, and CI=true requires the wheel's prebuilt kernels", pytrace=False)
        pytest.skip("nvcc not found: the wheel carries no prebuilt kernels")
    z = zipfile.ZipFile(wheel)
    manifest = json.loads(z.read("echonccl/prebuilt/manifest.json"))
    archs = build.supported_archs(nvcc)
    assert archs[:2] == ["sm_80", "sm_90"] and manifest["archs"] == archs
    images = build.fatbin_images(z.read("echonccl/prebuilt/kernels.fatbin"))
    assert images == [("sass", a) for a in archs] + [("ptx", manifest["ptx"])]
    assert manifest["kernels"] == [k.name for k in kt.PREBUILT]


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
        from echonccl import kernel_loader, kernel_table as kt
        d = kt.source_dir()
        src = kt.source(kt.ALL[:1])
        print(json.dumps({"package": echonccl.__file__, "source_dir": str(d),
                          "inlined": "#define ECHO_CODEC_CUH" in src and '#include "' not in src,
                          "prebuilt": kernel_loader.KernelLoader().prebuilt_names()}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py), "-I", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout)
    assert Path(got["package"]).is_relative_to(purelib), got     # the installed copy, not the checkout
    assert Path(got["source_dir"]) == purelib / "echonccl" / "cuda_src", got
    assert got["inlined"], got
    if build.find_nvcc():       # fresh: built from the installed sources
        assert got["prebuilt"] == [k.name for k in kt.PREBUILT], got
