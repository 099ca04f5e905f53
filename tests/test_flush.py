"""`all_reduce(..., flush=True)`: the last all-reduce of a forward pass gets one round more
(the multi-rank effect: tests/test_examples.py, tp_transformer_block.py's flush variant)."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import echonccl


@pytest.fixture
def comm():
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as c:
        yield c


def test_flush_adds_one_round(comm):
    fb = comm.new_feedback()
    assert comm._rounds(None, fb, "two_shot", True) == 2
    assert comm._rounds(2, None, "ring", True) == 3
    assert comm._rounds(None, None, "two_shot", False) == 1
    assert comm._rounds(3, fb, "nccl", True) == 1 and comm._rounds(None, fb, "one_shot", True) == 1
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", rounds=2) as c2:
        assert c2._rounds(None, None, "two_shot_pipelined", True) == 3


def test_flush_is_refused_where_it_cannot_apply(comm):
    x = np.ones(1000, np.float32)
    with pytest.raises(ValueError, match="flush=True sends the feedback residuals"):
        comm.all_reduce(x, feedback=False, flush=True)
    with pytest.raises(ValueError, match="flush=True sends the feedback residuals"):
        comm.all_reduce(x, feedback=echonccl.Feedback(enabled=False), flush=True)
    with pytest.raises(ValueError, match="at most 4 in all"):
        comm.all_reduce(x, rounds=4, flush=True)
    with pytest.raises(TypeError, match="flush must be True or False"):
        comm.all_reduce(x, flush=1)
    assert np.array_equal(comm.all_reduce(x, flush=True), x)        # one rank: the input back
