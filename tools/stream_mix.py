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
fused loops' ``g_ring``, the wire as the decode's copies), again (``--reg``) into registers at its
step, and again (``--bulk``) by bulk copies (``cp.async.bulk``, sm_90: one lane of a warp issues
the step's runs, completing on the warp's ``mbarrier``), and (``--hints``) by the ring's copies
with an L2 prefetch hint (``.L2::256B``), then with every store streaming (``st.global.cs``) as
well; every store is 16 bytes a lane, 512
contiguous bytes an instruction, but (``--shift``) where the output lies one element off 16-byte
alignment as the shifted twins store it (a run's whole words, then its bytes of the two words it
shares with its neighbours by 2-byte stores), and two forms that tell where that costs: only every
4th run's edge words in part (``_shift4``: as if the warps of a chunk passed each other their
edges), and every word whole with the same 2-byte stores beside (``_shiftx``). What a phase of the fused kernel takes beyond its
stream's time here is its instructions and its synchronization, not HBM.

    python tools/stream_mix.py [--elems 2**28 2**26] [--iters 20] [--reps 3] [--grid N] [--reg] [--bulk] [--hints] [--shift] [--shapes]

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
SHIFTED = tuple(p for p, f in PHASES.items() if f[2])   # --shift: the phases that write the output
# --shift's store forms (the kernel's OUT): as the shifted twins store (every run's two edge words
# in part), only every 4th run's edges in part, every word whole beside the same 2-byte stores
SHIFTS = {"_shift": 2, "_shift4": 3, "_shiftx": 4}

