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
                        residual, wire_out: np.ndarray, ref_dtype, base=None, out_layout=None) -> None:
        S, G, B, cd = layout.slice_elems, layout.group, layout.slice_bytes, layout.codec
        out = layout if out_layout is None else out_layout       # the codec wire_out is written in
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
        q, scale = codec.quantize_groups(acc, out.group, out.codec)
        codec.write_wire(wire_out, q, scale, out.codec)
        if residual is not None:
            ref = codec.dequantize_groups(q, scale, out.group)
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
            residual[:] = codec.residual_of(acc, ref, residual.dtype, scale, out.group)

    def dequantize(self, layout: Layout, wire: np.ndarray, out: np.ndarray, accumulate: bool = False,
                   terms: int = 1) -> None:
        S, G, cd = layout.slice_elems, layout.group, layout.codec
        part = wire.size // terms

        def decode(i):
            q, scale = codec.read_wire(wire[i * part:(i + 1) * part], S, G, cd)
            return (codec.dequantize_groups(q, scale, G), *codec.nan_units(scale, G, cd))

        values, nan_group, nan = decode(0)
        for i in range(1, terms):                    # float32, in term order; the first NaN unit's bits
            v, bad, first = decode(i)
            with np.errstate(over="ignore", invalid="ignore"):
                values = values + v
            nan = np.where(nan_group, nan, first)
            nan_group = nan_group | bad
        if terms > 1:                                # a unit whose sum overflowed: the codec's NaN scale
            unit = codec.unit_size(cd, G)
            over = np.repeat((~np.isfinite(values)).reshape(-1, unit).any(axis=1), unit) & ~nan_group
            nan = np.where(over, _SCALE_NAN, nan)
            nan_group = nan_group | over
        with np.errstate(invalid="ignore"):          # a NaN-scale unit keeps the scale's NaN bits
            if codec.rotated(cd):
                values = codec.unrotate(values)
            values = np.where(nan_group, nan * _F32.type(1), values)
        values, nan_group = values[: out.size], nan_group[: out.size]
        with np.errstate(over="ignore", invalid="ignore"):   # beyond the output dtype's range: +-Inf, by design
            if not accumulate:    # (a NaN made inside the inverse rotation gets its element's sign flip)
                flip = codec.rotation_flips(values.size) if codec.rotated(cd) else None
                out[:] = _canonical_nans(values, values.astype(out.dtype), nan_group, flip)
                return
            t32 = out.astype(_F32) + values
            total = _canonical_nans(t32, t32.astype(out.dtype), nan_group)
            total[nan_group] = values[nan_group].astype(out.dtype)
            keep = np.isnan(out) & ~nan_group                # a NaN already there keeps its bits
        total[keep] = out[keep]
        out[:] = total


_SCALE_NAN = _F32.type(np.nan)       # a non-finite group's scale (codec.quantize_groups): 0x7FC00000
# The NaN a GPU's arithmetic makes (inf - inf: 0x7fffffff), and its conversions (cvt.rn).
_CANONICAL_NAN: dict[int, np.unsignedinteger] = {2: np.uint16(0x7FFF), 4: np.uint32(0x7FFFFFFF)}


def _canonical_nans(f32: np.ndarray, converted: np.ndarray, nan_group: np.ndarray, flip=None) -> np.ndarray:
    """``converted`` (float32 ``f32`` in the output dtype) with the NaNs that arithmetic made
    (an overflow inside the inverse rotation, or an addition: inf - inf), outside the NaN-scale
    units, as the GPU makes them: its canonical NaN (numpy's bits depend on the operation, the
    GPU's never), in float32 with the sign bit ``flip`` (uint32 per element, or None) applied
    after it (the rotation's signs); a 16-bit conversion makes any NaN canonical."""
    made = np.isnan(f32) & ~nan_group
    if made.any():
        bits = _CANONICAL_NAN[converted.itemsize]
        view = converted.view(bits.dtype)
        view[made] = bits if flip is None or converted.itemsize != 4 else bits ^ flip[made]
    return converted
