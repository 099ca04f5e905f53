"""The kernel table, the sources it generates, and how the loader picks prebuilt kernels, without
a GPU or nvcc (the compiles: test_cuda_compile.py; loading and running: the GPU tests)."""
from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from dataclasses import replace

import pytest

from echonccl import codec, dtypes, kernel_loader
from echonccl import kernel_table as kt


def test_table_counts_and_names():
    fam = Counter(k.family for k in kt.ALL)
    # per wire codec: reduce_quantize for (input, residual, reference) = 2 x 3 x 2 + 2; dequantize and
    # its sum of parts per output type; the fused two-shot per (input, residual) and for 16-bit data
    # with the float32 owner reference, the quantized one-shot per (input, residual), each for any and
    # for whole slices, the 16-bit two-shots with the float32 reference and residuals of the input's
    # type or int8 for any count too (whole) and for misaligned buffers (general); per pair, its owner's reduce_quantize and fused
    # two-shot; the one-shots per type
    assert fam == {"reduce_quantize": 4 * 14, "dequantize": 3 * 3, "dequantize_sum": 3 * 3,
                   "two_shot": 4 * ((8 + 6) * 2 + 4 + 4), "one_shot_q": 3 * 8 * 2, "one_shot": 3, "one_shot_ll": 3}
    assert len(kt.ALL) == len(kt.BY_NAME) == 272
    assert {k.codec for k in kt.ALL} == {"", *codec.CODECS}
    assert len(kt.kernels_of("int4-h32")) == 72 and len(kt.kernels_of("int4")) == 72
    mixed = kt.kernels_of(codec.MIXED)      # int4-h32's but its two-shot, the pair's own, int7-h32's decodes
    assert len(mixed) == 72 - 36 + 50 + 6 and {k.codec for k in mixed} == {"int4-h32", codec.MIXED, "int7-h32"}
    # prebuilt: the default options' kernels (int8 residuals of 16-bit data, float32 ones of float32
    # data, or none; rounding off; the flush's refinement round), every type
    assert codec.DEFAULT_CODEC == codec.MIXED and len(kt.PREBUILT) == 58
    assert set(kt.PREBUILT) == {k for k in kt.ALL if k.codec == ""} | {k for k in mixed if kt.default_options(k)}
    assert {k.res for k in kt.PREBUILT if k.dtype == "f32"} == {"", "f32"}
    assert {k.res for k in kt.PREBUILT if k.dtype != "f32"} == {"", "f32", "i8"}
    assert {(k.res, k.ref, k.whole, k.any_count, k.shifted) for k in kt.PREBUILT
            if k.family == "two_shot" and k.dtype == "bf16"} == {
        ("f32", "", False, False, False), ("f32", "", True, False, False),      # no feedback
        ("i8", "f32", False, False, False), ("i8", "f32", False, False, True),   # round 1
        ("i8", "f32", True, False, False), ("i8", "f32", True, True, False),
        ("i8", "", False, False, False)}            # a refinement round (the flush) keeps the rounding
    assert {(k.res, k.ref) for k in kt.PREBUILT if k.family == "reduce_quantize" and k.dtype == "bf16"} == {
        ("f32", "f32"), ("i8", "f32"), ("i8", "bf16")}     # no feedback; contributions, owner; the flush's owner
    assert kt.Kernel("two_shot", "bf16", codec.MIXED, "i8").name == "echo_two_shot_bf16_resi8_int4_h32_int7_h32"
    assert "ECHO_RQ_KERNEL(echo_reduce_quantize_f16_resf16_reff32_int4_h32_int7_h32, f16, f16, f32, 16, 2, 32, 1)" \
        == kt.Kernel("reduce_quantize", "f16", codec.MIXED, "f16", "f32").line()
    assert kt.lookup("echo_two_shot_bf16_resbf16_int4_h32_whole") == kt.Kernel("two_shot", "bf16", "int4-h32",
                                                                              "bf16", whole=True)
    assert kt.Kernel("two_shot", "f16", "int7-h32", "i8", "f32").name == "echo_two_shot_f16_resi8_int7_h32_ref32"
    # any count: twins of the whole two-shots whose phases all run 16 elements a thread (cuda_src/fused.cuh)
    assert {(k.dtype, k.res) for k in kt.ALL if k.any_count and k.codec == codec.MIXED} == {
        ("bf16", "bf16"), ("bf16", "i8"), ("f16", "f16"), ("f16", "i8")}
    assert all(k.family == "two_shot" and k.whole and k.ref == "f32" for k in kt.ALL if k.any_count)
    assert {replace(k, any_count=True) for k in kt.ALL if kt.takes_any_count(k)} == {k for k in kt.ALL if k.any_count}
    anyk = kt.Kernel("two_shot", "bf16", codec.MIXED, "bf16", "f32", True, True)
    assert anyk.name == "echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32_whole_any"
    assert anyk.line().endswith(", 32, 1, 16, 2, true, true, true, false)")
    assert not kt.takes_any_count(kt.Kernel("two_shot", "bf16", codec.MIXED, "bf16", whole=True))   # rounding=True
    # shifted: twins of the same kernels' general two-shots, for buffers off 16-byte alignment
    assert {replace(k, whole=False, any_count=False) for k in kt.ALL if k.any_count} == {
        replace(k, shifted=False) for k in kt.ALL if k.shifted}
    assert {replace(k, shifted=True) for k in kt.ALL if kt.takes_shift(k)} == {k for k in kt.ALL if k.shifted}
    shiftk = kt.Kernel("two_shot", "f16", codec.MIXED, "i8", "f32", shifted=True)
    assert shiftk.name == "echo_two_shot_f16_resi8_int4_h32_int7_h32_ref32_shift"
    assert shiftk.line().endswith(", 32, 1, 16, 2, false, true, false, true)")
    assert not kt.takes_shift(kt.Kernel("two_shot", "bf16", codec.MIXED, "bf16"))     # rounding=True
    assert not kt.takes_shift(replace(shiftk, whole=True, shifted=False))
    assert kt.Kernel("reduce_quantize", "f32", "int4", "i8", "f32").name == "echo_reduce_quantize_f32_resi8_reff32_int4"
    assert "echo_two_shot_f32_resf32_int4_h32_ref32" not in kt.BY_NAME     # float32 data: the ref is float32
    assert kt.Kernel("dequantize_sum", "bf16", "int4").name == "echo_dequantize_sum_bf16_int4"
    assert "echo_one_shot_ll_f32" in kt.BY_NAME
    with pytest.raises(KeyError, match="no kernel 'echo_nothing'"):
        kt.lookup("echo_nothing")