SOURCE = CP16 + r"""
// Bulk copies (sm_90): global to shared completing on an mbarrier (a warp's own, one arrival),
// shared to global in bulk groups.
typedef unsigned long long u64;
__device__ __forceinline__ u32 sh(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(u64* b) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sh(b)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void bar_expect(u64* b, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sh(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(u64* b, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(sh(b)), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sh(dst)), "l"(src), "r"(bytes), "r"(sh(b)) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(sh(src)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// The lanes' reads of shared memory done before an async-proxy copy overwrites it.
__device__ __forceinline__ void reads_done() {
    __syncwarp();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ uint4 x4(uint4 a, uint4 b) { return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w); }

// The ring's copies with an L2 prefetch of 256 bytes (the sector group beside the 16 bytes asked).
__device__ __forceinline__ void cp16_l2(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(sh(dst)), "l"(src) : "memory");
}
// A 16-byte store, streaming (.cs: evict first) where CS.
template <int CS>
__device__ __forceinline__ void st16(uint4* p, uint4 v) {
    if (CS) asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    else *p = v;
}

// n512: runs of 512 elements (1 KiB of 16-bit data). A warp's step is one run: lane l moves the
// run's 16-byte chunks l and l + 32 of each 16-bit stream, and chunk l of a wire run (WIN, WOUT
// bytes a run, lanes l < bytes / 16). LOAD 0: the cp.async ring; 1: every read into registers at
// its step (no ring); 2: the ring filled by lane 0's bulk copies; 3: the ring with the L2
// prefetch hint (cp16_l2); 4: that, and every store streaming (.cs).
template <int X, int RES, int OUT, int WIN, int WOUT, int LOAD>
__device__ __forceinline__ void streams(const uint4* __restrict__ x, uint4* __restrict__ res, uint4* __restrict__ out,
                                        const uint4* __restrict__ win, uint4* __restrict__ wout, long long n512) {
    __shared__ __align__(128) uint4 ring[2][8][160];   // a warp's input (0-63), residual (64-127), wire (128-159)
    __shared__ u64 bar[2][8];
    constexpr int REG = LOAD == 1, CS = LOAD == 4;
    auto cp = [](void* d, const void* src) { if (LOAD >= 3) cp16_l2(d, src); else cp16(d, src); };
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + wp;
    auto issue = [&](long long v, int k) {
        if (LOAD == 2) {
            if (lane == 0 && v < n512) {
                bar_expect(&bar[k][wp], (X + RES) * 1024 + WIN);
                if (X) bulk_load(&ring[k][wp][0], x + 64 * v, 1024, &bar[k][wp]);
                if (RES) bulk_load(&ring[k][wp][64], res + 64 * v, 1024, &bar[k][wp]);
                if (WIN) bulk_load(&ring[k][wp][128], win + (WIN / 16) * v, WIN, &bar[k][wp]);
            }
            return;
        }
        if (v < n512) {
            if (X) {
                cp(&ring[k][wp][lane], x + 64 * v + lane);
                cp(&ring[k][wp][lane + 32], x + 64 * v + lane + 32);
            }
            if (RES) {
                cp(&ring[k][wp][64 + lane], res + 64 * v + lane);
                cp(&ring[k][wp][96 + lane], res + 64 * v + lane + 32);
            }
            if (WIN && lane < WIN / 16) cp(&ring[k][wp][128 + lane], win + (WIN / 16) * v + lane);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    if (LOAD == 2 && lane == 0) { bar_init(&bar[0][wp]); bar_init(&bar[1][wp]); }
    __syncwarp();
    if (!REG) issue(r, 0);
    for (int step = 0; r < n512; r += warps, ++step) {
        const int k = step & 1;
        uint4 a = make_uint4(lane, 0u, 0u, 0u), b = a;
        if (REG) {
            if (X) { a = x4(a, __ldcg(x + 64 * r + lane)); b = x4(b, __ldcg(x + 64 * r + lane + 32)); }
            if (RES) { a = x4(a, __ldcg(res + 64 * r + lane)); b = x4(b, __ldcg(res + 64 * r + lane + 32)); }
            if (WIN && lane < WIN / 16) a = x4(a, __ldcg(win + (WIN / 16) * r + lane));
        } else {
            if (LOAD == 2) reads_done(); else __syncwarp();
            issue(r + warps, k ^ 1);
            if (LOAD == 2) bar_wait(&bar[k][wp], (step >> 1) & 1);
            else asm volatile("cp.async.wait_group 1;" ::: "memory");
            __syncwarp();
            if (X) { a = x4(a, ring[k][wp][lane]); b = x4(b, ring[k][wp][lane + 32]); }
            if (RES) { a = x4(a, ring[k][wp][64 + lane]); b = x4(b, ring[k][wp][96 + lane]); }
            if (WIN && lane < WIN / 16) a = x4(a, ring[k][wp][128 + lane]);
        }
        if (RES) { st16<CS>(res + 64 * r + lane, b); st16<CS>(res + 64 * r + lane + 32, a); }
        if (OUT == 1) { st16<CS>(out + 64 * r + lane, a); st16<CS>(out + 64 * r + lane + 32, b); }
        if (OUT >= 2) {   // one element off alignment, stored as the shifted twins store a run (OUT 2)
            // OUT 3: only every 4th run's edge words in part (a chunk's, its warps' edges whole);
            // OUT 4: every word whole, the 2-byte stores of OUT 2 as well (their instructions, no partial word)
            const bool part = OUT == 2 || (OUT == 3 && r % 4 == 0);
            if (lane > 0 || !part) out[64 * r + lane] = a;
            out[64 * r + lane + 32] = b;
            const bool edge = OUT != 3 || (lane < 8 ? r % 4 == 0 : r % 4 == 3);
            if (lane >= 1 && lane <= 8 && edge)   // word 0's elements 1-7, word 64's element 0
                reinterpret_cast<unsigned short*>(out + 64 * r + (lane < 8 ? 0 : 64))[lane & 7] = (unsigned short)a.x;
        }
        if (WOUT && lane < WOUT / 16) st16<CS>(wout + (WOUT / 16) * r + lane, x4(a, b));
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}
#define STREAMS1(NAME, SUFFIX, X, RES, OUT, WIN, WOUT, LOAD) extern "C" __global__ void __launch_bounds__(256, 3) \
    NAME##SUFFIX(const uint4* x, uint4* res, uint4* out, const uint4* win, uint4* wout, long long n512) { \
        streams<X, RES, OUT, WIN, WOUT, LOAD>(x, res, out, win, wout, n512); }
#define STREAMS(NAME, X, RES, OUT, WIN, WOUT) STREAMS1(NAME, , X, RES, OUT, WIN, WOUT, 0) \
    STREAMS1(NAME, _reg, X, RES, OUT, WIN, WOUT, 1) STREAMS1(NAME, _bulk, X, RES, OUT, WIN, WOUT, 2) \
    STREAMS1(NAME, _l2, X, RES, OUT, WIN, WOUT, 3) STREAMS1(NAME, _l2cs, X, RES, OUT, WIN, WOUT, 4)

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

// Bulk copy shapes: lane 0 of a warp fills a ring DEPTH steps deep with one bulk copy of RUNS KiB
// a step; the lanes store it with 16-byte stores (BS 0), or lane 0 with one bulk copy (BS 1).
template <int DEPTH, int RUNS, int BS>
__device__ __forceinline__ void copy_bulk(const uint4* __restrict__ x, uint4* __restrict__ out, long long n512) {
    __shared__ __align__(128) uint4 ring[DEPTH][8][64 * RUNS];
    __shared__ u64 bar[DEPTH][8];
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5), nstep = n512 / RUNS;
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + wp;
    auto issue = [&](long long v, int k) {
        if (lane == 0 && v < nstep) {
            bar_expect(&bar[k][wp], 1024 * RUNS);
            bulk_load(&ring[k][wp][0], x + 64 * RUNS * v, 1024 * RUNS, &bar[k][wp]);
        }
    };
    if (lane == 0)
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) bar_init(&bar[d][wp]);
    __syncwarp();
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) issue(r + d * warps, d);
    for (int step = 0; r < nstep; r += warps, ++step) {
        const int k = step % DEPTH;
        bar_wait(&bar[k][wp], (step / DEPTH) & 1);
        if (BS) {
            if (lane == 0) {
                bulk_store(out + 64 * RUNS * r, &ring[k][wp][0], 1024 * RUNS);
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            }
        } else {
#pragma unroll
            for (int i = 0; i < 2 * RUNS; ++i) out[64 * RUNS * r + 32 * i + lane] = ring[k][wp][32 * i + lane];
            reads_done();
        }
        issue(r + DEPTH * warps, k);
    }
    if (BS && lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#define COPY_BULK(D, R, BS, NAME) extern "C" __global__ void __launch_bounds__(256, 3) \
    copy_##NAME##D##_r##R(const uint4* x, uint4* out, long long n512) { copy_bulk<D, R, BS>(x, out, n512); }
COPY_BULK(2, 1, 0, b) COPY_BULK(4, 1, 0, b) COPY_BULK(2, 2, 0, b)
COPY_BULK(2, 1, 1, bs) COPY_BULK(4, 1, 1, bs) COPY_BULK(2, 2, 1, bs)
""" + "".join(f"STREAMS({p}, {', '.join(map(str, f))})\n" for p, f in PHASES.items()) \
  + "".join(f"STREAMS1({p}, {sfx}, {x}, {res}, {mode}, {win}, {wout}, 0)\n"
            for p, (x, res, _, win, wout) in PHASES.items() if p in SHIFTED for sfx, mode in SHIFTS.items())
