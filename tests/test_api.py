"""The Communicator and Feedback API in one process (P = 1, MPI.COMM_SELF) on the CPU engine."""
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import echonccl
from echonccl import EchoncclError


@pytest.fixture
def comm():
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as c:
        yield c


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_single_rank_returns_input_unchanged(comm, dtype):
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(dtype)
    y = comm.all_reduce(x)
    assert y is not x and y.tobytes() == x.tobytes() and y.shape == x.shape
    z = comm.all_reduce(x, x)
    assert z is x


def test_rejects_non_float_dtype(comm):
    with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
        comm.all_reduce(np.arange(10))


def test_rejects_non_contiguous(comm):
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.all_reduce(np.zeros((4, 4), np.float32)[:, ::2])


def test_rejects_mismatched_and_partly_overlapping_out(comm):
    x = np.zeros(1024, np.float32)
    with pytest.raises(ValueError, match="must match"):
        comm.all_reduce(x, np.zeros(1024, np.float16))
    with pytest.raises(ValueError, match="overlaps x partly"):
        comm.all_reduce(x[:512], x[256:768])


def test_empty_input_gives_empty_output(comm):
    y = comm.all_reduce(np.zeros(0, np.float32))
    assert y.size == 0


def test_dtypes_by_name_dtype_or_scalar_type(comm):
    from echonccl import dtypes
    for d in (np.float32, np.dtype(np.float32), "float32", "float"):
        assert dtypes.canonical(d) == "float32"
    assert dtypes.canonical(ml_dtypes.bfloat16) == dtypes.canonical("bf16") == "bfloat16"
    assert comm.default_feedback(8, np.float16) is comm.default_feedback(8, "float16")
    for bad in (np.float64, "int8", object()):
        with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
            dtypes.canonical(bad)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="codec"):
        echonccl.Communicator(MPI.COMM_SELF, engine="cpu", codec="int5")
    with pytest.raises(TypeError, match="group_size"):      # the codec fixes it
        echonccl.Communicator(MPI.COMM_SELF, engine="cpu", group_size=32)
    with pytest.raises(ValueError, match="algorithm"):
        echonccl.Communicator(MPI.COMM_SELF, engine="cpu", algorithm="tree")


def test_environment_overrides_keywords(monkeypatch):
    monkeypatch.setenv("ECHONCCL_CODEC", "int7-h32")
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", codec="int4") as c:
        assert c.config.codec == "int7-h32" and c.group_size == 16


def test_closed_communicator_refuses(comm):
    comm.close()
    with pytest.raises(EchoncclError, match="closed"):
        comm.all_reduce(np.zeros(4, np.float32))


def test_feedback_binds_to_one_layout():
    L = echonccl.Layout(1000, 2)
    fb = echonccl.Feedback()
    res = fb.bind((1000, 2, 32, "float32"), L, np.dtype(np.float32), np.zeros)
    assert res.inputs.shape == (L.padded,) and res.output.shape == (L.slice_elems,)
    with pytest.raises(EchoncclError, match="bound to"):
        fb.bind((2000, 2, 32, "float32"), echonccl.Layout(2000, 2), np.dtype(np.float32), np.zeros)


def test_feedback_reset_save_load_and_off():
    L = echonccl.Layout(1000, 2)
    key = (1000, 2, 32, "bfloat16")
    fb = echonccl.Feedback(residual_dtype="input")
    res = fb.bind(key, L, np.dtype(ml_dtypes.bfloat16), np.zeros)
    assert res.inputs.dtype == ml_dtypes.bfloat16
    res.inputs[:] = 1.5
    saved = fb.state_dict()
    fb.reset()
    assert not res.inputs.astype(np.float32).any()
    fb.load_state_dict(saved)
    assert np.all(res.inputs.astype(np.float32) == 1.5)
    fresh = echonccl.Feedback()
    fresh.load_state_dict(saved, zeros=np.zeros)
    assert fresh.key == key and np.all(fresh.residuals.inputs.astype(np.float32) == 1.5)
    off = echonccl.Feedback(enabled=False)
    assert off.bind(key, L, np.dtype(ml_dtypes.bfloat16), np.zeros) is None


