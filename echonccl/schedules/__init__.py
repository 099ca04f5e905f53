"""All-reduce schedules, each written once over `kernels.Kernels` and `transport.Transport`.

A schedule is a function ``run(k, t, layout, x, out, state, ws, accumulate=False)``:

* ``k``, ``t``: the engine's kernels and transport;
* ``x``: the caller's flat input (``layout.count`` elements; empty in a refinement round), read only;
* ``out``: the flat output (same length; may be ``x`` itself), written last;
* ``state``: `feedback.Residuals` (``inputs``: ``layout.padded`` elements,
  ``output``: ``layout.slice_elems``) or None when feedback is off;
* ``ws``: `Workspace` wire buffers owned by the communicator (``gather``: P slices, or
  `gather_slices` ones where a schedule says so);
* ``accumulate``: a refinement round (`rounds`): add the sum into ``out``
  instead of writing it, the owners passing their slice of ``out`` as the
  ``base`` of their last quantization so that its rounding is fed back too.

Schedules never call numpy or cupy: they slice buffers and call ``k`` and ``t``.
`run_rounds` runs any of them as several 4-bit rounds (`rounds`).
"""
from .rounds import run_rounds
from .two_shot import two_shot
from .ring import ring
from .pipelined import two_shot_pipelined
from .one_shot_q import gather_slices as _one_shot_q_slices
from .one_shot_q import one_shot_q

SCHEDULES = {"two_shot": two_shot, "ring": ring, "two_shot_pipelined": two_shot_pipelined, "one_shot_q": one_shot_q}


def gather_slices(algo: str, nranks: int) -> int | None:
    """The gather slots schedule ``algo`` needs in its workspace; None: P, one per rank."""
    return _one_shot_q_slices(nranks) if algo == "one_shot_q" else None


__all__ = ["SCHEDULES", "gather_slices", "run_rounds", "two_shot", "ring", "two_shot_pipelined", "one_shot_q"]
