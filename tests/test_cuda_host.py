"""cuda_src's device code run on the CPU: its headers made host C++ (tests/host/hostify.py: the
inline PTX interpreted by tests/host/warp_host.h, a warp as 32 threads, `__syncwarp` a barrier),
compiled with the host compiler, under ThreadSanitizer where the compiler has it (the staging
helpers in every run, the loops in make test-all; a lane reading shared memory before its warp's
barrier is a reported race):

* staging_check.cpp: the 16-element loops' staging helpers, aligned and at every shift off 16-byte
  alignment: what each lane reads, which bytes a store writes (buffers against PROT_NONE pages);
* loops_check.cpp: the shifted kernels' 16-element loops at every shift against the aligned ones
  on the same data, byte for byte; and the three phases of the general two-shot and of its shifted
  twin on a ragged slice with misaligned buffers, and the whole kernel's and its any-count twin's,
  against the numpy reference (`NumpyKernels`), bit for bit;
* fused_check.cpp: the fused kernels whole, a process a block (work items, flags and epochs,
  peers' slots, the push halves of a call's parity, several blocks, calls and ranks, the ranks out
  of step): the default two-shot and one_shot_q kernels, and the whole two-shot of float16 data and
  the whole and shifted ones with int8 residuals, against their schedules on `NumpyKernels`,
  outputs and residuals bit for bit; the 16-bit one-shots, tiled and low-latency, against the
  float32 sum in rank order; each family's waits giving up on a peer that never comes.

What a GPU run adds: the hardware's cp.async and memory model, timing (tools/gpu_suite.sh)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from echonccl import codec, dtypes, kernel_table as kt
from echonccl.feedback import Feedback
from echonccl.fused import _one_shot_needs, _one_shot_q_needs, _two_shot_slot
from echonccl.kernels_numpy import NumpyKernels
from echonccl.layout import Layout
from echonccl.peer_memory import LL_BLOCKS, LL_WORDS, ONE_SHOT_TILE, fused_tiles, peer_table, region_layout

from test_properties import simulate

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
               "-Wno-unknown-pragmas", "-Wno-missing-field-initializers", "-Wno-sign-compare",
               # g++ cannot follow a value loaded and used under the same condition (the owner's
               # early load of its first incoming slice, `nin > 0`); the outputs are checked bit for bit
               "-Wno-maybe-uninitialized",
               f"-I{HOST}", f"-I{headers}", "-include", str(headers / "prelude.h"), str(HOST / f"{name}.cpp"),
               "-o", str(exe)]
        built = subprocess.run(cmd[:1] + ["-fsanitize=thread"] + cmd[1:] if sanitize else cmd, capture_output=True,
                               text=True, timeout=300)
        if sanitize and built.returncode != 0 and "tsan" in built.stderr.lower():   # no ThreadSanitizer runtime
            return _build(headers, name, False)
        assert built.returncode == 0, built.stderr[-4000:]
        _built[key] = exe
    return _built[key]


def _run(exe: Path, *args, status: int = 0, env=None, timeout: float = 300) -> str:
    env = dict(os.environ, TSAN_OPTIONS=f"suppressions={HOST / 'tsan.supp'}", **(env or {}))
    run = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == status, run.stdout[-4000:] + run.stderr[-2000:]
    return run.stdout


def test_staging_helpers_on_the_host(headers):
    assert _run(_build(headers, "staging_check", sanitize=True)).strip().endswith(" 0 failed")


def test_loops_at_a_shift_write_what_the_aligned_loops_write(headers):
    out = _run(_build(headers, "loops_check", sanitize=False)).strip()
    assert out.endswith(" 0 failed") and not out.startswith("0 checks"), out


def _phase_cases() -> list:
    """(kernel, dtype, residual, sanitize): every kernel's phases in every CI run; in make test-all
    (`slow`) also under ThreadSanitizer (bfloat16, residuals of its type: the shared-memory rings
    of the whole kernel, its any-count twin and the shifted twin, and the general kernel's
    8-element loops; 20-27 s each on a 2-core runner)."""
    cases: list = []
    for k in ("general", "shift", "whole", "any"):
        cases += [(k, "f16", "input", False), (k, "bf16", "int8", False), (k, "bf16", "input", False),
                  pytest.param(k, "bf16", "input", True, marks=pytest.mark.slow)]
    return cases


@pytest.mark.parametrize("kernel,dtype,residual,sanitize", _phase_cases())
def test_two_shot_phases_match_the_numpy_reference(headers, tmp_path, kernel, dtype, residual, sanitize):
    """The phases of the general kernel and of its shifted twin (a ragged slice, misaligned
    buffers), of the whole kernel and of its any-count twin (a ragged slice), bit for bit against
    `NumpyKernels`."""
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


# The fused kernels of 16-bit data with residuals of the data's type (the two-shot's rounding=False),
# by the choice `fused.FusedPaths.first_kernel` makes, the whole two-shot of float16 data, the whole
# and shifted ones with int8 residuals (bfloat16's default), and the 16-bit one-shots:
# fused_check.cpp's names.
_TWO_SHOT = kt.Kernel("two_shot", "bf16", codec.DEFAULT_CODEC, "bf16", "f32", True)
_ONE_SHOT_Q = kt.Kernel("one_shot_q", "bf16", Layout(1, 2, codec.DEFAULT_CODEC).codec, "bf16", whole=True)
FUSED = {"whole": _TWO_SHOT, "any": replace(_TWO_SHOT, any_count=True),
         "general": replace(_TWO_SHOT, whole=False), "shift": replace(_TWO_SHOT, whole=False, shifted=True),
         "whole_f16": replace(_TWO_SHOT, dtype="f16", res="f16"), "whole_i8": replace(_TWO_SHOT, res="i8"),
         "shift_i8": replace(_TWO_SHOT, res="i8", whole=False, shifted=True),
         "q_whole": _ONE_SHOT_Q, "q": replace(_ONE_SHOT_Q, whole=False),
         "one_shot": kt.Kernel("one_shot", "bf16"), "one_shot_ll": kt.Kernel("one_shot_ll", "bf16")}
_DTYPE = {"bf16": "bfloat16", "f16": "float16"}
# a kernel's arguments from fused_check.cpp's Call, in its macro's order (cuda_src/fused.cuh, fused_one_shot.cuh)
_ARGS = {"two_shot": "c.x, c.count, c.out, c.count, c.res_in, c.res_out, c.S, c.rank, c.P, c.tiles, c.max_tiles, 0, "
                     "c.table, c.ctl, c.timeout_ns",
         "one_shot_q": "c.x, c.count, c.out, c.count, c.res_in, c.S, c.rank, c.P, c.tiles, c.max_tiles, 0, c.table, "
                       "c.ctl, c.timeout_ns",
         "one_shot": "c.x, c.out, c.count, c.rank, c.P, c.tiles, c.max_tiles, c.table, c.ctl, c.timeout_ns",
         "one_shot_ll": "c.x, c.out, c.count, c.rank, c.P, c.tiles, c.table, c.block_epochs, c.ctl, c.timeout_ns"}


@pytest.fixture(scope="module")
def fused_exe(headers) -> Path:
    """fused_check.cpp built with the `FUSED` kernels' lines of `kernel_table.source` (kernels.h)."""
    lines = [ln for ln in kt.source(list(FUSED.values()), inline=False).splitlines()
             if ln.startswith(("ECHO_TWO_SHOT_KERNEL(", "ECHO_ONE_SHOT_Q_KERNEL(", "ECHO_ONE_SHOT_KERNEL(",
                               "ECHO_ONE_SHOT_LL_KERNEL("))]
    assert len(lines) == len(FUSED)
    runs = "".join(f"static void run_{kind}(const Call& c) {{ {k.name}({_ARGS[k.family]}); }}\n"
                   for kind, k in FUSED.items())
    table = ", ".join(f'{{"{kind}", &run_{kind}, {str(k.family != "one_shot_ll").lower()}}}'
                      for kind, k in FUSED.items())
    (headers / "kernels.h").write_text("\n".join(lines) + "\n" + runs + f"""using RunFn = void (*)(const Call&);
struct KernelEntry {{ const char* name; RunFn fn; bool ticketed; }};
constexpr int kLlBlocks = {LL_BLOCKS};
static const KernelEntry kKernels[] = {{{table}}};
""")
    return _build(headers, "fused_check", sanitize=False)


