"""Two-shot all-reduce: reduce-scatter to slice owners, then all-gather of the owners' codes."""
from __future__ import annotations

from ..codec import residual_span


def two_shot(k, t, layout, x, out, state, ws, accumulate: bool = False) -> None:
    """Each rank quantizes its contribution to every peer's slice and sends it to
    that owner; the owner sums, in float32 and rank order, the decoded peer
    slices with its own slice taken exactly, adds its output residual,
    quantizes once and sends the codes to everyone; all ranks decode all
    slices, so every rank's output is bitwise identical.

    Contributions travel in ``layout``'s codec, the sums in ``layout.sums``'
    (the same one, or 8 bits for 4-bit contributions: `codec.MIXED`).
    ``ws.peers_out`` and ``ws.peers_in`` hold P-1 slots of contributions, peer
    ``s`` in slot ``s`` if ``s < rank`` else ``s - 1``; ``ws.gather`` holds P
    slots of sums, owner ``s`` in slot ``s``, filled by `Transport.all_gather`
    (with two ranks and one codec it carries the contributions first; the peer
    slots are then unused).
    """
    r, L, Ls = t.rank, layout, layout.sums
    incoming, _ = _contribute(k, t, L, x, state, ws.gather, ws.peers_out, ws.peers_in)

    lo, hi = L.bounds(r)
    k.reduce_quantize(L, incoming=incoming, own_pos=r, own=x[lo:hi],
                      residual=None if state is None else state.output, wire_out=ws.gather[Ls.wire_slot(r)],
                      ref_dtype=_owner_ref(state, out, accumulate), base=out[lo:hi] if accumulate else None,
                      out_layout=Ls)
    t.all_gather(ws.gather, Ls.slice_bytes)
    k.dequantize(Ls, ws.gather, out, accumulate)


def _contribute(k, t, layout, x, state, gather, peers_out, peers_in, first=0, stride=1, start=False):
    """Quantize this rank's contribution to each peer ``s``'s slice (slice ``s * stride + first``
    of ``layout``) and send it to that owner: with two ranks and one codec as an all-gather
    through ``gather`` (P slots: ours into slot ``rank``, the peer's arrives in the other; the
    owner then writes its sum over its own slot), else as one round from ``peers_out`` to
    ``peers_in`` (P-1 slots, peer order). Returns ``(incoming, handle)``: the slots the owner's
    reduce reads, and with ``start`` the handle `Transport.wait` takes (the transfer posted by
    ``start_all_gather`` / ``start``), else None (done in stream order)."""
    r, P, B = t.rank, t.size, layout.slice_bytes
    peers = [s for s in range(P) if s != r]
    via_gather = P == 2 and layout.sums is layout   # sums of another size would overlap the peer's slot

    def slot(buf, i):
        return buf[i * B:(i + 1) * B]

    mine = [slot(gather, r)] if via_gather else [slot(peers_out, i) for i in range(P - 1)]
    for dst, s in zip(mine, peers):
        v = s * stride + first
        lo, hi = layout.bounds(v)
        _quantize(k, layout, x[lo:hi], _part(state, v, layout), dst)
    if via_gather:
        return slot(gather, peers[0]), (t.start_all_gather if start else t.all_gather)(gather, B)
    transfers = ([(s, m) for s, m in zip(peers, mine)], [(s, slot(peers_in, i)) for i, s in enumerate(peers)])
    return peers_in, (t.start if start else t.exchange)(*transfers)


def _owner_ref(state, out, accumulate: bool):
    """The owner's ``ref_dtype`` (`Residuals.owner_ref`; the output's dtype without feedback)."""
    return out.dtype if state is None else state.owner_ref(out.dtype, accumulate)


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
