"""The wire format of echonccl's 4-bit all-reduce, and its numpy reference.

This module is the single definition of the format. The numpy kernels
(`kernels_numpy`) call it; the CUDA kernels (`cuda_src/codec.cuh` and the parts it includes) reproduce
it bit for bit and are tested against it.

Slices
------
A tensor of ``count`` elements is cut into ``P`` slices (one per rank) of
``S`` elements each, ``S`` a multiple of ``SLICE_QUANTUM`` = 512 (so of every
group size) and the tail zero-padded (`layout.Layout`). A slice is cut into
``S / G`` groups of ``G`` consecutive elements, ``G`` the codec's group size
(`group_size`: 32 for ``int4`` and ``int4-h32``, 16 for ``int7-h32``).

Byte layout of one slice on the wire (``slice_bytes(S, G)`` bytes): ``S / 512``
chunks, one per ``CHUNK`` = 512 consecutive elements, in order; each chunk holds
its elements' codes, then its groups' scales::

    [ chunk 0: codes: 256 bytes | scales: 512/G IEEE float32, little-endian ][ chunk 1 ] ...

* codes: element ``2i`` of the chunk in the low nibble of byte ``i``, element
  ``2i+1`` in the high nibble. A nibble is a 4-bit two's-complement integer
  ``q`` in ``[-7, 7]``; the pattern ``0x8`` (-8) is never written.
* scales: one float32 per group, in group order (``int4-h32``: a bfloat16, see
  "Codecs"). Formats with float32's exponent range, so that no group can
  underflow (a group whose largest magnitude is 1e-30 keeps its values) or
  overflow (bf16/fp32 values up to the dtype's maximum decode finite).

Every chunk, and each part of it, starts 16-byte aligned, and a chunk is the wire
of a warp's 512 elements on a GPU: one contiguous run (``chunks`` and
``unchunk`` move between this layout and the sections of a whole slice).

Encoding a group (all arithmetic IEEE float32, round to nearest even, no
fused multiply-add, no approximate division)::

    v      = the group's values in float32 (input + residual, or a partial sum)
    if any v is NaN or +-Inf:   scale = NaN, every q = 0
    else:
        amax  = max |v|
        scale = 0                                  if amax == 0
              = max(amax / 7, 2**-149)             otherwise
        q     = 0                                  if scale == 0
              = rint(fl(v * fl(1 / scale)))        if scale >= 2**-126 (normal)
              = clip(rint(v / scale), -7, 7)       otherwise (rint: half to even)

A normal scale multiplies by its reciprocal (one instruction an element on a GPU
instead of a division); ``|v * fl(1 / scale)|`` stays below 7.5 (63.5 for
``int7-h32``), so no code clips there, and the quotient differs from ``v / scale``
by at most 2**-17 of a step (a half-integer within that may round the other way).
An all-zero group gets ``scale == 0`` and exact zeros back (no division by
zero). ``2**-149``, the smallest fp32 subnormal, keeps groups of tiny
subnormals (where ``amax / 7`` would underflow to 0) from collapsing to zero.

Decoding: ``value = fl(q * scale)`` in float32, then rounded (nearest even) to
the output dtype. A non-finite group decodes to NaN in every element: NaN and
Inf always reach the output of their group as non-finite, never as a finite
number. ``fl(7 * fl(amax / 7))`` never exceeds the largest float32, so finite
inputs up to any dtype's maximum decode finite.

Codecs: ``int4``, ``int4-h32`` (rotated) and ``int7-h32`` (rotated, 8 bits)
------------------------------------------------------------------------------
``CODECS`` names the three codecs; ``int4`` uses the byte layout and the group
encoding above (5 bits an element at G = 32); ``int4-h32`` too, except that its
scales are bfloat16 (below: 4.5 bits an element at G = 32); ``int7-h32`` is the
8-bit accuracy mode described at the end of this section. ``int4`` encodes the
values themselves. ``int4-h32`` runs the
whole all-reduce in a rotated domain: every block of ``ROT_BLOCK`` = 32
consecutive elements of a slice (blocks aligned with the groups, so a group of
G >= 32 holds G/32 whole blocks) is multiplied by a fixed sign-randomized
Hadamard matrix before its first quantization, and the decoded sum is rotated
back after the last decode. The wire then carries rotated values, and the
feedback residuals live in the rotated domain (in any of their storage formats).
Spreading each element over its block evens out the group's values, so the
absmax scale wastes fewer of the 15 levels on one outlier.

Signs: ``s_i = -1`` if bit ``i`` of ``ROT_SIGNS`` = 0x6A09E667 is set, else
``+1`` (i = 0..31, the element's index inside its block). Both transforms are
float32 with round to nearest even and, per block, in this exact order::

    forward   u_i = fl(x_i * (s_i * 2**-5))              (exact unless |x_i| < 2**-121)
              for h in 1, 2, 4, 8, 16:                    (pairs i, i+h with i & h == 0)
                  u_i, u_{i+h} = fl(u_i + u_{i+h}), fl(u_i - u_{i+h})
    inverse   w = y; the same five butterfly stages on w; x_i = w_i with its sign bit
              flipped where s_i = -1 (an exact bit operation)

The forward's 1/32 (a power of two) comes first, so no finite input overflows
in the forward transform (``|u| <= max |x|``); the inverse is the unnormalized
±1 transform (H H = 32 I). Exact arithmetic would make the inverse exact; in
float32 the round trip is within a few ulps of the block's largest element.
A NaN or Inf anywhere in a block makes the whole block, so its group, non-finite:
NaN/Inf still poison exactly their group. A group whose scale is NaN decodes to
the scale's NaN in every element, as with ``int4``. Limit: decoded groups
holding magnitudes near the float32 maximum (above about 2**126, 8.5e37) may
overflow in the inverse transform and come out +-Inf or NaN (NaN payload then
unspecified). A block's quantization error spreads over its 32 elements, so an
element whose exact value plus the error bound passes the output dtype's maximum
(float16: a sum within about 1/14 of its block's largest magnitude of 65504) may
round to +-Inf; ``int4`` returns a single rank's maximum exactly.

``int4-h32``'s scales: the group's scale is ``amax / 7`` *truncated* to a bfloat16, at
least 2**-133 (bfloat16's smallest subnormal), stored as the high 16 bits of the float32
(a chunk: ``[ codes: 256 bytes | scales: 512/G bfloat16 ]``), a non-finite group's as 0x7FC0::

    scale = 0                                         if amax == 0
          = max(trunc_bf16(fl(amax / 7)), 2**-133)    otherwise

(``trunc_bf16`` as for ``int7-h32`` below). bfloat16 has float32's exponent range, so no
group underflows or overflows; truncating keeps ``|q * scale| <= amax`` and ``|v * fl(1 / scale)|``
below 7.06 for a normal scale, so no code clips there. SmolLM2-135M: no loss against float32
scales (ACCURACY.md), at 10% fewer wire bytes.

The owner's residual is measured in the rotated domain: for a float32 output
without a base, ``ref = fl(q * scale)`` (the rotated decoded value, as with
``int4``); otherwise ``ref = forward(o)`` with ``o = round(inverse(fl(q * scale)))``
(or ``round(base + inverse(...)) - base``), what the output really holds,
rounded to the output dtype, rotated. Feedback states of one codec are not
valid for another (`feedback.Feedback` records the codec).

``int7-h32``: 7-bit codes, a 16-bit scale per 16 elements, the same rotation (the
accuracy mode: exactly 8 bits an element). Groups are ``G = 16`` (`group_size`), so a
rotation block holds two groups. A chunk of 512 elements is 512 bytes::

    [ low nibbles: 256 ][ bits 4-5: 128 ][ bit 6: 64 ][ scales: 32 bfloat16, little-endian ]

Element ``i`` of a chunk has the 7-bit offset code ``u = q + 63`` in ``[0, 126]``: its bits 0-3 in
nibble ``i`` of the first section (packed as ``int4``'s codes); with ``k = i % 8``,
``j = k // 2`` and ``odd = k % 2``, its bits 4-5 at bits ``2 j`` of byte ``2 (i // 8) + odd``
of the second, and its bit 6 at bit ``j + 4 odd`` of byte ``i // 8`` of the third (per 8
elements: the even ones' high bits in the low byte / nibble, so that a decoder can spread
them into four bytes at once). Encoding a group is ``int4``'s with 63 for 7 and a scale
truncated to a bfloat16 (the float32 exponent range, so no group underflows or overflows)::

    scale = 0                                          if amax == 0
          = max(trunc_bf16(fl(amax / 63)), 2**-133)    otherwise
    q     = rint(fl(v * fl(1 / scale)))  (a normal scale; else clip(rint(v / scale), -63, 63))
    trunc_bf16(s) = the float32 with bits bits(s) & 0xFFFF0000

and a non-finite group writes the bfloat16 NaN 0x7FC0 (float32 0x7FC00000) and ``q = 0``.
Truncating keeps ``|q * scale| <= amax`` (up to float32's rounding of ``amax / 63``), so a
finite input decodes finite, and ``|v * fl(1 / scale)| < 63.5`` for a normal scale, so no code is
clipped there; 2**-133 is bfloat16's smallest subnormal. Its NaN/Inf unit is the
rotation block: a NaN or Inf in a block makes both of its groups non-finite, and
decoding writes, to all 32 elements of a block where either group's scale is NaN, the
first such scale's NaN (quieted, then rounded to the output as for ``int4``).
SmolLM2-135M at P = 2, 4, 8 on two texts: within 0.2% of the unsplit model's perplexity
and 98.2-98.9% top-1 agreement (ACCURACY.md).

``int4-h32/int7-h32`` (``MIXED``): the two-shot's contributions travel as ``int4-h32``, the
owners' sums as ``int7-h32``. Both rotate the same 32-element blocks, so the owner adds the
decoded ``int4-h32`` contributions in the rotated domain, quantizes the sum once as ``int7-h32``
and every rank decodes that; the feedback residuals stay in the rotated domain. The second
quantization, the larger share of a 4-bit two-shot's error, is then 8-bit, for 8 instead of 4.5
bits an element of the gathered half of the traffic. Schedules that never quantize a sum
(``one_shot_q``) send ``int4-h32`` alone. (`parts` splits the name; every function here that
handles one slice's wire takes one of ``WIRE_CODECS``.)

Residuals (error feedback)
--------------------------
The quantizer keeps what rounding lost: ``residual = v - ref`` where ``ref`` is
the decoded value in float32 (for the owner's final requantization, the
decoded value after rounding to the output dtype, so that the output's own
rounding is fed back too). Any residual element that comes out non-finite
(the group was non-finite, or the output overflowed) is stored as 0, so a
NaN or Inf never poisons the next call. Residuals are stored as float32, in the
input dtype, or in the 8-bit block format below (``RESIDUAL_FORMATS``); the
array's dtype says which (uint8: the block format).

The 8-bit block format (``int8``) stores ``n`` residuals (``n`` a multiple of
``RES_SUPER`` = 512) in ``n / 512 * 528`` bytes: per 512 elements, 512 int8
mantissas ``m`` (element order) then 16 exponent bytes ``x``, one per block of
32 consecutive elements. The exponent is set by the quantizer's scale, not by
the block's values: a block ``e`` (float32, finite) whose values were quantized
with scales ``s`` (the groups the block lies in) is stored as::

    S = max over the block's finite scales of their biased float32 exponent (bits >> 23)
    E = biased float32 exponent of max |e|   (bits >> 23; 0 for zero/subnormal)
    x = min(max(S, E + 1, 7), 254)
    m_i = clip(rint(fl(e_i * 2**(133 - x))), -127, 127)

and read back as ``fl(m_i * 2**(x - 133))`` (exact and finite: |m| <= 127, and
the power of two is a normal float32). |m_i| <= 64 but where ``E = 254`` (the
clip). Bytes the encoder never writes (a mantissa of -128, an exponent outside
[7, 254]) are refused where residuals come from outside (`check_residual_bytes`,
`Feedback.load_state_dict`). A residual of a round-to-nearest quantization is at
most half a step, below ``2**(S - 127)`` for the bfloat16 scales of the rotated
codecs, so there ``E + 1 <= S`` and ``x = max(S, 7)``: the GPU's 16-element
loops take the exponent from the scale with no maximum over the block and no
clip (`tests/test_residual_int8.py` checks the bound); ``E`` counts where a
residual also holds the output's rounding (``rounding=True``, a base) or the
scales are float32 (``int4``). Zeroed residuals (`clear_residuals`: a new state,
`Feedback.reset`) are stored as the encoder stores a zero block (x = 7), so that
the blocks no call writes (past an all-reduce's count, `Layout.extent`) hold the
same bytes in every engine. Every element is kept to ``2**(x - 134)``, at most
1/128 of a quantization step where ``x = S``: what the format drops, and does
not feed back, is 1/64 to 1/128 of one call's quantization error (RMS), at a
quarter of float32's bytes.
"""
from __future__ import annotations