def _inputs(tmp_path, P: int, n: int, calls: int, dtype: str = "bf16") -> list:
    """Each call's inputs of every rank, of the kernel's ``dtype`` (fused_check.cpp's x_R_C.bin)."""
    t = dtypes.numpy_dtype(_DTYPE[dtype])
    xs = [[(np.random.default_rng([c, r]).standard_normal(n) * 4).astype(t) for r in range(P)] for c in range(calls)]
    for c in range(calls):
        for r in range(P):
            xs[c][r].tofile(tmp_path / f"x_{r}_{c}.bin")
    return xs


def _region(tmp_path, kind: str, P: int, n: int) -> tuple:
    """Every rank's peer table (fused_check.cpp's table_R.bin) for a call of FUSED[kind] on n
    elements, its region sized as `FusedPaths` sizes it; (S, TILES, MAX_TILES, REGION_BYTES)."""
    family = FUSED[kind].family
    if family in ("one_shot", "one_shot_ll"):
        S, T, push = _one_shot_needs(n, 2, P)
        lay, tiles, max_tiles = region_layout(P, 0, T, push), ONE_SHOT_TILE if family == "one_shot" else LL_WORDS, T
    else:
        layout = Layout(n, P, codec.DEFAULT_CODEC)
        S = layout.slice_elems
        tiles = fused_tiles(S)
        if family == "two_shot":
            lay, push, max_tiles = region_layout(P, _two_shot_slot(layout), tiles), 0, tiles
        else:
            slot, max_tiles, push = _one_shot_q_needs(layout, tiles)
            lay = region_layout(P, slot, max_tiles, push)
    for r in range(P):
        peer_table(r, [s * lay["nbytes"] for s in range(P)], lay, push).tofile(tmp_path / f"table_{r}.bin")
    return S, tiles, max_tiles, lay["nbytes"]


