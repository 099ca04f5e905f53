"""The GPU engine's kernels: `kernels.Kernels` on cupy arrays, bit-exact with `kernels_numpy`.

The kernels live in ``cuda_src/`` (``codec.cuh``: the templates, in the parts it includes:
``codec_base.cuh``, ``codec_wire.cuh``, ``rotation.cuh``, ``reduce_quantize.cuh``,
``dequantize.cuh``; ``echo_kernels.cu``: the ``extern "C"`` entry points over one
instantiation list). Loading, once per
process (CuPy then keeps one module per device):

1. ``$ECHONCCL_FATBIN`` if set (it must exist);
2. else a prebuilt ``echo_kernels.fatbin`` (``make fatbin``: ``tools/cuda_build.py``) in the
   repository's ``cuda_src/`` or the installed package's ``echonccl/cuda_src/``,
   unless its ``.sha256`` fingerprint says it was built from other sources;
3. else the source, compiled by NVRTC through ``cupy.RawModule(code=...)``.
   The headers are inlined into the code so that CuPy's on-disk cache key
   covers them. (CuPy appends ``-ftz=true`` to NVRTC options; the kernels do all
   float arithmetic in inline PTX without ``.ftz``, so that cannot change a bit.)

Launches go on the current cupy stream, never synchronize and allocate
nothing: every argument is a view the caller owns, passed to the kernel as a
raw pointer (cupy arrays, None for a null pointer) or a Python int (int64).

This module imports without cupy (``entry_points``, ``source_dir`` and
``module_source`` only need the files). Build tooling (nvcc compile checks,
the fatbin) is in ``tools/cuda_build.py``, outside the package; it compiles
with this module's `NVCC_FLAGS`.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import codec, dtypes

BLOCK = 256                      # threads per block; matches ECHO_BLOCK / __launch_bounds__
ELEMS_PER_THREAD = 8
SOURCE_NAMES = ("codec.cuh", "codec_base.cuh", "codec_wire.cuh", "rotation.cuh", "reduce_quantize.cuh",
                "dequantize.cuh", "echo_kernels.cu")
FATBIN_NAME = "echo_kernels.fatbin"
MODULE_NAME = "echo_kernels.cu"
# The one definition of the compile flags: exact IEEE arithmetic (no fmad contraction, no
# flush-to-zero, correctly rounded division and square root), C++17. NVRTC spells -std with
# two dashes; nvcc (tools/cuda_build.py: compile checks, fatbin) takes the same flags.
_FLAGS = ("--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")
NVRTC_OPTIONS = ("--std=c++17", *_FLAGS)
NVCC_FLAGS = ("-std=c++17", *_FLAGS)

_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
# Chunks of 8 outputs per thread and grid-stride step in dequantize, by output
# type (ECHO_DQ_UNROLL16 / ECHO_DQ_UNROLL32 in dequantize.cuh; only sizes the grid).
_DQ_UNROLL = {"f16": 2, "bf16": 2, "f32": 1}
# (input, residual, ref) combinations instantiated in echo_kernels.cu, per group size.
_RQ_COMBOS = tuple((i, r, f) for i in ("f16", "bf16") for r in ("f32", i, "i8") for f in ("f32", i)) + (
    ("f32", "f32", "f32"), ("f32", "i8", "f32"))
_DQ_TYPES = ("f16", "bf16", "f32")

_PKG_DIR = Path(__file__).resolve().parent
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*$', re.M)


# --------------------------------------------------------------------------- names
_CODEC_SUFFIX = {"int4": "", "int4-h32": "_h32", "int7-h32": "_i7h32"}


def codec_suffix(codec_name: str) -> str:
    """What a kernel name ends with for ``codec_name`` (`codec.CODECS`): nothing for int4."""
    return _CODEC_SUFFIX[codec_name]


def reduce_quantize_name(in_t: str, res_t: str, ref_t: str, group: int, codec_name: str = "int4") -> str:
    return f"echo_reduce_quantize_{in_t}_res{res_t}_ref{ref_t}_g{group}{_CODEC_SUFFIX[codec_name]}"


def dequantize_name(out_t: str, group: int, accumulate: bool = False, codec_name: str = "int4",
                    summed: bool = False) -> str:
    """``summed``: the kernel that decodes the sum of several parts (`Kernels.dequantize`'s ``terms``)."""
    return (f"echo_dequantize_{'sum_' if summed else ''}{'acc_' if accumulate else ''}{out_t}_g{group}"
            f"{_CODEC_SUFFIX[codec_name]}")


def entry_points() -> list[str]:
    """Every kernel name ``echo_kernels.cu`` defines (the same list, built the same way)."""
    names = []
    for c, g in codec.codec_groups():
        names += [reduce_quantize_name(i, r, f, g, c) for i, r, f in _RQ_COMBOS]
        names += [dequantize_name(o, g, acc, c, sm) for sm in (False, True) for o in _DQ_TYPES for acc in (False, True)]
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


def source_fingerprint(d: Path) -> str:
    """sha256 over the sources, as ``tools/cuda_build.py`` writes it next to the fatbin."""
    h = hashlib.sha256()
    for n in SOURCE_NAMES:
        h.update((d / n).read_bytes())
    return h.hexdigest()


def module_source(name: str = MODULE_NAME) -> str:
    """The ``.cu`` file ``name`` of `source_dir` with each header it ``#include "..."``s from
    that directory inlined once, in place (what NVRTC compiles: CuPy's on-disk cache key then
    covers the headers too)."""
    d = source_dir()
    seen: set = set()

    def inline(m):
        header = m.group(1)
        if not (d / header).is_file():
            raise RuntimeError(f'{name}: #include "{header}" is not in {d}')
        if header in seen:
            return ""
        seen.add(header)
        return _INCLUDE_RE.sub(inline, (d / header).read_text())

    body = _INCLUDE_RE.sub(inline, (d / name).read_text())
    if name == MODULE_NAME and "codec.cuh" not in seen:
        raise RuntimeError(f'{MODULE_NAME} must #include "codec.cuh"')
    return body


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
                              f"(rebuild with make fatbin)", RuntimeWarning, stacklevel=3)
                continue
        return p
    return None


