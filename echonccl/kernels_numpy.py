"""The CPU engine's kernels: the numpy reference of the three codec steps.

Every kernel works on one rank's buffers (numpy arrays, owned by the caller)
and follows `codec`'s arithmetic exactly; the CUDA kernels must match these
bit for bit. The contract of each method is the one of `kernels.Kernels`.
"""
from __future__ import annotations

import numpy as np

from . import codec
from .layout import Layout

_F32 = np.dtype(np.float32)


def _padded_f32(own: np.ndarray, n: int) -> np.ndarray:
    v = np.zeros(n, dtype=_F32)
    v[: own.size] = own
    return v


class NumpyKernels:
    """numpy implementation of `kernels.Kernels` (host memory, synchronous)."""

    def reduce_quantize(self, layout: Layout, incoming, own_pos: int, own: np.ndarray,
                        residual, wire_out: np.ndarray, ref_dtype, base=None) -> None:
        S, G, B, cd = layout.slice_elems, layout.group, layout.slice_bytes, layout.codec
        rot = codec.rotated(cd)
        n_in = 0 if incoming is None else incoming.size // B
        terms = [codec.decode(incoming[i * B:(i + 1) * B], S, G, cd) for i in range(n_in)]
        mine = _padded_f32(own, S)
        terms.insert(own_pos, codec.rotate(mine) if rot else mine)
        acc = terms[0].copy()
        with np.errstate(invalid="ignore", over="ignore"):
            for t in terms[1:]:
                acc += t
            if residual is not None:
                acc += codec.load_residuals(residual)
        q, scale = codec.quantize_groups(acc, G, cd)
        codec.write_wire(wire_out, q, scale, cd)
        if residual is not None:
            ref = codec.dequantize_groups(q, scale, G)
            with np.errstate(over="ignore", invalid="ignore"):
                if rot and (base is not None or np.dtype(ref_dtype) != _F32):
                    ref = codec.unrotate(ref)        # what the output holds, then rotated back
                if base is not None:                 # what accumulating into base really adds
                    b = _padded_f32(base, S)
                    ref = (b + ref).astype(ref_dtype).astype(_F32) - b
                elif np.dtype(ref_dtype) != _F32:
                    ref = ref.astype(ref_dtype).astype(_F32)
                if rot and (base is not None or np.dtype(ref_dtype) != _F32):
                    ref = codec.rotate(ref)
            residual[:] = codec.residual_of(acc, ref, residual.dtype)

    def dequantize(self, layout: Layout, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        S, G, cd = layout.slice_elems, layout.group, layout.codec
        q, scale = codec.read_wire(wire, S, G, cd)
        values = codec.dequantize_groups(q, scale, G)
        nan_group, nan = codec.nan_units(scale, G, cd)
        if codec.rotated(cd):                        # a NaN-scale unit keeps the scale's NaN bits
            with np.errstate(invalid="ignore"):
                values = np.where(nan_group, nan * _F32.type(1), codec.unrotate(values))
        values, nan_group = values[: out.size], nan_group[: out.size]
        with np.errstate(over="ignore", invalid="ignore"):   # beyond the output dtype's range: +-Inf, by design
            if not accumulate:
                out[:] = values.astype(out.dtype)
                return
            total = (out.astype(_F32) + values).astype(out.dtype)
            total[nan_group] = values[nan_group].astype(out.dtype)
            keep = np.isnan(out) & ~nan_group                # a NaN already there keeps its bits
        total[keep] = out[keep]
        out[:] = total
