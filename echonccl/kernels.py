"""The kernel interface every engine implements (numpy: `kernels_numpy`, CUDA: `kernels_cuda`).

Two operations are enough for every schedule:

``reduce_quantize(layout, incoming, own_pos, own, residual, wire_out, ref_dtype, base=None, out_layout=None)``
    Sum, in float32 and in this order, the decoded slices of ``incoming`` (a
    wire buffer of ``n_in`` consecutive slices, or None for ``n_in = 0``) with
    this rank's own contribution ``own`` inserted at position ``own_pos``
    (``0 <= own_pos <= n_in``); add ``residual``; quantize into ``wire_out``
    (one slice); and store the new residual, ``sum - ref`` with ``ref`` the
    decoded value rounded through ``ref_dtype``, back into ``residual``.

    * ``own``: 1-D view of the caller's input, float16/bfloat16/float32,
      length at most ``layout.slice_elems`` (the rest counts as zeros).
    * ``residual``: ``layout.slice_elems`` elements (float32 or the input
      dtype), read and overwritten; None when feedback is off.
    * ``wire_out``: ``out_layout.slice_bytes`` bytes, overwritten, in ``out_layout``'s codec
      (default ``layout``: ``incoming`` is in ``layout``'s; an owner of a mixed codec passes
      ``layout.sums``, the same slicing in another wire format of the same domain).
    * ``base`` (an owner in a refinement round, with ``residual``): this rank's
      slice of the output so far, ``ref_dtype``, at most ``layout.slice_elems``
      elements (the rest counts as zeros), read only. ``ref`` is then
      ``round(base + decoded) - base``: what `dequantize` with ``accumulate``
      will really add to that slice, its rounding included.

    Quantizing a contribution for a peer is the case ``n_in = 0``; a ring hop
    is ``n_in = 1, own_pos = 1``; the two-shot owner is ``n_in = P - 1,
    own_pos = rank``.

``dequantize(layout, wire, out, accumulate=False, terms=1)``
    Decode the consecutive slices of ``wire`` into ``out`` (1-D, the output
    dtype, at most as long as the slices hold), rounding to nearest even.
    With ``accumulate``, add instead: ``out = round(float32(out) + decoded)``,
    where an ``out`` element that is NaN keeps its bits, unless its group's
    scale is NaN: that group is written as without ``accumulate``.
    ``terms > 1`` (`schedules.one_shot_q`): ``wire`` is that many equal parts,
    each the consecutive slices of one contribution; ``decoded`` is their sum,
    the decoded values (fl(q * scale), before any inverse rotation) added in
    float32 in part order, then rotated back once; a unit with a NaN scale in
    any part decodes as the first such part's NaN, as with one term, and a unit
    whose sum overflows float32 as the NaN of a NaN scale (two-shot's owner
    would have quantized it so). A NaN that arithmetic makes (an overflow in the
    inverse rotation; inf - inf when accumulating) is the GPU's canonical NaN.

Both run in the engine's stream order (numpy: at once). Buffers stay owned
by the caller; kernels allocate only scratch that dies with the call.
"""
from __future__ import annotations

from typing import Protocol


class Kernels(Protocol):
    def reduce_quantize(self, layout, incoming, own_pos, own, residual, wire_out, ref_dtype,
                        base=None, out_layout=None) -> None: ...

    def dequantize(self, layout, wire, out, accumulate: bool = False, terms: int = 1) -> None: ...
