"""Error-feedback state: the residuals a caller owns and passes from call to call.

Scope it as a transformer needs it: ONE `Feedback` for all the all-reduces
whose outputs are added into the same residual stream, `reset()` at the start
of every forward pass (or backward pass, with a second state). The errors of
the calls sharing a state then telescope: the stream's total error is that of
the last call alone, whatever the depth and the number of ranks.

Without an explicit state, a `Communicator` keeps one default `Feedback` per
(element count, dtype) and never resets it, in its bounded cache (an evicted
default state loses its residuals: README "Memory"); pass ``feedback=False`` for
plain 4-bit quantization with no feedback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import codec as wire, dtypes
from .errors import EchoncclError
from .layout import Layout

DEFAULT_RESIDUAL = "auto"
# the owner's output rounding in its residual (`Feedback`): off by default
DEFAULT_ROUNDING = False


@dataclass
class Residuals:
    """The two residual buffers of one rank, engine arrays (numpy or cupy).

    ``inputs``: ``layout.padded`` elements, the residual of every quantization
    this rank made of a slice it does not own (its contribution, or a ring hop).
    ``output``: ``layout.slice_elems`` elements, the residual of the owner's
    final requantization of its own slice. ``rounding``: whether that residual also
    holds the owner's output rounding (`Feedback`).
    """

    inputs: Any
    output: Any
    rounding: bool = DEFAULT_ROUNDING

    def owner_ref(self, out_dtype, accumulate: bool):
        """The ``ref_dtype`` of the owner's requantization (`Kernels.reduce_quantize`): the output's
        dtype, so that the residual holds the output's rounding too, or float32 (the quantization
        error alone) when ``rounding`` is off and the call does not accumulate."""
        return out_dtype if self.rounding or accumulate else "float32"


class Feedback:
    """Residual state for one stream of all-reduces of one shape.

    The first call binds the state to its layout (count, ranks, group size)
    and input dtype, allocating zeroed residuals on the engine's device; a
    later call with another layout or dtype raises `EchoncclError` (create one
    state per stream). ``residual_dtype`` is ``"auto"`` (default: ``"int8"`` for 16-bit
    data, float32 for float32 data), ``"int8"`` (8-bit mantissas with an exponent byte
    per 32 elements; `codec`, "Residuals"), ``"input"`` (the input dtype) or
    ``"float32"``. ACCURACY.md measured them alike on the model study; with int8
    residuals the fused two-shot moves 7.62 bytes an element at P = 2 against 9.56 with
    16-bit ones (BENCHMARKS.md), and float32 data keeps float32 residuals, whose errors
    telescope exactly.
    ``enabled = False`` turns feedback off: calls then neither read nor write
    the residuals. Calls using one state must be ordered (one stream).
    ``rounding = False`` (default): the owner's residual holds its sum's quantization error but
    not its output's rounding to a 16-bit output dtype (calls that accumulate, refinement rounds,
    keep it in). The errors of a stream then telescope up to one 16-bit rounding a call (what a
    16-bit NCCL all-reduce makes too), and the owner rotates each element twice, not three
    times. ``rounding = True`` keeps the output's rounding in the residual too, so the errors
    telescope exactly; the fused two-shot is 6-12% slower so, and the model study measured no
    difference beyond noise (ACCURACY.md, "Feedback(rounding=)"; BENCHMARKS.md).

    The state also records the codec that wrote it (``codec``, set on binding):
    the rotated codecs (``int4-h32``, ``int7-h32``) keep their residuals in the rotated
    domain, so a state of one codec is refused (`EchoncclError`) by a call or a
    communicator of another.
    `state_dict` is versioned (``STATE_VERSION``); a state without a version
    (written before codecs existed) is an ``int4`` state.
    """

    STATE_VERSION = 2

    def __init__(self, residual_dtype: str = DEFAULT_RESIDUAL, enabled: bool = True, rounding: bool = DEFAULT_ROUNDING):
        if residual_dtype not in wire.RESIDUAL_FORMATS:
            raise ValueError(f"residual_dtype must be one of {wire.RESIDUAL_FORMATS}, got {residual_dtype!r}")
        if not isinstance(rounding, bool):
            raise ValueError(f"rounding must be True or False, got {rounding!r}")
        self.residual_dtype = residual_dtype
        self.enabled = enabled
        self.rounding = rounding
        self.key: tuple | None = None
        self.codec: str | None = None
        self.residuals: Residuals | None = None

    def bind(self, key: tuple, layout, input_dtype, zeros, codec: str | None = None) -> Residuals | None:
        """Residuals for a call of ``key`` = (count, nranks, group, dtype name) with ``codec``
        (default: the layout's); None if disabled. ``zeros(n, dtype)`` allocates a zeroed engine array.
        """
        if not self.enabled:
            return None
        codec = layout.name if codec is None else codec
        self.check_key(key, codec)
        if self.key is None:
            dt = wire.residual_dtype(self.residual_dtype, input_dtype)
            self.residuals = Residuals(zeros(wire.residual_size(layout.padded, dt), dt),
                                       zeros(wire.residual_size(layout.slice_elems, dt), dt), self.rounding)
            self.reset()
            self.key = key
            self.codec = codec
        return self.residuals

    def check_key(self, key: tuple, codec: str | None = None) -> None:
        """`EchoncclError` if this state is bound to another (count, ranks, group, dtype) than ``key``,
        or (``codec`` given) holds the residuals of another codec."""
        if self.key is not None and self.key != tuple(key):
            raise EchoncclError(
                f"feedback state is bound to (count, ranks, group, dtype) = {self.key}, "
                f"this call is {tuple(key)}: use one Feedback per stream of same-shaped all-reduces")
        if codec is not None and self.codec is not None and self.codec != codec:
            raise EchoncclError(f"feedback state holds residuals of codec {self.codec!r}, this call uses "
                                f"{codec!r}: use one Feedback per codec")

    def reset(self) -> None:
        """Zero the residuals in place (their buffers are kept; `codec.clear_residuals`)."""
        if self.residuals is not None:
            wire.clear_residuals(self.residuals.inputs)
            wire.clear_residuals(self.residuals.output)

    def state_dict(self) -> dict:
        """A checkpoint: plain numpy copies of the residuals and the binding key."""
        out: dict = {"version": self.STATE_VERSION, "codec": self.codec, "residual_dtype": self.residual_dtype,
                     "enabled": self.enabled, "rounding": self.rounding, "key": self.key}
        if self.residuals is not None:
            out["inputs"] = _to_numpy(self.residuals.inputs)
            out["output"] = _to_numpy(self.residuals.output)
        return out

    def load_state_dict(self, d: dict, zeros=None) -> None:
        """Restore a `state_dict`. Bound states copy into their buffers; an unbound
        state needs ``zeros`` (the engine allocator; `Communicator.load_feedback` passes it).

        The residuals come back in the dtype the key and ``residual_dtype`` imply, also
        from files that lost it (``np.savez`` stores bfloat16 as raw 2-byte void). A corrupt
        state (a missing entry, wrong sizes or dtypes, NaN or Inf residuals, an unknown
        version or codec, another codec than a bound state's) raises `EchoncclError` and
        changes nothing. States without a version (1) are the int4 codec's."""
        if not hasattr(d, "get") or not hasattr(d, "__getitem__"):
            raise EchoncclError(f"bad feedback state: a dict from Feedback.state_dict expected, "
                                f"not {type(d).__name__}")
        residual_dtype, enabled, key = (_entry(d, k) for k in ("residual_dtype", "enabled", "key"))
        residual_dtype, enabled = _plain(residual_dtype), bool(enabled)
        rounding = _plain(d.get("rounding", True))      # absent before the option: on
        if not isinstance(rounding, (bool, np.bool_)):
            raise EchoncclError(f"bad feedback state: rounding {rounding!r}")
        rounding = bool(rounding)
        if residual_dtype not in wire.RESIDUAL_FORMATS:
            raise EchoncclError(f"bad feedback state: residual_dtype {residual_dtype!r}")
        version, codec = _plain(d.get("version", 1)), _plain(d.get("codec", "int4"))
        if version not in (1, self.STATE_VERSION):
            raise EchoncclError(f"bad feedback state: version {version!r} (this echonccl reads 1 and "
                                f"{self.STATE_VERSION})")
        if version == 1:
            codec = "int4"                              # states before codecs: the int4 codec's
        key = _normalize_key(key)
        if key is None:
            self.residual_dtype, self.enabled, self.rounding = residual_dtype, enabled, rounding
            self.key, self.residuals, self.codec = None, None, None
            return
        if codec not in wire.CODECS:
            raise EchoncclError(f"bad feedback state: codec {codec!r}")
        if self.key is not None and self.codec is not None and self.codec != codec:
            raise EchoncclError(f"feedback state of codec {codec!r} cannot load into a state bound "
                                f"to codec {self.codec!r}")
        try:
            dt = wire.residual_dtype(residual_dtype, dtypes.numpy_dtype(key[3]))
            layout = Layout(key[0], key[1], codec)
            if key[2] != layout.group:
                raise ValueError(f"group size {key[2]}, codec {codec!r} has {layout.group}")
        except (TypeError, ValueError) as exc:
            raise EchoncclError(f"bad feedback state: key {key!r}: {exc}") from None
        inputs = _as_dtype(_entry(d, "inputs"), dt, wire.residual_size(layout.padded, dt), "inputs")
        output = _as_dtype(_entry(d, "output"), dt, wire.residual_size(layout.slice_elems, dt), "output")
        for what, a in (("inputs", inputs), ("output", output)):
            if a.dtype == np.uint8:
                try:
                    wire.check_residual_bytes(a)
                except ValueError as exc:
                    raise EchoncclError(f"bad feedback state: {what}: {exc} (the state is corrupt)") from None
            elif not np.isfinite(a.astype(np.float32)).all():   # the codec never stores NaN or Inf
                raise EchoncclError(f"bad feedback state: {what} holds NaN or Inf (residuals are always "
                                    "finite: the state is corrupt)")
        if self.residuals is None or self.key != key or self.residuals.inputs.dtype != dt:
            if zeros is None:
                raise EchoncclError("loading into an unbound Feedback needs the engine allocator: "
                                    "use Communicator.load_feedback")
            self.residuals = Residuals(zeros(inputs.size, dt), zeros(output.size, dt))
            self.key = key
        self.residual_dtype, self.enabled, self.codec, self.rounding = residual_dtype, enabled, codec, rounding
        self.residuals.rounding = rounding
        _copy_into(self.residuals.inputs, inputs)
        _copy_into(self.residuals.output, output)


def _entry(d, name: str):
    try:
        return d[name]
    except KeyError:
        raise EchoncclError(f"bad feedback state: no {name!r} entry (a Feedback.state_dict has "
                            "residual_dtype, enabled, key and, once bound, inputs and output)") from None


def _plain(v):
    """A scalar from a state field, also when ``np.savez`` made it a 0-d array."""
    return v.item() if isinstance(v, np.ndarray) and v.ndim == 0 else v


def _normalize_key(key):
    """``(count, ranks, group, dtype name)`` from a saved key (tuple, list or array of strings)."""
    if key is None or (isinstance(key, np.ndarray) and key.ndim == 0 and key.item() is None):
        return None
    try:
        count, nranks, group, name = list(key)
        return int(count), int(nranks), int(group), str(name)
    except (TypeError, ValueError):
        raise EchoncclError(f"bad feedback state: key {key!r} is not (count, ranks, group, dtype)") from None


def _as_dtype(a, dt: np.dtype, size: int, what: str) -> np.ndarray:
    a = np.asarray(a).reshape(-1)
    if a.size != size:
        raise EchoncclError(f"bad feedback state: {what} has {a.size} elements, its key needs {size}")
    if a.dtype == dt:
        return a
    if a.dtype.kind == "V" and a.dtype.itemsize == dt.itemsize:   # np.savez of bfloat16
        return a.view(dt)
    if a.dtype.kind != "f" or dt.kind != "f":
        raise EchoncclError(f"bad feedback state: {what} has dtype {a.dtype}, expected {dt}")
    return a.astype(dt)


def _to_numpy(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.array(a, copy=True)


def _copy_into(dst, src: np.ndarray) -> None:
    if hasattr(dst, "set"):
        dst.set(np.ascontiguousarray(src, dtype=dst.dtype))
    else:
        dst[...] = src
