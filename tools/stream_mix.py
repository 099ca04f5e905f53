#!/usr/bin/env python3
"""The HBM ceiling of each phase of the fused two-shot on one GPU: the phase's bytes as plain
streams, no arithmetic, in the fused kernels' launch shape (256 threads, 3 blocks a SM,
grid-stride, a warp's step 512 elements), against a device-to-device copy in the same run.

Per element of the phase's slice, default codec (int4-h32 contributions, int7-h32 sums), bf16
data and residuals (docs/notes/fused.md, "The byte floor"):

* ``contribute``: read the input (2 B) and the residual (2), write the residual in place (2) and
  the wire (9/16: 4-bit codes and a bf16 scale per 32);
* ``owner``: the same, plus the incoming wire read (9/16), the output written (2), and the sums'
  wire (1 B: 7-bit codes and a bf16 scale per 16) written instead of the contribution's;
* ``decode``: read the sums' wire (1), write the output (2);
* ``copy``: read 2, write 2 (the kernels' own copy, beside the runtime's).

Every read comes through shared memory by ``cp.async`` a step ahead (input and residual as in the
fused loops' ``g_ring``, the wire as the decode's copies), and (``--reg``) again into registers at
its step; every store is 16 bytes a lane, 512 contiguous bytes an instruction. What a phase of
the fused kernel takes beyond its stream's time here is its instructions and its synchronization,
not HBM.

    python tools/stream_mix.py [--elems 2**28 2**26] [--iters 20] [--reps 3] [--grid N] [--reg] [--shapes]

2^28 elements: a phase of a 1 GiB all-reduce at P = 2 (each rank's slice).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from hbm_mix import CP16, _count

# phase -> (input, residual, output written, incoming wire bytes / 512 elements, wire written / 512)
PHASES = {
    "copy": (1, 0, 1, 0, 0),
    "contribute": (1, 1, 0, 0, 288),
    "owner": (1, 1, 1, 288, 512),
    "decode": (0, 0, 1, 512, 0),
}

SOURCE = CP16 + r"""__device__ __forceinline__ uint4 x4(uint4 a, uint4 b) { return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w); }

