"""CudaKernels against NumpyKernels, bit for bit (needs cupy and a CUDA device; skipped otherwise).

Every input dtype x residual (none / float32 / input dtype / int8 blocks) x group size, with
incoming wires from the numpy reference (NaN, zero, subnormal and huge scales
included), own contributions full / partial / odd / empty / unaligned, the own
term at every kind of position, residuals fed back over consecutive calls;
then dequantize into every output dtype, full, partial and unaligned.
Equality is on bytes: wire bytes, residual bits, output bits (NaNs included).
Every test runs with every codec (``int4``, the rotated ``int4-h32`` and the 8-bit
``int7-h32``, each with its group sizes); for the rotated ones the huge values stay within its documented range (2**124 here), beyond
which an overflow inside the inverse transform makes a NaN whose payload differs
between numpy and CUDA.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from echonccl import codec
from echonccl.kernels_numpy import NumpyKernels
from echonccl.layout import Layout

cupy = pytest.importorskip("cupy")
try:
    _NDEV = cupy.cuda.runtime.getDeviceCount()
except Exception:  # no driver / no device
    _NDEV = 0
if _NDEV == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from echonccl.kernels_cuda import CudaKernels  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
DTYPES = {"f16": F16, "bf16": BF16, "f32": F32}
UINT = {2: np.uint16, 4: np.uint32}
S = 2048  # 64 groups of 32: room for every adversarial kind
NK = NumpyKernels()
CODEC_GROUPS = [(c, codec.group_size(c)) for c in codec.CODECS]


# ----------------------------------------------------------------- numpy-side helpers
def to_dev(a: np.ndarray):
    """Bit-exact upload (through bytes, whatever the dtype)."""
    a = np.ascontiguousarray(a)
    return cupy.asarray(a.view(np.uint8)).view(a.dtype)


def to_host(d) -> np.ndarray:
    return cupy.asnumpy(d.view(np.uint8)).view(d.dtype)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(UINT[a.dtype.itemsize])


def adversarial_f32(rng, n: int, dtype: np.dtype, group: int, cd: str = "int4") -> np.ndarray:
    """float32 values, one kind of trouble per group, then random normal groups of varied scales."""
    info_max = float(np.finfo(dtype).max) if dtype != BF16 else float(ml_dtypes.finfo(BF16).max)
    if codec.rotated(cd):
        info_max = min(info_max, 2.0 ** 124)
    v = (rng.standard_normal(n) * np.repeat(10.0 ** rng.integers(-4, 4, n // group), group)).astype(np.float32)
    g = [v[i * group:(i + 1) * group] for i in range(n // group)]
    g[0][:] = 0                                            # all zero
    g[1][3] = np.nan                                       # NaN
    g[2][5] = np.inf                                       # +Inf
    g[3][0] = -np.inf                                      # -Inf
    g[4][:] = rng.standard_normal(group) * 1e-30           # tiny (0 or subnormal in 16-bit types)
    g[5][:] = rng.standard_normal(group) * 1e-40           # fp32 / bf16 subnormals
    g[5][::3] = 0
    g[6][:] = info_max * np.sign(rng.standard_normal(group))  # dtype max, both signs
    g[7][:] = rng.standard_normal(group) * 1e-3            # mixed: huge, tiny, -0
    g[7][1], g[7][2], g[7][3] = info_max / 3, -1e-38, -0.0
    g[8][:] = np.resize(np.float32([7, 3.5, 0.5, -2.5, 1.5, -0.5, 2.5, -3.5, 4.5, 5.5, 6.5, -6.5]), group)  # ties
    g[9][:] = -0.0                                         # negative zeros
    g[10][:] = rng.standard_normal(group) * (info_max / 8)  # large: ref rounding / residual may overflow
    g[11][:group // 2] = np.nan
    g[11][group // 2:] = -np.inf
    g[12][:] = 2.0 ** -149 * rng.integers(-9, 10, group)   # scale subnormal: q may clip at 8/7
    g[13][:] = 2.0 ** -149 * rng.integers(-3, 4, group)    # amax / 7 underflows: scale = 2^-149
    g[13][0] = 2.0 ** -149
    return v.reshape(-1, group)[rng.permutation(n // group)].reshape(-1)  # kinds at varied places


def make_own(rng, n: int, dtype, group: int, cd: str = "int4") -> np.ndarray:
    return adversarial_f32(rng, S, dtype, group, cd)[:n].astype(dtype)


def make_incoming(rng, layout: Layout, n_in: int, dtype) -> np.ndarray:
    """n_in slices encoded by the reference (from adversarial data of `dtype`)."""
    B = layout.slice_bytes
    wire = np.zeros(n_in * B, dtype=np.uint8)
    for i in range(n_in):
        NK.reduce_quantize(layout, None, 0, make_own(rng, S, dtype, layout.group, layout.codec), None,
                           wire[i * B:(i + 1) * B], "float32")
    return wire


def make_residual(rng, dtype, kind: str):
    if kind == "none":
        return None
    rdt = F32 if kind == "f32" else dtype
    r = (rng.standard_normal(S) * 0.05).astype(np.float32)
    r[7] = 1e-40
    r[100] = -3.0e4  # large enough to push a float16 sum toward overflow
    if kind == "i8":                     # the 8-bit block format (codec, "Residuals")
        return codec.encode_residuals(r)
    return r.astype(rdt)


def ref_for(dtype, ref: str):
    return "float32" if ref == "f32" else dtype


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype == np.uint8:
        ok = np.array_equal(got, want)
    else:
        ok = np.array_equal(bits(got), bits(want))
    if not ok:
        g, w = (got, want) if got.dtype == np.uint8 else (bits(got), bits(want))
        idx = np.flatnonzero(g != w)
        raise AssertionError(f"{what}: {idx.size} differing elements, first at {idx[:8].tolist()}: "
                             f"got {g[idx[:8]].tolist()} want {w[idx[:8]].tolist()}")


def run_both(ck, layout, incoming, own_pos, own_host, own_offset, residual_host, ref_dtype, case, base=None):
    """One reduce_quantize on both engines from identical inputs; compare; return the new residuals.
    ``base``: None, or (host array, offset) for the refinement rounds' owner base. The output is in
    the sums' codec (`Layout.sums`): a mixed codec's owner, otherwise the layout's own."""
    sums = layout.sums
    B = sums.slice_bytes
    wire_np = np.full(B, 0xAB, dtype=np.uint8)
    res_np = None if residual_host is None else residual_host.copy()
    NK.reduce_quantize(layout, incoming, own_pos, own_host, res_np, wire_np, ref_dtype,
                       None if base is None else base[0], out_layout=sums)

    big = np.zeros(own_host.size + own_offset + 3, dtype=own_host.dtype)
    big[own_offset:own_offset + own_host.size] = own_host
    own_d = to_dev(big)[own_offset:own_offset + own_host.size]
    inc_d = None if incoming is None else to_dev(incoming)
    res_d = None if residual_host is None else to_dev(residual_host)
    wire_d = to_dev(np.full(B, 0x5C, dtype=np.uint8))
    base_d = None
    if base is not None:
        b_host, b_off = base
        base_d = to_dev(np.concatenate([np.zeros(b_off, b_host.dtype), b_host]))[b_off:]
    ck.reduce_quantize(layout, inc_d, own_pos, own_d, res_d, wire_d, ref_dtype, base_d, out_layout=sums)
    cupy.cuda.get_current_stream().synchronize()

    assert_same_bits(to_host(wire_d), wire_np, f"wire {case}")
    if res_np is not None:
        assert_same_bits(to_host(res_d), res_np, f"residual {case}")
    assert_same_bits(to_host(own_d), own_host, f"own unchanged {case}")
    return res_np, wire_np


