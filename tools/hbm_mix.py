#!/usr/bin/env python3
"""What HBM gives the fused decode's access pattern on one GPU: a stream that reads one byte an
element (the int7-h32 wire) and writes two (bf16 output), the decode's 1:2 mix, in the forms the
decode could take:

* layout ``planes``: a lane's 16 elements as the wire stores them, four narrow loads from four
  arrays (nibbles 8 bytes, bits 4-5 4 bytes, bit 6 2 bytes, a 4-byte scale word per two lanes);
  ``wide``: one 16-byte load a lane, 512 contiguous bytes a warp;
* loads ``reg`` (into registers at the step that uses them) or ``async`` (`cp.async` into shared
  memory two steps ahead, `dequantize_loop16`'s way since it was measured here);
* stores ``direct`` (two 16-byte stores a lane, 512 contiguous bytes an instruction), ``staged``
  (through the warp's shared memory first, `unit16_store`'s way) or ``bulk`` (staged the same way,
  then the warp's 1 KiB written by one bulk copy, ``cp.async.bulk`` from shared memory, sm_90 and
  newer; two staging buffers a warp, a buffer reused once its copy has read it);
* ``--work R``: R rounds of 16 fmas, 8 shuffles and 8 fmas per 16 elements, standing in for the
  decode's instructions (the shipped decode issues about 210 a lane-step, near R = 6).

    python tools/hbm_mix.py [--elems 2**28 2**26] [--work 0 6] [--iters 20] [--reps 3]

The fused kernels' launch shape (256 threads, 3 blocks a SM), grid-stride; medians of ``--iters``
launches, best of ``--reps``; bandwidth against a device-to-device copy in the same run. 2^28
elements is the decode of a 1 GiB bf16 all-reduce at P = 2 (805 MB).
"""
from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

LAYOUTS, LOADS, STORES = ("planes", "wide"), ("reg", "async"), ("direct", "staged", "bulk")

# 16 bytes from global memory to shared memory in flight (cp.async; the caller commits): the
# tools' stream kernels' copy (stream_mix.py too)
CP16 = r"""
typedef unsigned int u32;
__device__ __forceinline__ void cp16(void* dst, const void* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
"""
SOURCE = CP16 + r"""__device__ __forceinline__ void cp4(void* dst, const void* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp8(void* dst, const void* src) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src) : "memory");
}
// w: S bytes of wire (S = 16 n), out: 2 S bytes; unit u (16 elements) a lane-step.
template <int WIDE, int WORK, int STAGED, int ASYNC>
__device__ __forceinline__ void mix(const unsigned char* __restrict__ w, uint4* __restrict__ out, long long n) {
    __shared__ __align__(128) uint4 stage[2][8][64];   // a warp's 1 KiB of output (bulk: two)
    __shared__ __align__(16) uint4 ring[3][8][32];  // a warp's wire, three steps
    __shared__ u32 ring_top[3][8][32];              // planes: the bit-6 word of a lane's pair
    const long long S = n * 16;
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    auto load = [&](long long v) {
        if (WIDE) return __ldcg(reinterpret_cast<const uint4*>(w) + v);
        const uint2 lo = __ldcg(reinterpret_cast<const uint2*>(w) + v);
        const u32 mid = __ldcg(reinterpret_cast<const u32*>(w + (S >> 1)) + v);
        const u32 top = __ldcg(reinterpret_cast<const unsigned short*>(w + (S >> 1) + (S >> 2)) + v);
        const u32 sc = __ldcg(reinterpret_cast<const u32*>(w + S - (S >> 3)) + (v >> 1));
        return make_uint4(lo.x, lo.y, mid, top ^ sc);
    };
    auto issue = [&](long long v, int k) {   // unit v's wire into ring k: the bytes load() reads
        unsigned char* r = reinterpret_cast<unsigned char*>(&ring[k][wp][lane]);
        if (v < n) {
            if (WIDE) cp16(r, reinterpret_cast<const uint4*>(w) + v);
            else {
                cp8(r, w + v * 8);
                cp4(r + 8, w + (S >> 1) + v * 4);
                cp4(r + 12, w + S - (S >> 3) + (v >> 1) * 4);
                cp4(&ring_top[k][wp][lane], w + (S >> 1) + (S >> 2) + (v >> 1) * 4);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    if (ASYNC) { issue(u, 0); issue(u + stride, 1); }
    for (int step = 0; u < n; u += stride, ++step) {
        uint4 c;
        if (ASYNC) {
            issue(u + 2 * stride, (step + 2) % 3);
            asm volatile("cp.async.wait_group 2;" ::: "memory");
            c = ring[step % 3][wp][lane];
            if (!WIDE) c.w ^= ring_top[step % 3][wp][lane];
        } else {
            c = load(u);
        }
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __uint_as_float((((&c.x)[i & 3] >> (i >> 2)) & 0x007fffffu) | 0x3f800000u);
#pragma unroll
        for (int r = 0; r < WORK; ++r) {
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = fmaf(v[i], 1.0001f, v[i ^ (1 << (r & 3))]);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = fmaf(__shfl_xor_sync(0xffffffffu, v[i], 1), 0.5f, v[i]);
        }
        u32 o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = (__float_as_uint(v[2 * i]) >> 16) | (__float_as_uint(v[2 * i + 1]) & 0xffff0000u);
        uint4* p = out + ((u - lane) << 1);
        const uint4 a = make_uint4(o[0], o[1], o[2], o[3]), b = make_uint4(o[4], o[5], o[6], o[7]);
        if (STAGED == 2) {
#if __CUDA_ARCH__ >= 900
            uint4* s = stage[step & 1][wp];
            if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            __syncwarp();   // the copy from this buffer two steps ago has read it
            s[2 * lane] = a;
            s[2 * lane + 1] = b;
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncwarp();
            if (lane == 0) {
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 1024;"
                             ::"l"(p), "r"((u32)__cvta_generic_to_shared(s)) : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            }
#endif
        } else if (STAGED) {
            uint4* s = stage[0][wp];
            __syncwarp();
            s[2 * lane] = a;
            s[2 * lane + 1] = b;
            __syncwarp();
            p[lane] = s[lane];
            p[lane + 32] = s[lane + 32];
        } else {
            p[lane] = a;
            p[lane + 32] = b;
        }
    }
    if (ASYNC) asm volatile("cp.async.wait_group 0;" ::: "memory");
#if __CUDA_ARCH__ >= 900
    if (STAGED == 2 && lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}
#define MIX(W, R, S, A) extern "C" __global__ void __launch_bounds__(256, 3) \
    mix_##W##_##R##_##S##_##A(const unsigned char* w, uint4* out, long long n) { mix<W, R, S, A>(w, out, n); }
#define MIX_L(W, R) MIX(W, R, 0, 0) MIX(W, R, 0, 1) MIX(W, R, 1, 0) MIX(W, R, 1, 1) MIX(W, R, 2, 0) MIX(W, R, 2, 1)
#define MIX_R(R) MIX_L(0, R) MIX_L(1, R)
MIX_R(0) MIX_R(2) MIX_R(4) MIX_R(6) MIX_R(8)
"""
WORKS = (0, 2, 4, 6, 8)


