"""The GPU engine's kernels: `kernels.Kernels` on cupy arrays, bit-exact with `kernels_numpy`.

The kernels live in ``cuda_src/`` (``codec.cuh``: the templates; ``echo_kernels.cu``:
the ``extern "C"`` entry points over one instantiation list). Loading, once per
process (CuPy then keeps one module per device):

1. ``$ECHONCCL_FATBIN`` if set (it must exist);
2. else a prebuilt ``echo_kernels.fatbin`` (``tools/build_fatbin.sh``) in the
   repository's ``cuda_src/`` or the installed package's ``echonccl/cuda_src/``,
   unless its ``.sha256`` fingerprint says it was built from other sources;
3. else the source, compiled by NVRTC through ``cupy.RawModule(code=...)``.
   ``codec.cuh`` is inlined into the code so that CuPy's on-disk cache key
   covers it. (CuPy appends ``-ftz=true`` to NVRTC options; the kernels do all
   float arithmetic in inline PTX without ``.ftz``, so that cannot change a bit.)

Launches go on the current cupy stream, never synchronize and allocate
nothing: every argument is a view the caller owns, passed to the kernel as a
raw pointer (cupy arrays, None for a null pointer) or a Python int (int64).

This module imports without cupy (``entry_points``, ``source_files`` and
``compile_check`` only need the files and, for the latter, ``nvcc``).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from . import codec, dtypes

BLOCK = 256                      # threads per block; matches ECHO_BLOCK / __launch_bounds__
ELEMS_PER_THREAD = 8
SOURCE_NAMES = ("codec.cuh", "echo_kernels.cu")
FATBIN_NAME = "echo_kernels.fatbin"
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")
NVCC_FLAGS = ("-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")

_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
# Chunks of 8 outputs per thread and grid-stride step in dequantize, by output
# type (ECHO_DQ_UNROLL16 / ECHO_DQ_UNROLL32 in codec.cuh; only sizes the grid).
_DQ_UNROLL = {"f16": 2, "bf16": 2, "f32": 1}
# (input, residual, ref) combinations instantiated in echo_kernels.cu, per group size.
_RQ_COMBOS = tuple((i, r, f) for i in ("f16", "bf16") for r in ("f32", i) for f in ("f32", i)) + (
    ("f32", "f32", "f32"),)
_DQ_TYPES = ("f16", "bf16", "f32")

_PKG_DIR = Path(__file__).resolve().parent
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"codec\.cuh"[^\n]*$', re.M)


# --------------------------------------------------------------------------- names
_CODEC_SUFFIX = {"int4": "", "int4-h32": "_h32"}


def reduce_quantize_name(in_t: str, res_t: str, ref_t: str, group: int, codec_name: str = "int4") -> str:
    return f"echo_reduce_quantize_{in_t}_res{res_t}_ref{ref_t}_g{group}{_CODEC_SUFFIX[codec_name]}"


def dequantize_name(out_t: str, group: int, accumulate: bool = False, codec_name: str = "int4") -> str:
    return f"echo_dequantize_{'acc_' if accumulate else ''}{out_t}_g{group}{_CODEC_SUFFIX[codec_name]}"


def entry_points() -> list[str]:
    """Every kernel name ``echo_kernels.cu`` defines (the same list, built the same way)."""
    names = []
    for g in codec.GROUP_SIZES:
        for i, r, f in _RQ_COMBOS:
            names += [reduce_quantize_name(i, r, f, g, c) for c in codec.CODECS]
        for o in _DQ_TYPES:
            names += [dequantize_name(o, g, acc, c) for acc in (False, True) for c in codec.CODECS]
    return names


def _short(dtype) -> str:
    return _SHORT[dtypes.canonical(dtype)]


# ------------------------------------------------------------------------- sources
def source_dirs() -> list[Path]:
    """Where ``cuda_src`` may be: the repository checkout, then the installed package data."""
    return [_PKG_DIR.parent / "cuda_src", _PKG_DIR / "cuda_src"]


def source_dir() -> Path:
    for d in source_dirs():
        if all((d / n).is_file() for n in SOURCE_NAMES):
            return d
    raise FileNotFoundError(f"echonccl CUDA sources {SOURCE_NAMES} not found in "
                            f"{[str(d) for d in source_dirs()]}")


def source_files() -> list[Path]:
    d = source_dir()
    return [d / n for n in SOURCE_NAMES]


def source_fingerprint(d: Path) -> str:
    """sha256 over the sources, as ``tools/build_fatbin.sh`` writes it next to the fatbin."""
    h = hashlib.sha256()
    for n in SOURCE_NAMES:
        h.update((d / n).read_bytes())
    return h.hexdigest()


def module_source() -> str:
    """``echo_kernels.cu`` with ``codec.cuh`` inlined (what NVRTC compiles)."""
    d = source_dir()
    header = (d / "codec.cuh").read_text()
    body, n = _INCLUDE_RE.subn("", (d / "echo_kernels.cu").read_text())
    if n != 1:
        raise RuntimeError('echo_kernels.cu must #include "codec.cuh" exactly once')
    return header + "\n" + body


def find_fatbin() -> Path | None:
    """The prebuilt fatbin to load, or None (compile the source)."""
    env = os.environ.get("ECHONCCL_FATBIN")
    if env:
        p = Path(env)
        if not p.is_file():
            raise FileNotFoundError(f"ECHONCCL_FATBIN={env} does not exist")
        return p
    for d in source_dirs():
        p = d / FATBIN_NAME
        if not p.is_file():
            continue
        stamp = p.with_name(p.name + ".sha256")
        if stamp.is_file() and all((d / n).is_file() for n in SOURCE_NAMES):
            if stamp.read_text().strip() != source_fingerprint(d):
                import warnings

                warnings.warn(f"{p} was built from other sources than those beside it: ignored "
                              f"(rebuild with tools/build_fatbin.sh)", RuntimeWarning, stacklevel=3)
                continue
        return p
    return None


# -------------------------------------------------------------------------- module
class _Module:
    """The process-wide RawModule (lazy) and its RawKernels by name. CuPy loads or
    compiles the module once per device, on first use there."""

    def __init__(self):
        self._lock = threading.Lock()
        self._raw = None
        self._kernels: dict = {}
        self.origin: str | None = None

    def raw(self):
        if self._raw is None:
            with self._lock:
                if self._raw is None:
                    import cupy

                    fatbin = find_fatbin()
                    if fatbin is not None:
                        self._raw = cupy.RawModule(path=str(fatbin))
                        self.origin = f"fatbin {fatbin}"
                    else:
                        options = NVRTC_OPTIONS + (f"-I{source_dir()}",)
                        self._raw = cupy.RawModule(code=module_source(), options=options)
                        self.origin = f"nvrtc {source_dir()}"
        return self._raw

    def kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            k = self.raw().get_function(name)  # loads / compiles for the current device
            self._kernels[name] = k
        return k


_MODULE = _Module()


# ------------------------------------------------------------------------- kernels
class CudaKernels:
    """CUDA implementation of `kernels.Kernels` on cupy arrays (current stream, asynchronous).

    Launch geometry: blocks of `BLOCK` = 256 threads, one thread per 8
    elements. reduce_quantize: a 1-D grid of ``min(S / 2048, blocks_per_sm *
    SMs)`` blocks looping grid-stride over the slice (4 blocks of it are
    resident per SM: the kernels are capped at 64 registers, and they prefetch
    the next chunk while computing one). dequantize: a 2-D grid, ``y`` = one
    slice per row (only the slices holding ``out``), ``x`` = ``min(S / (2048 *
    unroll), dq_blocks_per_sm * SMs)``. Both defaults were measured best on H200.
    """

    source_files = staticmethod(source_files)
    entry_points = staticmethod(entry_points)

    def __init__(self, blocks_per_sm: int = 8, dq_blocks_per_sm: int = 16, check: bool = True):
        self.blocks_per_sm = int(blocks_per_sm)
        self.dq_blocks_per_sm = int(dq_blocks_per_sm)
        self.check = check
        self._rq: dict = {}       # (in dtype, res dtype, ref dtype, G, codec) -> RawKernel
        self._dq: dict = {}       # (out dtype, G, accumulate, codec) -> (RawKernel, unroll)
        self._geoms: dict = {}    # (layout, device) -> (layout, S, G, B, rq blocks, {unroll: dq blocks})
        self._sms: dict = {}      # device -> multiprocessor count

    @staticmethod
    def compile_check(**kw) -> dict:
        return compile_check(**kw)

    @property
    def origin(self) -> str | None:
        """Where the module came from (``fatbin PATH`` / ``nvrtc DIR``), once loaded."""
        return _MODULE.origin

    def preload(self) -> None:
        """Load (or compile) every entry point on the current device."""
        for name in entry_points():
            _MODULE.kernel(name)

    # -- launch geometry ------------------------------------------------------
    def _geom(self, layout):
        """Per (layout, device): sizes and grid sizes, computed once (layouts are frozen
        dataclasses, so equal layouts share an entry)."""
        import cupy

        dev = cupy.cuda.runtime.getDevice()
        key = (layout, dev)
        g = self._geoms.get(key)
        if g is not None:
            return g
        sms = self._sms.get(dev)
        if sms is None:
            sms = self._sms[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
        S, G, B = layout.slice_elems, layout.group, layout.slice_bytes
        threads = S // ELEMS_PER_THREAD

        def blocks(n, per_sm):
            return max(1, min(-(-n // BLOCK), sms * per_sm))

        dq = {u: blocks(threads // u, self.dq_blocks_per_sm) for u in set(_DQ_UNROLL.values())}
        g = (layout, S, G, B, blocks(threads, self.blocks_per_sm), dq)
        if len(self._geoms) >= 256:
            self._geoms.clear()
        self._geoms[key] = g
        return g

    # -- kernel lookup ---------------------------------------------------------
    def _rq_kernel(self, key):
        in_dt, res_dt, ref_dt, group, codec_name = key
        i = _short(in_dt)
        if res_dt is None:
            r = f = "f32"  # feedback off: any instantiation; the residual pointer is null
        else:
            r = _short(res_dt)
            f = _short(np.dtype(ref_dt))
            if r not in ("f32", i) or f not in ("f32", i):
                raise TypeError(f"reduce_quantize: residual {res_dt} and ref {ref_dt} must each be "
                                f"float32 or the input dtype {in_dt}")
        k = _MODULE.kernel(reduce_quantize_name(i, r, f, codec.check_group_size(group),
                                                codec.check_codec(codec_name)))
        self._rq[key] = k
        return k

    def _dq_kernel(self, key):
        out_dt, group, accumulate, codec_name = key
        t = _short(out_dt)
        k = (_MODULE.kernel(dequantize_name(t, codec.check_group_size(group), accumulate,
                                            codec.check_codec(codec_name))), _DQ_UNROLL[t])
        self._dq[key] = k
        return k

    # -- the interface -----------------------------------------------------------
    def reduce_quantize(self, layout, incoming, own_pos, own, residual, wire_out, ref_dtype, base=None) -> None:
        _, S, G, B, blocks, _ = self._geom(layout)
        n_in = 0 if incoming is None else incoming.size // B
        key = (own.dtype, None if residual is None else residual.dtype, ref_dtype, G, layout.codec)
        kern = self._rq.get(key) or self._rq_kernel(key)
        if residual is None:
            base = None                      # only the residual reads it
        if self.check:
            if base is not None and (base.dtype != np.dtype(ref_dtype) or base.size > S
                                     or (base.size > 1 and base.strides[0] != base.itemsize)):
                raise ValueError(f"base must be a contiguous 1-D view of at most {S} elements of {ref_dtype}")
            if not 0 <= own_pos <= n_in:
                raise ValueError(f"own_pos {own_pos} outside [0, {n_in}]")
            if own.size > S or (own.size > 1 and own.strides[0] != own.itemsize):
                raise ValueError(f"own must be a contiguous 1-D view of at most {S} elements")
            if residual is not None and (residual.size != S or residual.strides[0] != residual.itemsize):
                raise ValueError(f"residual must be a contiguous 1-D view of {S} elements")
            if wire_out.size < B or wire_out.data.ptr & 3 or (n_in and incoming.data.ptr & 3):
                raise ValueError("wire buffers must be 4-byte aligned and hold a whole slice")
        kern((blocks,), (BLOCK,), (incoming, n_in, own_pos, own, own.size, residual, wire_out, S,
                                   base, 0 if base is None else base.size))

    def dequantize(self, layout, wire, out, accumulate: bool = False) -> None:
        count = out.size
        if count == 0:
            return
        _, S, G, B, _, dq_blocks = self._geom(layout)
        key = (out.dtype, G, bool(accumulate), layout.codec)
        kern, unroll = self._dq.get(key) or self._dq_kernel(key)
        n = -(-count // S)
        if self.check:
            if n * B > wire.size or wire.data.ptr & 3:
                raise ValueError(f"{count} outputs need {n} slices of {B} bytes in a 4-byte aligned wire")
            if count > 1 and out.strides[0] != out.itemsize:
                raise ValueError("out must be a contiguous 1-D view")
        kern((dq_blocks[unroll], n), (BLOCK,), (wire, out, count, S))


# ------------------------------------------------------------------- compile check
_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_check(nvcc: str | None = None, arch: str = "sm_90", outdir: str | os.PathLike | None = None,
                  fatbin: bool = False) -> dict:
    """Compile ``cuda_src`` with nvcc (no GPU needed) and check the entry points.

    Runs ``nvcc -ptx`` and ``nvcc -c -Xptxas -v`` for ``arch`` (and, with
    ``fatbin=True``, ``tools/build_fatbin.sh``) in ``outdir`` (a temporary
    directory by default). Returns ``{"entries": [...], "registers": {name: n},
    "spills": {name: bytes}, "ptx": path, "fatbin": path or None}``; raises
    `RuntimeError` on a compile error or when the PTX entries differ from
    `entry_points()`.
    """
    nvcc = nvcc or shutil.which("nvcc")
    if not nvcc:
        raise FileNotFoundError("nvcc not found")
    d = source_dir()
    cu = d / "echo_kernels.cu"
    tmp = None
    if outdir is None:
        tmp = tempfile.mkdtemp(prefix="echonccl-cc-")
        outdir = tmp
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)

    def run(cmd, **kw):
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
        if r.returncode:
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r.stdout + r.stderr

    ptx = out / "echo_kernels.ptx"
    run([nvcc, f"-arch={arch}", "-ptx", *NVCC_FLAGS, "-o", ptx, cu])
    entries = re.findall(r"^\s*\.(?:visible\s+)?\.entry\s+(\w+)", ptx.read_text(), re.M)
    log = run([nvcc, f"-arch={arch}", "-c", *NVCC_FLAGS, "-Xptxas", "-v", "-o", out / "echo_kernels.o", cu])
    regs, spills, cur = {}, {}, None
    for line in log.splitlines():
        if m := _PTXAS_FUNC.search(line):
            cur = m.group(1)
        elif cur and (m := _PTXAS_SPILL.search(line)):
            spills[cur] = int(m.group(1)) + int(m.group(2))
        elif cur and (m := _PTXAS_REGS.search(line)):
            regs[cur] = int(m.group(1))
    fb = None
    if fatbin:
        fb = out / FATBIN_NAME
        run(["bash", d.parent / "tools" / "build_fatbin.sh", fb], env={**os.environ, "NVCC": str(nvcc)})
    expected = set(entry_points())
    if set(entries) != expected or len(entries) != len(expected):
        raise RuntimeError(f"PTX entries differ from entry_points(): missing "
                           f"{sorted(expected - set(entries))}, extra {sorted(set(entries) - expected)}")
    return {"entries": entries, "registers": regs, "spills": spills, "ptx": str(ptx),
            "fatbin": None if fb is None else str(fb), "log": log}
