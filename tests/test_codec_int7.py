"""The 8-bit accuracy codec ``int7-h32`` (codec.py, "int7-h32"): its wire layout, bit by bit,
its scale rule, decoding never past a group's largest magnitude, and NaN/Inf poisoning exactly
their rotation block, in the numpy reference (the CUDA kernels are held to it in
tests/test_gpu_kernels.py)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echonccl import codec
from echonccl.kernels_numpy import NumpyKernels
from echonccl.layout import Layout

I7 = "int7-h32"


def test_groups_and_slice_bytes():
    assert codec.group_size(I7) == 16 and Layout(512, 1, I7).group == 16
    assert codec.group_size("int4-h32") == codec.group_size("int4") == 32
    assert codec.slice_bytes(512, 16, I7) == 512                       # exactly 8 bits an element
    assert Layout(5000, 2, I7).slice_bytes == Layout(5000, 2, I7).slice_elems
    with pytest.raises(ValueError, match="codec"):
        codec.group_size("int8")


def test_wire_layout_bit_by_bit():
    S = 1024   # two chunks of 512 elements, 512 bytes each
    q = np.random.default_rng(0).integers(-63, 64, S).astype(np.int8)
    scale = np.float32(2.0 ** (np.arange(S // 16) % 64 - 20) * 0.75)
    wire = np.zeros(S, np.uint8)
    codec.write_wire(wire, q, scale, I7)
    u = q.astype(int) + 63
    for i in range(S):
        c, k = 512 * (i // 512), i % 512
        j, odd = (k % 8) // 2, k % 2
        assert (wire[c + k // 2] >> (4 * odd)) & 0xF == u[i] & 0xF
        assert (wire[c + 256 + 2 * (k // 8) + odd] >> (2 * j)) & 3 == (u[i] >> 4) & 3
        assert (wire[c + 384 + k // 8] >> (j + 4 * odd)) & 1 == u[i] >> 6
    sc = np.ascontiguousarray(wire.reshape(2, 512)[:, 448:]).reshape(-1).view("<u2")
    assert np.array_equal((sc.astype(np.uint32) << 16).view(np.float32), scale)
    q2, s2 = codec.read_wire(wire, S, 16, I7)
    assert np.array_equal(q2, q) and np.array_equal(s2, scale)


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(-149, 127), st.booleans())
def test_scale_rule_and_decode_within_amax(seed, e, ties):
    rng = np.random.default_rng(seed)
    v = np.clip(rng.standard_normal(64) * 2.0 ** e, -3e38, 3e38).astype(np.float32)
    if ties:
        v[::7] = np.float32(2.0 ** min(e, 120))
    q, scale = codec.quantize_groups(v, 16, I7)
    g = v.reshape(-1, 16)
    amax = np.abs(g).max(axis=1)
    trunc = ((amax / np.float32(63)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    want = np.where(amax > 0, np.maximum(trunc, np.float32(2.0 ** -133)), 0)
    assert np.array_equal(scale, want.astype(np.float32))
    assert np.all(np.abs(q) <= 63)
    d = codec.dequantize_groups(q, scale, 16).reshape(-1, 16)
    assert np.isfinite(d).all() and np.all(np.abs(d).max(axis=1) <= amax * (1 + 2.0 ** -23))
    normal = scale >= 2.0 ** -126
    err = np.abs(d.astype(np.float64) - g)[normal]
    assert np.all(err <= scale[normal, None].astype(np.float64) * (0.5 + 2.0 ** -20))


def test_float16_max_decodes_finite():
    """Truncating the scale keeps the dtype's largest value finite through the whole call."""
    L = Layout(512, 1, I7)
    x = np.zeros(512, np.float16)
    x[3], x[40] = np.float16(65504), np.float16(-65504)
    wire, out = np.zeros(L.slice_bytes, np.uint8), np.zeros(512, np.float16)
    NumpyKernels().reduce_quantize(L, None, 0, x, None, wire, "float32")
    NumpyKernels().dequantize(L, wire, out)
    assert np.isfinite(out.astype(np.float32)).all()
    assert abs(float(out[3]) - 65504) <= 65504 / 63 and abs(float(out[40]) + 65504) <= 65504 / 63


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_nan_poisons_its_block_of_two_groups(dtype):
    L = Layout(1024, 1, I7)
    x = (np.random.default_rng(1).standard_normal(1024)).astype(dtype)
    x[70] = np.nan                           # group 4 (64..79): block 2 (64..95)
    x[300] = np.inf                          # group 18 (288..303): block 9 (288..319)
    wire, out = np.zeros(L.slice_bytes, np.uint8), np.zeros(1024, dtype)
    NumpyKernels().reduce_quantize(L, None, 0, x, None, wire, "float32")
    _, scale = codec.read_wire(wire, 1024, 16, I7)
    assert np.flatnonzero(np.isnan(scale)).tolist() == [4, 5, 18, 19]
    NumpyKernels().dequantize(L, wire, out)
    bad = ~np.isfinite(out.astype(np.float32))
    assert np.flatnonzero(bad).tolist() == list(range(64, 96)) + list(range(288, 320))
    ref = np.array(np.nan, np.float32).astype(dtype)
    assert out[bad].view(f"u{out.itemsize}").tolist() == [ref.view(f"u{out.itemsize}")] * 64


def test_communicator_state_round_trip_and_group():
    """A one-rank CPU communicator of int7-h32: group 16 by default, a wrong group refused before
    anything runs, its Feedback state saved and loaded, and refused by an int4-h32 communicator."""
    import echonccl
    from mpi4py import MPI

    from echonccl.errors import EchoncclError

    fb = echonccl.Feedback()
    fb.bind((3000, 2, 16, "float32"), Layout(3000, 2, I7), np.dtype(np.float32), np.zeros, I7)
    fb.residuals.inputs[:] = 0.125
    sd = fb.state_dict()
    assert sd["codec"] == I7
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", codec=I7) as c:
        assert c.group_size == 16
        loaded = c.load_feedback(sd)
        assert loaded.codec == I7 and np.all(loaded.residuals.inputs == 0.125)
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as c:
        with pytest.raises(EchoncclError, match="codec"):
            c.load_feedback(sd)
