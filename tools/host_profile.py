"""Host time per eager call (no synchronization) of each algorithm, and a cProfile of one.

    mpirun -np 2 python3 tools/host_profile.py [--count N] [--calls K] [--profile ALGO]
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
    p.add_argument("--profile", default="two_shot")
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
    fb = comm.new_feedback()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls // 4):
        comm.all_reduce(x, out, feedback=fb, algorithm=a.profile)
    prof.disable()
    comm.synchronize()
    if world.Get_rank() == 0:
        for algo, host in rows:
            print(f"host time per eager call, {algo:9s} {a.count} x float16: {host:7.1f} us")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue()[-4000:])
    comm.close()


if __name__ == "__main__":
    main()
