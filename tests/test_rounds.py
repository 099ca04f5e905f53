"""`rounds`: the accumulating dequantize of the numpy reference, and the API's checks (P = 1)."""
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import echonccl
from echonccl import codec
from echonccl.kernels_numpy import NumpyKernels
from echonccl.layout import Layout

NK = NumpyKernels()
BF16 = np.dtype(ml_dtypes.bfloat16)


def _wire(values: np.ndarray, layout: Layout) -> np.ndarray:
    wire = np.zeros(layout.slice_bytes, np.uint8)
    NK.reduce_quantize(layout, None, 0, values, None, wire, np.float32)
    return wire


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_accumulate_adds_in_float32_and_rounds_once(dtype):
    layout = Layout(1024, 1)
    rng = np.random.default_rng(1)
    wire = _wire(rng.standard_normal(1024).astype(np.float32), layout)
    decoded = codec.decode(wire, layout.slice_elems, 32)
    prev = rng.standard_normal(1024).astype(dtype)
    out = prev.copy()
    NK.dequantize(layout, wire, out, accumulate=True)
    want = (prev.astype(np.float32) + decoded).astype(dtype)
    assert out.tobytes() == want.tobytes()
    assert out.tobytes() != prev.tobytes()


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_accumulate_keeps_nan_bits_and_writes_nan_groups(dtype):
    layout = Layout(1024, 1)
    v = np.ones(1024, np.float32)
    v[40] = np.inf                                          # group 1 has a NaN scale on the wire
    wire = _wire(v, layout)
    bits = np.uint32 if np.dtype(dtype).itemsize == 4 else np.uint16
    out = np.zeros(1024, dtype)
    payload = np.array([0x7f800001 if bits is np.uint32 else 0x7c01 if dtype == np.float16 else 0x7f81],
                       bits).view(dtype)[0]                  # a signalling-type payload, not numpy's default
    out[3] = payload                                         # group 0: a NaN already in out
    out[33] = payload                                        # group 1: overwritten by the group's NaN
    NK.dequantize(layout, wire, out, accumulate=True)
    assert out[3:4].view(bits)[0] == np.array([payload]).view(bits)[0], "NaN in out lost its bits"
    nan_alone = np.zeros(1024, dtype)
    NK.dequantize(layout, wire, nan_alone)
    assert out[32:64].tobytes() == nan_alone[32:64].tobytes(), "a NaN group is written as without accumulate"
    assert np.all(out[64:] == nan_alone[64:])


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_owner_base_feeds_back_the_rounding_of_the_accumulation(dtype):
    """With ``base`` (its slice of out), the owner's residual is measured against what
    dequantize(accumulate=True) really adds: base + decoded, rounded to the output dtype."""
    layout = Layout(1024, 1)
    rng = np.random.default_rng(3)
    incoming = _wire(rng.standard_normal(1024).astype(np.float32) * 1e-2, layout)
    base = (rng.standard_normal(1024) * 30).astype(dtype)
    res_with, res_without = np.zeros(1024, np.float32), np.zeros(1024, np.float32)
    wire = np.zeros(layout.slice_bytes, np.uint8)
    NK.reduce_quantize(layout, incoming, 1, np.zeros(0, dtype), res_with, wire, np.dtype(dtype), base)
    NK.reduce_quantize(layout, incoming, 1, np.zeros(0, dtype), res_without, wire, np.dtype(dtype))
    out = base.copy()
    NK.dequantize(layout, wire, out, accumulate=True)
    acc = codec.decode(incoming, 1024, 32)
    added = out.astype(np.float32) - base.astype(np.float32)
    assert np.array_equal(res_with, acc - added), "residual is not what the accumulation left out"
    if np.dtype(dtype) != np.float32:
        assert not np.array_equal(res_with, res_without), "the rounding of out should matter here"


@pytest.fixture
def comm():
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as c:
        yield c


@pytest.mark.parametrize("bad", [0, 5, True, 1.5, "2"])
def test_bad_rounds_are_named(comm, bad):
    with pytest.raises(ValueError, match="rounds must be an int from 1 to 4"):
        comm.all_reduce(np.ones(8, np.float32), rounds=bad)


def test_rounds_need_feedback(comm):
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="needs feedback"):
        comm.all_reduce(x, feedback=False, rounds=2)
    off = comm.new_feedback()
    off.enabled = False
    with pytest.raises(ValueError, match="needs feedback"):
        comm.all_reduce(x, feedback=off, rounds=2)
    assert comm.all_reduce(x, algorithm="nccl", rounds=2).tobytes() == x.tobytes()   # exact: nothing to refine


def test_environment_sets_rounds_for_calls_with_feedback(monkeypatch):
    monkeypatch.setenv("ECHONCCL_ROUNDS", "2")
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as c:
        assert c.config.rounds == 2
        x = np.ones(8, np.float32)
        assert c.all_reduce(x, feedback=False).tobytes() == x.tobytes()     # no feedback: one round
        assert c._rounds(None, None, "two_shot") == 2
        assert c._rounds(None, False, "two_shot") == 1
    monkeypatch.setenv("ECHONCCL_ROUNDS", "9")
    with pytest.raises(ValueError, match="rounds must be an int from 1 to 4"):
        echonccl.Communicator(MPI.COMM_SELF, engine="cpu")
