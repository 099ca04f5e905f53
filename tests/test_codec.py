"""The wire format and the reference codec (echonccl/codec.py)."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from echonccl import codec
from echonccl.kernels_numpy import NumpyKernels
from echonccl.layout import Layout

S = codec.SLICE_QUANTUM


def roundtrip(v, group):
    return codec.decode(codec.encode(v, group), v.size, group)


def step_of(v, group):
    _, scale = codec.quantize_groups(v.astype(np.float32), group)
    return np.repeat(scale, group)


@pytest.mark.parametrize("group", [32])
@pytest.mark.parametrize("kind", ["normal", "heavy", "outliers", "constant", "alternating"])
def test_roundtrip_within_half_a_step(group, kind):
    rng = np.random.default_rng(0)
    v = {"normal": rng.standard_normal(S),
         "heavy": rng.standard_t(2, S),
         "outliers": rng.standard_normal(S) * np.where(rng.random(S) < 0.01, 100, 1),
         "constant": np.full(S, 3.3),
         "alternating": np.tile([1e4, -1e-4], S // 2)}[kind].astype(np.float32)
    err = np.abs(roundtrip(v, group) - v)
    assert np.all(err <= step_of(v, group) * (0.5 + 1e-6))


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, S, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
       st.just(32))
def test_roundtrip_property(v, group):
    out = roundtrip(v, group)
    assert np.isfinite(out).all()
    # A subnormal scale fl(amax / 7) may fall up to 2^-150 below amax / 7, so amax / scale may
    # pass 7.5 and clip: the bound then gains 7 * 2^-150 (absolute; normal scales are exact to 2^-23).
    slack = 7 * 2.0 ** -150
    assert np.all(np.abs(out.astype(np.float64) - v) <= step_of(v, group).astype(np.float64) * (0.5 + 1e-6) + slack)


def test_wire_layout_and_nibble_order():
    v = np.zeros(S, np.float32)
    v[:4] = [7, -7, 1, -1]
    w = codec.encode(v, 32)
    assert w.size == codec.slice_bytes(S, 32) == S // 2 + 4 * S // 32
    assert w[0] == (7 | (0x9 << 4))           # q=7 low nibble, q=-7 (0b1001) high nibble
    assert w[1] == (1 | (0xF << 4))           # q=1, q=-1 (0b1111)
    assert w[S // 2:S // 2 + 4].view("<f4")[0] == np.float32(1.0)
    assert not np.any((w[:S // 2] & 0x0F) == 8) and not np.any((w[:S // 2] >> 4) == 8)


@pytest.mark.parametrize("cd,group", [("int4", 32), ("int4", 64), ("int4", 128), ("int4-h32", 32), ("int7-h32", 16)])
def test_chunks_hold_their_codes_then_their_scales(cd, group):
    """A slice is its 512-element chunks in order, each its codes' bytes (as `pack_codes` packs
    those 512 codes) then its groups' scales; `read_wire` reads consecutive slices back."""
    n = 3 * S                                             # three chunks a slice, two slices
    rng = np.random.default_rng(group)
    slices = [(rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20)).astype(np.float32) for _ in range(2)]
    wires = [codec.encode(v, group, cd) for v in slices]
    for v, w in zip(slices, wires):
        q, scale = codec.quantize_groups(v, group, cd)
        sbytes = ((scale.view(np.uint32) >> 16).astype("<u2") if cd != "int4" else scale.astype("<f4")).view(np.uint8)
        per = sbytes.size // 3
        want = np.concatenate([np.concatenate([codec.pack_codes(q[c * S:(c + 1) * S], cd), sbytes[c * per:(c + 1) * per]])
                               for c in range(3)])
        assert w.size == codec.slice_bytes(n, group, cd) and np.array_equal(w, want)
    q2, s2 = codec.read_wire(np.concatenate(wires), n, group, cd)
    qs = [codec.quantize_groups(v, group, cd) for v in slices]
    assert np.array_equal(q2, np.concatenate([q for q, _ in qs]))
    assert np.array_equal(s2, np.concatenate([sc for _, sc in qs]))


def test_all_zero_group_is_exact():
    q, scale = codec.quantize_groups(np.zeros(64, np.float32), 32)
    assert np.all(q == 0) and np.all(scale == 0)
    assert np.all(roundtrip(np.zeros(S, np.float32), 32) == 0)


def test_tiny_values_survive():
    v = np.zeros(S, np.float32)
    v[:32] = np.linspace(-1e-30, 1e-30, 32)
    out = roundtrip(v, 32)
    assert np.abs(out[:32]).max() == pytest.approx(1e-30, rel=1e-6)
    assert np.count_nonzero(out[:32]) >= 28


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_huge_values_decode_finite_in_their_dtype(dtype):
    dmax = float(ml_dtypes.finfo(dtype).max)
    v = np.zeros(S, np.float32)
    v[:32] = dmax
    v[32:64] = -dmax
    v[64:96] = np.linspace(-dmax, dmax, 32)
    out = roundtrip(v, 32).astype(dtype).astype(np.float64)
    assert np.isfinite(out).all()
    assert np.all(out[:32] == dmax) and np.all(out[32:64] == -dmax)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_reaches_its_group_only(bad):
    v = np.random.default_rng(1).standard_normal(S).astype(np.float32)
    v[40] = bad
    out = roundtrip(v, 32)
    assert np.isnan(out[32:64]).all()
    assert np.isfinite(np.delete(out, np.s_[32:64])).all()


def test_residual_resets_on_non_finite_and_overflow():
    v = np.array([1.0, np.nan, np.inf, 3e38], np.float32)
    ref = np.array([1.0, 0.0, 1.0, np.inf], np.float32)
    e = codec.residual_of(v, ref, np.float32)
    assert e.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_codes_unpack_inverse():
    q = np.random.default_rng(2).integers(-7, 8, 1024).astype(np.int8)
    assert np.array_equal(codec.unpack_codes(codec.pack_codes(q)), q)


