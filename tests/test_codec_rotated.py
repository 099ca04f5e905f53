"""The rotated codec ``int4-h32`` (codec.py): its transform, its kernels' semantics, its state and its API."""
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import echonccl
from echonccl import codec
from echonccl.errors import EchoncclError
from echonccl.kernels_numpy import NumpyKernels
from echonccl.layout import Layout

NK = NumpyKernels()
BF16 = np.dtype(ml_dtypes.bfloat16)
H32 = "int4-h32"


def hadamard_matrix(n=32):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def signs():
    return np.array([-1.0 if (codec.ROT_SIGNS >> i) & 1 else 1.0 for i in range(32)])


def test_rotation_is_the_signed_hadamard_and_inverts():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(32 * 40) * np.repeat(2.0 ** rng.integers(-20, 20, 40), 32)).astype(np.float32)
    H, s = hadamard_matrix(), signs()
    want = (x.astype(np.float64).reshape(-1, 32) * s) @ H.T / 32
    y = codec.rotate(x)
    amax = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
    assert np.all(np.abs(y.reshape(-1, 32) - want) <= 2.0 ** -20 * amax)
    back = codec.unrotate(y)
    assert np.all(np.abs(back.reshape(-1, 32) - x.reshape(-1, 32)) <= 2.0 ** -19 * amax)
    # a one-hot power of two rotates exactly to +-2**-5 times it: the 1/32 and the signs are exact
    e = np.zeros(64, np.float32)
    e[5], e[32 + 17] = 4.0, -0.5
    y = codec.rotate(e)
    assert np.array_equal(np.abs(y[:32]), np.full(32, np.float32(4.0 / 32)))
    assert np.array_equal(y[:32], (H[:, 5] * s[5] * 4.0 / 32).astype(np.float32))
    assert np.array_equal(codec.unrotate(y), e)
    assert np.array_equal(codec.residual_values(codec.rotate(e), H32), e.astype(np.float64))


def _round_trip(v, layout, out_dtype=np.float32):
    wire = np.zeros(layout.slice_bytes, np.uint8)
    NK.reduce_quantize(layout, None, 0, v, None, wire, np.float32)
    out = np.zeros(v.size, out_dtype)
    NK.dequantize(layout, wire, out)
    return wire, out


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
def test_nonfinite_poisons_exactly_its_group(bad, dtype):
    group = 32
    L = Layout(1024, 1, H32)
    v = np.random.default_rng(1).standard_normal(1024).astype(np.float32)
    at = 3 * group + 7
    v[at] = bad
    wire, out = _round_trip(v, L, dtype)
    g = np.arange(1024) // group == at // group
    assert np.isnan(out.astype(np.float32)[g]).all(), "the group of the NaN/Inf is not all NaN"
    assert np.isfinite(out.astype(np.float32)[~g]).all(), "a neighbouring group was poisoned"
    # the same NaN bits as the int4 codec writes for a NaN group (the scale's NaN)
    _, ref = _round_trip(v, Layout(1024, 1), dtype)
    assert out[g].tobytes() == ref[g].tobytes()


