"""Two-shot all-reduce: reduce-scatter to slice owners, then all-gather of the owners' codes."""
from __future__ import annotations

from ..codec import residual_span


def two_shot(k, t, layout, x, out, state, ws, accumulate: bool = False) -> None:
    """Each rank quantizes its contribution to every peer's slice and sends it to
    that owner; the owner sums, in float32 and rank order, the decoded peer
    slices with its own slice taken exactly, adds its output residual,
    quantizes once and sends the codes to everyone; all ranks decode all
    slices, so every rank's output is bitwise identical.

    ``ws.peers_out`` and ``ws.peers_in`` hold P-1 slots, peer ``s`` in slot
    ``s`` if ``s < rank`` else ``s - 1``; ``ws.gather`` holds P slots, owner
    ``s`` in slot ``s``, filled by `Transport.all_gather` (with two ranks it
    carries the contributions first; the peer slots are then unused).
    """
    r, P, L = t.rank, t.size, layout
    peers = [s for s in range(P) if s != r]
    slot = L.wire_slot

    if P == 2:
        # Two ranks: the exchange of contributions is an all-gather, through ``ws.gather``
        # (slot r: ours, for the peer; then slot 1 - r: the peer's, for us).
        s = peers[0]
        lo, hi = L.bounds(s)
        _quantize(k, L, x[lo:hi], _part(state, s, L), ws.gather[slot(r)])
        t.all_gather(ws.gather, L.slice_bytes)
        incoming = ws.gather[slot(s)]
    else:
        for i, s in enumerate(peers):
            lo, hi = L.bounds(s)
            _quantize(k, L, x[lo:hi], _part(state, s, L), ws.peers_out[slot(i)])
        t.exchange([(s, ws.peers_out[slot(i)]) for i, s in enumerate(peers)],
                   [(s, ws.peers_in[slot(i)]) for i, s in enumerate(peers)])
        incoming = ws.peers_in

    lo, hi = L.bounds(r)
    k.reduce_quantize(L, incoming=incoming, own_pos=r, own=x[lo:hi],
                      residual=None if state is None else state.output, wire_out=ws.gather[slot(r)],
                      ref_dtype=out.dtype, base=out[lo:hi] if accumulate else None)
    t.all_gather(ws.gather, L.slice_bytes)
    k.dequantize(L, ws.gather, out, accumulate)


def _quantize(k, layout, own, residual, wire_out) -> None:
    """Quantize this rank's contribution ``own`` (plus its input ``residual``) alone, for a peer."""
    k.reduce_quantize(layout, incoming=None, own_pos=0, own=own, residual=residual, wire_out=wire_out,
                      ref_dtype="float32")


def _part(state, s, layout):
    """Slice ``s`` of the input residual, or None when feedback is off."""
    if state is None:
        return None
    n = layout.slice_elems
    return residual_span(state.inputs, s * n, (s + 1) * n)