def kernel_name(layout: str, work: int, store: str, load: str) -> str:
    """The SOURCE kernel of one case."""
    if work not in WORKS:
        raise ValueError(f"work {work}: one of {WORKS}")
    return f"mix_{LAYOUTS.index(layout)}_{work}_{STORES.index(store)}_{LOADS.index(load)}"


def bytes_moved(elems: int) -> int:
    """HBM bytes of one launch: a wire byte read and two output bytes written an element."""
    return 3 * elems


def _count(s: str) -> int:
    """An element count: an integer or 2**k."""
    return 2 ** int(s[3:]) if s.startswith("2**") else int(s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elems", nargs="+", type=_count, default=[1 << 28, 1 << 26])
    p.add_argument("--work", nargs="+", type=int, default=[0, 6], choices=WORKS)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    if any(e <= 0 or e % (16 * 256) for e in a.elems):
        p.error("--elems: positive multiples of 4096")

    import cupy as cp

    from fused_solo import _Solo, per_launch_us
    from kernel_bench import copy_bandwidth

    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    spin = _Solo().spin
    grid = 3 * cp.cuda.Device().attributes["MultiProcessorCount"]
    copy_tbs = copy_bandwidth(1 << 30, a.iters)
    # the bulk stores compile to nothing before sm_90: those cases would time a stream without stores
    stores = STORES if int(cp.cuda.Device().compute_capability) >= 90 else STORES[:-1]
    cases = list(itertools.product(LAYOUTS, a.work, stores, LOADS))
    print(f"# the decode's 1:2 read:write mix, grid {grid} x 256; device-to-device copy {copy_tbs:.2f} TB/s"
          + ("" if stores == STORES else "; no bulk stores before sm_90"))
    for elems in a.elems:
        w = cp.random.randint(0, 256, size=elems, dtype=cp.uint8)
        out = cp.empty(2 * elems, dtype=cp.uint8)
        best = {}
        for _ in range(a.reps):      # cases alternate within a rep
            for case in cases:
                f = mod.get_function(kernel_name(*case))
                t = per_launch_us(lambda _s, f=f: f((grid,), (256,), (w, out, np.int64(elems // 16))), a.iters, spin)
                best[case] = min(t, best.get(case, t))
        mb = bytes_moved(elems) / 1e6
        print(f"\n## {elems} elements ({mb:.0f} MB), us (best of {a.reps} medians of {a.iters}), TB/s, % of the copy rate\n")
        print("| layout | work | stores | loads | us | TB/s | % |\n|---|---:|---|---|---:|---:|---:|")
        for case, t in best.items():
            tbs = bytes_moved(elems) / t / 1e6
            print(f"| {case[0]} | {case[1]} | {case[2]} | {case[3]} | {t:.1f} | {tbs:.2f} | {100 * tbs / copy_tbs:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
