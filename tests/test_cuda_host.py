"""cuda_src's device code run on the CPU: its headers made host C++ (tests/host/hostify.py: the
inline PTX interpreted by tests/host/warp_host.h, a warp as 32 threads, `__syncwarp` a barrier),
compiled with the host compiler, under ThreadSanitizer where the compiler has it (a lane reading
shared memory before its warp's barrier is a reported race):

* staging_check.cpp: the 16-element loops' staging helpers, aligned and at every shift off 16-byte
  alignment: what each lane reads, which bytes a store writes (buffers against PROT_NONE pages);
* loops_check.cpp: the shifted kernels' 16-element loops at every shift against the aligned ones
  on the same data, byte for byte; and the three phases of the general two-shot and of its shifted
  twin on a ragged slice with misaligned buffers, and the whole kernel's and its any-count twin's,
  against the numpy reference (`NumpyKernels`), bit for bit.

What a GPU run adds: the hardware's cp.async, the kernels around these functions (work items,
flags, peers), timing (tools/gpu_suite.sh)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from echonccl import kernel_table as kt
from echonccl.kernels_numpy import NumpyKernels
from echonccl.layout import Layout

HOST = Path(__file__).parent / "host"
CXX = shutil.which("g++") or shutil.which("clang++")
S = 512 * 64     # loops_check.cpp's slice


@pytest.fixture(scope="module")
def headers(tmp_path_factory) -> Path:
    """cuda_src hostified, with the launch constants as prelude.h. Without a host C++ compiler
    these tests skip, except under CI=true (as the nvcc tests: nvcc needs one too)."""
    if CXX is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("no host C++ compiler (g++ or clang++), and CI=true requires the host CUDA tests",
                        pytrace=False)
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp("hostified")
    spec = importlib.util.spec_from_file_location("hostify", HOST / "hostify.py")
    hostify = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hostify)
    hostify.hostify(kt.source_dir(), d)
    (d / "prelude.h").write_text(kt.prelude())
    return d


_built: dict = {}


def _build(headers: Path, name: str, sanitize: bool) -> Path:
    """tests/host/NAME.cpp compiled against the hostified headers (once a module)."""
    key = (headers, name, sanitize)
    if key not in _built:
        exe = headers / (name + ("_tsan" if sanitize else ""))
        cmd = [CXX, "-std=c++20", "-O1", "-g", "-pthread", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
               "-Wno-unknown-pragmas", "-Wno-missing-field-initializers", f"-I{HOST}", f"-I{headers}",
               "-include", str(headers / "prelude.h"), str(HOST / f"{name}.cpp"), "-o", str(exe)]
        built = subprocess.run(cmd[:1] + ["-fsanitize=thread"] + cmd[1:] if sanitize else cmd, capture_output=True,
                               text=True, timeout=300)
        if sanitize and built.returncode != 0 and "tsan" in built.stderr.lower():   # no ThreadSanitizer runtime
            return _build(headers, name, False)
        assert built.returncode == 0, built.stderr[-4000:]
        _built[key] = exe
    return _built[key]


def _run(exe: Path, *args) -> str:
    env = dict(os.environ, TSAN_OPTIONS=f"suppressions={HOST / 'tsan.supp'}")
    run = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run.stdout


def test_staging_helpers_on_the_host(headers):
    assert _run(_build(headers, "staging_check", sanitize=True)).strip().endswith(" 0 failed")


def test_loops_at_a_shift_write_what_the_aligned_loops_write(headers):
    out = _run(_build(headers, "loops_check", sanitize=False)).strip()
    assert out.endswith(" 0 failed") and not out.startswith("0 checks"), out


@pytest.mark.parametrize("dtype,residual", [("bf16", "input"), ("f16", "input"), ("bf16", "int8")])
@pytest.mark.parametrize("kernel", ["general", "shift", "whole", "any"])
def test_two_shot_phases_match_the_numpy_reference(headers, tmp_path, kernel, dtype, residual):
    """The phases of the general kernel and of its shifted twin (a ragged slice, misaligned
    buffers), of the whole kernel and of its any-count twin (a ragged slice), bit for bit against `NumpyKernels` (ThreadSanitizer
    on the default's: bfloat16, residuals of its type)."""
    sanitize = (dtype, residual) == ("bf16", "input")
    _run(_build(headers, "loops_check", sanitize=sanitize), tmp_path, kernel, dtype, residual)
    n = int((tmp_path / "n.txt").read_text())
    assert (n == S) if kernel == "whole" else (n % 512 and n // 512 > 0)   # both loops ran where ragged

    def rd(name, dt):
        return np.fromfile(tmp_path / f"{name}.bin", dtype=dt)

    t = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}[dtype]
    r = np.uint8 if residual == "int8" else t
    x, r0, incoming = rd("x", t)[:n], rd("r0", r), rd("incoming", np.uint8)
    L4, L7 = Layout(2 * S, 2, "int4-h32"), Layout(2 * S, 2, "int4-h32/int7-h32").sums
    k = NumpyKernels()
    res, wire = r0.copy(), np.zeros(L4.slice_bytes, np.uint8)
    k.reduce_quantize(L4, None, 0, x, res, wire, np.float32)
    assert np.array_equal(wire, rd("wire4", np.uint8)), "a contribution's codes"
    assert np.array_equal(res.view(np.uint8), rd("res4", np.uint8)), "a contribution's residuals"
    res, wire = r0.copy(), np.zeros(L7.slice_bytes, np.uint8)
    k.reduce_quantize(L4, incoming, 1, x, res, wire, np.float32, out_layout=L7)
    assert np.array_equal(wire, rd("wire7", np.uint8)), "the owner's codes"
    assert np.array_equal(res.view(np.uint8), rd("res7", np.uint8)), "the owner's residuals"
    y = np.zeros(n, t)
    k.dequantize(L7, wire, y)
    for name in ("out", "dec"):              # the owner's output slice; the decode of its codes
        got = rd(name, np.uint16)
        assert np.array_equal(got[:n], y.view(np.uint16)), name
        assert (got[n:] == 0xA5A5).all(), f"{name}: elements past the count written"
