"""The shortest complete use of echonccl: one 4-bit all-reduce, checked against the plain sum.

    mpiexec -n 2 python mpi_examples/hello_allreduce.py        # GPU + NCCL if cupy sees GPUs, else CPU + MPI

One process per GPU. The baseline is `baseline_all_reduce`: NCCL's all-reduce
on the GPU engine, MPI's on the CPU engine.
"""
import numpy

import echonccl

# algorithm="two_shot": always 4-bit ("auto", the default, uses the plain sum below a few MiB).
comm = echonccl.Communicator(algorithm="two_shot")
if comm.engine.name == "gpu":
    import cupy as xp
else:
    xp = numpy

x = xp.random.default_rng(comm.rank).standard_normal(1 << 20, dtype=xp.float32)  # this rank's part
y = comm.all_reduce(x)                        # the sum over ranks, moved in 4 bits
ref = comm.baseline_all_reduce(x)             # the same sum in full precision
err = float(xp.linalg.norm(y - ref) / xp.linalg.norm(ref))   # (float() waits for the GPU)
if comm.rank == 0:
    print(f"{comm.size} ranks on {comm.engine.name}: 4-bit all-reduce of {x.size} float32, "
          f"relative error {err:.4f} vs {comm.engine.baseline_name}")
comm.close()