import numpy as np

WIRE_CODECS = ("int4", "int4-h32", "int7-h32")      # the wire formats of one slice
MIXED = "int4-h32/int7-h32"                         # int4-h32 contributions, int7-h32 sums
CODECS = (*WIRE_CODECS, MIXED)
DEFAULT_CODEC = MIXED
ROT_BLOCK = 32
ROT_SIGNS = 0x6A09E667
SLICE_QUANTUM = 512
CHUNK = 512                 # elements of a wire chunk (see "Slices")
QMAX = 7
SCALE_DTYPE = np.dtype("<f4")
_GROUPS = {"int4": 32, "int4-h32": 32, "int7-h32": 16}
_LEVELS = {"int4": QMAX, "int4-h32": QMAX, "int7-h32": 63}
_BF16_SCALE = np.dtype("<u2")     # the rotated codecs' scales: the high half of a float32
RESIDUAL_FORMATS = ("auto", "float32", "input", "int8")
RES_BLOCK = 32              # elements per exponent byte of the int8 residual format
RES_SUPER = 512             # elements per (mantissas, exponents) record of it
RES_SUPER_BYTES = RES_SUPER + RES_SUPER // RES_BLOCK
RES_MIN_EXP = 7             # the least exponent byte x the encoder writes (that of a zero block)
RES_MAX_EXP = 254           # the largest

