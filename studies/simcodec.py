"""Codec search in one process: the two-shot data flow of P ranks simulated in numpy, codec pluggable.

A study-only model of echonccl's two_shot all-reduce (`schedules.two_shot`) with
error feedback, rounds and the flush, used to compare many 4-bit codecs on the
model without MPI and without recomputing the unsplit reference per variant:

* every rank r adds its input residual to its rotated contribution to slice s
  (s != r), quantizes it and keeps what rounding lost;
* owner s sums, in float32 and rank order, the decoded peer terms with its own
  term taken exactly, adds its output residual, quantizes once; every rank
  decodes, inverse-rotates and rounds to the output dtype; the owner's residual
  is measured against what the output really holds (its rounding included);
* refinement rounds send the residuals with an empty input and add into ``out``.

A codec is a `Rotation` (None, or a blockwise Hadamard of B elements with fixed
random signs) and a `Quantizer` per round (scale format, group, rounding
rule). The rotated domain is the one the feedback residuals live in. The
arithmetic is float32 like the real codec's, but the simulation does not try
to be bit-exact with it: it ranks codecs. `studies/codec_search.py` drives it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_F32 = np.float32


def hadamard_signs(block: int, seed: int = 0x5EED) -> np.ndarray:
    """Fixed random +-1 signs of one block (the same on every rank, every call)."""
    rng = np.random.default_rng(seed + block)
    return np.where(rng.random(block) < 0.5, _F32(-1), _F32(1)).astype(_F32)


def fwht(x: np.ndarray, block: int) -> np.ndarray:
    """Unnormalized Walsh-Hadamard transform of each block of ``block`` elements (last axis)."""
    shp = x.shape
    y = x.reshape(-1, block).astype(_F32, copy=True)
    h = 1
    while h < block:
        y = y.reshape(-1, block // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2)
        h *= 2
    return y.reshape(shp)


@dataclass
class Rotation:
    block: int = 0                      # 0: no rotation

    def __post_init__(self):
        self.signs = hadamard_signs(self.block) if self.block else None
        self.inv_b = _F32(1.0 / self.block) if self.block else None

    def forward(self, x):
        if not self.block:
            return x
        s = x.shape
        return (fwht(x.reshape(-1, self.block) * self.signs, self.block) * self.inv_b).reshape(s)

    def inverse(self, y):
        if not self.block:
            return y
        s = y.shape
        return (fwht(y.reshape(-1, self.block), self.block) * self.signs).reshape(s)


@dataclass
class Quantizer:
    """Integer codes in [-levels, levels] (int4: 7), one scale per ``group`` elements.

    ``scale``: ``fp32`` (absmax / 7), ``e8m0`` (a power of two >= absmax / 7: 8-bit
    exponent-only), ``m3`` (absmax / 7 rounded up to 3 mantissa bits: an 8-bit float
    scale, e4m3-like, exponent range assumed covered by a per-slice scale), ``m7`` (rounded up
    to 7 mantissa bits: a 16-bit scale, bfloat16-like, rounded up so that no code clips),
    ``implicit`` (round 2+: the previous round's scale / ``implicit_div``, no scale bits; the
    residual it codes is at most half the previous step).
    ``mse``: pick the clipping ratio minimizing the group's squared error.
    ``levels``: 7 (int4), 3 (int3), 31 (int6), 63 (int7): ceil(log2(2 levels + 1)) bits a code.
    """

    group: int = 32
    scale: str = "fp32"
    mse: bool = False
    levels: int = 7
    implicit_div: float = 8.0

    def bits(self) -> float:
        code = int(np.ceil(np.log2(2 * self.levels + 1)))
        return code + {"fp32": 32, "e8m0": 8, "m3": 8, "m7": 16, "implicit": 0}[self.scale] / self.group

    def _scale(self, amax):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            s = amax / _F32(self.levels)
            if self.scale == "e8m0":
                e = np.ceil(np.log2(np.where(s > 0, s, 1)))
                s = np.where(s > 0, np.exp2(e), 0).astype(_F32)
            elif self.scale in ("m3", "m7"):
                k = 16 if self.scale == "m3" else 256      # 3 or 7 mantissa bits after the leading one
                m, e = np.frexp(s)                         # s = m 2^e, m in [0.5, 1)
                s = (np.ceil(m * k) / k * np.exp2(e)).astype(_F32)
        return np.maximum(s, _F32(0)).astype(_F32)

    def qdq(self, v: np.ndarray, prev_scale=None):
        """Decoded float32 values of ``v`` (last axis a multiple of ``group``), and the scales."""
        shp = v.shape
        g = v.reshape(-1, self.group)
        finite = np.isfinite(g).all(axis=1)
        g0 = np.where(finite[:, None], g, _F32(0))
        amax = np.abs(g0).max(axis=1)
        if self.scale == "implicit":
            s = (prev_scale / _F32(self.implicit_div)).astype(_F32)
            cands = [s]
        elif self.mse:
            cands = [self._scale(amax * _F32(c)) for c in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)]
        else:
            cands = [self._scale(amax)]
        best, best_err = None, None
        for s in cands:
            safe = np.where(s > 0, s, _F32(1))[:, None]
            d = (np.clip(np.rint(g0 / safe), -self.levels, self.levels) * safe).astype(_F32)
            d[s == 0] = 0
            if best is None:
                best, best_err, best_s = d, ((g0 - d) ** 2).sum(axis=1), s
            else:
                err = ((g0 - d) ** 2).sum(axis=1)
                better = err < best_err
                best = np.where(better[:, None], d, best)
                best_err = np.where(better, err, best_err)
                best_s = np.where(better, s, best_s)
        best = np.where(finite[:, None], best, _F32(np.nan)).astype(_F32)
        return best.reshape(shp), best_s


@dataclass
class Codec:
    name: str
    rotation: Rotation
    rounds: list = field(default_factory=lambda: [Quantizer()])
    sums: Quantizer | None = None        # the owners' sums' quantizer (default: the round's)

    def quantizer(self, r: int) -> Quantizer:
        return self.rounds[min(r, len(self.rounds) - 1)]

    def sum_quantizer(self, r: int) -> Quantizer:
        return self.sums or self.quantizer(r)

    def bits(self, nrounds: int) -> float:
        return sum(self.quantizer(r).bits() for r in range(nrounds))


def _round_to(x, dtype):
    return x.astype(dtype).astype(_F32) if dtype is not None else x


class SimTwoShot:
    """A simulated two_shot all-reduce of P ranks with one feedback state (all ranks' residuals).

    ``__call__(parts)``: ``parts`` (P, ...) float32 partial sums -> the (identical) output of
    every rank, float32. ``in_dtype``: the dtype the parts are handed over in and the output
    is rounded to (bf16 as a bf16 deployment). ``residual_dtype``: None (float32) or a dtype.
    ``rounds`` per call; ``flush``: one more round on call ``calls_per_pass``.
    """

    def __init__(self, codec: Codec, P: int, in_dtype=None, residual_dtype=None, feedback=True,
                 rounds=1, flush=False, calls_per_pass=0, slice_quantum=512):
        self.codec, self.P, self.in_dtype, self.res_dtype = codec, P, in_dtype, residual_dtype
        self.feedback, self.rounds, self.flush, self.calls_per_pass = feedback, rounds, flush, calls_per_pass
        self.q = slice_quantum
        self.calls, self.state = 0, None

    def reset(self):
        self.calls, self.state = 0, None

    def _store(self, e):
        e = np.where(np.isfinite(e), e, _F32(0)).astype(_F32)
        return _round_to(e, self.res_dtype)

    def __call__(self, parts: np.ndarray) -> np.ndarray:
        P, c = self.P, self.codec
        self.calls += 1
        nr = self.rounds + (1 if self.flush and self.calls == self.calls_per_pass else 0)
        shape = parts.shape[1:]
        n = int(np.prod(shape))
        S = max(self.q, -(-(-(-n // P)) // self.q) * self.q)
        x = np.zeros((P, P * S), _F32)
        x[:, :n] = _round_to(parts.reshape(P, n).astype(_F32), self.in_dtype)
        x = x.reshape(P, P, S)                                   # [rank, slice, elem]
        if self.state is None or not self.feedback:
            self.state = (np.zeros((P, P, S), _F32), np.zeros((P, S), _F32))
        res_in, res_out = self.state
        xr = c.rotation.forward(x)
        out = None
        prev_in = prev_out = None
        eye = np.eye(P, dtype=bool)
        for r in range(nr):
            qz = c.quantizer(r)
            v = (xr if r == 0 else np.zeros_like(xr)) + res_in
            d, s_in = qz.qdq(v, prev_in)
            if self.feedback:
                res_in = np.where(eye[:, :, None], _F32(0), self._store(v - d))   # own slice: no quantization
            own = xr if r == 0 else np.zeros_like(xr)
            terms = np.where(eye[:, :, None], own, d)            # the owner's own term exact
            acc = terms.sum(axis=0, dtype=_F32) + res_out
            dq, s_out = c.sum_quantizer(r).qdq(acc, prev_out)
            vals = c.rotation.inverse(dq)
            if out is None:
                new = _round_to(vals, self.in_dtype)
                ref = new
            else:
                new = _round_to(out + vals, self.in_dtype)
                ref = new - out
            if self.feedback:
                res_out = self._store(acc - c.rotation.forward(ref))
            out = new
            prev_in, prev_out = s_in, s_out
        if self.feedback:
            self.state = (res_in, res_out)
        return out.reshape(-1)[:n].reshape(shape)


class SimExact:
    def __call__(self, parts):
        return parts.astype(np.float64).sum(axis=0).astype(_F32)

    def reset(self):
        pass
