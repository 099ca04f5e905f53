"""What echonccl is for, in a few seconds: a residual stream that adds an all-reduce per layer.

    mpiexec -n 4 python mpi_examples/demo_allreduce.py            # or: make demo

Each layer, every rank contributes a partial sum (heavy-tailed, as a transformer block's output
is) and the stream adds their all-reduce. Three all-reduces run side by side on the same partial
sums: a 16-bit sum (what NCCL moves), a plain quantized one (no feedback), and echonccl's (the
default codec: 4-bit contributions, 8-bit sums) with error feedback. Printed: each one's wire bits
per element (the mean of a two-shot's two passes) and the stream's relative error
against the exact float64 stream after 1, 4, 16, 64 and 128 layers (plain 4-bit's grows with
depth, echonccl's stays at one call's), then the time of one all-reduce against the baseline's
(NCCL on GPUs, MPI on CPUs). Runs on the default engine (GPU + NCCL when cupy sees a GPU).
"""
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

import echonccl

LAYERS, DEPTHS = 128, (1, 4, 16, 64, 128)
N = 1 << 16                                    # elements a layer: 128 tokens x 512 hidden

world = MPI.COMM_WORLD
comm = echonccl.Communicator()
gpu = comm.engine.name == "gpu"
if gpu:
    import cupy as xp
    dtype = np.float32                         # cupy has no bfloat16: the partial sums travel as float32
else:
    xp, dtype = np, ml_dtypes.bfloat16


def partial(layer: int) -> np.ndarray:
    """This rank's share of layer ``layer``'s block output: a part all ranks see alike (heavy
    tails, a few outlier channels) plus the rank's own."""
    shared = np.random.default_rng([layer, 0]).standard_t(3, N) * 0.05
    shared[::97] *= 20
    own = np.random.default_rng([layer, 1 + comm.rank]).standard_normal(N) * 0.02
    return (shared / comm.size + own).astype(dtype)


h0 = np.random.default_rng(7).standard_normal(N)
streams = {"exact": h0.copy(), "bf16": h0.copy(), "plain": h0.copy(), "echonccl": h0.copy()}
errors = {k: {} for k in streams if k != "exact"}
fb = comm.new_feedback()                       # one state for every call that adds into the stream
for layer in range(1, LAYERS + 1):
    t = partial(layer)
    streams["exact"] += world.allreduce(t.astype(np.float64))
    streams["bf16"] += world.allreduce(t.astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float64)
    td = xp.asarray(t)
    for name, kw in (("plain", dict(feedback=False)), ("echonccl", dict(feedback=fb))):
        y = comm.all_reduce(td, algorithm="two_shot", **kw)
        streams[name] += (y.get() if gpu else y).astype(np.float64)
    if layer in DEPTHS:
        ref = streams["exact"]
        for name in errors:
            errors[name][layer] = np.linalg.norm(streams[name] - ref) / np.linalg.norm(ref)

# one all-reduce's time, echonccl against the baseline, same buffers
x = xp.asarray(partial(0))
out = xp.empty_like(x)
times = {}
for name, call in (("echonccl", lambda: comm.all_reduce(x, out, feedback=fb, algorithm="two_shot")),
                   ("baseline", lambda: comm.baseline_all_reduce(x, out))):
    call()
    comm.synchronize()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(10):
        call()
    comm.synchronize()
    times[name] = (time.perf_counter() - t0) / 10
comm.close()

if comm.rank == 0:
    layout = echonccl.Layout(N, comm.size, comm.config.codec)
    # codes and scales, bits an element a pass: the mean of the contributions' and the sums' (4.5, 8)
    four = f"{8 * (layout.slice_bytes + layout.sums.slice_bytes) / (2 * layout.slice_elems):g}"
    wire = {"bf16": "16", "plain": four, "echonccl": four}
    print(f"echonccl demo: {comm.size} ranks, {comm.engine.describe()}; a residual stream of {LAYERS} layers, "
          f"{N} elements a layer, partial sums in {np.dtype(dtype).name}")
    print(f"{'all-reduce':28s} {'wire bits':>9s}   stream error after layer " + "".join(f"{d:>9d}" for d in DEPTHS))
    for name, label in (("bf16", "16-bit sum (NCCL)"), ("plain", "plain 4-bit, no feedback"),
                        ("echonccl", "echonccl + feedback")):
        print(f"{label:28s} {wire[name]:>9s}   {'':25s}" + "".join(f"{errors[name][d]:9.1e}" for d in DEPTHS))
    base = "NCCL" if gpu else "MPI"
    print(f"one all-reduce of {N} {np.dtype(dtype).name}: echonccl {times['echonccl'] * 1e3:.2f} ms, "
          f"{base} {times['baseline'] * 1e3:.2f} ms"
          + ("" if gpu else " (the CPU engine is the reference, not the product: run it on GPUs for speed)"))
