"""The CUDA sources compile with nvcc (no GPU needed) and define exactly the expected kernels;
kernels_cuda finds the right module file; nvcc results are cached by fingerprint.

The compile tests (marker ``nvcc``) skip when nvcc is missing, except under CI=true, where that
is a failure. They go through tools/cuda_build.py, whose cache (build/nvcc-cache) makes a second
run of unchanged sources free; the cache tests below use a fake nvcc.
"""
from __future__ import annotations

import os
import re
import shutil
import stat

import pytest

import cuda_build
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
def checked(nvcc):
    return cuda_build.compile_check(nvcc=nvcc, arch="sm_90", fatbin=True)


def _ptx(src, *flags):
    # Drop comments (compiler banner) so two compiles can be compared.
    text = cuda_build.ptx(src, *flags, nvcc=NVCC)
    return "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("//"))


@pytest.mark.nvcc
def test_entry_points_match_the_list(checked):
    assert sorted(checked["entries"]) == sorted(kc.entry_points())
    # reduce_quantize 14 (in, res, ref) x 3 groups; dequantize and its sum of parts 3 x 3 x 2 each;
    # each for the 2 int4 codecs; int7-h32: one group (16) of each
    assert len(kc.entry_points()) == 2 * (42 + 18 + 18) + (14 + 6 + 6)
    assert "echo_dequantize_sum_acc_bf16_g32_h32" in checked["entries"]
    assert "echo_reduce_quantize_bf16_resbf16_refbf16_g16_i7h32" in checked["entries"]
    assert "echo_dequantize_acc_f32_g16_i7h32" in checked["entries"]
    assert "echo_reduce_quantize_bf16_resf32_refbf16_g32" in checked["entries"]
    assert "echo_reduce_quantize_bf16_resf32_refbf16_g32_h32" in checked["entries"]
    assert "echo_dequantize_acc_f16_g64_h32" in checked["entries"]
    assert "echo_dequantize_f16_g128" in checked["entries"]
    assert "echo_dequantize_acc_bf16_g32" in checked["entries"]


@pytest.mark.nvcc
def test_no_spills_and_registers(checked):
    assert set(checked["registers"]) == set(kc.entry_points()), checked["log"]
    # Spills: none, except a few bytes measured cheaper than the occupancy ptxas would give up
    # (BENCHMARKS.md, seventh pass): dequantize is built for 8 blocks per SM (32 registers; the
    # int7-h32 and accumulating kernels spill, yet run 1-11% faster than at 40 registers or with
    # one chunk a step), and the rotated owner's 16-bit-reference kernels keep a second loop
    # for whole slices (a register; 3-4% faster than one loop without the spill).
    # int4-h32's reduce_quantize at G = 32 with the reference in the input's dtype runs a 32-element
    # block a thread (reduce_quantize.cuh, kBlock32Rq): no spills, but 68 bytes with float32 input
    # (measured at 1.00-1.07x int4's time on H200, BENCHMARKS.md, tenth pass); so does its
    # dequantize into 16 bits (dequantize_block32): no spills.
    spills = checked["spills"]
    block32 = ({f"echo_reduce_quantize_{t}_res{r}_ref{t}_g32_h32" for t in ("f16", "bf16") for r in (t, "f32")}
               | {"echo_reduce_quantize_f32_resf32_reff32_g32_h32"})
    dq32 = {f"echo_dequantize{a}_{t}_g32_h32" for a in ("", "_acc") for t in ("f16", "bf16")}
    allowed = {n: 80 if n.startswith("echo_dequantize_") and n not in dq32 else
               80 if n == "echo_reduce_quantize_f32_resf32_reff32_g32_h32" else
               8 if n.startswith("echo_reduce_quantize_") and n.endswith("_h32") and n not in block32 else 0
               for n in spills}
    assert all(v <= allowed[n] for n, v in spills.items()), {n: v for n, v in spills.items() if v}
    assert spills["echo_dequantize_bf16_g32_h32"] == 0 and spills["echo_reduce_quantize_bf16_resbf16_reff32_g32_h32"] == 0
    # __launch_bounds__(256) allows 255; stay well below for occupancy: 64 (4 blocks of 256 per
    # SM), except the rotated float32-input reduce_quantize and every int7-h32 reduce_quantize,
    # built for 3 blocks per SM (80), and the block-a-thread reduce_quantize: 2 blocks (128).
    regs = checked["registers"]
    wide = {n for n in regs if n.startswith("echo_reduce_quantize_") and n not in block32 and
            (n.endswith("_i7h32") or (n.startswith("echo_reduce_quantize_f32_") and n.endswith("_h32")))}
    assert len(wide) == 5 + 14             # f32: float32 (G = 64, 128) and int8 residuals; int7-h32
    assert max(v for n, v in regs.items() if n not in wide | block32) <= 64, regs
    assert max(regs[n] for n in wide) <= 80, regs
    assert max(regs[n] for n in block32) <= 128, regs


