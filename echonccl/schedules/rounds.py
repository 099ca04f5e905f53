"""Refinement rounds: one all-reduce sent as several 4-bit all-reduces of what is left.

Round 1 is the schedule itself. Each further round runs the same schedule on an
empty input with the same feedback state and ``accumulate=True``: every
quantization then encodes only the residual the previous round left, and the
decoded sum is added into ``out`` instead of written. The owners quantize with
their slice of ``out`` as ``base``, so their residual is measured against what
the addition really stores, 16-bit rounding included. By the telescoping of error
feedback, ``out`` after r rounds misses the exact sum only by the residuals of
round r, each about 1/10 of the previous round's, at r times the wire bytes and
kernel launches of one round.
"""
from __future__ import annotations


def run_rounds(schedule, k, t, layout, x, out, state, ws, rounds: int = 1) -> None:
    """``schedule(k, t, layout, x, out, state, ws)``, then ``rounds - 1`` refinement rounds.

    ``state`` must not be None when ``rounds > 1`` (the residuals are what the
    refinement sends)."""
    if rounds > 1 and state is None:
        raise ValueError("rounds > 1 sends the feedback residuals: it needs feedback")
    schedule(k, t, layout, x, out, state, ws)
    for _ in range(rounds - 1):
        schedule(k, t, layout, x[:0], out, state, ws, accumulate=True)