def test_a_first_call_with_default_options_finds_its_kernels_prebuilt():
    import first_call      # tools/: what tools/first_call.py times as the first call
    assert {kt.lookup(n) for n in first_call.first_call_kernels()} <= set(kt.PREBUILT)

def test_table_agrees_with_the_codec():
    assert set(kt.CODECS) == set(codec.WIRE_CODECS) and kt.DEFAULT_CODEC == codec.DEFAULT_CODEC
    assert set(kt.PAIRS) == set(codec.CODECS) - set(codec.WIRE_CODECS)
    assert all(kt.CODECS[c][1] == codec.group_size(c) for c in codec.WIRE_CODECS)
    wire = (kt.source_dir() / "codec_wire.cuh").read_text()
    ids = dict(re.findall(r"(kInt\w+) = (\d)", wire))
    assert ids == {"kInt4": "0", "kInt4H32": "1", "kInt7H32": "2"}
    assert [kt.CODECS[c][0] for c in ("int4", "int4-h32", "int7-h32")] == [0, 1, 2]


def test_dtype_names_are_the_tables():
    """The launch code names kernels through `dtypes`: every data dtype's name is one of the
    table's, and every residual format `Feedback` stores is one the table lists for it."""
    assert sorted(dtypes.kernel_name(n) for n in dtypes.SUPPORTED) == sorted(kt.DTYPES)
    for name, dt in dtypes.SUPPORTED.items():
        t = dtypes.kernel_name(dt)
        for fmt in codec.RESIDUAL_FORMATS:
            r = dtypes.residual_kernel_name(codec.residual_dtype(fmt, dt))
            assert r in (t, "f32", "i8") and (r != "i8" or fmt in ("int8", "auto"))
    assert dtypes.residual_kernel_name(codec.residual_dtype("auto", dtypes.numpy_dtype("bfloat16"))) == "i8"
    assert dtypes.residual_kernel_name(codec.residual_dtype("auto", dtypes.numpy_dtype("float32"))) == "f32"
    with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
        dtypes.kernel_name("int32")
    with pytest.raises(TypeError):
        dtypes.residual_kernel_name("int8")     # one byte, but not the block format's storage


def test_source_has_one_line_per_kernel_and_the_launch_constants():
    ks = [kt.lookup("echo_dequantize_f16_int4"), kt.lookup("echo_one_shot_q_bf16_resi8_int7_h32_whole")]
    text = kt.source(ks, inline=False)
    assert text.startswith(kt.prelude()) and "#define ECHO_BLOCK 256\n" in text
    assert '#include "kernels.cuh"' in text and '#include "fused.cuh"' in text
    assert "ECHO_DQ_KERNEL(echo_dequantize_f16_int4, f16, 32, 0)" in text
    assert "ECHO_ONE_SHOT_Q_KERNEL(echo_one_shot_q_bf16_resi8_int7_h32_whole, bf16, i8, 16, 2, true)" in text
    assert '#include "fused.cuh"' not in kt.source(ks[:1], inline=False)   # only what the kernels need
    inlined = kt.source(ks)
    assert "#include \"" not in inlined and inlined.count("#define ECHO_CODEC_CUH") == 1
    assert "struct PeerTable" in inlined


