"""Ring all-reduce: P-1 requantizing reduce-scatter hops, then P-1 hops forwarding codes."""
from __future__ import annotations

from .two_shot import _owner_ref, _part, _quantize


def ring(k, t, layout, x, out, state, ws, accumulate: bool = False) -> None:
    """Slice ``c`` starts at rank ``c + 1``, which quantizes its contribution
    (plus its input residual); each following rank decodes the partial sum,
    adds its own contribution in float32 plus its input residual for that
    slice, and requantizes; the owner ``c`` adds its output residual instead
    and quantizes once more. An all-gather (NCCL's runs as a ring) delivers the
    owners' codes unchanged, so every rank decodes the same bytes.

    Uses slot 0 of ``ws.peers_out`` / ``ws.peers_in`` as the hop buffers and
    ``ws.gather`` (P slots); hops travel in ``layout``'s codec, the owners' sums in
    ``layout.sums``'.
    """
    r, P, L, Ls = t.rank, t.size, layout, layout.sums
    right, left = (r + 1) % P, (r - 1) % P
    slot = L.wire_slot
    send, recv = ws.peers_out[slot(0)], ws.peers_in[slot(0)]

    c = (r - 1) % P
    lo, hi = L.bounds(c)
    _quantize(k, L, x[lo:hi], _part(state, c, L), send)
    for step in range(P - 1):
        t.exchange([(right, send)], [(left, recv)])
        c = (r - step - 2) % P
        lo, hi = L.bounds(c)
        if step < P - 2:                 # a hop: the partial sum from the left, then ours
            k.reduce_quantize(L, incoming=recv, own_pos=1, own=x[lo:hi], residual=_part(state, c, L),
                              wire_out=send, ref_dtype="float32")
        else:                            # the owner: its output residual, quantized once more
            k.reduce_quantize(L, incoming=recv, own_pos=1, own=x[lo:hi],
                              residual=None if state is None else state.output, wire_out=ws.gather[Ls.wire_slot(r)],
                              ref_dtype=_owner_ref(state, out, accumulate), base=out[lo:hi] if accumulate else None,
                              out_layout=Ls)

    t.all_gather(ws.gather, Ls.slice_bytes)
    k.dequantize(Ls, ws.gather, out, accumulate)
