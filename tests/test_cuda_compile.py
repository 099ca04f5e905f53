"""The CUDA sources compile with nvcc (no GPU needed): the prebuilt kernels as the wheel carries
them (each architecture's SASS, ptxas's registers and spills), and the table's kernels to PTX from
the inlined source, with exactly their entry points and arithmetic that no compiler flag can
change: a pairwise cover of the table (every pair of values two kernel fields take together) in
every CI run, the whole table in make test-all (`slow`).

The compile tests (marker ``nvcc``) skip when nvcc is missing, except under CI=true, where that
is a failure. Their nvcc runs are cached by fingerprint (``ECHONCCL_DEV_NVCC_CACHE``, set by
conftest to build/nvcc-cache), so the wheel test's build reuses the prebuilt compile; the cache
itself is tested with a fake nvcc.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import re
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from echonccl import build
from echonccl import kernel_table as kt

NVCC = build.find_nvcc()
LOOSE = ("-std=c++17", "-ftz=true", "--use_fast_math")   # CuPy appends -ftz=true for NVRTC


@pytest.fixture(scope="module")
def nvcc():
    if NVCC is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("nvcc not found, and CI=true requires the CUDA compile tests", pytrace=False)
        pytest.skip("nvcc not found")
    return NVCC


@pytest.fixture(scope="module")
def prebuilt(nvcc):
    """(fatbin bytes, manifest) of the prebuilt kernels, as `python -m echonccl.build` makes them."""
    return build.compile_fatbin(kt.PREBUILT, nvcc=nvcc)


def _pairwise_cover(kernels) -> list:
    """Few kernels of ``kernels`` in which every pair of values two of their fields take together
    somewhere (a family with a codec, a residual type with a dtype, ...) occurs (greedy)."""
    fields = [f.name for f in dataclasses.fields(kt.Kernel)]

    def pairs(k):
        return {(a, getattr(k, a), b, getattr(k, b)) for a, b in itertools.combinations(fields, 2)}

    need, chosen = set().union(*map(pairs, kernels)), []
    while need:
        k = max(kernels, key=lambda k: len(pairs(k) & need))
        chosen.append(k)
        need -= pairs(k)
    return chosen


def _ptx(nvcc, kernels, flags) -> str:
    """``kernels`` compiled to PTX for sm_90 from the inlined source (what NVRTC gets, no include
    path) with ``flags``, nvcc's banner left out."""
    out, _ = build.nvcc_run(["-arch=sm_90", "-ptx", *flags, "-o", "k.ptx", "k.cu"],
                            {"k.cu": kt.source(kernels).encode()}, ["k.ptx"], nvcc)
    return "\n".join(ln for ln in out["k.ptx"].decode().splitlines() if not ln.lstrip().startswith("//"))


def _entries(ptx_text: str) -> list:
    """The names of the kernels (entry points) a PTX text defines, sorted."""
    return sorted(re.findall(r"\.entry\s+(\w+)", ptx_text))


# The kernels every CI run compiles to PTX, a few dozen of the table's.
COVER = _pairwise_cover(kt.ALL)


@pytest.mark.nvcc
def test_prebuilt_kernels_for_each_architecture(prebuilt):
    fatbin, m = prebuilt
    assert m["kernels"] == [k.name for k in kt.PREBUILT]
    assert m["archs"][:2] == ["sm_80", "sm_90"] and m["ptx"] == "compute_" + m["archs"][-1][3:]
    assert build.fatbin_images(fatbin) == [("sass", a) for a in m["archs"]] + [("ptx", m["ptx"])]
    assert m["fingerprint"] == kt.fingerprint(kt.PREBUILT)
    assert set(m["resources"]) == set(m["archs"])
    assert all(set(r["registers"]) == set(m["kernels"]) for r in m["resources"].values())