def _states(tmp_path, kind: str, P: int, n: int) -> tuple:
    """Every rank's feedback state for FUSED[kind] on n elements (the two-shot's rounding=False;
    the kernel's residual type, int8 or its input's), its residuals before the first call written
    as fused_check.cpp's res0_in_R.bin and res0_out_R.bin: (states, RES_IN, RES_OUT bytes)."""
    k = FUSED[kind]
    if k.family in ("one_shot", "one_shot_ll"):
        return [None] * P, 0, 0
    layout = Layout(n, P, codec.DEFAULT_CODEC)
    key = (n, P, codec.group_size(codec.DEFAULT_CODEC), _DTYPE[k.dtype])
    states = [Feedback("int8" if k.res == "i8" else "input", rounding=False).bind(
        key, layout, dtypes.numpy_dtype(_DTYPE[k.dtype]), np.zeros) for _ in range(P)]
    for r, st in enumerate(states):
        st.inputs.tofile(tmp_path / f"res0_in_{r}.bin")
        st.output.tofile(tmp_path / f"res0_out_{r}.bin")
    return states, states[0].inputs.nbytes, states[0].output.nbytes


# Every kernel at 2 ranks in every CI run, and at 3 (slices that do not divide evenly) but for the
# bf16-residual whole and shifted kernels and the float16 whole one, whose int8-residual bfloat16
# twins (the default) run at 3 (`slow`: 15 s of a 2-core runner).
_AT_3_SLOW = ("whole", "shift", "whole_f16")


@pytest.mark.parametrize("kind,P", [(k, P) if P == 2 or k not in _AT_3_SLOW else
                                    pytest.param(k, P, marks=pytest.mark.slow)
                                    for k, v in FUSED.items() if v.family in ("two_shot", "one_shot_q")
                                    for P in (2, 3)])
