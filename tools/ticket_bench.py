#!/usr/bin/env python3
"""What the fused kernels' work items cost apart from their bytes, on one GPU: an empty launch, a
streaming copy, and the same copy cut into items taken from one atomic ticket (the fused kernels'
`next_item`), each item ending in a flag published one of several ways.

    python tools/ticket_bench.py [--mb 40 160] [--items 396 768 1536 3072] [--iters 50]

Each kernel runs with the fused kernels' launch shape (256 threads, 3 blocks a SM, the whole GPU);
``--mb`` is the bytes copied (read and written: a 16 MiB all-reduce moves about 80 MB through one
rank's HBM, 40 MB copied). Flag modes: 0 none, 1 ``st.release.sys`` (the fused kernels'), 2
``st.release.gpu``, 3 ``st.relaxed.sys`` (no ordering: a floor), 9 an ``ld.acquire.sys`` wait on a
flag that is already set, then 1 (an owner's item); 16 and 17 as 0 and 1 with no block barrier an
item (the warps walk the items on their own and take turns publishing: `ticket_items_warps`). After
each items row one more call into a cleared output is checked: every element copied, every flag
published. Times: per call, CUDA events around each launch
(medians of ``--iters``, the launches queued behind a spin kernel, as `fused_solo`), back to
back (one event pair around ``--iters`` launches, over ``--iters``), and the same in a CUDA graph
(one replay of ``--iters`` launches, median of 5, over ``--iters``).

``--pdl``: the copy also as a programmatic dependent launch (``cuLaunchKernelEx`` with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``; the kernel waits on its predecessor by
``griddepcontrol.wait``, then lets its successor launch), each launch a +1 of the previous one's
output, checked after the run: whether launching the next call early hides the launch gap.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import sys

import numpy as np

from fused_solo import _Solo, per_launch_us

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256, 3) ticket_empty(long long a) {}

extern "C" __global__ void __launch_bounds__(256, 3) ticket_pdl_add(const uint4* __restrict__ src,
                                                                   uint4* __restrict__ dst, long long n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < n; i += (long long)gridDim.x * 256) {
        uint4 v = src[i];
        dst[i] = make_uint4(v.x + 1, v.y + 1, v.z + 1, v.w + 1);
    }
}

extern "C" __global__ void __launch_bounds__(256, 3) ticket_copy(const uint4* __restrict__ src,
                                                                uint4* __restrict__ dst, long long n) {
    for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < n; i += (long long)gridDim.x * 256)
        dst[i] = src[i];
}

// ctl: {epoch, ticket, done}; flags: [0, 32768) published, [32768, ...) waited on (all ones: set).
extern "C" __global__ void __launch_bounds__(256, 3) ticket_items(const uint4* __restrict__ src,
                                                                 uint4* __restrict__ dst, long long n,
                                                                 long long nitems, unsigned* ctl,
                                                                 unsigned* flags, long long mode) {
    __shared__ long long s_item;
    __shared__ unsigned s_epoch;
    if (threadIdx.x == 0) s_epoch = *(volatile unsigned*)ctl + 1u;
    __syncthreads();
    const unsigned epoch = s_epoch;
    const long long per = n / nitems;
    for (;;) {
        __syncthreads();
        if (threadIdx.x == 0) s_item = atomicAdd(ctl + 1, 1u);
        __syncthreads();
        const long long it = s_item;
        if (it >= nitems) break;
        if (mode & 8) {
            if (threadIdx.x == 0) {
                unsigned v;
                do {
                    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(flags + 32768 + it) : "memory");
                } while ((int)(v - epoch) < 0 && v != 0xffffffffu);
            }
            __syncthreads();
        }
        for (long long i = it * per + threadIdx.x; i < (it + 1) * per; i += 256) dst[i] = src[i];
        __syncthreads();
        if (threadIdx.x == 0) {
            const int m = (int)(mode & 7);
            if (m == 1) asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flags + it), "r"(epoch) : "memory");
            else if (m == 2) asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + it), "r"(epoch) : "memory");
            else if (m == 3) asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(flags + it), "r"(epoch) : "memory");
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(ctl + 2, 1u) == gridDim.x - 1) {
        ctl[1] = 0;
        ctl[2] = 0;
        ctl[0] = epoch;
    }
}


__device__ __forceinline__ unsigned ld_acquire_cta(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.cta.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_cta(unsigned* p, unsigned v) {
    asm volatile("st.release.cta.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void add_release_cta(unsigned* p, unsigned v) {
    asm volatile("red.release.cta.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Modes 16 (no flag) and 17 (st.release.sys): the same items with no block barrier an item. The
// warps walk the block's items in order q = 0, 1, ...: warp q % 8 takes item q's ticket and posts it
// in ring slot q % 16, every warp copies its share and counts itself done there, and warp q % 8
// then waits for the 8 counts and publishes the item's flag: a system-scope release stalls one
// warp, and each warp in turn, instead of the whole block every item.
extern "C" __global__ void __launch_bounds__(256, 3) ticket_items_warps(const uint4* __restrict__ src,
                                                                       uint4* __restrict__ dst, long long n,
                                                                       long long nitems, unsigned* ctl,
                                                                       unsigned* flags, long long mode) {
    constexpr unsigned R = 16;
    __shared__ long long s_item[R];
    __shared__ unsigned s_seq[R];    // 2q + 1: item q posted; 2q + 2: item q done, its flag published
    __shared__ unsigned s_cnt[R];    // warps done with the slot's item
    __shared__ unsigned s_epoch;
    if (threadIdx.x < R) {
        s_seq[threadIdx.x] = 0;
        s_cnt[threadIdx.x] = 0;
    }
    if (threadIdx.x == 0) s_epoch = *(volatile unsigned*)ctl + 1u;
    __syncthreads();
    const unsigned epoch = s_epoch, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long per = n / nitems;
    for (unsigned q = 0;; ++q) {
        const unsigned slot = q % R;
        const bool mine = q % 8 == warp;
        if (lane == 0) {
            if (mine) {
                if (q >= R)
                    while (ld_acquire_cta(&s_seq[slot]) != 2 * (q - R) + 2) {}
                s_item[slot] = atomicAdd(ctl + 1, 1u);
                st_release_cta(&s_seq[slot], 2 * q + 1);
            } else {
                while (ld_acquire_cta(&s_seq[slot]) < 2 * q + 1) {}
            }
        }
        __syncwarp();
        const long long it = s_item[slot];
        if (it >= nitems) break;
        for (long long i = it * per + threadIdx.x; i < (it + 1) * per; i += 256) dst[i] = src[i];
        __syncwarp();
        if (lane == 0) {
            add_release_cta(&s_cnt[slot], 1u);
            if (mine) {
                while (ld_acquire_cta(&s_cnt[slot]) != 8u) {}
                s_cnt[slot] = 0;
                if (mode & 1)
                    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flags + it), "r"(epoch) : "memory");
                st_release_cta(&s_seq[slot], 2 * q + 2);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(ctl + 2, 1u) == gridDim.x - 1) {
        ctl[1] = 0;
        ctl[2] = 0;
        ctl[0] = epoch;
    }
}
"""
MODES = (0, 1, 2, 3, 9, 16, 17)
MAX_ITEMS = 32768
_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID (cuda.h)


