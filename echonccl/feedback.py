"""Error-feedback state: the residuals a caller owns and passes from call to call.

Scope it as a transformer needs it: ONE `Feedback` for all the all-reduces
whose outputs are added into the same residual stream, `reset()` at the start
of every forward pass (or backward pass, with a second state). The errors of
the calls sharing a state then telescope: the stream's total error is that of
the last call alone, whatever the depth and the number of ranks.

Without an explicit state, a `Communicator` keeps one default `Feedback` per
(element count, dtype) and never resets it; pass ``feedback=False`` for plain
4-bit quantization with no feedback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import EchoncclError


@dataclass
class Residuals:
    """The two residual buffers of one rank, engine arrays (numpy or cupy).

    ``inputs``: ``layout.padded`` elements, the residual of every quantization
    this rank made of a slice it does not own (its contribution, or a ring hop).
    ``output``: ``layout.slice_elems`` elements, the residual of the owner's
    final requantization of its own slice.
    """

    inputs: Any
    output: Any


class Feedback:
    """Residual state for one stream of all-reduces of one shape.

    The first call binds the state to its layout (count, ranks, group size)
    and input dtype, allocating zeroed residuals on the engine's device; a
    later call with another layout or dtype raises `EchoncclError` (create one
    state per stream). ``residual_dtype`` is ``"float32"`` (default) or
    ``"input"`` (the input dtype, half the memory, coarser feedback).
    ``enabled = False`` turns feedback off: calls then neither read nor write
    the residuals. Calls using one state must be ordered (one stream).
    """

    def __init__(self, residual_dtype: str = "float32", enabled: bool = True):
        if residual_dtype not in ("float32", "input"):
            raise ValueError(f"residual_dtype must be 'float32' or 'input', got {residual_dtype!r}")
        self.residual_dtype = residual_dtype
        self.enabled = enabled
        self.key = None
        self.residuals: Residuals | None = None

    def bind(self, key: tuple, layout, input_dtype, zeros) -> Residuals | None:
        """Residuals for a call of ``key`` = (count, nranks, group, dtype name); None if disabled.

        ``zeros(n, dtype)`` allocates a zeroed engine array.
        """
        if not self.enabled:
            return None
        if self.key is None:
            dt = np.dtype("float32") if self.residual_dtype == "float32" else input_dtype
            self.residuals = Residuals(zeros(layout.padded, dt), zeros(layout.slice_elems, dt))
            self.key = key
        elif self.key != key:
            raise EchoncclError(
                f"feedback state is bound to (count, ranks, group, dtype) = {self.key}, "
                f"this call is {key}: use one Feedback per stream of same-shaped all-reduces")
        return self.residuals

    def reset(self) -> None:
        """Zero the residuals in place (their buffers are kept)."""
        if self.residuals is not None:
            self.residuals.inputs.fill(0)
            self.residuals.output.fill(0)

    def state_dict(self) -> dict:
        """A checkpoint: plain numpy copies of the residuals and the binding key."""
        out = {"residual_dtype": self.residual_dtype, "enabled": self.enabled, "key": self.key}
        if self.residuals is not None:
            out["inputs"] = _to_numpy(self.residuals.inputs)
            out["output"] = _to_numpy(self.residuals.output)
        return out

    def load_state_dict(self, d: dict, zeros=None) -> None:
        """Restore a `state_dict`. Bound states copy into their buffers; an unbound
        state needs ``zeros`` (the engine allocator; `Communicator.load_feedback` passes it)."""
        self.residual_dtype, self.enabled = d["residual_dtype"], d["enabled"]
        key = tuple(d["key"]) if d["key"] is not None else None
        if key is None:
            self.key, self.residuals = None, None
            return
        if self.residuals is None or self.key != key:
            if zeros is None:
                raise EchoncclError("loading into an unbound Feedback needs the engine allocator: "
                                    "use Communicator.load_feedback")
            self.residuals = Residuals(zeros(d["inputs"].size, d["inputs"].dtype),
                                       zeros(d["output"].size, d["output"].dtype))
            self.key = key
        _copy_into(self.residuals.inputs, d["inputs"])
        _copy_into(self.residuals.output, d["output"])


def _to_numpy(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.array(a, copy=True)


def _copy_into(dst, src: np.ndarray) -> None:
    if hasattr(dst, "set"):
        dst.set(np.ascontiguousarray(src, dtype=dst.dtype))
    else:
        dst[...] = src