@pytest.mark.nvcc
def test_fatbin_built_with_fingerprint(checked, tmp_path):
    fb = checked["fatbin"]
    assert fb and os.path.getsize(fb) > 0
    out = cuda_build.build_fatbin(tmp_path / kc.FATBIN_NAME, nvcc=NVCC)
    assert out.read_bytes() == open(fb, "rb").read()
    assert (tmp_path / (kc.FATBIN_NAME + ".sha256")).read_text().strip() == kc.source_fingerprint(kc.source_dir())


@pytest.mark.nvcc
def test_fused_kernels_compile_self_contained(nvcc):
    """fused_kernels.cu as NVRTC gets it (codec.cuh inlined) compiles with the module's flags and
    defines exactly the fused entry points; the kernels keep to the registers that let
    `fused.BLOCKS_PER_SM` blocks of 256 threads per SM be resident (the grid the host launches)."""
    from echonccl import fused

    src = kc.module_source(fused.SOURCE)
    ptx = _ptx(src, *kc.NVCC_FLAGS)
    assert sorted(re.findall(r"\.entry\s+(\w+)", ptx)) == sorted(fused.entry_points())
    _, log = cuda_build.nvcc_run(["-arch=sm_90", "-c", *kc.NVCC_FLAGS, "-Xptxas", "-v", "-o", "f.o", "f.cu"],
                                 {"f.cu": src.encode()}, ["f.o"], nvcc)
    regs = {m.group(1): int(r.group(1)) for m, r in zip(re.finditer(r"Compiling entry function '(\w+)'", log),
                                                       re.finditer(r"Used (\d+) registers", log))}
    assert set(regs) >= set(fused.entry_points()), log[-2000:]
    assert max(regs[k] for k in fused.entry_points()) <= 65536 // (fused.BLOCK * fused.BLOCKS_PER_SM), regs


@pytest.mark.nvcc
def test_nvrtc_source_is_self_contained(nvcc):
    """What kernels_cuda hands NVRTC (codec.cuh inlined) compiles with no include path at all."""
    ptx = _ptx(kc.module_source())
    assert sorted(re.findall(r"\.entry\s+(\w+)", ptx)) == sorted(kc.entry_points())


@pytest.mark.nvcc
def test_arithmetic_ignores_ftz_and_fast_math(nvcc):
    """CuPy appends -ftz=true to NVRTC options: the PTX must not depend on it (nor on fmad)."""
    src = kc.module_source()
    exact = _ptx(src, *kc.NVCC_FLAGS[1:])
    loose = _ptx(src, "-ftz=true", "--use_fast_math")
    assert exact == loose
    assert ".ftz" not in exact
    # The only fma is codec_base.cuh's explicit fma_rn (products by +-1, exact); a contracted one
    # would make exact and loose differ.
    assert not re.search(r"\bfma\.(?!rn\.f32\s)", exact)
    assert "div.rn.f32" in exact and "div.approx" not in exact