def test_kernel_residual_is_what_rounding_lost():
    """reduce_quantize keeps v - decode(codes), so codes + residual reproduce the input exactly."""
    L = Layout(1000, 1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1000).astype(np.float32)
    e = np.zeros(L.slice_elems, np.float32)
    wire = np.empty(L.slice_bytes, np.uint8)
    NumpyKernels().reduce_quantize(L, None, 0, x, e, wire, "float32")
    dec = codec.decode(wire, L.slice_elems, L.group)
    assert np.array_equal(dec[:1000] + e[:1000], x)
    assert np.all(e[1000:] == 0)


def test_rounding_is_half_to_even():
    v = np.zeros(S, np.float32)
    v[:4] = [7.0, 0.5, 1.5, 2.5]       # scale 1: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    q, scale = codec.quantize_groups(v, 32)
    assert scale[0] == 1.0 and q[:4].tolist() == [7, 0, 2, 2]


def test_layout_slices_cover_the_tensor():
    for count, P in [(0, 2), (1, 3), (513, 2), (100_003, 8)]:
        L = Layout(count, P)
        assert L.slice_elems % codec.SLICE_QUANTUM == 0 and L.padded >= count
        covered = sum(hi - lo for lo, hi in (L.bounds(s) for s in range(P)))
        assert covered == count
        assert L.slice_bytes % 16 == 0


def test_mixed_layout_slices_contributions_and_sums_alike():
    """``int4-h32/int7-h32``: contributions in int4-h32, the owners' sums in int7-h32, one slicing;
    0.39 of a bf16 ring all-reduce's bytes (two-shot int4-h32 alone: 0.28)."""
    assert codec.parts(codec.MIXED) == ("int4-h32", "int7-h32") and codec.parts("int4") == ("int4", "int4")
    assert all(codec.joined(*codec.parts(c)) == c for c in codec.CODECS)
    L = Layout(100_003, 4, codec.MIXED)
    assert (L.codec, L.sum_codec, L.name, L.group) == ("int4-h32", "int7-h32", codec.MIXED, 32)
    S = L.sums
    assert (S.codec, S.name, S.group, S.slice_elems) == ("int7-h32", "int7-h32", 16, L.slice_elems)
    assert (L.slice_bytes, S.slice_bytes) == (L.slice_elems * 9 // 16, L.slice_elems)
    assert L.wire_bytes_per_rank == 3 * (L.slice_bytes + S.slice_bytes)
    bf16_ring = 2 * 3 * L.slice_elems * 2
    assert round(L.wire_bytes_per_rank / bf16_ring, 2) == 0.39
    assert round(Layout(100_003, 4, "int4-h32").wire_bytes_per_rank / bf16_ring, 2) == 0.28
    assert Layout(8, 2, "int4").sums is not None and Layout(8, 2, "int4").sums == Layout(8, 2, "int4")
    with pytest.raises(ValueError):
        Layout(8, 2, "int7-h32/int4-h32")


@pytest.mark.parametrize("cd", codec.WIRE_CODECS)
def test_normal_scales_multiply_by_the_reciprocal_and_never_clip(cd):
    """codec.py's quantizer: for a normal scale q = rint(fl(v * fl(1 / scale))), which stays within
    the codec's levels with no clip (the kernels rely on it: they do not clip there), even where
    truncating the scale to a bfloat16 loses the most (fl(amax / L) just below a bfloat16 step);
    for a subnormal scale q = clip(rint(v / scale)). Against an independent float64 evaluation."""
    group, levels = codec.group_size(cd), {"int7-h32": 63}.get(cd, 7)
    rng = np.random.default_rng(len(cd))
    n = 4096
    # amax / L with a mantissa of all ones below the bfloat16 bits: the largest truncation
    top = (np.float32(levels) * ((rng.integers(100, 140, n) << 23) | 0x7FFF).astype(np.uint32).view(np.float32))
    g = (rng.uniform(-1, 1, (n, group)) * top[:, None]).astype(np.float32)
    g[np.arange(n), rng.integers(0, group, n)] = top * np.where(rng.random(n) < 0.5, -1, 1)
    g[:8] = (rng.uniform(-1, 1, (8, group)) * 2.0 ** -128).astype(np.float32)   # subnormal scales
    g[:8, 0] = np.float32(2.0 ** -128)
    # exact ties v / scale = k + 0.5 (bfloat16 scales: amax = L * scale exactly), where the
    # product by the rounded reciprocal may land on either side
    s16 = (rng.integers(0x3C00, 0x4400, 1024).astype(np.uint32) << 16).view(np.float32)
    k = rng.integers(-levels, levels, (1024, group)) + 0.5
    g[8:1032] = (k * s16[:, None]).astype(np.float32)
    g[8:1032, 0] = np.float32(levels) * s16
    q, scale = codec.quantize_groups(g.reshape(-1), group, cd)
    q = q.reshape(n, group).astype(np.float64)
    s = scale.astype(np.float64)[:, None]
    normal = (scale >= 2.0 ** -126)[:, None]
    with np.errstate(over="ignore"):
        r = (np.float32(1) / scale.astype(np.float32)).astype(np.float64)[:, None]
    y = (g.astype(np.float64) * r).astype(np.float32).astype(np.float64)       # fl(v * fl(1 / scale))
    unclipped = np.rint(np.where(normal, y, g / s))
    assert normal.sum() >= n - 8 and (~normal).sum() == 8
    assert np.abs(unclipped[normal[:, 0]]).max() <= levels
    assert np.array_equal(q, np.clip(unclipped, -levels, levels))
