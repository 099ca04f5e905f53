"""One-shot quantized all-reduce: every rank's 4-bit contribution to every rank, summed by each."""
from __future__ import annotations

from .two_shot import _part, _quantize


def one_shot_q(k, t, layout, x, out, state, ws, accumulate: bool = False) -> None:
    """Each rank quantizes its whole contribution once (slice by slice, each with its input
    residual) into its part of ``ws.gather`` (P parts of P slices, rank ``s``'s part first at
    slice ``s * P``) and all-gathers it; every rank then decodes the P contributions and sums
    them in float32 in rank order (`Kernels.dequantize` with ``terms = P``), rounding once, so
    every rank's output is bitwise identical.

    Against `two_shot`: one quantization per element instead of two (the sum is not quantized
    again), one exchange instead of two, and no owner step; but each rank sends its whole
    contribution to every peer, P - 1 slices' worth to each where two-shot sends 2 (P - 1) / P:
    the same bytes with two ranks, more with more. ``state.output`` is not used. With
    ``accumulate`` (a refinement round, `rounds`) the decoded sum is added into ``out``; the
    rounding of that addition is not fed back (no owner measures it).
    """
    P, B = t.size, layout.slice_bytes
    part = P * B
    mine = ws.gather[t.rank * part:(t.rank + 1) * part]
    for v in range(P):
        lo, hi = layout.bounds(v)
        _quantize(k, layout, x[lo:hi], _part(state, v, layout), mine[layout.wire_slot(v)])
    t.all_gather(ws.gather, part)
    k.dequantize(layout, ws.gather, out, accumulate, terms=P)


def gather_slices(nranks: int) -> int:
    """The slots of ``ws.gather`` `one_shot_q` uses: P contributions of P slices."""
    return nranks * nranks