class _Attr(ctypes.Structure):      # CUlaunchAttribute: id, padding, a 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("nattrs", ctypes.c_uint)]


@functools.cache
def _driver():
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuLaunchKernelEx.argtypes = [ctypes.c_void_p] * 4
    return cu


def launch_ex(fn, grid: int, args, pdl: bool):
    """``f(stream)``: ``cuLaunchKernelEx`` of cupy RawKernel ``fn`` (grid x 256) with 8-byte
    ``args`` packed once, as a programmatic dependent launch where ``pdl``."""
    cu = _driver()
    vals = (ctypes.c_int64 * len(args))(*[int(v) for v in args])
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(vals) + 8 * i for i in range(len(args))])
    attr = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1

    def f(stream) -> None:
        cfg = _Config((grid, 1, 1), (256, 1, 1), 0, stream.ptr, ctypes.pointer(attr) if pdl else None, int(pdl))
        err = cu.cuLaunchKernelEx(ctypes.byref(cfg), fn.kernel.ptr, params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx: CUresult {err}")

    f.keep = (vals, params, attr)
    return f


def _items_right(cp, f, mb, ni, mode, dst, words, ctl, flags) -> bool:
    """One more call ``f`` of an items row into a cleared ``dst``: the ``words`` its items cover
    copied, and in the modes that publish, every item's flag at the call's epoch."""
    dst.fill(0)
    f()
    cp.cuda.Device().synchronize()
    ok = bool((dst[:words] == 1).all())
    if (mode & 7) in (1, 2, 3):
        ok &= bool((flags[:ni] == ctl[0]).all())
    if not ok:
        print(f"# {mb} MiB, {ni} items, flag mode {mode}: WRONG (elements or flags)")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", nargs="+", type=int, default=[40, 160], help="MiB copied per call")
    p.add_argument("--items", nargs="+", type=int, default=[396, 768, 1536, 3072])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--pdl", action="store_true", help="the copy as a programmatic dependent launch too")
    a = p.parse_args(argv)
    if a.pdl and a.iters % 2:
        p.error("--pdl: --iters must be even (a graph's replays alternate the two buffers)")
    if any(not 1 <= n <= MAX_ITEMS for n in a.items):
        p.error(f"--items: 1 to {MAX_ITEMS}")

    import cupy as cp

    mod = cp.RawModule(code=SOURCE)
    empty, copy, items, items_warps, add = (mod.get_function(f"ticket_{n}")
                                            for n in ("empty", "copy", "items", "items_warps", "pdl_add"))
    spin = _Solo().spin            # holds the stream while the host queues the launches
    grid = 3 * cp.cuda.Device().attributes["MultiProcessorCount"]
    stream = cp.cuda.get_current_stream()

    def per_call(f) -> float:
        return per_launch_us(lambda _stream: f(), a.iters, spin)

    def back_to_back(f) -> float:
        for _ in range(3):
            f()
        x, y = cp.cuda.Event(), cp.cuda.Event()
        spin(2_000_000 + 100_000 * a.iters)
        x.record(stream)
        for _ in range(a.iters):
            f()
        y.record(stream)
        y.synchronize()
        return cp.cuda.get_elapsed_time(x, y) * 1e3 / a.iters

    def graph(f) -> float:
        side = cp.cuda.Stream(non_blocking=True)
        with side:
            side.begin_capture()
            try:
                for _ in range(a.iters):
                    f()
            finally:
                g = side.end_capture()
            g.launch(side)
            times = []
            for _ in range(5):
                x, y = cp.cuda.Event(), cp.cuda.Event()
                x.record(side)
                g.launch(side)
                y.record(side)
                y.synchronize()
                times.append(cp.cuda.get_elapsed_time(x, y) * 1e3 / a.iters)
        return float(np.median(times))

    ctl = cp.zeros(4, dtype=cp.uint32)
    flags = cp.full(2 * MAX_ITEMS, 0xFFFFFFFF, dtype=cp.uint32)
    # (name, the call, what to check after its timings or None)
    rows = [("empty launch", lambda: empty((grid,), (256,), (np.int64(0),)), None)]
    checks = []
    for mb in a.mb:
        n = (mb << 20) // 16
        src, dst = cp.ones(4 * n, dtype=cp.uint32), cp.zeros(4 * n, dtype=cp.uint32)
        rows.append((f"copy {mb} MiB", lambda s=src, d=dst, n=n: copy((grid,), (256,), (s, d, np.int64(n))), None))
        for ni in a.items:
            for mode in MODES:
                k = items_warps if mode & 16 else items
                f = (lambda k=k, s=src, d=dst, n=n, ni=ni, m=mode:
                     k((grid,), (256,), (s, d, np.int64(n), np.int64(ni), ctl, flags, np.int64(m))))
                rows.append((f"{mb} MiB, {ni} items, flag mode {mode}", f, (mb, ni, mode, dst, 4 * (n // ni) * ni)))
        if a.pdl:
            for pdl in (False, True):
                u, v = cp.zeros(4 * n, dtype=cp.uint32), cp.zeros(4 * n, dtype=cp.uint32)
                ping, pong = (launch_ex(add, grid, (s.data.ptr, d.data.ptr, n), pdl) for s, d in ((u, v), (v, u)))
                state = {"k": 0}

                def step(ping=ping, pong=pong, state=state) -> None:
                    (ping if state["k"] % 2 == 0 else pong)(cp.cuda.get_current_stream())
                    state["k"] += 1
                rows.append((f"+1 {mb} MiB, {'programmatic dependent launch' if pdl else 'cuLaunchKernelEx'}", step,
                             None))
                checks.append((mb, pdl, u, v, state))
    print(f"# ticketed items, grid {grid} x 256")
    print("| case | per call, us | back to back, us | CUDA graph, us |\n|---|---:|---:|---:|")
    bad = 0
    for name, f, check in rows:
        print(f"| {name} | {per_call(f):.2f} | {back_to_back(f):.2f} | {graph(f):.2f} |", flush=True)
        if check is not None:
            bad += not _items_right(cp, f, *check, ctl, flags)
    cp.cuda.Device().synchronize()
    for mb, pdl, u, v, state in checks:    # every launch added 1 to what the one before it wrote
        k = state["k"] + 5 * a.iters     # the graph's calls: captured once, replayed 6 times
        last = (v if k % 2 else u).get()
        ok = bool((last == k).all())
        bad += not ok
        print(f"# +1 chain, {mb} MiB, pdl={pdl}: {'ok' if ok else 'WRONG'} ({last[0]} after {k} launches)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