_F32 = np.float32
_MIN_SCALE = np.float32(2.0 ** -149)
_MIN_NORMAL = np.float32(2.0 ** -126)


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    return codec


def parts(codec: str) -> tuple[str, str]:
    """(the contributions' wire codec, the sums' wire codec) of ``codec``: ``MIXED`` sends 4-bit
    contributions and 8-bit sums, every other codec one wire format both ways."""
    a, _, b = check_codec(codec).partition("/")
    return a, b or a


def joined(contributions: str, sums: str) -> str:
    """The codec name whose `parts` are ``(contributions, sums)``: the one wire codec, or the pair
    (not checked: `check_codec` where it matters)."""
    return contributions if sums == contributions else f"{contributions}/{sums}"


def _wire(codec: str) -> str:
    if codec not in WIRE_CODECS:
        raise ValueError(f"a slice's wire format is one of {WIRE_CODECS}, got {codec!r} (parts() splits a pair)")
    return codec


def group_size(codec: str) -> int:
    """Elements per scale of ``codec``'s contributions: 32 (``int4``, ``int4-h32``, ``MIXED``) or 16
    (``int7-h32``)."""
    return _GROUPS[parts(codec)[0]]


def rotated(codec: str) -> bool:
    """Whether ``codec`` runs in the rotated (Hadamard) domain (both parts of ``MIXED`` do)."""
    return parts(codec)[0] != "int4"


