"""Ring all-reduce: P-1 requantizing reduce-scatter hops, then P-1 hops forwarding codes."""
from __future__ import annotations

from .two_shot import _part


def ring(k, t, layout, x, out, state, ws, accumulate: bool = False) -> None:
    """Slice ``c`` starts at rank ``c + 1``, which quantizes its contribution
    (plus its input residual); each following rank decodes the partial sum,
    adds its own contribution in float32 plus its input residual for that
    slice, and requantizes; the owner ``c`` adds its output residual instead
    and quantizes once more. The all-gather forwards the owners' codes around
    the ring unchanged, so every rank decodes the same bytes.

    Uses slot 0 of ``ws.peers_out`` / ``ws.peers_in`` as the hop buffers and
    ``ws.gather`` (P slots).
    """
    r, P, L = t.rank, t.size, layout
    right, left = (r + 1) % P, (r - 1) % P
    slot = L.wire_slot
    send, recv = ws.peers_out[slot(0)], ws.peers_in[slot(0)]

    c = (r - 1) % P
    lo, hi = L.bounds(c)
    k.reduce_quantize(L, None, 0, x[lo:hi], _part(state, c, L), send, "float32")
    for step in range(P - 1):
        t.exchange([(right, send)], [(left, recv)])
        c = (r - step - 2) % P
        lo, hi = L.bounds(c)
        if step < P - 2:
            k.reduce_quantize(L, recv, 1, x[lo:hi], _part(state, c, L), send, "float32")
        else:
            k.reduce_quantize(L, recv, 1, x[lo:hi], None if state is None else state.output,
                              ws.gather[slot(r)], out.dtype, out[lo:hi] if accumulate else None)

    for step in range(P - 1):
        t.exchange([(right, ws.gather[slot((r - step) % P)])],
                   [(left, ws.gather[slot((r - step - 1) % P)])])
    k.dequantize(L, ws.gather, out, accumulate)
