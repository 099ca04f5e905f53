"""Two-shot all-reduce cut into chunks, so that transfers overlap the codec kernels.

Each rank's slice of ``S`` elements is cut into ``K`` chunks of ``C = S / K``;
chunk ``j`` of slice ``s`` is the *virtual slice* ``v = s * K + j`` of a layout
of ``P * K`` slices of ``C`` elements (`Layout` with ``quantum = C``), so every
element is quantized in the same group, summed in the same rank order and fed
back through the same residual element as in `two_shot`: the outputs and
residuals are bitwise those of `two_shot`. Only the order of work changes:
chunk ``j``'s transfers (`Transport.start`, `Transport.start_all_gather`, on the
GPU a communication stream) run while chunk ``j + 1`` is being quantized or
reduced, and chunk ``j`` is decoded while later ones travel. Its Python runs
once per chunk: the GPU engine replays the whole schedule as one CUDA graph.
"""
from __future__ import annotations

from .. import settings
from ..codec import SLICE_QUANTUM, residual_span
from ..layout import Layout
from .two_shot import _contribute, _owner_ref, two_shot

MAX_CHUNKS = 8


def chunk_count(slice_elems: int) -> int:
    """The number of chunks K: a power of two up to `MAX_CHUNKS` that divides the slice into
    chunks of a whole number of `SLICE_QUANTUM`s, each at least ``ECHONCCL_DEV_PIPELINE_MIN_CHUNK``
    (2^20) elements long."""
    min_chunk = settings.get("ECHONCCL_DEV_PIPELINE_MIN_CHUNK")
    k = 1
    while (2 * k <= MAX_CHUNKS and slice_elems % (2 * k * SLICE_QUANTUM) == 0
           and slice_elems // (2 * k) >= min_chunk):
        k *= 2
    return k


def two_shot_pipelined(k, t, layout, x, out, state, ws, accumulate: bool = False) -> None:
    """`two_shot` in K chunks (see the module docstring); K = 1 is `two_shot` itself.

    ``ws.gather`` holds chunk ``j``'s P slots of sums (owner ``s`` in slot ``s``) at
    ``j * P * Bs``, gathered by one `Transport.start_all_gather` per chunk and
    decoded as soon as it is there; with two ranks and one codec the chunk's
    contributions travel the same way first. Otherwise ``ws.peers_out``/``ws.peers_in``
    hold chunk ``j``'s P-1 peer slots at ``j * (P - 1) * Bc``.
    """
    K = chunk_count(layout.slice_elems)
    if K == 1:
        return two_shot(k, t, layout, x, out, state, ws, accumulate)
    r, P = t.rank, t.size
    C = layout.slice_elems // K
    V = Layout(layout.count, P * K, layout.name, quantum=C)
    Vs = V.sums
    Bc, Bs = V.slice_bytes, Vs.slice_bytes     # a chunk's slice of contributions, of sums

    def chunk(buf, j, n, b=Bc):    # chunk j's n slots of b bytes in buf
        return buf[j * n * b:(j + 1) * n * b]

    sent = [_contribute(k, t, V, x, state, chunk(ws.gather, j, P, Bs), chunk(ws.peers_out, j, P - 1),
                        chunk(ws.peers_in, j, P - 1), first=j, stride=K, start=True) for j in range(K)]
    gathered = []
    for j, (incoming, handle) in enumerate(sent):
        t.wait(handle)
        gather = chunk(ws.gather, j, P, Bs)
        lo, hi = V.bounds(r * K + j)
        e_out = None if state is None else residual_span(state.output, j * C, (j + 1) * C)
        k.reduce_quantize(V, incoming=incoming, own_pos=r, own=x[lo:hi], residual=e_out,
                          wire_out=gather[Vs.wire_slot(r)], ref_dtype=_owner_ref(state, out, accumulate),
                          base=out[lo:hi] if accumulate else None, out_layout=Vs)
        gathered.append(t.start_all_gather(gather, Bs))
    for j in range(K):
        t.wait(gathered[j])
        for s in range(P):
            lo, hi = V.bounds(s * K + j)
            k.dequantize(Vs, chunk(ws.gather, j, P, Bs)[Vs.wire_slot(s)], out[lo:hi], accumulate)