def test_fused_kernel_matches_the_schedule(fused_exe, tmp_path, kind, P):
    """Two calls of a fused kernel on P ranks of two blocks each (the last rank one block, late to
    each call), four tiles a slice: each rank's outputs of both calls and its residuals after them
    are those of its schedule (two_shot, one_shot_q) over `NumpyKernels` with the same feedback,
    bit for bit. The whole kernels (whole, whole_f16, whole_i8, q_whole): a count of whole slices,
    aligned; any: a ragged last slice, aligned; general, shift, shift_i8, q: a ragged last slice
    with the input and output one element off 16-byte alignment."""
    k = FUSED[kind]
    calls, n = 2, P * 8 * kt.BLOCK * 8 - (300 if not k.whole or k.any_count else 0)   # slices of 8 chunks
    offset = 0 if k.whole else 1
    family = k.family
    S, tiles, max_tiles, region_bytes = _region(tmp_path, kind, P, n)
    assert tiles == 4                                                   # tiles of two chunks
    xs = _inputs(tmp_path, P, n, calls, k.dtype)
    states, res_in, res_out = _states(tmp_path, kind, P, n)
    _run(fused_exe, tmp_path, kind, P, n, S, tiles, max_tiles, 2, 1, calls, offset, region_bytes, res_in, res_out)

    G = codec.group_size(codec.DEFAULT_CODEC)
    for c in range(calls):
        outs = simulate(family, xs[c], G, states, 1, codec.DEFAULT_CODEC)
        for r in range(P):
            got = np.fromfile(tmp_path / f"out_{r}_{c}.bin", np.uint16)
            assert np.array_equal(got, outs[r].view(np.uint16)), f"rank {r}, call {c}: output"
    for r, st in enumerate(states):
        assert (tmp_path / f"res_in_{r}.bin").read_bytes() == st.inputs.tobytes(), f"rank {r}: input residuals"
        if family == "two_shot":
            assert (tmp_path / f"res_out_{r}.bin").read_bytes() == st.output.tobytes(), f"rank {r}: output residuals"


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("kind,n,offset", [("one_shot", 4 * 8192, 0), ("one_shot", 3 * 8192 + 5, 1),
                                           ("one_shot_ll", 1000, 0), ("one_shot_ll", 1001, 0)])
def test_fused_one_shot_matches_the_float32_sum(fused_exe, tmp_path, kind, n, offset, P):
    """Two calls of a 16-bit one-shot on P ranks: every rank's outputs are the float32 sum of the
    ranks' inputs in rank order, rounded once. The tiled one (`FusedPaths.one_shot` above
    `LL_MAX_BYTES` or off 4-byte alignment: 8192 elements a tile, whole and ragged, the second off
    16-byte alignment) with two blocks a rank, the last rank one and late; the low-latency one
    (every 4 bytes a line with its epoch; an odd count's last line half a word) with the grid its
    lines need on every rank, the last rank late."""
    calls = 2
    S, tiles, max_tiles, region_bytes = _region(tmp_path, kind, P, n)
    xs = _inputs(tmp_path, P, n, calls)
    if kind == "one_shot":
        assert max_tiles > 1
        blocks, last = 2, 1
    else:
        blocks = last = -(-(-(-n * 2 // 4)) // kt.BLOCK)       # a thread a 4-byte line
        assert blocks > 1
    _run(fused_exe, tmp_path, kind, P, n, S, tiles, max_tiles, blocks, last, calls, offset, region_bytes, 0, 0)
    for c in range(calls):
        acc = np.full(n, -0.0, np.float32)
        for r in range(P):
            acc = acc + xs[c][r].astype(np.float32)
        want = acc.astype(ml_dtypes.bfloat16).view(np.uint16)
        for r in range(P):
            got = np.fromfile(tmp_path / f"out_{r}_{c}.bin", np.uint16)
            assert np.array_equal(got, want), f"rank {r}, call {c}"


@pytest.mark.parametrize("kind", ["whole", "q_whole", "one_shot", "one_shot_ll"])
def test_a_fused_kernel_gives_up_on_a_peer_that_never_comes(fused_exe, tmp_path, kind):
    """Two ranks, the second making no call: the first's kernels stop waiting after their timeout
    (0.3 s in fused_check.cpp) and set `Ctl.error` (which the host turns into PeerTimeoutError),
    in both calls, instead of spinning on; every thread of a block leaves its item loop at the
    same barrier, with one thread of each block late after every barrier (a block whose threads
    left at different ones would hang: the timeout)."""
    P, calls = 2, 2
    n = {"one_shot": 4 * 8192, "one_shot_ll": 1000}.get(kind, P * 8 * kt.BLOCK * 8)
    S, tiles, max_tiles, region_bytes = _region(tmp_path, kind, P, n)
    _inputs(tmp_path, P, n, calls)
    _, res_in, res_out = _states(tmp_path, kind, P, n)
    out = _run(fused_exe, tmp_path, kind, P, n, S, tiles, max_tiles, 2, 0, calls, 0, region_bytes, res_in, res_out,
               status=1,
               env={"ECHO_HOST_LATE_THREAD": str(kt.BLOCK - 1)}, timeout=120)
    assert "rank 0: a wait timed out" in out, out
    assert "rank 1: a wait timed out" not in out, out