# ------------------------------------------------------------------------ geometry
class Geometry(NamedTuple):
    """Sizes and grid sizes of one layout on one device (`CudaKernels._geom`)."""

    slice_elems: int          # S
    group: int                # G
    slice_bytes: int          # B
    rq_blocks: int            # reduce_quantize grid
    dq_blocks: dict           # dequantize grid, by unroll factor


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
    ``max_blocks`` (> 0; ``ECHONCCL_CODEC_MAX_BLOCKS``) caps every grid, so that kernels
    running beside NCCL's on another stream leave SMs free.
    """

    def __init__(self, blocks_per_sm: int = 8, dq_blocks_per_sm: int = 16, check: bool = True,
                 max_blocks: int | None = None):
        self.blocks_per_sm = int(blocks_per_sm)
        self.dq_blocks_per_sm = int(dq_blocks_per_sm)
        if max_blocks is None:
            max_blocks = int(os.environ.get("ECHONCCL_CODEC_MAX_BLOCKS", 0) or 0)
        self.max_blocks = int(max_blocks)
        self.check = check
        self._rq: dict = {}       # (in dtype, res dtype, ref dtype, G, codec) -> RawKernel
        self._dq: dict = {}       # (out dtype, G, accumulate, codec, summed) -> (RawKernel, unroll)
        self._geoms: dict = {}    # (layout, device) -> Geometry
        self._sms: dict = {}      # device -> multiprocessor count

    @property
    def origin(self) -> str | None:
        """Where the module came from (``fatbin PATH`` / ``nvrtc DIR``), once loaded."""
        return _MODULE.origin

    def preload(self) -> None:
        """Load (or compile) every entry point on the current device."""
        for name in entry_points():
            _MODULE.kernel(name)

    # -- launch geometry ------------------------------------------------------
    def _geom(self, layout) -> Geometry:
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
            cap = sms * per_sm if self.max_blocks <= 0 else min(sms * per_sm, self.max_blocks)
            return max(1, min(-(-n // BLOCK), cap))

        dq = {u: blocks(threads // u, self.dq_blocks_per_sm) for u in set(_DQ_UNROLL.values())}
        g = Geometry(S, G, B, blocks(threads, self.blocks_per_sm), dq)
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
            r = "i8" if np.dtype(res_dt) == np.uint8 else _short(res_dt)
            f = _short(np.dtype(ref_dt))
            if r not in ("f32", i, "i8") or f not in ("f32", i):
                raise TypeError(f"reduce_quantize: residual {res_dt} must be float32, the input dtype {in_dt} "
                                f"or uint8 (the int8 block format), ref {ref_dt} float32 or {in_dt}")
        k = _MODULE.kernel(reduce_quantize_name(i, r, f, codec.check_group_size(group, codec_name), codec_name))
        self._rq[key] = k
        return k

    def _dq_kernel(self, key):
        out_dt, group, accumulate, codec_name, summed = key
        t = _short(out_dt)
        k = (_MODULE.kernel(dequantize_name(t, codec.check_group_size(group, codec_name), accumulate, codec_name,
                                            summed)),
             1 if summed else _DQ_UNROLL[t])
        self._dq[key] = k
        return k

    # -- the interface -----------------------------------------------------------
    def reduce_quantize(self, layout, incoming, own_pos, own, residual, wire_out, ref_dtype, base=None) -> None:
        geo = self._geom(layout)
        S, G, B = geo.slice_elems, geo.group, geo.slice_bytes
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
            if residual is not None and (residual.size != codec.residual_size(S, residual.dtype)
                                         or residual.strides[0] != residual.itemsize):
                raise ValueError(f"residual must be a contiguous 1-D view of {S} residuals")
            if wire_out.size < B or wire_out.data.ptr & 3 or (n_in and incoming.data.ptr & 3):
                raise ValueError("wire buffers must be 4-byte aligned and hold a whole slice")
        if base is not None and base.size == 0:
            # A base is given (the reference's rule: `base is not None`), with nothing in it; an
            # empty cupy array may have a null pointer, which the kernel would take for no base.
            # Any valid pointer does: base_n = 0 elements of it are read.
            base = wire_out.data.ptr
            base_n = 0
        else:
            base_n = 0 if base is None else base.size
        kern((geo.rq_blocks,), (BLOCK,), (incoming, n_in, own_pos, own, own.size, residual, wire_out, S,
                                   base, base_n))

    def dequantize(self, layout, wire, out, accumulate: bool = False, terms: int = 1) -> None:
        count = out.size
        if count == 0:
            return
        geo = self._geom(layout)
        S, B = geo.slice_elems, geo.slice_bytes
        key = (out.dtype, geo.group, bool(accumulate), layout.codec, terms > 1)
        kern, unroll = self._dq.get(key) or self._dq_kernel(key)
        n = -(-count // S)
        part = wire.size // terms
        if self.check:
            if n * B > part or wire.data.ptr & 3 or (terms > 1 and part & 3):
                raise ValueError(f"{count} outputs need {terms} part(s) of {n} slices of {B} bytes in a 4-byte "
                                 "aligned wire")
            if count > 1 and out.strides[0] != out.itemsize:
                raise ValueError("out must be a contiguous 1-D view")
        if terms > 1:
            kern((geo.dq_blocks[unroll], n), (BLOCK,), (wire, out, count, S, terms, part))
        else:
            kern((geo.dq_blocks[unroll], n), (BLOCK,), (wire, out, count, S))