# Spill bytes (stored + loaded) ptxas reports on sm_90, at most: none in the standalone kernels,
# except int4-h32's float32 owner with float32 residuals, which runs a 32-element block a thread
# (reduce_quantize.cuh, kBlock32Rq) and was measured faster so: 92 bytes; int7-h32's 16-bit decodes
# (kernels.cuh, kDqMinBlocks): 68; int4-h32's 16-bit contributions with int8 residuals (the default
# feedback's): 188 (docs/notes/fused.md, "The levers", the quantizer's row); the float32 decodes (32
# registers), since the wire's chunks: 20.
# The fused kernels (80 registers) spill a little in their loop control and their phases; the
# default path's (bfloat16, int8 residuals, whole slices) is held to what it spilled when it was
# last measured, and so are its general kernel's and its shifted twin's loop controls (the shifted
# loops in the general kernel made it spill 220 bytes, and run 4-18% slower on aligned buffers on
# one H200).
_DEFAULT_FUSED = {"echo_two_shot_bf16_resi8_int4_h32_int7_h32_ref32_whole": 0,
                  "_ZN4echo12phase_reduceINS_6bf16_tENS_7i8res_tEfLi16ELi2ELi32ELi1ELb1ELb0ELb0E": 8,
                  "_ZN4echo16phase_contributeINS_6bf16_tENS_7i8res_tELi32ELi1ELb1ELb0ELb0E": 0,
                  "_ZN4echo12phase_decodeINS_6bf16_tELi16ELi2ELb1ELb0ELb0ELb0E": 0,
                  # its any-count twin (kAny: the partial block's tests)
                  "echo_two_shot_bf16_resi8_int4_h32_int7_h32_ref32_whole_any": 32,
                  "_ZN4echo12phase_reduceINS_6bf16_tENS_7i8res_tEfLi16ELi2ELi32ELi1ELb1ELb1ELb0E": 0,
                  "_ZN4echo16phase_contributeINS_6bf16_tENS_7i8res_tELi32ELi1ELb1ELb1ELb0E": 0,
                  "_ZN4echo12phase_decodeINS_6bf16_tELi16ELi2ELb1ELb0ELb1ELb0E": 0,
                  "echo_two_shot_bf16_resi8_int4_h32_int7_h32_ref32": 108,
                  "echo_two_shot_bf16_resi8_int4_h32_int7_h32_ref32_shift": 216}


@pytest.mark.nvcc
def test_registers_and_spills(prebuilt):
    res = prebuilt[1]["resources"]["sm_90"]
    regs, spills = res["registers"], res["spills"]
    for k in kt.PREBUILT:
        r = regs[k.name]
        if k.fused:
            # launched FUSED_BLOCKS_PER_SM (3) blocks of 256 per SM, all resident at once
            assert r <= 65536 // (kt.BLOCK * kt.FUSED_BLOCKS_PER_SM), (k.name, r)
        elif k.family == "reduce_quantize":      # kRqMinBlocks, by the codec it writes
            written = k.codec.rpartition("/")[2]
            block32 = written == "int4-h32" and k.ref == k.dtype and k.res in ("f32", k.dtype)   # 2 blocks a SM
            assert r <= (128 if block32 else 80 if k.dtype == "f32" or written == "int7-h32" else 64), (k.name, r)
        else:
            assert r <= 64, (k.name, r)
    standalone = {k.name: spills.get(k.name, 0) for k in kt.PREBUILT if not k.fused}
    assert standalone.pop("echo_reduce_quantize_f32_resf32_reff32_int4_h32") <= 92
    for c in ("int4_h32", "int7_h32"):       # float32 decodes at 32 registers
        assert standalone.pop(f"echo_dequantize_f32_{c}") <= 20
    for t in ("f16", "bf16"):                # int7-h32's decodes at 32 registers (kDqMinBlocks)
        assert standalone.pop(f"echo_dequantize_{t}_int7_h32") <= 68
        # int4-h32's 16-bit contributions at 64 registers: loop invariants, since the quantizer
        # multiplies by the reciprocal (the kernel 4-6% slower, its owners 10-13% faster), and
        # the int8 residuals' block encoder
        assert standalone.pop(f"echo_reduce_quantize_{t}_resi8_reff32_int4_h32") <= 188
    assert not any(standalone.values()), {n: v for n, v in standalone.items() if v}
    for prefix, most in _DEFAULT_FUSED.items():
        got = [v for f, v in spills.items() if f == prefix or (prefix.startswith("_Z") and f.startswith(prefix))]
        assert len(got) == 1 and got[0] <= most, (prefix, got)


@pytest.mark.nvcc
@pytest.mark.parametrize("tool,name", [("fused_solo", "ARM_SOURCE"), ("ticket_bench", "SOURCE"), ("hbm_mix", "SOURCE"),
                                       ("stream_mix", "SOURCE")])
def test_the_tools_cuda_sources_compile(nvcc, tool, name):
    """The kernels tools/ hand to NVRTC on the GPU machine compile here too (the same PTX for sm_90)."""
    import importlib

    mod = importlib.import_module(tool)      # tools/ is on the path (pyproject.toml)
    out, _ = build.nvcc_run(["-arch=sm_90", "-ptx", "-o", "t.ptx", "t.cu"], {"t.cu": getattr(mod, name).encode()},
                            ["t.ptx"], nvcc)
    entries = set(_entries(out["t.ptx"].decode()))
    assert entries
    if tool == "hbm_mix":            # every case the tool can ask for is compiled
        for case in itertools.product(mod.LAYOUTS, mod.WORKS, mod.STORES, mod.LOADS):
            assert mod.kernel_name(*case) in entries, case
    if tool == "stream_mix":
        assert entries == ({p + s for p in mod.PHASES for s in mod.LOADS} | {p + x for p in mod.SHIFTED for x in mod.SHIFTS}
                           | {"copy_" + s for s in mod.SHAPES})