SHAPES = ("d2_r1", "d3_r1", "d4_r1", "d2_r2", "d3_r2", "d0_r1", "d0_r2", "d0_r4",
          "b2_r1", "b4_r1", "b2_r2", "bs2_r1", "bs4_r1", "bs2_r2")
LOADS = ("", "_reg", "_bulk", "_l2", "_l2cs")   # the phases' streams: cp.async ring, registers, bulk
# copies, the ring with an L2 prefetch hint, and with streaming stores too
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
    p.add_argument("--bulk", action="store_true", help="also each phase's streams with the ring filled by bulk copies")
    p.add_argument("--hints", action="store_true",
                   help="also each phase's streams with the ring's L2 prefetch hint (256 B), and with streaming stores too")
    p.add_argument("--shift", action="store_true",
                   help="also the phases that write the output with it one element off 16-byte alignment")
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
        x, res, out = (cp.random.randint(0, 256, 2 * elems + 16, dtype=cp.uint8) for _ in range(3))
        win, wout = cp.random.randint(0, 256, n512 * 512, dtype=cp.uint8), cp.empty(n512 * 512, dtype=cp.uint8)
        best: dict = {}
        loads = [s for s, on in zip(LOADS, (True, a.reg, a.bulk, a.hints, a.hints)) if on]
        names = [p + s for s in loads for p in PHASES] + [p + x for p in SHIFTED for x in SHIFTS if a.shift]
        decoded = []      # each form's decode moves the same bytes: the same output
        for s in loads:
            out[:] = 0
            mod.get_function("decode" + s)((grid,), (256,), (x, res, out, win, wout, np.int64(n512)))
            decoded.append(out.copy())
        if any(not bool((d == decoded[0]).all()) for d in decoded):
            raise SystemExit("stream_mix: the decode's forms stored different bytes")
        for _ in range(a.reps):      # phases alternate within a rep
            for name in names:
                f = mod.get_function(name)
                args = (x, res, out, win, wout, np.int64(n512))
                t = per_launch_us(lambda _s, f=f, args=args: f((grid,), (256,), args), a.iters, spin)
                best[name] = min(t, best.get(name, t))
        print(f"\n## {elems} elements, us (best of {a.reps} medians of {a.iters}), TB/s, % of the copy rate\n")
        print("| phase | MB | us | TB/s | % |\n|---|---:|---:|---:|---:|")
        for name, t in best.items():
            b = bytes_moved(name.split("_")[0], elems)
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
                    if not bool((out[:2 * elems] == x[:2 * elems]).all()):
                        raise SystemExit(f"stream_mix: copy_{shape} did not copy")
                    out[:] = 0
            print(f"\n### copy shapes, {elems} elements: TB/s (% of the copy rate) by blocks a SM\n")
            print("| shape | " + " | ".join(f"{g} a SM" for g in GRIDS) + " |\n|---|" + "---:|" * len(GRIDS))
            for shape in SHAPES:
                cells = [4 * elems / shape_t[shape, g] / 1e6 for g in GRIDS]
                print(f"| {shape} | " + " | ".join(f"{c:.2f} ({100 * c / copy_tbs:.0f}%)" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
