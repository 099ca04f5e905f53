"""The CUDA sources compile with nvcc (no GPU needed) and define exactly the expected kernels;
kernels_cuda finds the right module file.

The compile tests skip when nvcc is missing, except under CI=true, where that is a failure.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from echonccl import kernels_cuda as kc

NVCC = shutil.which("nvcc")


@pytest.fixture(scope="module")
def nvcc():
    if NVCC is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("nvcc not found, and CI=true requires the CUDA compile tests", pytrace=False)
        pytest.skip("nvcc not found")
    return NVCC


@pytest.fixture(scope="module")
def checked(nvcc, tmp_path_factory):
    return kc.compile_check(nvcc=nvcc, arch="sm_90", outdir=tmp_path_factory.mktemp("cc"), fatbin=True)


def _ptx(tmp_path, src, *flags, name="k"):
    assert NVCC is not None
    cu = tmp_path / f"{name}.cu"
    cu.write_text(src)
    out = tmp_path / f"{name}.ptx"
    r = subprocess.run([NVCC, "-arch=sm_90", "-ptx", "-std=c++17", *flags, "-o", str(out), str(cu)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # Drop comments (compiler banner) so two compiles can be compared.
    return "\n".join(l for l in out.read_text().splitlines() if not l.lstrip().startswith("//"))


def test_entry_points_match_the_list(checked):
    assert sorted(checked["entries"]) == sorted(kc.entry_points())
    # reduce_quantize 9 x 3 groups; dequantize 3 x 3 x 2; each for the 2 codecs (int4, int4-h32)
    assert len(kc.entry_points()) == 2 * (27 + 18)
    assert "echo_reduce_quantize_bf16_resf32_refbf16_g32" in checked["entries"]
    assert "echo_reduce_quantize_bf16_resf32_refbf16_g32_h32" in checked["entries"]
    assert "echo_dequantize_acc_f16_g64_h32" in checked["entries"]
    assert "echo_dequantize_f16_g128" in checked["entries"]
    assert "echo_dequantize_acc_bf16_g32" in checked["entries"]


def test_no_spills_and_registers(checked):
    assert set(checked["registers"]) == set(kc.entry_points()), checked["log"]
    assert all(v == 0 for v in checked["spills"].values()), checked["spills"]
    # __launch_bounds__(256) allows 255; stay well below for occupancy: 64 (4 blocks of 256 per
    # SM), except the rotated float32-input reduce_quantize, built for 3 blocks per SM (80).
    regs = checked["registers"]
    wide = {n for n in regs if n.startswith("echo_reduce_quantize_f32_") and n.endswith("_h32")}
    assert len(wide) == 3
    assert max(v for n, v in regs.items() if n not in wide) <= 64, regs
    assert max(regs[n] for n in wide) <= 80, regs


def test_fatbin_built_with_fingerprint(checked):
    fb = checked["fatbin"]
    assert fb and os.path.getsize(fb) > 0
    with open(fb + ".sha256") as f:
        assert f.read().strip() == kc.source_fingerprint(kc.source_dir())


def test_nvrtc_source_is_self_contained(nvcc, tmp_path):
    """What kernels_cuda hands NVRTC (codec.cuh inlined) compiles with no include path at all."""
    ptx = _ptx(tmp_path, kc.module_source())
    assert sorted(re.findall(r"\.entry\s+(\w+)", ptx)) == sorted(kc.entry_points())


def test_arithmetic_ignores_ftz_and_fast_math(nvcc, tmp_path):
    """CuPy appends -ftz=true to NVRTC options: the PTX must not depend on it (nor on fmad)."""
    src = kc.module_source()
    exact = _ptx(tmp_path, src, "--fmad=false", "-ftz=false", "-prec-div=true", name="exact")
    loose = _ptx(tmp_path, src, "-ftz=true", "--use_fast_math", name="loose")
    assert exact == loose
    assert ".ftz" not in exact
    assert not re.search(r"\bfma\.", exact)
    assert "div.rn.f32" in exact and "div.approx" not in exact


# --------------------------------------------------------------- module file discovery (no nvcc)
@pytest.fixture
def fake_dirs(tmp_path, monkeypatch):
    """Two candidate cuda_src dirs holding copies of the real sources."""
    dirs = [tmp_path / "repo", tmp_path / "pkg"]
    for d in dirs:
        d.mkdir()
        for f in kc.source_files():
            (d / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(kc, "source_dirs", lambda: list(dirs))
    monkeypatch.delenv("ECHONCCL_FATBIN", raising=False)
    return dirs


def test_no_fatbin_means_nvrtc(fake_dirs):
    assert kc.find_fatbin() is None
    src = kc.module_source()
    assert "ECHO_CODEC_CUH" in src and '#include "codec.cuh"' not in src


def test_fatbin_with_matching_or_missing_stamp_is_used(fake_dirs):
    repo, pkg = fake_dirs
    (pkg / kc.FATBIN_NAME).write_bytes(b"x")  # no stamp: trusted
    assert kc.find_fatbin() == pkg / kc.FATBIN_NAME
    (repo / kc.FATBIN_NAME).write_bytes(b"x")
    (repo / (kc.FATBIN_NAME + ".sha256")).write_text(kc.source_fingerprint(repo) + "\n")
    assert kc.find_fatbin() == repo / kc.FATBIN_NAME


def test_stale_fatbin_is_ignored(fake_dirs):
    repo, _ = fake_dirs
    (repo / kc.FATBIN_NAME).write_bytes(b"x")
    (repo / (kc.FATBIN_NAME + ".sha256")).write_text("0" * 64 + "\n")
    with pytest.warns(RuntimeWarning, match="other sources"):
        assert kc.find_fatbin() is None


def test_env_fatbin_wins_and_must_exist(fake_dirs, tmp_path, monkeypatch):
    fb = tmp_path / "mine.fatbin"
    fb.write_bytes(b"x")
    monkeypatch.setenv("ECHONCCL_FATBIN", str(fb))
    assert kc.find_fatbin() == fb
    monkeypatch.setenv("ECHONCCL_FATBIN", str(tmp_path / "missing.fatbin"))
    with pytest.raises(FileNotFoundError):
        kc.find_fatbin()