def test_headers_take_the_launch_constants_from_the_table():
    """No header sets a launch constant or a build switch of its own: `kt.prelude` is the one place."""
    d = kt.source_dir()
    for name in kt.SOURCE_NAMES:
        text = (d / name).read_text()
        defined = set(re.findall(r"#\s*define\s+(ECHO_\w+)", text))
        overridable = set(re.findall(r"#\s*ifndef\s+(ECHO_\w+)", text)) - {n for n in defined if n.endswith("_CUH")}
        assert not overridable - {"ECHO_BLOCK", "ECHO_FUSED_MIN_BLOCKS"}, (name, overridable)
        assert not {"ECHO_BLOCK", "ECHO_FUSED_MIN_BLOCKS", "ECHO_DQ_UNROLL16", "ECHO_DQ_UNROLL32"} & defined, name
    assert not list(d.glob("*.cu"))           # every entry point comes from the table


def test_fingerprint_covers_headers_table_and_flags(tmp_path, monkeypatch):
    ks = kt.PREBUILT[:3]
    base = kt.fingerprint(ks)
    assert base == kt.fingerprint(ks) and base != kt.fingerprint(kt.PREBUILT[:2])
    assert base != kt.fingerprint(ks, kt.NVRTC_OPTIONS)
    copy = tmp_path / "cuda_src"
    shutil.copytree(kt.source_dir(), copy)
    assert kt.fingerprint(ks, directory=copy) == base
    (copy / "rotation.cuh").write_text((copy / "rotation.cuh").read_text() + "\n// edited\n")
    assert kt.fingerprint(ks, directory=copy) != base


# ------------------------------------------------------------------ the loader's prebuilt manifest
def _prebuilt(tmp_path, kernels, fingerprint=None):
    d = tmp_path / "prebuilt"
    d.mkdir()
    (d / kernel_loader.FATBIN).write_bytes(b"not loaded in these tests")
    (d / kernel_loader.MANIFEST).write_text(json.dumps({
        "kernels": [k.name for k in kernels], "archs": ["sm_90"], "ptx": "compute_90", "nvcc": "13.0",
        "fingerprint": fingerprint or kt.fingerprint(kernels)}))
    return d


def test_a_fresh_manifest_is_taken(tmp_path, capsys):
    d = _prebuilt(tmp_path, kt.PREBUILT[:4])
    assert kernel_loader.KernelLoader(d).prebuilt_names() == [k.name for k in kt.PREBUILT[:4]]
    assert capsys.readouterr().err == ""


def test_a_stale_or_broken_manifest_is_set_aside_with_one_line(tmp_path, capsys):
    d = _prebuilt(tmp_path, kt.PREBUILT[:4], fingerprint="0" * 64)
    loader = kernel_loader.KernelLoader(d)
    assert loader.prebuilt_names() == [] and loader.prebuilt_names() == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "built from other sources" in err and "python -m echonccl.build" in err
    (d / kernel_loader.MANIFEST).write_text(json.dumps({"kernels": ["echo_gone"], "fingerprint": "x"}))
    assert kernel_loader.KernelLoader(d).prebuilt_names() == []
    assert "unreadable" in capsys.readouterr().err
    assert kernel_loader.KernelLoader(tmp_path / "missing").prebuilt_names() == []
    assert kernel_loader.KernelLoader(None).prebuilt_names() == []


def test_the_prebuilt_folder_follows_the_setting_read_at_the_first_lookup(monkeypatch, tmp_path, capsys):
    d = _prebuilt(tmp_path, kt.PREBUILT[:3])
    monkeypatch.delenv("ECHONCCL_KERNEL_DIR", raising=False)
    loader = kernel_loader.KernelLoader()
    monkeypatch.setenv("ECHONCCL_KERNEL_DIR", str(d))       # set after the loader is made: still read
    assert loader.prebuilt_names() == [k.name for k in kt.PREBUILT[:3]]
    monkeypatch.delenv("ECHONCCL_KERNEL_DIR")               # read once: a process keeps its folder
    assert loader.prebuilt_names() == [k.name for k in kt.PREBUILT[:3]]
    assert kernel_loader.prebuilt_dir() == kernel_loader.PREBUILT_DIR
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ECHONCCL_KERNEL_DIR", str(tmp_path / "missing"))
    assert kernel_loader.KernelLoader().prebuilt_names() == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"ECHONCCL_KERNEL_DIR={tmp_path / 'missing'}" in err and "on demand" in err
    assert kernel_loader.KernelLoader(None).prebuilt_names() == []     # an explicit folder beats the setting
    assert kernel_loader.KernelLoader(d).prebuilt_names() == [k.name for k in kt.PREBUILT[:3]]


def test_cache_dir_follows_the_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("ECHONCCL_KERNEL_CACHE", str(tmp_path / "k"))
    assert kernel_loader.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("ECHONCCL_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_loader.cache_dir() == tmp_path / "xdg" / "echonccl"


def test_node_lock_serializes_processes(tmp_path):
    """The compile lock (fcntl) keeps a second process out until the first lets go."""
    import subprocess
    import sys
    import time

    lock = tmp_path / "k.lock"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, sys, time
f = open({str(lock)!r}, "a"); fcntl.flock(f, fcntl.LOCK_EX); print("held", flush=True); time.sleep(1.0)
"""], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    with kernel_loader._node_lock(lock) as locked:
        waited = time.monotonic() - t0
    holder.wait(10)
    assert locked and waited > 0.3
