"""The 8-bit block residual format (`codec`, "Residuals"): the numpy reference against an
independent scalar reading of the spec, its error bound, zeros, slicing, and Feedback states."""
from __future__ import annotations

import math

import numpy as np
import pytest

from echonccl import Feedback, Layout, codec
from echonccl.errors import EchoncclError

F32 = np.float32


def scalar_encode(e: np.ndarray, scale=None, group: int = 32) -> np.ndarray:
    """The spec, one block at a time in Python floats (float64 is exact for these products)."""
    out = bytearray()
    scales = [] if scale is None else [float(v) for v in np.asarray(scale, F32)]
    for r, rec in enumerate(np.asarray(e, F32).reshape(-1, codec.RES_SUPER)):
        mant, exps = [], []
        for k, blk in enumerate(rec.reshape(-1, codec.RES_BLOCK)):
            first = (r * codec.RES_SUPER + k * codec.RES_BLOCK)
            mine = {s for i in range(first, first + codec.RES_BLOCK) if scales
                    for s in [scales[i // group]] if math.isfinite(s)}
            s_exp = max([int(np.array(s, F32).view(np.uint32)) >> 23 for s in mine], default=0)
            amax_bits = max(int(v) & 0x7FFFFFFF for v in blk.view(np.uint32))
            x = min(max(s_exp, (amax_bits >> 23) + 1, 7), 254)
            for v in blk:
                y = float(F32(float(v) * 2.0 ** (133 - x)))      # fl(): one float32 rounding
                m = round(y)                                         # round(): half to even
                assert -64 <= m <= 64 or amax_bits >> 23 == 254
                mant.append(max(-127, min(127, m)) & 0xFF)
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


def sample_scales(rng, n: int, group: int) -> np.ndarray:
    s = (np.exp2(rng.integers(-40, 40, n // group)) * rng.uniform(1, 2, n // group)).astype(F32)
    s[1] = np.nan                                      # a non-finite group
    s[2] = 0                                           # an all-zero group
    s[3] = F32(2.0 ** -133)                            # bfloat16's smallest scale
    s[4] = F32(3e38)
    return s


@pytest.mark.parametrize("group", [16, 32, 64])
def test_encode_matches_an_independent_reading_of_the_spec(group):
    rng = np.random.default_rng(0)
    e = sample(rng, 2048)
    assert np.array_equal(codec.encode_residuals(e), scalar_encode(e))
    s = sample_scales(rng, 2048, group)
    assert np.array_equal(codec.encode_residuals(e, s, group), scalar_encode(e, s, group))


def test_error_bound_and_exact_values():
    rng = np.random.default_rng(1)
    e = sample(rng, 4096)
    r = codec.load_residuals(codec.encode_residuals(e))
    blk = np.abs(e.astype(np.float64)).reshape(-1, 32).max(axis=1).repeat(32)
    err = np.abs(r.astype(np.float64) - e)
    assert np.all(err <= blk / 64 + 2.0 ** -126), float(np.max(err / np.maximum(blk, 1e-300)))
    assert np.mean(err[blk > 1e-30] / blk[blk > 1e-30]) < 1 / 128
    m = rng.integers(-63, 64, 512).astype(F32)           # representable values come back exactly
    exact = (m * F32(2.0 ** -20)).astype(F32)
    exact[::32] = F32(63 * 2.0 ** -20)                  # every block's max sets the same exponent
    assert np.array_equal(codec.load_residuals(codec.encode_residuals(exact)), exact)
    s = np.full(16, F32(2.0 ** -14), F32)              # a scale whose exponent is the block's
    assert np.array_equal(codec.load_residuals(codec.encode_residuals(exact, s, 32)), exact)
    s[0] = F32(2.0 ** -13)                              # one above: the first block loses its last bit
    back = codec.load_residuals(codec.encode_residuals(exact, s, 32))
    assert np.array_equal(back[32:], exact[32:]) and np.all(np.abs(back[:32] - exact[:32]) <= 2.0 ** -20)


@pytest.mark.parametrize("cd", ["int4-h32", "int7-h32"])
def test_a_residual_stays_below_its_scales_power_of_two(cd):
    """The bound the GPU's 16-element loops rely on (codec.py, "Residuals"): for the bfloat16
    scales of the rotated codecs, v - fl(q * scale) has E + 1 <= max(S, 7), so the block's
    exponent is the scale's and needs no maximum over the block."""
    rng = np.random.default_rng(6)
    G = codec.group_size(cd)
    L = codec._LEVELS[cd]
    parts = [rng.standard_normal(1 << 16) * np.exp2(rng.integers(-140, 120, (1 << 16) // G)).repeat(G)]
    # adversarial groups: quotients at k + 1/2, the group's maximum just under a power of two, so
    # that the truncated bfloat16 scale has an all-ones mantissa, tiny and subnormal groups
    k = rng.integers(-L, L, 1 << 14)
    amax = np.exp2(rng.integers(-130, 100, (1 << 14) // G)).repeat(G) * (2 - 2.0 ** -8) * L
    half = (k + 0.5) / L * amax
    half[::G] = amax[::G]
    parts += [half, rng.standard_normal(1 << 12) * 1e-40, rng.standard_normal(1 << 12) * 1e-44]
    v = np.concatenate(parts).astype(F32)
    v = v[: v.size // 512 * 512]
    q, scale = codec.quantize_groups(v, G, cd)
    e = codec.residual_of(v, codec.dequantize_groups(q, scale, G), np.float32)
    E = ((e.view(np.uint32) & 0x7FFFFFFF).reshape(-1, 32).max(axis=1) >> 23).astype(np.int64)
    S = codec.scale_exponents(scale, G).astype(np.int64)
    assert np.all(E + 1 <= np.maximum(S, 7)), int(np.max(E + 1 - np.maximum(S, 7)))
    assert np.any(E + 1 == S)                           # the bound is reached: the test can fail


def test_what_the_encoder_writes_reads_finite_and_other_bytes_are_refused():
    e = sample(np.random.default_rng(2), 2048)
    e[300:332] = F32(3.4e38) * np.sign(np.random.default_rng(3).standard_normal(32)).astype(F32)
    buf = codec.encode_residuals(e, sample_scales(np.random.default_rng(2), 2048, 32), 32)
    codec.check_residual_bytes(buf)
    assert np.isfinite(codec.load_residuals(buf)).all()
    zero = np.zeros(1024, F32)
    assert not codec.load_residuals(codec.encode_residuals(zero)).any()
    for pos, byte, what in ((3, 0x80, "-128"), (512, 6, "exponent"), (528 + 515, 255, "exponent")):
        bad = buf.copy()
        bad[pos] = byte
        with pytest.raises(ValueError, match=what):
            codec.check_residual_bytes(bad)


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
    junk = sd["output"].copy()
    junk[7] = 0x80
    with pytest.raises(EchoncclError, match="output.*-128"):
        again.load_state_dict({**sd, "output": junk}, zeros=np.zeros)
    assert np.array_equal(again.residuals.inputs, st.inputs)     # nothing changed
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
        _, scale = codec.read_wire(w32, L.slice_elems, L.group, L.codec)
        assert np.array_equal(r8, codec.encode_residuals(r32, scale, L.group)), cd
        assert not np.array_equal(r8, codec.encode_residuals(r32)), cd   # the scales set the exponents
        assert math.isfinite(float(np.abs(codec.load_residuals(r8)).max()))
