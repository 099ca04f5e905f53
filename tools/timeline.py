"""GPU timeline of all-reduce calls from CUPTI activity records: which kernels ran when, on
which stream, and how much of the time the codec kernels and NCCL's kernels overlapped.

    mpirun -np 2 python3 tools/timeline.py --count N [--algo two_shot_pipelined] [--calls 3]

Needs cupti-python and the nvidia-cuda-cupti wheel (carried to the GPU machine as wheels and
unzipped onto PYTHONPATH / LD_LIBRARY_PATH).
Every rank traces its own device; rank 0 prints its last call's kernels (start and duration in
us from the call's first kernel, stream, name) and, for every call, the span, the busy time of
NCCL's kernels and of the others, and the time both ran at once.
"""
import argparse


def _union(iv):
    """Total length of the union of intervals [(start, end)], and the merged list."""
    merged = []
    for s, e in sorted(iv):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(e - s for s, e in merged), merged


def _overlap(a, b):
    """Length of the intersection of two merged interval lists."""
    i = j = tot = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def summary(recs) -> tuple[float, float, float, float]:
    """(span, NCCL kernels busy, other kernels busy, both at once) in us of kernel records
    ``(start_ns, end_ns, stream, name)``; NCCL's kernels are those named ``*nccl*``."""
    t0 = min(r[0] for r in recs)
    t1 = max(r[1] for r in recs)
    nccl_t, nccl_iv = _union([(s, e) for s, e, _, n in recs if "nccl" in n.lower()])
    other_t, other_iv = _union([(s, e) for s, e, _, n in recs if "nccl" not in n.lower()])
    return (t1 - t0) / 1e3, nccl_t / 1e3, other_t / 1e3, _overlap(nccl_iv, other_iv) / 1e3


def main():
    import cupy
    from cupti import cupti
    from mpi4py import MPI

    import echonccl

    records = []

    def requested():
        return 8 << 20, 0

    def completed(activities):
        for act in activities:
            if act.kind == cupti.ActivityKind.CONCURRENT_KERNEL:
                records.append((act.start, act.end, act.stream_id, act.name))

    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, required=True, help="elements (bfloat16)")
    p.add_argument("--algo", default="two_shot_pipelined")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--show", type=int, default=60, help="kernels of the last call to list")
    a = p.parse_args()
    comm = echonccl.Communicator(engine="gpu")
    world = MPI.COMM_WORLD
    x = cupy.random.standard_normal(a.count, dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
    out = cupy.empty_like(x)
    fb = comm.new_feedback()
    for _ in range(5):
        comm.all_reduce(x, out, feedback=fb, algorithm=a.algo)
    comm.synchronize()
    cupti.activity_register_callbacks(requested, completed)
    cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
    calls = []
    for _ in range(a.calls):
        world.Barrier()
        n0 = len(records)
        comm.all_reduce(x, out, feedback=fb, algorithm=a.algo)
        comm.synchronize()
        cupti.activity_flush_all(1)
        calls.append(records[n0:])
    cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
    cupti.activity_flush_all(1)
    if world.Get_rank() == 0:
        print(f"# {a.algo}, {a.count} x bfloat16, {a.calls} calls traced on rank 0")
        for i, recs in enumerate(calls):
            if not recs:
                print(f"call {i}: no kernel records")
                continue
            span, nccl_t, other_t, both = summary(recs)
            print(f"call {i}: span {span:9.1f} us  nccl busy {nccl_t:9.1f}  "
                  f"codec busy {other_t:8.1f}  both at once {both:8.1f}  kernels {len(recs)}")
        recs = sorted(calls[-1])
        if recs:
            t0 = recs[0][0]
            print("   start(us)    dur(us)  stream  kernel")
            for s, e, st, n in recs[: a.show]:
                print(f"{(s - t0) / 1e3:12.1f} {(e - s) / 1e3:10.1f} {st:7d}  {n[:90]}")
    comm.close()


if __name__ == "__main__":
    main()
