"""The demo: a 4-bit all-reduce across ranks, its speed and its error against the exact sum.

    mpiexec -n 4 python mpi_examples/demo_allreduce.py            # or: make demo

Runs on the default engine (GPU + NCCL when cupy sees a GPU, else CPU + MPI).
"""
import time

import numpy as np
from mpi4py import MPI

import echonccl

comm = echonccl.Communicator()
world = MPI.COMM_WORLD
n = 1 << 20
x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
exact = world.allreduce(x.astype(np.float64))

gpu = comm.engine.name == "gpu"
if gpu:
    import cupy as xp
else:
    xp = np
xd = xp.asarray(x)
out = xp.empty_like(xd)
fb = comm.new_feedback()

for algo in ("two_shot", "ring"):
    comm.all_reduce(xd, out, feedback=fb, algorithm=algo)          # warm-up (binds the state)
    fb.reset()
    comm.engine.synchronize()
    world.Barrier()
    t0 = time.perf_counter()
    comm.all_reduce(xd, out, feedback=fb, algorithm=algo)
    comm.engine.synchronize()
    dt = time.perf_counter() - t0
    y = out.get() if gpu else out
    err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    blobs = world.allgather(y.tobytes())
    same = all(b == blobs[0] for b in blobs)
    if comm.rank == 0:
        print(f"{algo:8s} {comm.size} ranks, {n} float32 on {comm.engine.describe()}: "
              f"{dt * 1e3:8.2f} ms, relative error {err:.4f} vs exact fp64 sum, identical on all ranks: {same}")
    fb = comm.new_feedback()
comm.close()
