"""The wire format of echonccl's 4-bit all-reduce, and its numpy reference.

This module is the single definition of the format. The numpy kernels
(`kernels_numpy`) call it; the CUDA kernels (`cuda_src/codec.cuh`) reproduce
it bit for bit and are tested against it.

Slices
------
A tensor of ``count`` elements is cut into ``P`` slices (one per rank) of
``S`` elements each, ``S`` a multiple of ``SLICE_QUANTUM`` = 512 (so of every
group size) and the tail zero-padded (`layout.Layout`). A slice is cut into
``S / G`` groups of ``G`` consecutive elements, ``G`` in ``GROUP_SIZES``.

Byte layout of one slice on the wire (``slice_bytes(S, G)`` bytes)::

    [ codes: S/2 bytes ][ scales: S/G IEEE float32, little-endian ]

* codes: element ``2i`` of the slice in the low nibble of byte ``i``, element
  ``2i+1`` in the high nibble. A nibble is a 4-bit two's-complement integer
  ``q`` in ``[-7, 7]``; the pattern ``0x8`` (-8) is never written.
* scales: one float32 per group, in group order. float32 rather than a 16-bit
  type so that no group can underflow (a group whose largest magnitude is
  1e-30 keeps its values) or overflow (bf16/fp32 values up to the dtype's
  maximum decode finite). Both sections start 16-byte aligned because ``S``
  is a multiple of 512.

Encoding a group (all arithmetic IEEE float32, round to nearest even, no
fused multiply-add, no approximate division)::

    v      = the group's values in float32 (input + residual, or a partial sum)
    if any v is NaN or +-Inf:   scale = NaN, every q = 0
    else:
        amax  = max |v|
        scale = 0                                  if amax == 0
              = max(amax / 7, 2**-149)             otherwise
        q     = 0                                  if scale == 0
              = clip(rint(v / scale), -7, 7)       otherwise (rint: half to even)

An all-zero group gets ``scale == 0`` and exact zeros back (no division by
zero). ``2**-149``, the smallest fp32 subnormal, keeps groups of tiny
subnormals (where ``amax / 7`` would underflow to 0) from collapsing to zero.

Decoding: ``value = fl(q * scale)`` in float32, then rounded (nearest even) to
the output dtype. A non-finite group decodes to NaN in every element: NaN and
Inf always reach the output of their group as non-finite, never as a finite
number. ``fl(7 * fl(amax / 7))`` never exceeds the largest float32, so finite
inputs up to any dtype's maximum decode finite.

Residuals (error feedback)
--------------------------
The quantizer keeps what rounding lost: ``residual = v - ref`` where ``ref`` is
the decoded value in float32 (for the owner's final requantization, the
decoded value after rounding to the output dtype, so that the output's own
rounding is fed back too). Any residual element that comes out non-finite
(the group was non-finite, or the output overflowed) is stored as 0, so a
NaN or Inf never poisons the next call. Residuals are stored as float32 or,
optionally, in the input dtype.
"""
from __future__ import annotations

import numpy as np

GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
SLICE_QUANTUM = 512
QMAX = 7
SCALE_DTYPE = np.dtype("<f4")

_F32 = np.float32
_SEVEN = np.float32(QMAX)
_MIN_SCALE = np.float32(2.0 ** -149)


def check_group_size(group: int) -> int:
    if group not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {GROUP_SIZES}, got {group!r}")
    return int(group)


def slice_bytes(slice_elems: int, group: int) -> int:
    """Bytes of one slice of ``slice_elems`` elements on the wire."""
    if slice_elems % SLICE_QUANTUM:
        raise ValueError(f"slice of {slice_elems} elements is not a multiple of {SLICE_QUANTUM}")
    return slice_elems // 2 + SCALE_DTYPE.itemsize * (slice_elems // group)


def quantize_groups(v: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float32 ``v`` (length a multiple of ``group``) to int8 codes and float32 scales."""
    g = v.reshape(-1, group)
    finite = np.isfinite(g).all(axis=1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.abs(np.where(finite[:, None], g, _F32(0))).max(axis=1)
        scale = np.where(amax > 0, np.maximum(amax / _SEVEN, _MIN_SCALE), _F32(0)).astype(_F32)
        nonzero = scale != 0
        safe = np.where(nonzero, scale, _F32(1))[:, None]
        q = np.rint(np.where(finite[:, None], g, _F32(0)) / safe)
    q = np.clip(q, -QMAX, QMAX)
    q[~(nonzero & finite)] = 0
    scale = np.where(finite, scale, _F32(np.nan)).astype(_F32)
    return q.astype(np.int8).reshape(-1), scale


def dequantize_groups(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """float32 values ``fl(q * scale)`` of int8 codes ``q`` and float32 ``scale``."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (q.reshape(-1, group).astype(_F32) * scale[:, None]).reshape(-1)


def pack_codes(q: np.ndarray) -> np.ndarray:
    """int8 codes (even length) -> uint8 bytes, element 2i in the low nibble of byte i."""
    u = q.astype(np.uint8) & 0x0F
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def unpack_codes(b: np.ndarray) -> np.ndarray:
    """uint8 bytes -> int8 codes (two per byte), the inverse of `pack_codes`."""
    lo = (b & 0x0F).astype(np.int8)
    hi = (b >> 4).astype(np.int8)
    q = np.empty(b.size * 2, dtype=np.int8)
    q[0::2] = lo
    q[1::2] = hi
    return np.where(q > 7, q - 16, q).astype(np.int8)


def encode(v: np.ndarray, group: int) -> np.ndarray:
    """One slice of float32 values -> its wire bytes (codes, then scales)."""
    q, scale = quantize_groups(np.ascontiguousarray(v, dtype=_F32), group)
    return np.concatenate([pack_codes(q), scale.astype(SCALE_DTYPE).view(np.uint8)])


def split_wire(wire: np.ndarray, slice_elems: int) -> tuple[np.ndarray, np.ndarray]:
    """Views of a slice's wire bytes: (packed codes uint8, scales float32)."""
    ncode = slice_elems // 2
    return wire[:ncode], wire[ncode:].view(SCALE_DTYPE)


def decode(wire: np.ndarray, slice_elems: int, group: int) -> np.ndarray:
    """One slice's wire bytes -> float32 values ``fl(q * scale)``."""
    codes, scale = split_wire(wire, slice_elems)
    return dequantize_groups(unpack_codes(codes), scale, group)


def residual_of(v: np.ndarray, ref: np.ndarray, dtype) -> np.ndarray:
    """``v - ref`` in float32, non-finite elements set to 0, stored as ``dtype``."""
    with np.errstate(invalid="ignore", over="ignore"):
        e = v - ref
    e[~np.isfinite(e)] = 0
    return e.astype(dtype)