def wide(codec: str) -> bool:
    """Whether wire codec ``codec`` is ``int7-h32`` (7-bit codes, bfloat16 scales)."""
    return _wire(codec) == "int7-h32"


def bf16_scales(codec: str) -> bool:
    """Whether wire codec ``codec``'s scales are truncated to bfloat16 on the wire (the rotated
    codecs); ``int4``'s are float32."""
    return _wire(codec) != "int4"


def unit_size(codec: str, group: int) -> int:
    """Elements that share one fate under NaN/Inf and one scale's error bound: the group, or
    ``int7-h32``'s rotation block of two groups (``MIXED``: the block, which is an int4-h32 group)."""
    return ROT_BLOCK if any(wide(c) for c in parts(codec)) else group


_ROT_NEG = np.array([(ROT_SIGNS >> i) & 1 for i in range(ROT_BLOCK)], dtype=bool)
_ROT_MUL = np.where(_ROT_NEG, _F32(-(2.0 ** -5)), _F32(2.0 ** -5)).astype(_F32)
_ROT_FLIP = np.where(_ROT_NEG, np.uint32(0x80000000), np.uint32(0)).astype(np.uint32)


def _butterflies(u: np.ndarray) -> np.ndarray:
    """The five unnormalized Hadamard stages h = 1, 2, ..., 16 on rows of 32 float32 values."""
    for h in (1, 2, 4, 8, 16):
        y = u.reshape(-1, ROT_BLOCK // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        u = np.stack([a + b, a - b], axis=2).reshape(-1, ROT_BLOCK)
    return u


def rotate(x: np.ndarray) -> np.ndarray:
    """Forward rotation of float32 ``x`` (length a multiple of 32), block by block (spec above)."""
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        u = np.ascontiguousarray(x, dtype=_F32).reshape(-1, ROT_BLOCK) * _ROT_MUL
        return _butterflies(u).reshape(-1)


def rotation_flips(n: int) -> np.ndarray:
    """The sign bits (uint32, 0x80000000 where s_i = -1) the inverse rotation XORs into
    elements 0 .. n-1 of a slice."""
    return np.tile(_ROT_FLIP.reshape(-1), -(-n // ROT_BLOCK))[:n]


def unrotate(y: np.ndarray) -> np.ndarray:
    """Inverse rotation of float32 ``y`` (length a multiple of 32): butterflies, then sign flips."""
    with np.errstate(invalid="ignore", over="ignore"):
        w = _butterflies(np.ascontiguousarray(y, dtype=_F32).reshape(-1, ROT_BLOCK))
    return (w.view(np.uint32) ^ _ROT_FLIP).view(_F32).reshape(-1)


def residual_values(r: np.ndarray, codec: str) -> np.ndarray:
    """What residuals ``r`` (any length a multiple of 32 for a rotated codec; any storage
    format) owe the sum, in float64 in the values' domain: ``r`` itself for ``int4``, the exact
    inverse rotation of ``r`` (signs of H r) for ``int4-h32``. For tests and diagnostics."""
    r = np.asarray(r)
    r = (load_residuals(r) if r.dtype == np.uint8 else r).astype(np.float64)
    if not rotated(codec):
        return r
    u = r.reshape(-1, ROT_BLOCK)
    for h in (1, 2, 4, 8, 16):
        y = u.reshape(-1, ROT_BLOCK // (2 * h), 2, h)
        u = np.stack([y[:, :, 0, :] + y[:, :, 1, :], y[:, :, 0, :] - y[:, :, 1, :]], axis=2).reshape(-1, ROT_BLOCK)
    return (u * np.where(_ROT_NEG, -1.0, 1.0)).reshape(r.shape)


def slice_bytes(slice_elems: int, group: int, codec: str = "int4") -> int:
    """Bytes of one slice of ``slice_elems`` elements on the wire."""
    if slice_elems % SLICE_QUANTUM:
        raise ValueError(f"slice of {slice_elems} elements is not a multiple of {SLICE_QUANTUM}")
    if wide(codec):
        return slice_elems                     # 7 bits of code + 16 bits of scale per 16
    scale_bytes = _BF16_SCALE.itemsize if bf16_scales(codec) else SCALE_DTYPE.itemsize
    return slice_elems // 2 + scale_bytes * (slice_elems // group)


_MIN_BF16_SCALE = np.uint32(0x00010000)    # 2**-133


def _trunc_bf16(s: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """Non-negative float32 ``s`` truncated to a bfloat16, at least 2**-133 where ``positive``."""
    b = s.astype(_F32).view(np.uint32) & np.uint32(0xFFFF0000)
    return np.where((b == 0) & positive, _MIN_BF16_SCALE, b).astype(np.uint32).view(_F32)


def quantize_groups(v: np.ndarray, group: int, codec: str = "int4") -> tuple[np.ndarray, np.ndarray]:
    """Quantize float32 ``v`` (length a multiple of ``group``) to int8 codes and float32 scales."""
    levels = _F32(_LEVELS[_wire(codec)])
    g = v.reshape(-1, group)
    finite = np.isfinite(g).all(axis=1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.abs(np.where(finite[:, None], g, _F32(0))).max(axis=1)
        if bf16_scales(codec):
            scale = _trunc_bf16((amax / levels).astype(_F32), amax > 0)
        else:
            scale = np.where(amax > 0, np.maximum(amax / levels, _MIN_SCALE), _F32(0)).astype(_F32)
        nonzero = scale != 0
        safe = np.where(nonzero, scale, _F32(1))[:, None]
        x = np.where(finite[:, None], g, _F32(0))
        # a normal scale: times its reciprocal fl(1 / scale); a subnormal one: divided
        q = x * (_F32(1) / safe)
        sub = safe[:, 0] < _MIN_NORMAL
        if sub.any():
            q[sub] = x[sub] / safe[sub]
        q = np.rint(q, out=q)
    q = np.clip(q, -levels, levels)
    q[~(nonzero & finite)] = 0
    scale = np.where(finite, scale, _F32(np.nan)).astype(_F32)
    return q.astype(np.int8).reshape(-1), scale


def dequantize_groups(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """float32 values ``fl(q * scale)`` of int8 codes ``q`` and float32 ``scale``."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (q.reshape(-1, group).astype(_F32) * scale[:, None]).reshape(-1)


def _pack_nibbles(u: np.ndarray) -> np.ndarray:
    u = u.astype(np.uint8) & 0x0F
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(b: np.ndarray) -> np.ndarray:
    u = np.empty(b.size * 2, dtype=np.uint8)
    u[0::2] = b & 0x0F
    u[1::2] = b >> 4
    return u


def pack_codes(q: np.ndarray, codec: str = "int4") -> np.ndarray:
    """int8 codes (a multiple of 8 of them) -> their code bytes as sections (no chunks): int4
    nibbles (element 2i in the low nibble of byte i), or int7-h32's three sections one after
    another."""
    if not wide(codec):
        return _pack_nibbles(q)
    u = (q.astype(np.int16) + 63).astype(np.uint8)
    hi = (u >> 4).reshape(-1, 4, 2)                   # (chunk of 8, j, odd)
    w2, w1 = np.array([1, 4, 16, 64], np.uint8)[:, None], np.array([1, 2, 4, 8], np.uint8)[:, None]
    mid = ((hi & 3) * w2).sum(axis=1, dtype=np.uint8)  # (chunk, odd): byte 2c + odd
    top = ((hi >> 2) * w1).sum(axis=1, dtype=np.uint8)
    return np.concatenate([_pack_nibbles(u), mid.reshape(-1), top[:, 0] | (top[:, 1] << 4)])


def unpack_codes(b: np.ndarray, codec: str = "int4") -> np.ndarray:
    """Code bytes as sections -> int8 codes, the inverse of `pack_codes`."""
    if not wide(codec):
        q = _unpack_nibbles(b).astype(np.int8)
        return np.where(q > 7, q - 16, q).astype(np.int8)
    n = b.size * 8 // 7
    u = _unpack_nibbles(b[: n // 2]).reshape(-1, 4, 2)  # (chunk of 8, j, odd)
    mid = b[n // 2: n // 2 + n // 4].reshape(-1, 1, 2)
    top = b[n // 2 + n // 4:].reshape(-1, 1, 1)
    j = np.arange(4, dtype=np.uint8)[:, None]
    u |= ((mid >> (2 * j)) & 3) << 4
    u |= ((top >> (j + 4 * np.arange(2, dtype=np.uint8))) & 1) << 6
    return (u.reshape(-1).astype(np.int16) - 63).astype(np.int8)


def _code_sections(codec: str) -> tuple[int, ...]:
    """Bytes a chunk of each section of the code bytes (`pack_codes`): the nibbles, then
    int7-h32's bits 4-5 and bit 6."""
    return (256, 128, 64) if wide(codec) else (256,)


def chunks(sections, n_elems: int) -> np.ndarray:
    """Byte sections of ``n_elems`` elements (a multiple of `CHUNK`), each a whole number of bytes
    a chunk -> the chunked layout: per chunk, its part of every section in order."""
    k = n_elems // CHUNK
    return np.concatenate([np.asarray(b, np.uint8).reshape(k, -1) for b in sections], axis=1).reshape(-1)


def unchunk(wire: np.ndarray, n_elems: int, sizes) -> list[np.ndarray]:
    """The inverse of `chunks`: ``sizes`` are each section's bytes a chunk."""
    w = np.asarray(wire, np.uint8).reshape(n_elems // CHUNK, -1)
    edges = np.cumsum([0, *sizes])
    return [np.ascontiguousarray(w[:, a:b]).reshape(-1) for a, b in zip(edges[:-1], edges[1:])]


def _scale_bytes(scale: np.ndarray, codec: str) -> np.ndarray:
    if bf16_scales(codec):
        return (scale.astype(_F32).view(np.uint32) >> 16).astype(_BF16_SCALE).view(np.uint8)
    return scale.astype(SCALE_DTYPE).view(np.uint8)


def write_wire(wire: np.ndarray, q: np.ndarray, scale: np.ndarray, codec: str = "int4") -> None:
    """Store one slice's codes ``q`` and scales (float32, already bfloat16 values for the rotated
    codecs) into its wire bytes ``wire``."""
    packed = pack_codes(q, codec)
    cuts = np.cumsum([0, *_code_sections(codec)]) * (q.size // CHUNK)
    wire[:] = chunks([packed[a:b] for a, b in zip(cuts[:-1], cuts[1:])] + [_scale_bytes(scale, codec)], q.size)


def read_wire(wire: np.ndarray, slice_elems: int, group: int,
              codec: str = "int4") -> tuple[np.ndarray, np.ndarray]:
    """The consecutive whole slices of ``wire`` -> (int8 codes, float32 scales), in order."""
    S, B = slice_elems, slice_bytes(slice_elems, group, codec)
    n = wire.size // B
    sizes = _code_sections(codec)
    parts = unchunk(wire[: n * B], n * S, [*sizes, B * CHUNK // S - sum(sizes)])
    q = unpack_codes(np.concatenate(parts[:-1]), codec)   # the n slices' sections: one run of n S codes
    sc = parts[-1]
    if bf16_scales(codec):
        return q, (sc.view(_BF16_SCALE).astype(np.uint32) << 16).view(_F32)
    return q, sc.view(SCALE_DTYPE).astype(_F32)


def encode(v: np.ndarray, group: int, codec: str = "int4") -> np.ndarray:
    """One slice of float32 values -> its wire bytes (codes, then scales)."""
    q, scale = quantize_groups(np.ascontiguousarray(v, dtype=_F32), group, codec)
    wire = np.empty(slice_bytes(q.size, group, codec), np.uint8)
    write_wire(wire, q, scale, codec)
    return wire


def decode(wire: np.ndarray, slice_elems: int, group: int, codec: str = "int4") -> np.ndarray:
    """One slice's wire bytes -> float32 values ``fl(q * scale)``."""
    q, scale = read_wire(wire, slice_elems, group, codec)
    return dequantize_groups(q, scale, group)


def nan_units(scale: np.ndarray, group: int, codec: str = "int4") -> tuple[np.ndarray, np.ndarray]:
    """Per element of the groups of ``scale``: whether its NaN/Inf unit (the group, or for
    ``int7-h32`` the rotation block) has a NaN scale, and that unit's first NaN scale."""
    unit = unit_size(codec, group)
    s = scale.reshape(-1, unit // group)
    bad = np.isnan(s)
    first = s[np.arange(s.shape[0]), bad.argmax(axis=1)]
    return np.repeat(bad.any(axis=1), unit), np.repeat(first, unit)


def residual_of(v: np.ndarray, ref: np.ndarray, dtype, scale=None, group: int = 0) -> np.ndarray:
    """``v - ref`` in float32, non-finite elements set to 0, stored as ``dtype`` (uint8: the
    8-bit block format, whose exponents also take the quantizer's ``scale``, one per ``group``
    elements)."""
    with np.errstate(invalid="ignore", over="ignore"):
        e = v - ref
    e[~np.isfinite(e)] = 0
    return encode_residuals(e, scale, group) if np.dtype(dtype) == np.uint8 else e.astype(dtype)


def residual_dtype(fmt: str, input_dtype) -> np.dtype:
    """The array dtype residuals of format ``fmt`` (`RESIDUAL_FORMATS`) are stored in for data of
    ``input_dtype``: ``"auto"`` is the int8 block format (uint8) for 16-bit data and float32 for
    float32 data."""
    if fmt not in RESIDUAL_FORMATS:
        raise ValueError(f"residual format must be one of {RESIDUAL_FORMATS}, got {fmt!r}")
    if fmt == "auto":
        fmt = "int8" if np.dtype(input_dtype).itemsize == 2 else "input"
    return np.dtype({"float32": np.float32, "int8": np.uint8}.get(fmt, input_dtype))


def residual_size(n: int, dtype) -> int:
    """Array elements holding ``n`` residuals stored as ``dtype``."""
    if np.dtype(dtype) != np.uint8:
        return n
    if n % RES_SUPER:
        raise ValueError(f"{n} residuals in the int8 format: not a multiple of {RES_SUPER}")
    return n // RES_SUPER * RES_SUPER_BYTES


def clear_residuals(r) -> None:
    """Set residual array ``r`` (numpy or cupy, any storage format) to zeros as the encoder
    stores them: all bytes zero, but the int8 format's exponent bytes `RES_MIN_EXP` (`encode_residuals`)."""
    r.fill(0)
    if r.dtype == np.uint8:
        r.reshape(-1, RES_SUPER_BYTES)[:, RES_SUPER:] = RES_MIN_EXP


def residual_span(r, lo: int, hi: int):
    """The part of residual array ``r`` (numpy or cupy) holding elements ``[lo, hi)``."""
    if r.dtype != np.uint8:
        return r[lo:hi]
    return r[residual_size(lo, r.dtype):residual_size(hi, r.dtype)]


def check_residual_bytes(r) -> None:
    """`ValueError` unless int8-format residuals ``r`` (numpy or cupy) hold only bytes the encoder
    writes: no mantissa -128, exponents in [`RES_MIN_EXP`, `RES_MAX_EXP`]."""
    rec = r.reshape(-1, RES_SUPER_BYTES)
    if bool((rec[:, :RES_SUPER] == 0x80).any()):
        raise ValueError("an int8 residual mantissa of -128 (the encoder writes -127 .. 127)")
    x = rec[:, RES_SUPER:]
    if bool(((x < RES_MIN_EXP) | (x > RES_MAX_EXP)).any()):
        raise ValueError(f"an int8 residual exponent outside [{RES_MIN_EXP}, {RES_MAX_EXP}]")


def load_residuals(r: np.ndarray) -> np.ndarray:
    """float32 values of residual array ``r`` (any storage format)."""
    if r.dtype != np.uint8:
        return r.astype(_F32)
    rec = r.reshape(-1, RES_SUPER_BYTES)
    m = rec[:, :RES_SUPER].view(np.int8).reshape(-1, RES_BLOCK).astype(_F32)
    x = rec[:, RES_SUPER:].reshape(-1).astype(np.uint32)
    return (m * ((x - 6) << 23).view(_F32)[:, None]).reshape(-1)


def scale_exponents(scale: np.ndarray, group: int) -> np.ndarray:
    """Per 32-element block of the int8 residual format: the largest biased exponent
    (bits >> 23) of the finite float32 scales of its groups (one per ``group`` elements), 0 if
    none (``S`` of "Residuals")."""
    s = np.asarray(scale, dtype=_F32)
    bits = s.view(np.uint32)
    exps = np.where(np.isfinite(s), (bits >> 23) & np.uint32(0xFF), np.uint32(0)).astype(np.uint32)
    if group >= RES_BLOCK:
        return exps.repeat(group // RES_BLOCK)
    return exps.reshape(-1, RES_BLOCK // group).max(axis=1)


def encode_residuals(e: np.ndarray, scale=None, group: int = 0) -> np.ndarray:
    """float32 residuals (finite, length a multiple of 512) in the 8-bit block format, with the
    quantizer's ``scale`` per ``group`` elements (None: no scale, ``S`` = 0)."""
    b = np.ascontiguousarray(e, dtype=_F32).reshape(-1, RES_BLOCK)
    x = np.maximum(((b.view(np.uint32) & np.uint32(0x7FFFFFFF)).max(axis=1) >> 23) + 1, RES_MIN_EXP).astype(np.uint32)
    if scale is not None:
        x = np.maximum(x, scale_exponents(scale, group))
    x = np.minimum(x, RES_MAX_EXP)
    with np.errstate(under="ignore"):
        m = np.clip(np.rint(b * ((260 - x) << 23).view(_F32)[:, None]), -127, 127).astype(np.int8)
    rec = np.empty((b.shape[0] // (RES_SUPER // RES_BLOCK), RES_SUPER_BYTES), dtype=np.uint8)
    rec[:, :RES_SUPER] = m.view(np.uint8).reshape(-1, RES_SUPER)
    rec[:, RES_SUPER:] = x.astype(np.uint8).reshape(-1, RES_SUPER // RES_BLOCK)
    return rec.reshape(-1)