// n512: runs of 512 elements (1 KiB of 16-bit data). A warp's step is one run: lane l moves the
// run's 16-byte chunks l and l + 32 of each 16-bit stream, and chunk l of a wire run (WIN, WOUT
// bytes a run, lanes l < bytes / 16). REG: every read into registers at its step (no ring).
template <int X, int RES, int OUT, int WIN, int WOUT, int REG>
__device__ __forceinline__ void streams(const uint4* __restrict__ x, uint4* __restrict__ res, uint4* __restrict__ out,
                                        const uint4* __restrict__ win, uint4* __restrict__ wout, long long n512) {
    __shared__ __align__(16) uint4 ring[2][8][160];   // a warp's input (0-63), residual (64-127), wire (128-159)
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + wp;
    auto issue = [&](long long v, int k) {
        if (v < n512) {
            if (X) {
                cp16(&ring[k][wp][lane], x + 64 * v + lane);
                cp16(&ring[k][wp][lane + 32], x + 64 * v + lane + 32);
            }
            if (RES) {
                cp16(&ring[k][wp][64 + lane], res + 64 * v + lane);
                cp16(&ring[k][wp][96 + lane], res + 64 * v + lane + 32);
            }
            if (WIN && lane < WIN / 16) cp16(&ring[k][wp][128 + lane], win + (WIN / 16) * v + lane);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    if (!REG) issue(r, 0);
    for (int step = 0; r < n512; r += warps, ++step) {
        const int k = step & 1;
        uint4 a = make_uint4(lane, 0u, 0u, 0u), b = a;
        if (REG) {
            if (X) { a = x4(a, __ldcg(x + 64 * r + lane)); b = x4(b, __ldcg(x + 64 * r + lane + 32)); }
            if (RES) { a = x4(a, __ldcg(res + 64 * r + lane)); b = x4(b, __ldcg(res + 64 * r + lane + 32)); }
            if (WIN && lane < WIN / 16) a = x4(a, __ldcg(win + (WIN / 16) * r + lane));
        } else {
            __syncwarp();
            issue(r + warps, k ^ 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
            __syncwarp();
            if (X) { a = x4(a, ring[k][wp][lane]); b = x4(b, ring[k][wp][lane + 32]); }
            if (RES) { a = x4(a, ring[k][wp][64 + lane]); b = x4(b, ring[k][wp][96 + lane]); }
            if (WIN && lane < WIN / 16) a = x4(a, ring[k][wp][128 + lane]);
        }
        if (RES) { res[64 * r + lane] = b; res[64 * r + lane + 32] = a; }
        if (OUT) { out[64 * r + lane] = a; out[64 * r + lane + 32] = b; }
        if (WOUT && lane < WOUT / 16) wout[(WOUT / 16) * r + lane] = x4(a, b);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}
#define STREAMS(NAME, X, RES, OUT, WIN, WOUT) extern "C" __global__ void __launch_bounds__(256, 3) \
    NAME(const uint4* x, uint4* res, uint4* out, const uint4* win, uint4* wout, long long n512) { \
        streams<X, RES, OUT, WIN, WOUT, 0>(x, res, out, win, wout, n512); } \
    extern "C" __global__ void __launch_bounds__(256, 3) \
    NAME##_reg(const uint4* x, uint4* res, uint4* out, const uint4* win, uint4* wout, long long n512) { \
        streams<X, RES, OUT, WIN, WOUT, 1>(x, res, out, win, wout, n512); }

// Copy shapes (--shapes): a warp's step RUNS consecutive KiB through a ring DEPTH steps deep
// (cp.async), or (DEPTH 0) RUNS KiB loaded into registers (2 RUNS 16-byte loads a lane in flight).
template <int DEPTH, int RUNS>
__device__ __forceinline__ void copy_shape(const uint4* __restrict__ x, uint4* __restrict__ out, long long n512) {
    __shared__ __align__(16) uint4 ring[DEPTH > 0 ? DEPTH : 1][8][64 * RUNS];
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5), nstep = n512 / RUNS;
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + wp;
    if constexpr (DEPTH == 0) {
        for (; r < nstep; r += warps) {
            uint4 v[2 * RUNS];
#pragma unroll
            for (int i = 0; i < 2 * RUNS; ++i) v[i] = __ldcg(x + 64 * RUNS * r + 32 * i + lane);
#pragma unroll
            for (int i = 0; i < 2 * RUNS; ++i) out[64 * RUNS * r + 32 * i + lane] = v[i];
        }
    } else {
        auto issue = [&](long long v, int k) {
            if (v < nstep)
#pragma unroll
                for (int i = 0; i < 2 * RUNS; ++i) cp16(&ring[k][wp][32 * i + lane], x + 64 * RUNS * v + 32 * i + lane);
            asm volatile("cp.async.commit_group;" ::: "memory");
        };
#pragma unroll
        for (int d = 0; d + 1 < DEPTH; ++d) issue(r + d * warps, d);
        for (int step = 0; r < nstep; r += warps, ++step) {
            const int k = step % DEPTH;
            __syncwarp();
            issue(r + (DEPTH - 1) * warps, (step + DEPTH - 1) % DEPTH);
            asm volatile("cp.async.wait_group %0;" ::"n"(DEPTH - 1) : "memory");
            __syncwarp();
#pragma unroll
            for (int i = 0; i < 2 * RUNS; ++i) out[64 * RUNS * r + 32 * i + lane] = ring[k][wp][32 * i + lane];
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
}
#define COPY_SHAPE(D, R) extern "C" __global__ void __launch_bounds__(256, 3) \
    copy_d##D##_r##R(const uint4* x, uint4* out, long long n512) { copy_shape<D, R>(x, out, n512); }
COPY_SHAPE(2, 1) COPY_SHAPE(3, 1) COPY_SHAPE(4, 1) COPY_SHAPE(2, 2) COPY_SHAPE(3, 2)
COPY_SHAPE(0, 1) COPY_SHAPE(0, 2) COPY_SHAPE(0, 4)
""" + "".join(f"STREAMS({p}, {', '.join(map(str, f))})\n" for p, f in PHASES.items())
SHAPES = ("d2_r1", "d3_r1", "d4_r1", "d2_r2", "d3_r2", "d0_r1", "d0_r2", "d0_r4")
GRIDS = (1, 2, 3, 4, 8)   # blocks a SM


def bytes_moved(phase: str, elems: int) -> int:
    """HBM bytes of one launch of ``phase`` over ``elems`` elements (reads and writes)."""
    x, res, out, win, wout = PHASES[phase]
    return elems * (2 * x + 4 * res + 2 * out) + (elems // 512) * (win + wout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elems", nargs="+", type=_count, default=[1 << 28, 1 << 26])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--grid", type=int, default=0,
                   help="blocks of the phases' streams (default 3 a SM)")
    p.add_argument("--reg", action="store_true", help="also each phase's streams with register loads (no ring)")
    p.add_argument("--shapes", action="store_true",
                   help="also a plain copy in other shapes and grids: ring depth, KiB a warp's step, blocks a SM")
    a = p.parse_args(argv)
    if any(e <= 0 or e % 512 for e in a.elems):
        p.error("--elems: positive multiples of 512")

    import cupy as cp

    from fused_solo import _Solo, per_launch_us
    from kernel_bench import copy_bandwidth

    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    spin = _Solo().spin
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    grid = a.grid or 3 * sms
    copy_tbs = copy_bandwidth(1 << 30, a.iters)
    print(f"# the fused two-shot's phases as plain streams, grid {grid} x 256; device-to-device copy "
          f"{copy_tbs:.2f} TB/s")
    for elems in a.elems:
        n512 = elems // 512
        x, res, out = (cp.ones(2 * elems, dtype=cp.uint8) for _ in range(3))
        win, wout = cp.ones(n512 * 512, dtype=cp.uint8), cp.empty(n512 * 512, dtype=cp.uint8)
        best: dict = {}
        names = [p + s for s in ("", "_reg")[:1 + a.reg] for p in PHASES]
        for _ in range(a.reps):      # phases alternate within a rep
            for name in names:
                f = mod.get_function(name)
                args = (x, res, out, win, wout, np.int64(n512))
                t = per_launch_us(lambda _s, f=f, args=args: f((grid,), (256,), args), a.iters, spin)
                best[name] = min(t, best.get(name, t))
        print(f"\n## {elems} elements, us (best of {a.reps} medians of {a.iters}), TB/s, % of the copy rate\n")
        print("| phase | MB | us | TB/s | % |\n|---|---:|---:|---:|---:|")
        for name, t in best.items():
            b = bytes_moved(name.removesuffix("_reg"), elems)
            tbs = b / t / 1e6
            print(f"| {name} | {b / 1e6:.0f} | {t:.1f} | {tbs:.2f} | {100 * tbs / copy_tbs:.0f} |")
        if a.shapes:
            shape_t: dict = {}
            for _ in range(a.reps):
                for shape in SHAPES:
                    f = mod.get_function("copy_" + shape)
                    for g in GRIDS:
                        t = per_launch_us(lambda _s, f=f, g=g: f((g * sms,), (256,), (x, out, np.int64(n512))),
                                          a.iters, spin)
                        shape_t[shape, g] = min(t, shape_t.get((shape, g), t))
            print(f"\n### copy shapes, {elems} elements: TB/s (% of the copy rate) by blocks a SM\n")
            print("| shape | " + " | ".join(f"{g} a SM" for g in GRIDS) + " |\n|---|" + "---:|" * len(GRIDS))
            for shape in SHAPES:
                cells = [4 * elems / shape_t[shape, g] / 1e6 for g in GRIDS]
                print(f"| {shape} | " + " | ".join(f"{c:.2f} ({100 * c / copy_tbs:.0f}%)" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