def test_feedback_rounding_option(monkeypatch):
    with pytest.raises(ValueError, match="rounding"):
        echonccl.Feedback(rounding=1)
    L, key, bf16 = echonccl.Layout(1000, 2), (1000, 2, 32, "bfloat16"), np.dtype(ml_dtypes.bfloat16)
    fb = echonccl.Feedback(rounding=False)
    res = fb.bind(key, L, bf16, np.zeros)
    assert res.rounding is False
    assert res.owner_ref(bf16, accumulate=False) == "float32" and res.owner_ref(bf16, accumulate=True) == bf16
    saved = fb.state_dict()
    assert saved["rounding"] is False
    assert echonccl.Feedback().rounding is False
    fresh = echonccl.Feedback(rounding=True)
    fresh.load_state_dict(saved, zeros=np.zeros)
    assert fresh.rounding is False and fresh.residuals.rounding is False
    older = {k: v for k, v in saved.items() if k != "rounding"}      # a state saved before the option
    fresh.load_state_dict(older)
    assert fresh.rounding is True and fresh.residuals.rounding is True
    with pytest.raises(EchoncclError, match="rounding"):
        fresh.load_state_dict({**saved, "rounding": "no"})
    assert fresh.rounding is True
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as c:
        assert c.config.feedback_rounding is False and c.new_feedback().rounding is False
    monkeypatch.setenv("ECHONCCL_FEEDBACK_ROUNDING", "1")
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as c:
        assert c.config.feedback_rounding is True and c.new_feedback().rounding is True
        assert c.new_feedback(rounding=False).rounding is False
        assert c.default_feedback(8, "float32").rounding is True
    monkeypatch.setenv("ECHONCCL_FEEDBACK_ROUNDING", "maybe")
    with pytest.raises(ValueError, match="ECHONCCL_FEEDBACK_ROUNDING"):
        echonccl.Communicator(MPI.COMM_SELF, engine="cpu")


def test_prepared_call_expires_when_the_feedback_rounding_changes():
    from echonccl.communicator import _Prepared
    L, key = echonccl.Layout(64, 2), (64, 2, 32, "bfloat16")
    fb = echonccl.Feedback(rounding=True)
    fb.bind(key, L, np.dtype(ml_dtypes.bfloat16), np.zeros)
    prep = _Prepared(None, None, feedback=fb)
    assert prep.ready()
    fb.load_state_dict({**fb.state_dict(), "rounding": False})    # same residual buffers, other option
    assert fb.residuals.rounding is False and not prep.ready()


def test_unbound_load_needs_allocator():
    fb = echonccl.Feedback()
    fb.bind((10, 2, 32, "float32"), echonccl.Layout(10, 2), np.dtype(np.float32), np.zeros)
    with pytest.raises(EchoncclError, match="allocator"):
        echonccl.Feedback().load_state_dict(fb.state_dict())


def test_choose_algorithm_resolves_auto_by_size(monkeypatch):
    monkeypatch.delenv("ECHONCCL_ALGO", raising=False)
    monkeypatch.delenv("ECHONCCL_CROSSOVER_BYTES", raising=False)
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", crossover_bytes=1000) as c:
        assert c.choose_algorithm(999) == "nccl" and c.choose_algorithm(999, "auto") == "nccl"
        assert c.choose_algorithm(1000) == c.engine.preferred_schedule(1) == "two_shot"
        assert c.choose_algorithm(10, "ring") == "ring"
        with pytest.raises(ValueError, match="algorithm must be one of"):
            c.choose_algorithm(10, "tree")
    from echonccl.config import ALGORITHMS
    from echonccl.schedules import SCHEDULES

    assert ALGORITHMS == (*SCHEDULES, "nccl", "one_shot", "auto")


def test_call_signature_names_its_fields():
    from echonccl.communicator import CallSignature

    sig = CallSignature(n=6, shape=(2, 3), dtype="bfloat16", algorithm="ring",
                        no_feedback=True, rounds=1, codec="int4-h32")
    assert CallSignature(*tuple(sig)) == sig and sig._fields[0] == "n"
    assert sig.describe() == ("count=6 shape=(2, 3) dtype=bfloat16 algorithm=ring rounds=1 "
                              "codec=int4-h32 no feedback")