def test_the_pairwise_cover_covers():
    assert len(COVER) < len(kt.ALL) // 4
    for a, b in itertools.combinations([f.name for f in dataclasses.fields(kt.Kernel)], 2):
        assert ({(getattr(k, a), getattr(k, b)) for k in COVER}
                == {(getattr(k, a), getattr(k, b)) for k in kt.ALL}), (a, b)


def _exact_arithmetic(exact: str, loose: str) -> None:
    assert exact == loose
    assert ".ftz" not in exact
    # The only fma is codec_base.cuh's explicit fma_rn (products by +-1 or a power of two, exact);
    # a contracted one would make exact and loose differ.
    assert not re.search(r"\bfma\.(?!rn\.f32\s)", exact)
    assert "div.approx" not in exact


@pytest.mark.nvcc
def test_a_pairwise_cover_of_the_table_compiles_and_ignores_ftz_and_fast_math(nvcc):
    """The cover's kernels compile from the inlined source with exactly their entry points, and
    CuPy's -ftz=true (appended to NVRTC options) changes nothing in their PTX, nor would fmad."""
    with ThreadPoolExecutor(2) as pool:
        exact, loose = pool.map(lambda flags: _ptx(nvcc, COVER, flags), (kt.NVCC_FLAGS, LOOSE))
    assert _entries(exact) == sorted(k.name for k in COVER)
    _exact_arithmetic(exact, loose)
    assert "div.rn.f32" in exact


@pytest.mark.nvcc
@pytest.mark.slow
def test_every_kernel_of_the_table_compiles_and_ignores_ftz_and_fast_math(nvcc):
    jobs = [(half, flags) for half in (kt.ALL[0::2], kt.ALL[1::2]) for flags in (kt.NVCC_FLAGS, LOOSE)]
    with ThreadPoolExecutor(2) as pool:
        e0, l0, e1, l1 = pool.map(lambda job: _ptx(nvcc, *job), jobs)
    assert sorted(_entries(e0) + _entries(e1)) == sorted(k.name for k in kt.ALL)
    _exact_arithmetic(e0, l0)
    _exact_arithmetic(e1, l1)


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
    monkeypatch.setenv("ECHONCCL_DEV_NVCC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_NVCC_VERSION", "1")
    return str(exe), lambda: len(calls.read_text().splitlines()) if calls.exists() else 0


def test_nvcc_results_are_cached_by_fingerprint(fake_nvcc, monkeypatch, tmp_path):
    exe, ncalls = fake_nvcc
    args = ["-ptx", *kt.NVCC_FLAGS, "-o", "a.ptx", "a.cu"]
    out, log = build.nvcc_run(args, {"a.cu": b"one"}, ["a.ptx"], exe)
    assert out["a.ptx"] == b"one" and "built a.ptx" in log and ncalls() == 1
    again, log2 = build.nvcc_run(args, {"a.cu": b"one"}, ["a.ptx"], exe)
    assert again == out and log2 == log and ncalls() == 1          # served from the cache
    changed, _ = build.nvcc_run(args, {"a.cu": b"two"}, ["a.ptx"], exe)
    assert changed["a.ptx"] == b"two" and ncalls() == 2  # new source: compiled
    build.nvcc_run(args[:1] + ["-ftz=true"] + args[1:], {"a.cu": b"two"}, ["a.ptx"], exe)
    assert ncalls() == 3                                           # new flags: compiled
    monkeypatch.setenv("FAKE_NVCC_VERSION", "2")
    build.nvcc_run(args, {"a.cu": b"two"}, ["a.ptx"], exe)
    assert ncalls() == 4                                           # another compiler: compiled
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temp left
    monkeypatch.delenv("ECHONCCL_DEV_NVCC_CACHE")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    uncached, _ = build.nvcc_run(args, {"a.cu": b"two"}, ["a.ptx"], exe)
    assert uncached["a.ptx"] == b"two" and ncalls() == 5           # no cache: compiled again,
    assert not list(scratch.iterdir())                             # and nothing left behind


def test_failed_compile_is_not_cached(fake_nvcc, tmp_path):
    exe, ncalls = fake_nvcc
    with pytest.raises(RuntimeError, match="wrote no missing.o"):
        build.nvcc_run(["-c", "-o", "a.o", "a.cu"], {"a.cu": b"x"}, ["missing.o"], exe)
    with pytest.raises(RuntimeError):
        build.nvcc_run(["-c", "-o", "a.o", "a.cu"], {"a.cu": b"x"}, ["missing.o"], exe)
    assert ncalls() == 2


def test_gencode_has_ptx_of_the_newest_only():
    assert build.gencode(["sm_80", "sm_90"]) == ["-gencode", "arch=compute_80,code=sm_80",
                                                 "-gencode", "arch=compute_90,code=[sm_90,compute_90]"]
