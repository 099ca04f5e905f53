"""Host time per eager call (no synchronization) of each algorithm, and a cProfile of one.

    mpirun -np 2 python3 tools/host_profile.py [--count N] [--calls K] [--profile ALGO,...]
"""
import argparse
import cProfile
import io
import pstats
import time

import cupy
from mpi4py import MPI

import echonccl


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=4096)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", default="two_shot,one_shot,nccl", help="algorithms to cProfile, comma-separated")
    a = p.parse_args()
    comm = echonccl.Communicator(engine="gpu")
    world = MPI.COMM_WORLD
    x = cupy.ones(a.count, dtype=cupy.float16)
    out = cupy.empty_like(x)
    rows = []
    for algo in ("nccl", "one_shot", "two_shot", "auto"):
        fb = comm.new_feedback()
        for _ in range(20):
            comm.all_reduce(x, out, feedback=fb, algorithm=algo)
        comm.synchronize()
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            comm.all_reduce(x, out, feedback=fb, algorithm=algo)
        host = (time.perf_counter() - t0) / a.calls * 1e6
        comm.synchronize()
        rows.append((algo, host))
    # The fastest plain way to call NCCL from Python: CuPy's own binding, in the same loop.
    from cupy.cuda import nccl as cnccl

    uid = world.bcast(cnccl.get_unique_id() if world.Get_rank() == 0 else None, root=0)
    cc = cnccl.NcclCommunicator(world.Get_size(), uid, world.Get_rank())
    stream = cupy.cuda.get_current_stream().ptr
    for _ in range(20):
        cc.allReduce(x.data.ptr, out.data.ptr, x.size, cnccl.NCCL_FLOAT16, cnccl.NCCL_SUM, stream)
    comm.synchronize()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(a.calls):
        cc.allReduce(x.data.ptr, out.data.ptr, x.size, cnccl.NCCL_FLOAT16, cnccl.NCCL_SUM, stream)
    rows.append(("cupy.cuda.nccl", (time.perf_counter() - t0) / a.calls * 1e6))
    comm.synchronize()
    cc.destroy()
    profiles = []
    for algo in a.profile.split(","):
        fb = comm.new_feedback()
        comm.all_reduce(x, out, feedback=fb, algorithm=algo)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls // 4):
            comm.all_reduce(x, out, feedback=fb, algorithm=algo)
        prof.disable()
        comm.synchronize()
        profiles.append((algo, prof))
    if world.Get_rank() == 0:
        for algo, host in rows:
            print(f"host time per eager call, {algo:14s} {a.count} x float16: {host:7.1f} us")
        for algo, prof in profiles:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
            print(f"--- cProfile {algo} ({a.calls // 4} calls)")
            print(s.getvalue()[-2500:])
    comm.close()


if __name__ == "__main__":
    main()
