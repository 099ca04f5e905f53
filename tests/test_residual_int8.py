"""The 8-bit block residual format (`codec`, "Residuals"): the numpy reference against an
independent scalar reading of the spec, its error bound, zeros, slicing, and Feedback states."""
from __future__ import annotations

import math

import numpy as np
import pytest

from echonccl import Feedback, Layout, codec
from echonccl.errors import EchoncclError

F32 = np.float32


def scalar_encode(e: np.ndarray) -> np.ndarray:
    """The spec, one block at a time in Python floats (float64 is exact for these products)."""
    out = bytearray()
    for rec in np.asarray(e, F32).reshape(-1, codec.RES_SUPER):
        mant, exps = [], []
        for blk in rec.reshape(-1, codec.RES_BLOCK):
            amax_bits = max(int(v) & 0x7FFFFFFF for v in blk.view(np.uint32))
            x = max(amax_bits >> 23, 7)
            for v in blk:
                y = float(F32(float(v) * 2.0 ** (133 - x)))      # fl(): one float32 rounding
                m = max(-127, min(127, round(y)))                   # round(): half to even
                mant.append(m & 0xFF)
            exps.append(x)
        out += bytes(mant) + bytes(exps)
    return np.frombuffer(bytes(out), dtype=np.uint8)


def sample(rng, n: int) -> np.ndarray:
    e = rng.standard_normal(n).astype(F32) * np.exp2(rng.integers(-30, 30, n // 32)).repeat(32).astype(F32)
    e[5:37] = 0                                        # an all-zero block
    e[64:96] = np.float32(1e-41) * rng.standard_normal(32).astype(F32)     # subnormals
    e[128:160] = np.clip(rng.standard_normal(32), -3, 3).astype(F32) * F32(1.1e38)   # near the float32 maximum
    e[200] = np.float32(2.0 ** -149)
    return e


def test_encode_matches_an_independent_reading_of_the_spec():
    e = sample(np.random.default_rng(0), 2048)
    assert np.array_equal(codec.encode_residuals(e), scalar_encode(e))


def test_error_bound_and_exact_values():
    rng = np.random.default_rng(1)
    e = sample(rng, 4096)
    r = codec.load_residuals(codec.encode_residuals(e))
    blk = np.abs(e.astype(np.float64)).reshape(-1, 32).max(axis=1).repeat(32)
    err = np.abs(r.astype(np.float64) - e)
    assert np.all(err <= blk / 128 + 2.0 ** -126), float(np.max(err / np.maximum(blk, 1e-300)))
    assert np.mean(err[blk > 1e-30] / blk[blk > 1e-30]) < 1 / 256
    m = rng.integers(-127, 128, 512).astype(F32)         # representable values come back exactly
    exact = (m * F32(2.0 ** -20)).astype(F32)
    exact[::32] = F32(127 * 2.0 ** -20)                 # every block's max sets the same exponent
    assert np.array_equal(codec.load_residuals(codec.encode_residuals(exact)), exact)


def test_zero_bytes_read_as_zeros_and_any_bytes_read_finite():
    assert not codec.load_residuals(np.zeros(1056, np.uint8)).any()
    junk = np.random.default_rng(2).integers(0, 256, 528 * 4, dtype=np.uint8)
    assert np.isfinite(codec.load_residuals(junk)).all()


def test_sizes_and_spans():
    assert codec.residual_size(1024, np.uint8) == 1056
    assert codec.residual_size(1000, np.float32) == 1000
    with pytest.raises(ValueError, match="multiple of 512"):
        codec.residual_size(1000, np.uint8)
    e = sample(np.random.default_rng(3), 2048)
    buf = codec.encode_residuals(e)
    part = codec.residual_span(buf, 512, 1536)
    assert np.array_equal(codec.load_residuals(part), codec.load_residuals(buf)[512:1536])
    assert codec.residual_dtype("int8", np.float16) == np.uint8
    assert codec.residual_dtype("input", np.float16) == np.float16


def test_feedback_int8_states():
    layout = Layout(3000, 2)
    fb = Feedback("int8")
    st = fb.bind((3000, 2, 32, "float16"), layout, np.dtype(np.float16), np.zeros, "int4")
    assert st.inputs.dtype == np.uint8 and st.inputs.size == layout.padded // 512 * 528
    assert st.output.size == layout.slice_elems // 512 * 528
    st.inputs[:] = codec.encode_residuals(sample(np.random.default_rng(4), layout.padded))
    sd = fb.state_dict()
    again = Feedback()
    again.load_state_dict(sd, zeros=np.zeros)
    assert again.residual_dtype == "int8" and np.array_equal(again.residuals.inputs, st.inputs)
    bad = {**sd, "inputs": sd["inputs"].astype(np.float32)}
    with pytest.raises(EchoncclError, match="dtype"):
        Feedback().load_state_dict(bad, zeros=np.zeros)
    with pytest.raises(ValueError, match="residual_dtype"):
        Feedback("int7")


def test_reference_kernel_stores_the_format():
    """reduce_quantize with an int8 residual stores exactly encode(what float32 would store)."""
    from echonccl.kernels_numpy import NumpyKernels

    rng = np.random.default_rng(5)
    for cd in codec.CODECS:
        L = Layout(2048, 1, cd)
        own = rng.standard_normal(L.slice_elems).astype(F32)
        r32 = (rng.standard_normal(L.slice_elems) * 0.01).astype(F32)
        r8 = codec.encode_residuals(r32)
        r32 = codec.load_residuals(r8)               # the same values in both formats
        w32 = np.zeros(L.slice_bytes, np.uint8)
        w8 = np.zeros(L.slice_bytes, np.uint8)
        NumpyKernels().reduce_quantize(L, None, 0, own, r32, w32, "float32")
        NumpyKernels().reduce_quantize(L, None, 0, own, r8, w8, "float32")
        assert np.array_equal(w32, w8), cd
        assert np.array_equal(r8, codec.encode_residuals(r32)), cd
        assert math.isfinite(float(np.abs(codec.load_residuals(r8)).max()))