# ------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ck():
    return CudaKernels()


@pytest.mark.parametrize("res", ["none", "f32", "input", "i8"])
@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("cd,group", CODEC_GROUPS)
def test_reduce_quantize_matches_numpy(ck, dt, res, group, cd):
    dtype = DTYPES[dt]
    rng = np.random.default_rng([ord(c) for c in dt + res] + [group])
    layout = Layout(S, 1, cd)
    refs = ["f32"] if (res == "none" or dtype == F32) else ["f32", "in"]
    cases = [  # (n_in, own_pos, own_n, offset)
        (0, 0, S, 0), (0, 0, 1000, 0), (0, 0, 513, 1), (0, 0, 1, 0), (0, 0, 0, 0), (0, 0, S - 3, 1),
        (1, 1, S, 0), (1, 0, 1000, 1), (1, 1, 0, 0),
        (3, 0, S, 0), (3, 1, 513, 0), (3, 3, 1, 1), (3, 2, S, 1),
    ]
    for ref in refs:
        ref_dtype = ref_for(dtype, ref)
        for n_in, own_pos, own_n, off in cases:
            incoming = None if n_in == 0 else make_incoming(rng, layout, n_in, dtype)
            own = make_own(rng, own_n, dtype, group, cd)
            residual = make_residual(rng, dtype, res)
            case = f"{cd} {dt} res={res} ref={ref} G={group} n_in={n_in} own_pos={own_pos} own_n={own_n} off={off}"
            run_both(ck, layout, incoming, own_pos, own, off, residual, ref_dtype, case)


