"""Two-shot all-reduce cut into chunks, so that transfers overlap the codec kernels.

Each rank's slice of ``S`` elements is cut into ``K`` chunks of ``C = S / K``;
chunk ``j`` of slice ``s`` is the *virtual slice* ``v = s * K + j`` of a layout
of ``P * K`` slices of ``C`` elements (`Layout` with ``quantum = C``), so every
element is quantized in the same group, summed in the same rank order and fed
back through the same residual element as in `two_shot`: the outputs and
residuals are bitwise those of `two_shot`. Only the order of work changes:
chunk ``j``'s transfers (`Transport.start`) run while chunk ``j + 1`` is being
quantized or reduced.

EXPERIMENTAL: correct on the CPU engine (tested bit for bit against two_shot);
its speed on GPUs has not been measured yet (BENCHMARKS.md).
"""
from __future__ import annotations

import os

from ..codec import SLICE_QUANTUM, residual_span
from ..layout import Layout
from .two_shot import _part, _quantize, two_shot

MAX_CHUNKS = 8
MIN_CHUNK_ELEMS = int(os.environ.get("ECHONCCL_PIPELINE_MIN_CHUNK", 1 << 20))


def chunk_count(slice_elems: int) -> int:
    """The number of chunks K: a power of two up to `MAX_CHUNKS` that divides the slice into
    chunks of a whole number of `SLICE_QUANTUM`s, each at least `MIN_CHUNK_ELEMS` long."""
    k = 1
    while (2 * k <= MAX_CHUNKS and slice_elems % (2 * k * SLICE_QUANTUM) == 0
           and slice_elems // (2 * k) >= MIN_CHUNK_ELEMS):
        k *= 2
    return k


def two_shot_pipelined(k, t, layout, x, out, state, ws, accumulate: bool = False) -> None:
    """`two_shot` in K chunks (see the module docstring); K = 1 is `two_shot` itself.

    ``ws.peers_out``/``ws.peers_in`` are used chunk-major: chunk ``j`` holds its
    P-1 peer slots consecutively at ``j * (P - 1) * Bc``; ``ws.gather`` holds the
    P * K virtual slices in order, so one dequantize decodes them all.
    """
    K = chunk_count(layout.slice_elems)
    if K == 1:
        return two_shot(k, t, layout, x, out, state, ws, accumulate)
    r, P = t.rank, t.size
    C = layout.slice_elems // K
    V = Layout(layout.count, P * K, layout.group, quantum=C, codec=layout.codec)
    Bc = V.slice_bytes
    peers = [s for s in range(P) if s != r]

    def peer_slot(buf, j, i):
        base = (j * (P - 1) + i) * Bc
        return buf[base:base + Bc]

    sent = []
    for j in range(K):
        for i, s in enumerate(peers):
            lo, hi = V.bounds(s * K + j)
            _quantize(k, V, x[lo:hi], _part(state, s * K + j, V), peer_slot(ws.peers_out, j, i))
        sent.append(t.start([(s, peer_slot(ws.peers_out, j, i)) for i, s in enumerate(peers)],
                            [(s, peer_slot(ws.peers_in, j, i)) for i, s in enumerate(peers)]))
    gathered = []
    for j in range(K):
        t.wait(sent[j])
        v = r * K + j
        lo, hi = V.bounds(v)
        incoming = ws.peers_in[j * (P - 1) * Bc:(j + 1) * (P - 1) * Bc]
        e_out = None if state is None else residual_span(state.output, j * C, (j + 1) * C)
        k.reduce_quantize(V, incoming=incoming, own_pos=r, own=x[lo:hi], residual=e_out,
                          wire_out=ws.gather[V.wire_slot(v)], ref_dtype=out.dtype,
                          base=out[lo:hi] if accumulate else None)
        gathered.append(t.start([(s, ws.gather[V.wire_slot(v)]) for s in peers],
                                [(s, ws.gather[V.wire_slot(s * K + j)]) for s in peers]))
    for h in gathered:
        t.wait(h)
    k.dequantize(V, ws.gather, out, accumulate)
