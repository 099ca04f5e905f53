"""Refinement rounds: one all-reduce sent as several 4-bit all-reduces of what is left.

Round 1 is the schedule itself. Each further round runs the same schedule on an
empty input with the same feedback state: every quantization then encodes only
the residual the previous round left (the owner's includes the rounding of
``out``), and the decoded sum is added into ``out`` instead of written. By the
telescoping of error feedback, ``out`` after r rounds misses the exact sum only by
the residuals of round r, each about 1/10 of the previous round's, at r times the
wire bytes and kernel launches of one round.

One thing is not fed back: adding round r's sum into a 16-bit ``out`` rounds it once
more (``round(out + decoded)``), and the owners' residuals only know
``round(decoded)``. So with float16/bfloat16 outputs each call with ``rounds > 1``
leaves one rounding of its output to the dtype untracked (at most half an ulp of
``out``, what NCCL's own bf16 all-reduce leaves on every call); float32 outputs lose
only float32 rounding. Feeding it back would need the owner's quantize to read its
slice of ``out``.
"""
from __future__ import annotations


class _Accumulating:
    """The engine's kernels, with ``dequantize`` adding into ``out``."""

    def __init__(self, kernels):
        self.reduce_quantize = kernels.reduce_quantize
        self._dequantize = kernels.dequantize

    def dequantize(self, layout, wire, out) -> None:
        self._dequantize(layout, wire, out, accumulate=True)


def run_rounds(schedule, k, t, layout, x, out, state, ws, rounds: int = 1) -> None:
    """``schedule(k, t, layout, x, out, state, ws)``, then ``rounds - 1`` refinement rounds.

    ``state`` must not be None when ``rounds > 1`` (the residuals are what the
    refinement sends)."""
    schedule(k, t, layout, x, out, state, ws)
    if rounds > 1:
        if state is None:
            raise ValueError("rounds > 1 sends the feedback residuals: it needs feedback")
        acc = _Accumulating(k)
        for _ in range(rounds - 1):
            schedule(acc, t, layout, x[:0], out, state, ws)
