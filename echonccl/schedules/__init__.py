"""All-reduce schedules, each written once over `kernels.Kernels` and `transport.Transport`.

A schedule is a function ``run(k, t, layout, x, out, state, ws, accumulate=False)``:

* ``k``, ``t``: the engine's kernels and transport;
* ``x``: the caller's flat input (``layout.count`` elements; empty in a refinement round), read only;
* ``out``: the flat output (same length; may be ``x`` itself), written last;
* ``state``: `feedback.Residuals` (``inputs``: ``layout.padded`` elements,
  ``output``: ``layout.slice_elems``) or None when feedback is off;
* ``ws``: `Workspace` wire buffers owned by the communicator (``peers_out``, ``peers_in``: P-1
  slices of contributions each; ``gather``: `gather_slots`);
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


def gather_slots(algo: str, layout) -> tuple[int, int]:
    """(slots, bytes a slot) of the ``ws.gather`` schedule ``algo`` needs for ``layout``: the P
    owners' sums (``layout.sums``' slices), or `one_shot_q`'s P contributions of P slices."""
    if algo == "one_shot_q":
        return _one_shot_q_slices(layout.nranks), layout.slice_bytes
    return layout.nranks, layout.sums.slice_bytes


__all__ = ["SCHEDULES", "gather_slots", "run_rounds", "two_shot", "ring", "two_shot_pipelined", "one_shot_q"]