# --------------------------------------------------------------- module file discovery (no nvcc)
@pytest.fixture
def fake_dirs(tmp_path, monkeypatch):
    """Two candidate cuda_src dirs holding copies of the real sources."""
    dirs = [tmp_path / "repo", tmp_path / "pkg"]
    for d in dirs:
        d.mkdir()
        for name in kc.SOURCE_NAMES:
            (d / name).write_bytes((kc.source_dir() / name).read_bytes())
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


def test_module_source_inlines_each_local_header_once(fake_dirs):
    repo, _ = fake_dirs
    (repo / "extra.cuh").write_text('#include "codec.cuh"\n// EXTRA_HEADER\n')
    (repo / "other.cu").write_text('#include "extra.cuh"\n#include "codec.cuh"\nint body;\n')
    src = kc.module_source("other.cu")
    assert src.count("EXTRA_HEADER") == 1 and src.count("#define ECHO_CODEC_CUH") == 1
    assert "#include" not in src.replace("#include <", "")
    assert src.index("EXTRA_HEADER") < src.index("int body;")
    (repo / "bad.cu").write_text('#include "missing.cuh"\n')
    with pytest.raises(RuntimeError, match="missing.cuh"):
        kc.module_source("bad.cu")


# ------------------------------------------------------------------ the nvcc cache (fake nvcc)
@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """An ``nvcc`` that writes its -o argument and logs each compile; the cache in tmp_path."""
    calls = tmp_path / "calls"
    exe = tmp_path / "nvcc"
    exe.write_text(f"""#!/bin/sh
if [ "$1" = --version ]; then echo "fake nvcc $FAKE_NVCC_VERSION"; exit 0; fi
echo "$@" >> {calls}
while [ $# -gt 0 ]; do
  if [ "$1" = -o ]; then cat *.cu > "$2"; echo "built $2"; fi
  shift
done
""")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("ECHONCCL_NVCC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_NVCC_VERSION", "1")
    return str(exe), lambda: len(calls.read_text().splitlines()) if calls.exists() else 0


def test_nvcc_results_are_cached_by_fingerprint(fake_nvcc, monkeypatch):
    exe, ncalls = fake_nvcc
    args = ["-ptx", *kc.NVCC_FLAGS, "-o", "a.ptx", "a.cu"]
    out, log = cuda_build.nvcc_run(args, {"a.cu": b"one"}, ["a.ptx"], exe)
    assert out["a.ptx"].read_bytes() == b"one" and "built a.ptx" in log and ncalls() == 1
    again, log2 = cuda_build.nvcc_run(args, {"a.cu": b"one"}, ["a.ptx"], exe)
    assert again == out and log2 == log and ncalls() == 1          # served from the cache
    changed, _ = cuda_build.nvcc_run(args, {"a.cu": b"two"}, ["a.ptx"], exe)
    assert changed["a.ptx"].read_bytes() == b"two" and ncalls() == 2  # new source: compiled
    cuda_build.nvcc_run(args[:1] + ["-ftz=true"] + args[1:], {"a.cu": b"two"}, ["a.ptx"], exe)
    assert ncalls() == 3                                           # new flags: compiled
    monkeypatch.setenv("FAKE_NVCC_VERSION", "2")
    cuda_build.nvcc_run(args, {"a.cu": b"two"}, ["a.ptx"], exe)
    assert ncalls() == 4                                           # another compiler: compiled
    assert not [p for p in out["a.ptx"].parent.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_failed_compile_is_not_cached(fake_nvcc, tmp_path):
    exe, ncalls = fake_nvcc
    with pytest.raises(RuntimeError, match="wrote no missing.o"):
        cuda_build.nvcc_run(["-c", "-o", "a.o", "a.cu"], {"a.cu": b"x"}, ["missing.o"], exe)
    with pytest.raises(RuntimeError):
        cuda_build.nvcc_run(["-c", "-o", "a.o", "a.cu"], {"a.cu": b"x"}, ["missing.o"], exe)
    assert ncalls() == 2
