"""The GPU engine's kernels: `kernels.Kernels` on cupy arrays, bit-exact with `kernels_numpy`.

The CUDA code is ``cuda_src/`` (``kernels.cuh`` over ``codec.cuh`` and its parts); which kernels
exist, and their names, is `kernel_table`'s; `kernel_loader` loads them (prebuilt, or compiled
on demand). Launches go on the current cupy stream, never synchronize and allocate nothing:
every argument is a view the caller owns, passed to the kernel as a raw pointer (cupy arrays,
None for a null pointer) or a Python int (int64).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import codec, dtypes, kernel_loader
from . import kernel_table as kt
from .kernel_table import BLOCK, ELEMS_PER_THREAD

# ------------------------------------------------------------------------ geometry
class Geometry(NamedTuple):
    """Sizes and grid sizes of one layout on one device (`CudaKernels._geom`)."""

    slice_elems: int          # S
    group: int                # G
    slice_bytes: int          # B
    rq_blocks: int            # reduce_quantize grid
    dq_blocks: dict           # dequantize grid, by unroll factor


# ------------------------------------------------------------------------- kernels
class CudaKernels:
    """CUDA implementation of `kernels.Kernels` on cupy arrays (current stream, asynchronous).

    Launch geometry (`kernel_table`'s constants): blocks of `BLOCK` = 256 threads, one thread
    per 8 elements. reduce_quantize: a 1-D grid of ``min(S / 2048, RQ_BLOCKS_PER_SM * SMs)``
    blocks looping grid-stride over the slice (2 to 4 blocks of it are resident per SM, as the
    kernels' launch bounds say; they prefetch the next chunk while computing one). dequantize: a
    2-D grid, ``y`` = one slice per row (only the slices holding ``out``), ``x`` =
    ``min(S / (2048 * unroll), DQ_BLOCKS_PER_SM * SMs)``. Measured best on H200.
    ``max_blocks`` (> 0) caps every grid, so that kernels running beside NCCL's on another stream
    leave SMs free (tools/kernel_bench.py).
    """

    def __init__(self, check: bool = True, max_blocks: int = 0):
        self.max_blocks = int(max_blocks)
        self.check = check
        self._rq: dict = {}       # (in dtype, res dtype, ref dtype, codec or pair) -> RawKernel
        self._dq: dict = {}       # (out dtype, codec, summed) -> (RawKernel, unroll)
        self._geoms: dict = {}    # (layout, device) -> Geometry
        self._sms: dict = {}      # device -> multiprocessor count

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

        dq = {u: blocks(threads // u, kt.DQ_BLOCKS_PER_SM) for u in set(kt.DQ_UNROLL.values())}
        g = Geometry(S, G, B, blocks(threads, kt.RQ_BLOCKS_PER_SM), dq)
        if len(self._geoms) >= 256:
            self._geoms.clear()
        self._geoms[key] = g
        return g

    # -- kernel lookup ---------------------------------------------------------
    def _rq_kernel(self, key):
        in_dt, res_dt, ref_dt, codec_name = key
        i = dtypes.kernel_name(in_dt)
        if res_dt is None:
            r = f = "f32"  # feedback off: any instantiation; the residual pointer is null
        else:
            r = dtypes.residual_kernel_name(res_dt)
            f = dtypes.kernel_name(np.dtype(ref_dt))
            if r not in ("f32", i, "i8") or f not in ("f32", i):
                raise TypeError(f"reduce_quantize: residual {res_dt} must be float32, the input dtype {in_dt} "
                                f"or uint8 (the int8 block format), ref {ref_dt} float32 or {in_dt}")
        k = kernel_loader.function(kt.Kernel("reduce_quantize", i, codec_name, r, f).name)
        self._rq[key] = k
        return k

    def _dq_kernel(self, key):
        out_dt, codec_name, summed = key
        t = dtypes.kernel_name(out_dt)
        k = (kernel_loader.function(kt.Kernel("dequantize_sum" if summed else "dequantize", t, codec_name).name),
             1 if summed else kt.DQ_UNROLL[t])
        self._dq[key] = k
        return k

    # -- the interface -----------------------------------------------------------
    def reduce_quantize(self, layout, incoming, own_pos, own, residual, wire_out, ref_dtype, base=None,
                        out_layout=None) -> None:
        geo = self._geom(layout)
        S, B = geo.slice_elems, geo.slice_bytes
        n_in = 0 if incoming is None else incoming.size // B
        pair = codec.joined(layout.codec, layout.codec if out_layout is None else out_layout.codec)
        if self.check and out_layout is not None and (out_layout.slice_elems != S
                                                      or pair not in (layout.codec, *kt.PAIRS)):
            raise ValueError(f"out_layout must slice as layout does, in {layout.codec} or a pair of {kt.PAIRS}")
        key = (own.dtype, None if residual is None else residual.dtype, ref_dtype, pair)
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
            B_out = B if out_layout is None else out_layout.slice_bytes
            if wire_out.size < B_out or wire_out.data.ptr & 3 or (n_in and incoming.data.ptr & 3):
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
        key = (out.dtype, layout.codec, terms > 1)
        kern, unroll = self._dq.get(key) or self._dq_kernel(key)
        n = -(-count // S)
        part = wire.size // terms
        if self.check:
            if n * B > part or wire.data.ptr & 3 or (terms > 1 and part & 3):
                raise ValueError(f"{count} outputs need {terms} part(s) of {n} slices of {B} bytes in a 4-byte "
                                 "aligned wire")
            if count > 1 and out.strides[0] != out.itemsize:
                raise ValueError("out must be a contiguous 1-D view")
        acc = 1 if accumulate else 0
        if terms > 1:
            kern((geo.dq_blocks[unroll], n), (BLOCK,), (wire, out, count, S, acc, terms, part))
        else:
            kern((geo.dq_blocks[unroll], n), (BLOCK,), (wire, out, count, S, acc))
