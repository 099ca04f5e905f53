#!/usr/bin/env python3
"""The fused kernels alone (no NCCL): time per all-reduce of the general two-shot kernel against
the whole-slice one (slices whole and aligned, no bounds tests), and of the quantized one-shot
(``q``, ``q_whole``) and the 16-bit one (``one_shot``), one row per size.

    python tools/launch.py -n 2 tools/fused_bench.py [--sizes 16M 64M 256M 1G] [--codec int4-h32]
        [--residual input|float32|int8] [--rounding on|off] [--kernels general whole] [--iters 10] [--reps 2]
        [--grid N] [--tiles N]
    bash tools/with_mps.sh [--percent 50] python3 tools/launch.py -n 2 tools/fused_bench.py ...
    python tools/fused_bench.py --solo [--ranks 2 4 8] ...      (= tools/fused_solo.py: one process)

Rank r runs on device r % (devices): on a two-GPU host each rank has its GPU and the times are
the fused path's own (NVLink between them). On one GPU both ranks share it, which times their
work only under MPS (`tools/with_mps.sh`; without it the two processes' kernels take turns and
each spins on the other's flags): a proxy for the kernels' cost that leaves NVLink out and
makes the ranks share the SMs and the memory. It ranks variants differently depending on how
they share: use it to spot large effects, and confirm on two GPUs. ``--solo`` times instead one
rank's kernel alone on the GPU (rank 0 of P = 2, 4, 8, its peers' data and flags pre-set:
`tools/fused_solo.py`), what bounds the P-GPU time; the MPS proxy stays the check that ranks
running at once make progress.
``--grid`` sets the blocks per launch (default: `kernel_table.FUSED_BLOCKS_PER_SM` per SM, divided
by the ranks sharing the GPU so that every grid stays resident; with ``--percent`` give it);
``--tiles`` sets `FusedPaths.tiles`. bf16 input, feedback on; medians over
``--iters`` calls (`kernel_bench.time_us`), each kernel timed ``--reps`` times in alternation.
"""
from __future__ import annotations

import argparse
import sys

import cupy as cp

import echonccl
from echonccl import codec, dtypes, fused
from echonccl.feedback import DEFAULT_RESIDUAL, DEFAULT_ROUNDING
from echonccl.layout import Layout
from echonccl.perf.options import format_size, parse_size
from kernel_bench import time_us


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--solo" in argv:                 # one rank alone, one process, no MPI (tools/fused_solo.py)
        import fused_solo

        argv.remove("--solo")
        raise SystemExit(fused_solo.main(argv))
    from mpi4py import MPI

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["16M", "64M", "256M", "1G"], help="bytes of bf16 input")
    p.add_argument("--codec", default=codec.DEFAULT_CODEC, choices=codec.CODECS)
    p.add_argument("--residual", default=DEFAULT_RESIDUAL, choices=codec.RESIDUAL_FORMATS)
    p.add_argument("--rounding", default=None, choices=("on", "off"),
                   help="Feedback(rounding=): the owner's output rounding in its residual (default: Feedback's, off)")
    p.add_argument("--kernels", nargs="+", default=["general", "whole"],
                   choices=("general", "whole", "q", "q_whole", "one_shot"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--grid", type=int, default=0, help="blocks per launch (0: the default)")
    p.add_argument("--tiles", type=int, default=0, help="most tiles per slice (0: the default)")
    a = p.parse_args(argv)
    rounding = DEFAULT_ROUNDING if a.rounding is None else a.rounding == "on"

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    dev = rank % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(dev).use()
    sharing = comm.allgather(dev).count(dev)
    paths = fused.FusedPaths(comm, comm.allgather, rank, P, 30.0, lambda: False)
    paths.tiles = a.tiles
    paths.max_blocks = a.grid or paths.max_blocks // sharing   # every rank's grid resident at once
    bf16 = dtypes.numpy_dtype("bfloat16")
    group = codec.group_size(a.codec)
    times = {}
    for nbytes in map(parse_size, a.sizes):
        n = nbytes // 2
        layout = Layout(n, P, a.codec)
        state = echonccl.Feedback(a.residual, rounding=rounding).bind((n, P, group, "bfloat16"), layout, bf16,
                                                   lambda k, dt: cp.zeros(k, dtype=dt), a.codec)
        x = cp.random.default_rng(rank).standard_normal(n, dtype=cp.float32).astype(bf16)
        out = cp.empty_like(x)
        for _ in range(a.reps):
            for kernel in a.kernels:
                paths.whole = kernel.endswith("whole")
                if kernel == "one_shot":
                    run, _ = paths.prepare_one_shot(x, out)
                else:
                    prepare = paths.prepare_one_shot_q if kernel.startswith("q") else paths.prepare_two_shot
                    run, _ = prepare(layout, x, out, state)
                stream = cp.cuda.get_current_stream()
                comm.Barrier()   # the ranks start together; each call then waits for its peers
                times.setdefault((nbytes, kernel), []).append(time_us(lambda: run(stream), a.iters))
    cp.cuda.runtime.deviceSynchronize()
    failed = paths.failed()
    paths.close()
    if failed:
        raise SystemExit("fused_bench: a kernel timed out waiting for a peer")
    if rank == 0:
        print(f"# fused kernels, {P} ranks, {a.codec}, bf16, {a.residual} residuals, "
              f"grid {paths.max_blocks}, us (median of {a.iters}; one column per rep)")
        print("| size | " + " | ".join(a.kernels) + " |")
        print("|---:|" + "---:|" * len(a.kernels))
        for nbytes in map(parse_size, a.sizes):
            cells = [" / ".join(f"{t:.1f}" for t in times[(nbytes, k)]) for k in a.kernels]
            print(f"| {format_size(nbytes)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
