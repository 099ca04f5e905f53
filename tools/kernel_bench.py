#!/usr/bin/env python3
"""Codec kernel bandwidth on one GPU: bytes each kernel moves (read + written) over its time,
against the device-to-device copy bandwidth measured in the same run.

    python tools/kernel_bench.py [--elems 2**26] [--iters 20] [--codecs int4 int4-h32 int7-h32]
                                 [--max-blocks 124]

Each kernel is timed for each codec (default: the rotated int4-h32 against int4), so the
rotation's cost shows as the ratio of their bandwidths. ``--max-blocks`` caps every grid
(``CudaKernels(max_blocks=)``): the SMs the codec kernels may take beside NCCL's.
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

from echonccl import codec, dtypes
from echonccl.kernels_cuda import CudaKernels
from echonccl.layout import Layout


def time_us(fn, iters: int) -> float:
    """Median of per-call CUDA-event times in microseconds, after 3 warm-ups."""
    for _ in range(3):
        fn()
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    ev[-1][1].synchronize()
    return float(np.median([cp.cuda.get_elapsed_time(a, b) * 1e3 for a, b in ev]))


def copy_bandwidth(nbytes: int, iters: int) -> float:
    a = cp.empty(nbytes, dtype=cp.uint8)
    b = cp.empty_like(a)
    t = time_us(lambda: b.__setitem__(Ellipsis, a), iters)
    return 2 * nbytes / t / 1e6  # TB/s


def cases(elems: int, codec_name: str = "int4", max_blocks: int = 0):
    """The kernels as two_shot calls them: (name, bytes moved, launch function) for each."""
    k = CudaKernels(max_blocks=max_blocks)
    L = Layout(elems, 1, codec_name)
    S, B = L.slice_elems, L.slice_bytes
    for dt in ("bfloat16", "float16", "float32"):
        ndt = dtypes.numpy_dtype(dt)
        own = cp.random.standard_normal(S, dtype=cp.float32).astype(ndt)
        for rdt, n_in in (("float32", 0), ("input", 0), ("int8", 0), ("float32", 1), ("input", 1),
                          ("int8", 1), ("input", 3), ("float32", 7), ("input", 7)):
            rd = codec.residual_dtype(rdt, ndt)
            res = cp.zeros(codec.residual_size(S, rd), dtype=rd)
            codec.clear_residuals(res)
            inc = cp.zeros(max(n_in, 1) * B, dtype=cp.uint8) if n_in else None
            out = cp.empty(B, dtype=cp.uint8)
            # as two_shot calls it: a contribution (n_in = 0) measures its residual in float32,
            # the owner (n_in > 0) against the output dtype (int4-h32: rotated back and forth)
            ref = np.float32 if n_in == 0 else ndt
            moved = n_in * B + own.nbytes + 2 * res.nbytes + B
            yield (f"reduce_quantize in={dt} residual={'int8' if rd == np.uint8 else rd.name} n_in={n_in} {codec_name}", moved,
                   lambda inc=inc, n_in=n_in, own=own, res=res, out=out, ref=ref:
                   k.reduce_quantize(L, inc, n_in, own, res, out, ref))
        wire = cp.zeros(B, dtype=cp.uint8)
        dst = cp.empty(S, dtype=ndt)
        yield f"dequantize out={dt} {codec_name}", B + dst.nbytes, lambda wire=wire, dst=dst: k.dequantize(L, wire, dst)
        prev = cp.zeros(S, dtype=ndt)
        yield (f"dequantize accumulate out={dt} {codec_name}", B + 2 * prev.nbytes,
               lambda wire=wire, prev=prev: k.dequantize(L, wire, prev, accumulate=True))
        wires = cp.zeros(2 * B, dtype=cp.uint8)     # one_shot_q's decode at two ranks: two parts summed
        yield (f"dequantize 2 terms out={dt} {codec_name}", 2 * B + dst.nbytes,
               lambda wires=wires, dst=dst: k.dequantize(L, wires, dst, terms=2))


def bench(elems: int, iters: int, codec_name: str = "int4", max_blocks: int = 0):
    """Rows (name, bytes moved, us) of `cases`, each timed by `time_us`."""
    return [(name, moved, time_us(fn, iters)) for name, moved, fn in cases(elems, codec_name, max_blocks)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elems", type=lambda s: int(eval(s, {})), default=2 ** 26)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--codecs", nargs="+", default=["int4", "int4-h32"], choices=codec.CODECS)
    p.add_argument("--max-blocks", type=int, default=0, help="cap on every grid (default 0: none)")
    a = p.parse_args()
    copy = copy_bandwidth(1 << 30, a.iters)
    print(f"# device-to-device copy (1 GiB): {copy:.2f} TB/s (read + written); slice of {a.elems} elements")
    print("| kernel | MB moved | time (us) | TB/s | % of copy |")
    print("|---|---:|---:|---:|---:|")
    for name, moved, t in (r for c in a.codecs
                           for r in bench(a.elems, a.iters, c, a.max_blocks)):
        bw = moved / t / 1e6
        print(f"| {name} | {moved / 1e6:.1f} | {t:.1f} | {bw:.2f} | {100 * bw / copy:.0f}% |")


if __name__ == "__main__":
    main()