def tie_slices(rng, layout: Layout) -> np.ndarray:
    """Three wire slices whose sum, in float32, lands on and near half-integers of the owner's
    bfloat16 scale: per group a scale s (a bfloat16, 2^-110 to 2^20) and codes c1 in [1 - L, L - 1],
    the group's first L, then c2 in {-1, 0, 1} at s / 2 (so the sum is (c1 + c2 / 2) s: exact ties, and
    the owner's scale is s), then c3 in {-1, 0, 1} at s * 2^-20 or s * 2^-24 (quotients about
    2^-20 or 2^-24 from a tie)."""
    S, G, cd = layout.slice_elems, layout.group, layout.codec
    L = 63 if codec.wide(cd) else 7
    e = rng.integers(-110, 20, S // G).astype(np.float64)
    s = (rng.integers(128, 256, S // G) * 2.0 ** (e - 7)).astype(np.float32)     # 8 significant bits
    c1 = rng.integers(1 - L, L, S).astype(np.int8)                               # |sum| < L s
    c1[::G] = L
    c2 = rng.integers(-1, 2, S).astype(np.int8)
    c2[::G] = 0
    c3 = rng.integers(-1, 2, S).astype(np.int8)
    c3[::G] = 0
    s3 = (s * np.where(rng.random(S // G) < 0.5, 2.0 ** -20, 2.0 ** -24)).astype(np.float32)
    B = layout.slice_bytes
    wire = np.zeros(3 * B, np.uint8)
    for i, (q, sc) in enumerate(((c1, s), (c2, (s / 2).astype(np.float32)), (c3, s3))):
        codec.write_wire(wire[i * B:(i + 1) * B], q, sc, cd)
    return wire


@pytest.mark.parametrize("dt", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("cd,group", [(c, codec.group_size(c)) for c in codec.WIRE_CODECS if codec.bf16_scales(c)])
def test_ties_of_bfloat16_scales_match_numpy(ck, dt, cd, group):
    """8-bit scales make exact ties of the quotient v / scale common: exact ties, quotients about
    2^-20 and 2^-24 from one (where fl(v * fl(1 / scale)) may round either way), and scales below
    2^-102 must give numpy's codes (codec.quantize_groups) bit for bit; owners of 1-3 incoming
    slices, with and without their own term, residuals fed back. The data is checked to hold
    exact and near ties."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([group, len(dt), len(cd)])
    layout = Layout(S, 1, cd)
    B = layout.slice_bytes
    incoming = tie_slices(rng, layout)
    acc = sum(codec.decode(incoming[i * B:(i + 1) * B], S, group, cd) for i in range(3))
    _, scale = codec.quantize_groups(acc, group, cd)
    z = np.abs(acc.astype(np.float64) / np.repeat(scale.astype(np.float64), group))
    frac = np.abs(z - np.floor(z) - 0.5)
    assert (frac == 0).sum() > S // 8 and ((frac > 0) & (frac < 2.0 ** -16)).sum() > S // 64
    assert ((frac > 0) & (frac < 2.0 ** -21)).any()
    assert (scale[scale > 0] < 2.0 ** -102).any()
    own = np.zeros(S, dtype)                       # an own term that adds nothing, or none (own_n = 0)
    for rdt in (dtype, F32):
        for n_in, own_pos, own_n in ((3, 1, 0), (2, 2, 0), (3, 0, S)):
            res = np.zeros(S, rdt)
            for call in range(2):
                case = f"{cd} {dt} G={group} res={rdt.name} n_in={n_in} own_n={own_n} call={call}"
                res, _ = run_both(ck, layout, incoming[:n_in * B], own_pos, own[:own_n], 0, res, dtype, case)


@pytest.mark.parametrize("res", ["f32", "input", "i8"])
@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("cd,group", CODEC_GROUPS)
def test_reduce_quantize_with_base_matches_numpy(ck, dt, res, group, cd):
    """The owner of a refinement round: ref = round(base + decoded) - base, base being its slice
    of the output so far (adversarial: NaN, Inf, the dtype's max, subnormals), full, partial,
    empty and unaligned."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([group, len(dt), len(res)])
    layout = Layout(S, 1, cd)
    ref_dtype = ref_for(dtype, "in")
    for n_in, base_n, off in [(1, S, 0), (3, S, 1), (1, 1000, 0), (2, 513, 1), (1, 0, 0)]:
        incoming = make_incoming(rng, layout, n_in, dtype)
        residual = make_residual(rng, dtype, res)
        base = make_own(rng, base_n, dtype, group, cd)
        case = f"{cd} {dt} res={res} G={group} n_in={n_in} base_n={base_n} off={off}"
        run_both(ck, layout, incoming, n_in, make_own(rng, 0, dtype, group, cd), 0, residual, ref_dtype, case,
                 base=(base, off))
        if dtype == F32:   # a float32 base: the owner's ref rounded through nothing (rotated both ways)
            run_both(ck, layout, incoming, n_in, make_own(rng, 0, dtype, group, cd), 0,
                     make_residual(rng, dtype, "f32"), "float32", case + " ref=f32", base=(base, off))


@pytest.mark.parametrize("res", ["f32", "input", "i8"])
@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("cd", codec.CODECS)
def test_residual_feedback_over_calls(ck, dt, res, cd):
    """Consecutive calls, each fed the residual the previous one left (both engines' own)."""
    dtype, group = DTYPES[dt], codec.group_size(cd)
    rng = np.random.default_rng(7)
    layout = Layout(S, 1, cd)
    residual = make_residual(rng, dtype, res)
    ref_dtype = ref_for(dtype, "in")
    for step in range(4):
        n_in = step % 3
        incoming = None if n_in == 0 else make_incoming(rng, layout, n_in, dtype)
        own = make_own(rng, S - 7 * step, dtype, group, cd)
        residual, _ = run_both(ck, layout, incoming, n_in, own, step % 2, residual, ref_dtype,
                               f"{cd} {dt} res={res} step={step}")


@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("cd,group", CODEC_GROUPS)
def test_dequantize_matches_numpy(ck, dt, group, cd):
    dtype = DTYPES[dt]
    rng = np.random.default_rng(group)
    layout = Layout(3 * S, 3, cd)
    wire = make_incoming(rng, layout, 3, dtype)
    wire_d = to_dev(wire)
    for count, off in [(3 * S, 0), (3 * S - 5, 0), (2 * S + 1, 1), (S, 1), (1, 0), (0, 0)]:
        want = np.zeros(count, dtype=dtype)
        NK.dequantize(layout, wire, want)
        big = to_dev(np.full(count + off + 4, 77, dtype=dtype))
        out = big[off:off + count]
        ck.dequantize(layout, wire_d, out)
        cupy.cuda.get_current_stream().synchronize()
        host = to_host(big)
        assert_same_bits(host[off:off + count], want, f"dequantize {cd} {dt} G={group} count={count} off={off}")
        guard = np.concatenate([host[:off], host[off + count:]])
        assert (guard == dtype.type(77)).all(), "dequantize wrote outside out"
        assert np.isnan(want.astype(np.float32)).any() or count < S, "the wire should carry NaN groups"


@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("cd,group", CODEC_GROUPS)
def test_dequantize_accumulate_matches_numpy(ck, dt, group, cd):
    """out += decoded (rounds > 1): prior outputs with NaNs of several payloads, Inf, huge and
    subnormal values, against NaN-scale, zero and huge wire groups; full, partial, unaligned."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([group, len(dt)])
    layout = Layout(3 * S, 3, cd)
    wire = make_incoming(rng, layout, 3, dtype)
    wire_d = to_dev(wire)
    for count, off in [(3 * S, 0), (3 * S - 5, 0), (2 * S + 1, 1), (S, 1), (1, 0)]:
        prev = np.concatenate([make_own(rng, S, dtype, group, cd) for _ in range(3)])[:count]
        nan_bits = {2: [0x7c01, 0xfe00, 0x7fc0], 4: [0x7f800001, 0xffc00000, 0x7fc00123]}[dtype.itemsize]
        for i, b in zip(rng.integers(0, count, 3), nan_bits):
            prev[i:i + 1].view(UINT[dtype.itemsize])[0] = b
        want = prev.copy()
        NK.dequantize(layout, wire, want, accumulate=True)
        big = to_dev(np.concatenate([np.full(off, 77, dtype), prev, np.full(4, 77, dtype)]))
        ck.dequantize(layout, wire_d, big[off:off + count], accumulate=True)
        cupy.cuda.get_current_stream().synchronize()
        host = to_host(big)
        assert_same_bits(host[off:off + count], want, f"dequantize accumulate {cd} {dt} G={group} count={count}")
        guard = np.concatenate([host[:off], host[off + count:]])
        assert (guard == dtype.type(77)).all(), "dequantize wrote outside out"


@pytest.mark.parametrize("terms", [2, 3])
@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("cd,group", CODEC_GROUPS)
def test_dequantize_sum_matches_numpy(ck, dt, group, cd, terms):
    """The sum of `terms` wires (one_shot_q's decode): each term's NaN, Inf, zero, subnormal and
    huge groups at other places than the others' (a unit NaN in any term is NaN, the first
    term's bits), written and accumulated, full, partial and unaligned."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([group, terms, len(dt)])
    layout = Layout(2 * S, 2, cd)
    wire = np.concatenate([make_incoming(rng, layout, 2, dtype) for _ in range(terms)])
    wire_d = to_dev(wire)
    for count, off, acc in [(2 * S, 0, False), (2 * S - 5, 0, False), (S + 1, 1, False), (1, 0, False),
                            (2 * S, 0, True), (S + 3, 1, True)]:
        prev = np.concatenate([make_own(rng, S, dtype, group, cd) for _ in range(2)])[:count]
        want = prev.copy()
        NK.dequantize(layout, wire, want, accumulate=acc, terms=terms)
        big = to_dev(np.concatenate([np.full(off, 77, dtype), prev, np.full(4, 77, dtype)]))
        ck.dequantize(layout, wire_d, big[off:off + count], accumulate=acc, terms=terms)
        cupy.cuda.get_current_stream().synchronize()
        host = to_host(big)
        assert_same_bits(host[off:off + count], want, f"dequantize {terms} terms {cd} {dt} G={group} count={count} "
                                                      f"acc={acc}")
        guard = np.concatenate([host[:off], host[off + count:]])
        assert (guard == dtype.type(77)).all(), "dequantize wrote outside out"
    # the same huge group in every term: the float32 sum overflows (int4: a NaN group)
    big = []
    for _ in range(terms):
        x = np.concatenate([make_own(rng, S, dtype, group, cd) for _ in range(2)]).astype(np.float32)
        x[:group] = min(float(ml_dtypes.finfo(dtype).max), 2.0 ** 127)
        part = np.zeros(2 * layout.slice_bytes, np.uint8)
        for v in range(2):
            NK.reduce_quantize(layout, None, 0, x[v * S:(v + 1) * S].astype(dtype), None,
                               part[v * layout.slice_bytes:(v + 1) * layout.slice_bytes], "float32")
        big.append(part)
    want = np.zeros(2 * S, dtype)
    NK.dequantize(layout, np.concatenate(big), want, terms=terms)
    got = to_dev(np.zeros(2 * S, dtype))
    ck.dequantize(layout, to_dev(np.concatenate(big)), got, terms=terms)
    cupy.cuda.get_current_stream().synchronize()
    assert_same_bits(to_host(got), want, f"dequantize {terms} terms {cd} {dt} G={group}: overflowing sum")
    if dtype != F16 and not codec.rotated(cd):
        assert np.isnan(want[:group].astype(F32)).all(), "an overflowing sum is not a NaN group"
    one = np.zeros(2 * S, dtype)
    NK.dequantize(layout, wire[:wire.size // terms], one)
    summed = np.zeros(2 * S, dtype)
    NK.dequantize(layout, np.concatenate([wire[:wire.size // terms], np.zeros(wire.size // terms, np.uint8)]),
                  summed, terms=2)
    assert np.array_equal(summed.astype(F32), one.astype(F32), equal_nan=True), "a term of zeros adds nothing"


@pytest.mark.parametrize("grid", [{"max_blocks": 1}, {"max_blocks": 3}])
@pytest.mark.parametrize("cd", codec.CODECS)
def test_large_slice_grid_stride(cd, grid):
    """A slice bigger than one grid (grids capped at 1 or 3 blocks, as `CudaKernels(max_blocks=)`
    does): the grid-stride loop, several incoming slices."""
    ck1 = CudaKernels(**grid)
    rng = np.random.default_rng(3)
    big_s = 1 << 19
    layout = Layout(big_s * 4, 4, cd)
    assert layout.slice_elems == big_s
    B = layout.slice_bytes
    dtype = BF16
    incoming = np.zeros(3 * B, dtype=np.uint8)
    for i in range(3):
        v = (rng.standard_normal(big_s) * 3).astype(dtype)
        NK.reduce_quantize(layout, None, 0, v, None, incoming[i * B:(i + 1) * B], "float32")
    own = (rng.standard_normal(big_s - 9) * 3).astype(dtype)
    residual = (rng.standard_normal(big_s) * 0.01).astype(np.float32)
    _, wire = run_both(ck1, layout, incoming, 2, own, 0, residual, dtype, f"large {cd} bf16 G=64")
    out_np = np.zeros(big_s * 4 - 100, dtype=dtype)
    sums = layout.sums                   # a mixed codec's owner wrote int7-h32: gather four of it
    gather = np.concatenate([incoming, wire]) if sums is layout else np.tile(wire, 4)
    NK.dequantize(sums, gather, out_np)
    out_d = cupy.zeros(out_np.size, dtype=dtype)
    ck1.dequantize(sums, to_dev(gather), out_d)
    assert_same_bits(to_host(out_d), out_np, "large dequantize")


# Slices for the block-a-thread kernels: bigger than the capped grids below, and one whose 32-element
# blocks end in the middle of a warp (37 * 512 elements: 592 blocks = 18.5 warps).
BLOCK32_SLICES = [1 << 18, 37 * 512]


def adversarial_slice(rng, n: int, dtype) -> np.ndarray:
    """n elements (a multiple of 512) of `make_own`'s adversarial groups (NaN, Inf, huge, tiny...)."""
    return np.concatenate([make_own(rng, S, dtype, 32, "int4-h32") for _ in range(-(-n // S))])[:n]


@pytest.mark.parametrize("grid", [{"max_blocks": 1}, {"max_blocks": 3}])
@pytest.mark.parametrize("dt,res", [("f16", "input"), ("bf16", "input"), ("f16", "f32"), ("bf16", "f32"),
                                    ("f32", "f32")])
@pytest.mark.parametrize("big_s", BLOCK32_SLICES)
def test_block32_owner_grid_stride(dt, res, grid, big_s):
    """reduce_quantize of int4-h32 at G = 32 with the reference in the input's dtype runs one thread
    per 32-element block (reduce_quantize.cuh, reduce_quantize_block32) on whole aligned slices, with
    float32 data staged through shared memory: a slice bigger than its grid or ending inside a warp,
    adversarial own data, 0, 1 and 3 incoming slices, 16-bit and float32 residuals fed back over calls."""
    ck1 = CudaKernels(**grid)
    dtype = DTYPES[dt]
    rng = np.random.default_rng(11)
    layout = Layout(big_s * 4, 4, "int4-h32")
    assert layout.slice_elems == big_s
    residual = (rng.standard_normal(big_s) * 0.01).astype(dtype if res == "input" else F32)
    for n_in, own_pos in [(0, 0), (1, 1), (3, 0), (3, 2)]:
        B = layout.slice_bytes
        incoming = np.zeros(n_in * B, dtype=np.uint8) if n_in else None
        for i in range(n_in):
            NK.reduce_quantize(layout, None, 0, adversarial_slice(rng, big_s, dtype), None,
                               incoming[i * B:(i + 1) * B], "float32")
        own = adversarial_slice(rng, big_s, dtype)
        residual, _ = run_both(ck1, layout, incoming, own_pos, own, 0, residual, dtype,
                               f"block32 {dt} res={res} S={big_s} n_in={n_in} own_pos={own_pos}")


@pytest.mark.parametrize("grid", [{"max_blocks": 1}, {"max_blocks": 3}])
@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("big_s", BLOCK32_SLICES)
def test_block32_dequantize_grid_stride(dt, grid, big_s):
    """int4-h32's dequantize at G = 32 into 16 bits runs one thread per 32-element block
    (dequantize.cuh, dequantize_block32) on whole aligned slices, its output staged through shared
    memory: slices bigger than the grid or ending inside a warp, NaN / Inf groups, plain and
    accumulating (prior outputs with NaNs of several payloads); the last slice cut short and an
    unaligned output take the 8-element loop beside it."""
    ck1 = CudaKernels(**grid)
    dtype = DTYPES[dt]
    rng = np.random.default_rng([big_s, len(dt)])
    layout = Layout(big_s * 2, 2, "int4-h32")
    assert layout.slice_elems == big_s
    B = layout.slice_bytes
    wire = np.zeros(2 * B, dtype=np.uint8)
    for i in range(2):
        NK.reduce_quantize(layout, None, 0, adversarial_slice(rng, big_s, dtype), None, wire[i * B:(i + 1) * B],
                           "float32")
    wire_d = to_dev(wire)
    for count, off in [(2 * big_s, 0), (2 * big_s - 40, 0), (2 * big_s, 1)]:
        for accumulate in (False, True):
            prev = adversarial_slice(rng, 2 * big_s, dtype)[:count]
            for i, b in zip(rng.integers(0, count, 3), [0x7c01, 0xfe00, 0x7fc0]):
                prev[i:i + 1].view(np.uint16)[0] = b
            want = prev.copy()
            NK.dequantize(layout, wire, want, accumulate=accumulate)
            big = to_dev(np.concatenate([np.full(off, 77, dtype), prev, np.full(8, 77, dtype)]))
            ck1.dequantize(layout, wire_d, big[off:off + count], accumulate=accumulate)
            host = to_host(big)
            what = f"block32 dequantize {dt} S={big_s} count={count} off={off} accumulate={accumulate}"
            assert_same_bits(host[off:off + count], want, what)
            assert (np.concatenate([host[:off], host[off + count:]]) == dtype.type(77)).all(), what


def test_no_allocation_and_current_stream(ck):
    """Launches go on the current stream and allocate nothing from cupy's pool."""
    layout = Layout(S, 1)
    own = to_dev(np.ones(S, dtype=F16))
    res = cupy.zeros(S, dtype=np.float32)
    wire = cupy.zeros(layout.slice_bytes, dtype=np.uint8)
    out = cupy.zeros(S, dtype=F16)
    ck.reduce_quantize(layout, None, 0, own, res, wire, F16)  # warm: load the kernels
    ck.dequantize(layout, wire, out)
    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):
            ck.reduce_quantize(layout, None, 0, own, res, wire, F16)
            ck.dequantize(layout, wire, out)
    stream.synchronize()
    assert pool.used_bytes() == used
    assert (to_host(out) == np.float16(1)).all()


def test_argument_checks(ck):
    """Bad views are refused before any launch (an out-of-bounds write would corrupt memory)."""
    layout = Layout(S, 1)
    B = layout.slice_bytes
    own = cupy.zeros(S + 8, dtype=F16)
    res = cupy.zeros(S + 8, dtype=np.float32)
    wire = cupy.zeros(2 * B + 4, dtype=np.uint8)
    with pytest.raises(ValueError):
        ck.reduce_quantize(layout, None, 0, own, None, wire[:B], "float32")          # own too long
    with pytest.raises(ValueError):
        ck.reduce_quantize(layout, None, 0, own[:S], res, wire[:B], "float32")       # residual size
    with pytest.raises(ValueError):
        ck.reduce_quantize(layout, None, 0, own[:S:2], None, wire[:B], "float32")    # strided own
    with pytest.raises(ValueError):
        ck.reduce_quantize(layout, None, 0, own[:S], None, wire[1:B + 1], "float32")  # misaligned wire
    with pytest.raises(ValueError):
        ck.reduce_quantize(layout, wire[:B], 2, own[:S], None, wire[B:2 * B], "float32")  # own_pos > n_in
    with pytest.raises(TypeError):
        ck.reduce_quantize(layout, None, 0, own[:S], res[:S].astype(np.float16).view(BF16), wire[:B], F16)
    with pytest.raises(ValueError):
        ck.dequantize(layout, wire[:B], cupy.zeros(S + 1, dtype=F16))               # wire too short
    mixed = Layout(S, 1, codec.MIXED)
    with pytest.raises(ValueError):     # the owner's int7-h32 sum needs more bytes than a contribution
        ck.reduce_quantize(mixed, None, 0, own[:S], None, wire[:mixed.slice_bytes], "float32", out_layout=mixed.sums)
    with pytest.raises(ValueError):     # no kernel writes int4 from int4-h32 contributions
        ck.reduce_quantize(mixed, None, 0, own[:S], None, wire, "float32", out_layout=Layout(S, 1, "int4"))


@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("cd", ["int4-h32", "int7-h32"])
def test_rotated_partial_last_slice_and_nan_groups(ck, dt, cd):
    """Rotated dequantize of a last slice cut inside a block (the warp-rounded thread count: lanes
    past count still rotate, nothing is written past count), and NaN/Inf poisoning exactly their
    unit: the group of 32 (int4-h32), the block of two groups of 16 (int7-h32)."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng(11)
    layout = Layout(2 * S, 2, cd)
    B = layout.slice_bytes
    wire = np.zeros(2 * B, np.uint8)
    for i in range(2):
        v = (rng.standard_normal(S) * 4).astype(dtype)
        v[64 * (i + 1) + 3] = np.nan if i else np.inf
        NK.reduce_quantize(layout, None, 0, v, None, wire[i * B:(i + 1) * B], "float32")
    for count in (S + 1, S + 13, S + 40, 2 * S - 1, 2 * S - 33):
        want = np.zeros(count, dtype)
        NK.dequantize(layout, wire, want)
        big = to_dev(np.full(count + 40, 77, dtype))
        ck.dequantize(layout, to_dev(wire), big[:count])
        host = to_host(big)
        assert_same_bits(host[:count], want, f"{cd} {dt} count={count}")
        assert (host[count:] == dtype.type(77)).all(), "dequantize wrote past count"
        nan = np.isnan(want.astype(np.float32))
        assert nan[64:96].all() and nan.sum() == 32 + min(32, max(0, count - S - 128)), "NaN not exactly its group"