@pytest.mark.parametrize("group", [16, 32])
def test_bfloat16_scales_layout_rule_and_range(group):
    """int4-h32's scales (codec.py, "int4-h32's scales"): a bfloat16 per group after the S/2 code
    bytes, amax / 7 truncated (at least 2**-133), 0x7FC0 for a non-finite group; decoded values
    never exceed their group's largest magnitude, and float16's largest value stays finite."""
    S = 1024
    assert codec.slice_bytes(S, group, H32) == S // 2 + 2 * (S // group)
    assert codec.slice_bytes(S, group, "int4") == S // 2 + 4 * (S // group)
    rng = np.random.default_rng(group)
    e = rng.integers(-149, 128, S // group)
    v = np.clip(rng.standard_normal(S) * np.repeat(2.0 ** e, group), -3e38, 3e38).astype(np.float32)
    v[:group] = 0
    v[group + 3] = np.nan
    q, scale = codec.quantize_groups(v, group, H32)
    g = np.where(np.isfinite(v), v, 0).reshape(-1, group)
    amax = np.abs(g).max(axis=1)
    trunc = ((amax / np.float32(7)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    want = np.where(amax > 0, np.maximum(trunc, np.float32(2.0 ** -133)), 0).astype(np.float32)
    want[1] = np.nan
    assert np.array_equal(scale, want, equal_nan=True) and np.all(np.abs(q) <= 7)
    wire = np.zeros(codec.slice_bytes(S, group, H32), np.uint8)
    codec.write_wire(wire, q, scale, H32)
    bits = np.ascontiguousarray(wire.reshape(S // 512, -1)[:, 256:]).reshape(-1).view("<u2")   # each chunk's scales
    assert bits[1] == 0x7FC0 and np.array_equal(bits[2:], (want[2:].view(np.uint32) >> 16).astype(np.uint16))
    q2, s2 = codec.read_wire(wire, S, group, H32)
    assert np.array_equal(q2, q) and np.array_equal(s2, scale, equal_nan=True)
    d = codec.dequantize_groups(q, scale, group).reshape(-1, group)[2:]
    assert np.all(np.abs(d) <= amax[2:, None])
    normal = scale[2:] >= 2.0 ** -126
    err = np.abs(d.astype(np.float64) - g[2:])[normal]
    assert np.all(err <= scale[2:][normal, None].astype(np.float64) * (0.5 + 2.0 ** -20))
    L = Layout(512, 1, H32)
    x = np.zeros(512, np.float16)
    x[3], x[40] = np.float16(65504), np.float16(-65504)
    wire, out = np.zeros(L.slice_bytes, np.uint8), np.zeros(512, np.float16)
    NK.reduce_quantize(L, None, 0, x, None, wire, "float32")
    NK.dequantize(L, wire, out)
    assert np.isfinite(out.astype(np.float32)).all()


def test_rotation_beats_int4_on_outliers_and_stays_within_its_bound():
    rng = np.random.default_rng(2)
    v = rng.standard_normal(1 << 14).astype(np.float32)
    v[rng.integers(0, v.size, 200)] *= 30                   # outliers, one per few groups
    errs = {}
    for name in codec.CODECS:
        _, out = _round_trip(v, Layout(v.size, 1, name))
        errs[name] = float(np.linalg.norm(out - v) / np.linalg.norm(v))
    assert errs[H32] < 0.6 * errs["int4"], errs
    assert errs["int7-h32"] < errs[H32] / 8, errs            # 63 levels against 7
    amax = np.repeat(np.abs(v.reshape(-1, 32)).max(axis=1), 32)
    _, out = _round_trip(v, Layout(v.size, 1, H32))
    assert np.all(np.abs(out - v) <= 32 * amax / 14 * (1 + 2.0 ** -10))
    # int7-h32: half a step of a scale no larger than amax / 63, 32 of them per element
    _, out = _round_trip(v, Layout(v.size, 1, "int7-h32"))
    assert np.all(np.abs(out - v) <= 32 * amax / 126 * (1 + 2.0 ** -10))


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_owner_residual_is_what_the_output_holds_rotated(dtype):
    """ref_dtype rounding and the base of a refinement round are measured in the values' domain
    and fed back rotated: residual == acc - rotate(out - base) (base 0 without accumulate)."""
    L = Layout(1024, 1, H32)
    rng = np.random.default_rng(3)
    inc = np.zeros(L.slice_bytes, np.uint8)
    NK.reduce_quantize(L, None, 0, (rng.standard_normal(1024) * 1e-2).astype(np.float32), None, inc, np.float32)
    acc = codec.decode(inc, 1024, 32, H32)
    for base in (None, (rng.standard_normal(1024) * 30).astype(dtype)):
        res = np.zeros(1024, np.float32)
        wire = np.zeros(L.slice_bytes, np.uint8)
        NK.reduce_quantize(L, inc, 1, np.zeros(0, dtype), res, wire, np.dtype(dtype), base)
        b = np.zeros(1024, dtype) if base is None else base.copy()
        out = b.copy()
        NK.dequantize(L, wire, out, accumulate=True)
        added = out.astype(np.float32) - b.astype(np.float32)
        want = acc - (codec.decode(wire, 1024, 32, H32) if base is None and dtype == np.float32
                      else codec.rotate(added))
        assert np.array_equal(res, want)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_accumulate_adds_the_unrotated_sum_once(dtype):
    L = Layout(1024, 1, H32)
    rng = np.random.default_rng(4)
    v = rng.standard_normal(1024).astype(np.float32)
    wire = np.zeros(L.slice_bytes, np.uint8)
    NK.reduce_quantize(L, None, 0, v, None, wire, np.float32)
    decoded = codec.unrotate(codec.decode(wire, 1024, 32, H32))
    prev = rng.standard_normal(1024).astype(dtype)
    out = prev.copy()
    NK.dequantize(L, wire, out, accumulate=True)
    assert out.tobytes() == (prev.astype(np.float32) + decoded).astype(dtype).tobytes()


# -- API and feedback state --------------------------------------------------------------------
def test_codec_option_environment_and_errors(monkeypatch):
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", codec=H32) as c:
        assert c.config.codec == H32
    monkeypatch.setenv("ECHONCCL_CODEC", "int4")
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", codec=H32) as c:
        assert c.config.codec == "int4"                         # the environment overrides
    monkeypatch.setenv("ECHONCCL_CODEC", "fp4")
    with pytest.raises(ValueError, match="codec must be one of"):
        echonccl.Communicator(MPI.COMM_SELF, engine="cpu")
    with pytest.raises(ValueError, match="codec must be one of"):
        Layout(100, 1, "int8")


def _bound(codec_name, count=1000):
    fb = echonccl.Feedback()
    fb.bind((count, 2, 32, "float32"), Layout(count, 2, codec_name), np.dtype(np.float32),
            np.zeros, codec_name)
    fb.residuals.inputs[:] = 0.25
    return fb


def test_state_records_codec_and_version_and_other_codecs_are_refused():
    fb = _bound(H32)
    sd = fb.state_dict()
    assert sd["codec"] == H32 and sd["version"] == echonccl.Feedback.STATE_VERSION
    with pytest.raises(EchoncclError, match="codec"):
        fb.check_key((1000, 2, 32, "float32"), "int4")          # a call with the other codec
    fresh = echonccl.Feedback()
    fresh.load_state_dict(sd, zeros=np.zeros)
    assert fresh.codec == H32 and np.all(fresh.residuals.inputs == 0.25)
    with pytest.raises(EchoncclError, match="codec"):
        _bound("int4").load_state_dict(sd)                      # into a state bound to int4
    old = {k: v for k, v in _bound("int4").state_dict().items() if k not in ("codec", "version")}
    legacy = echonccl.Feedback()
    legacy.load_state_dict(old, zeros=np.zeros)                 # a state from before codecs: int4
    assert legacy.codec == "int4"
    with pytest.raises(EchoncclError, match="version"):
        echonccl.Feedback().load_state_dict({**sd, "version": 99}, zeros=np.zeros)
    with pytest.raises(EchoncclError, match="codec"):
        echonccl.Feedback().load_state_dict({**sd, "codec": "fp4"}, zeros=np.zeros)


def test_communicator_refuses_a_state_of_another_codec():
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", codec="int4") as c:
        with pytest.raises(EchoncclError, match="codec 'int4-h32'"):
            c.load_feedback(_bound(H32).state_dict())
        fb = c.load_feedback(_bound("int4").state_dict())
        assert fb.codec == "int4"
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", codec=H32) as c:
        assert c.load_feedback(_bound(H32).state_dict()).codec == H32
        with pytest.raises(EchoncclError, match="codec"):
            c.load_feedback(_bound("int4").state_dict())
