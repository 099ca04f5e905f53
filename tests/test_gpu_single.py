"""The GPU engine with one rank (P = 1, MPI.COMM_SELF) on one GPU: the input comes back
unchanged, out of place and in place, for every dtype. Skipped without a GPU."""
import numpy as np
import pytest

from conftest import needs_gpus

pytestmark = needs_gpus(1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_single_rank_gpu_returns_input(dtype):
    import cupy
    from mpi4py import MPI

    import echonccl
    from echonccl import dtypes

    with echonccl.Communicator(MPI.COMM_SELF, engine="gpu") as comm:
        x = cupy.asarray(np.random.default_rng(0).standard_normal((7, 513)).astype(dtypes.numpy_dtype(dtype)))
        for algo in ("two_shot", "ring", "nccl"):
            y = comm.all_reduce(x, algorithm=algo)
            assert y is not x and y.shape == x.shape and y.tobytes() == x.tobytes()
            assert comm.all_reduce(x, x, algorithm=algo) is x
        comm.synchronize()
