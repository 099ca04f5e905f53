// echonccl codec: global memory through shared memory, so that a warp's loads and stores cover
// whole contiguous runs: a warp's 32-element blocks, the cp.async copies and the ring of a
// thread's next chunks, the 16-element units of the 16-element loops.
#ifndef ECHO_STAGING_CUH
#define ECHO_STAGING_CUH

#include "codec_base.cuh"

namespace echo {

// ------------------------------------ a warp's 32-element blocks, coalesced through shared memory
// Where a thread holds a whole block of 32 elements (N chunks of 16 bytes: N = 4 for 16-bit
// elements, 8 for float32), a warp's 32 blocks (contiguous) go through a staging area of 32 N
// chunks in shared memory, so that every global access instruction covers 512 contiguous bytes
// instead of 32 chunks a block apart (partial sectors). Global side, "chunk order": lane l holds
// chunks l + 32 m (m < N) of the warp's run; thread side, "block order": chunk k of its own block.
// Chunk c sits in slot c ^ ((c >> 3) & (N - 1)): conflict-free in both orders. Every lane of the
// warp calls these together; blocks from `nvalid` on are neither read nor written in memory.
template <int N>
__device__ __forceinline__ int stage_slot(int c) { return c ^ ((c >> 3) & (N - 1)); }

// Chunk-order loads of the warp's blocks from p (its first block); plain or read-only path.
template <int N, bool kReadOnly>
__device__ __forceinline__ void load_chunks(const uint4* p, int nvalid, uint4 (&c)[N]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < N; ++m) {
        const int i = lane + 32 * m;
        c[m] = make_uint4(0u, 0u, 0u, 0u);
        if (i / N < nvalid) c[m] = kReadOnly ? ldg16(p + i) : p[i];
    }
}

// How many of a warp's 32 blocks, from block u0 on, lie before u_end (the `nvalid` above).
__device__ __forceinline__ int warp_blocks(i64 u0, i64 u_end) { return u_end - u0 < 32 ? (int)(u_end - u0) : 32; }

// This lane's block, read from a filled staging area (after the warp's __syncwarp).
template <int N>
__device__ __forceinline__ void read_block(const uint4* stage, uint4 (&v)[N]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = stage[stage_slot<N>(N * lane + k)];
}

// Chunk order (load_chunks) to block order through `stage` (32 N chunks).
template <int N>
__device__ __forceinline__ void chunks_to_block(uint4* stage, const uint4 (&c)[N], uint4 (&v)[N]) {
    const int lane = threadIdx.x & 31;
    __syncwarp();
#pragma unroll
    for (int m = 0; m < N; ++m) stage[stage_slot<N>(lane + 32 * m)] = c[m];
    __syncwarp();
    read_block<N>(stage, v);
}

// This lane's block v, stored to p (the warp's first block) in chunk order through `stage`.
template <int N>
__device__ __forceinline__ void store_block(uint4* stage, uint4* p, int nvalid, const uint4 (&v)[N]) {
    const int lane = threadIdx.x & 31;
    __syncwarp();
#pragma unroll
    for (int k = 0; k < N; ++k) stage[stage_slot<N>(N * lane + k)] = v[k];
    __syncwarp();
#pragma unroll
    for (int m = 0; m < N; ++m) {
        const int i = lane + 32 * m;
        if (i / N < nvalid) p[i] = stage[stage_slot<N>(i)];
    }
}

// 16 bytes copied from global src to shared dst in flight, no register holding them, until this
// thread waits for its group (cp.async, sm_80 and newer; older: a plain load and store).
__device__ __forceinline__ void cp_async16(uint4* dst, const void* src) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    u32 d;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(d) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
#else
    *dst = *reinterpret_cast<const uint4*>(src);
#endif
}
// cp_async16 of the first `bytes` (0 to 16) of src, the rest of dst zero-filled (none read past them).
__device__ __forceinline__ void cp_async16_zfill(uint4* dst, const void* src, u32 bytes) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    u32 d;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(d) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(bytes) : "memory");
#else
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    for (u32 i = 0; i < bytes; ++i) reinterpret_cast<unsigned char*>(&v)[i] = reinterpret_cast<const unsigned char*>(src)[i];
    *dst = v;
#endif
}
// This thread's copies since the last commit, as one group.
__device__ __forceinline__ void cp_async_commit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// The same chunk-order run copied from global p straight into the staging area, in flight (no
// registers) until stage_wait_block.
template <int N>
__device__ __forceinline__ void stage_chunks_async(uint4* stage, const uint4* p, int nvalid) {
    const int lane = threadIdx.x & 31;
    __syncwarp();   // the lanes are done with the stage's previous contents
#pragma unroll
    for (int m = 0; m < N; ++m) {
        const int i = lane + 32 * m;
        if (i / N < nvalid) cp_async16(stage + stage_slot<N>(i), p + i);
    }
    cp_async_commit();
}

// This lane's block of a run staged by stage_chunks_async, once every lane's copies have landed.
template <int N>
__device__ __forceinline__ void stage_wait_block(const uint4* stage, uint4 (&v)[N]) {
    cp_async_wait<0>();
    __syncwarp();
    read_block<N>(stage, v);
}

// ------------------------------------------- a thread's next chunks, in flight in shared memory
// reduce_quantize_loop loads its 16-bit own input and residual kRingDepth - 1 steps
// ahead with cp_async16 into this thread's own column of a ring in shared memory: bytes in flight
// without holding registers (the default fused owner spills 24 bytes so, 104 with them in
// registers; docs/notes/fused.md, "The levers"; 3 or 4 steps ahead were no faster). A thread reads only the
// slots it filled, so no barrier is needed; the loop waits for all its copies before it returns
// (a later phase of the block reuses the ring). The 16-element loops (reduce_quantize_loop16) keep
// a warp's 32 units of own input and residual (2 KiB; 1.5 with int8 residuals) in its part of a
// slot, the lanes reading each other's copies after a __syncwarp (below); the 8-element loops 32
// bytes a thread. The 16-element
// decode (dequantize_loop16) stages its stores in slot 0 and copies its wire ahead into slot 1.
constexpr int kRingDepth = 2;
constexpr int kRingParts = 4;
__shared__ uint4 g_ring[kRingDepth][kRingParts][ECHO_BLOCK];

// ------------------------------------------- 16 elements a thread, coalesced through shared memory
// A lane of the 16-element loops holds unit u = 32 contiguous bytes of 16-bit data (chunks 2 lane and
// 2 lane + 1 of its warp's 1 KiB); global loads and stores go through the warp's part of a ring slot
// in stage_slot<2> order, a lane moving chunks lane and lane + 32, so each instruction covers 512
// contiguous bytes. Every lane of the warp calls these together.
constexpr int kWarpRing = kRingParts * 32;   // chunks of a warp in a slot: own input 0-63, residual 64-127
__device__ __forceinline__ uint4* warp_ring(int slot) { return &g_ring[slot][0][0] + (threadIdx.x >> 5) * kWarpRing; }
// The warp's 1 KiB at p copied into r in flight (cp.async; the caller commits).
__device__ __forceinline__ void unit16_copy_async(uint4* r, const void* p) {
    const int lane = threadIdx.x & 31;
    cp_async16(r + stage_slot<2>(lane), reinterpret_cast<const uint4*>(p) + lane);
    cp_async16(r + stage_slot<2>(lane + 32), reinterpret_cast<const uint4*>(p) + lane + 32);
}
// The valid elements of the partial last 512-element block of the slice a 16-element loop of an
// any-count kernel works on (0: that block is whole; the loops' kAny). Every thread of the block stores the same
// value as the loop starts, and reads it only where a warp's step is the slice's last block: kept
// in shared memory, not in a register across the loop (where it made ptxas spill).
__shared__ int g_tail;
// unit16_copy_async of a partial 512-element block: its first n 16-bit elements (0 < n < 512), the
// rest of r zero-filled; nothing past them read.
__device__ __forceinline__ void unit16_copy_async_n(uint4* r, const void* p, int n) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const int c = lane + 32 * m, bytes = 2 * min(max(n - 8 * c, 0), 8);
        cp_async16_zfill(r + stage_slot<2>(c), reinterpret_cast<const uint4*>(p) + (bytes ? c : 0), (u32)bytes);
    }
}
// This lane's unit of r, once every lane's copies into r have landed and the warp synchronized.
__device__ __forceinline__ void unit16_read(const uint4* r, uint4& a, uint4& b) {
    const int lane = threadIdx.x & 31;
    a = r[stage_slot<2>(2 * lane)];
    b = r[stage_slot<2>(2 * lane + 1)];
}
// The lanes' units (a, b) put in r in stage_slot<2> order, for the warp to store (the unit16_store
// family); every lane done with r before, and every lane's unit in it after.
__device__ __forceinline__ void unit16_stage(uint4* r, const uint4& a, const uint4& b) {
    const int lane = threadIdx.x & 31;
    __syncwarp();
    r[stage_slot<2>(2 * lane)] = a;
    r[stage_slot<2>(2 * lane + 1)] = b;
    __syncwarp();
}
// The lanes' units (a, b) stored to the warp's 1 KiB at p through r.
__device__ __forceinline__ void unit16_store(uint4* r, void* p, const uint4& a, const uint4& b) {
    const int lane = threadIdx.x & 31;
    unit16_stage(r, a, b);
    reinterpret_cast<uint4*>(p)[lane] = r[stage_slot<2>(lane)];
    reinterpret_cast<uint4*>(p)[lane + 32] = r[stage_slot<2>(lane + 32)];
}
// unit16_store of a partial 512-element block: only its first n 16-bit elements (0 < n < 512) stored.
__device__ __forceinline__ void unit16_store_n(uint4* r, void* p, const uint4& a, const uint4& b, int n) {
    const int lane = threadIdx.x & 31;
    unit16_stage(r, a, b);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const int c = lane + 32 * m, k = n - 8 * c;
        if (k >= 8) {
            reinterpret_cast<uint4*>(p)[c] = r[stage_slot<2>(c)];
        } else if (k > 0) {
            const u16* src = reinterpret_cast<const u16*>(r + stage_slot<2>(c));
            u16* dst = reinterpret_cast<u16*>(p) + 8 * c;
            for (int i = 0; i < k; ++i) dst[i] = src[i];
        }
    }
}

// ---------------------------- 16-bit data off 16-byte alignment through the 16-element loops
// A warp's 1 KiB run at p, p off a 16-byte boundary by `off` bytes (p & 15; even, as a 16-bit
// element's address is): the aligned words holding it are words 0 .. 64 from p - off (0 .. 63
// where off is 0), and no byte past them is read or written. Loads copy those words, lanes
// reading theirs at the shift (bytes_at); stores stage the lanes' units, then write the run's
// aligned words: whole ones with one 16-byte store, the run's elements in the first and last (which
// hold neighbouring runs' bytes) with 2-byte stores. off 0 is the aligned helpers' layout.

// A buffer's shift: its bytes off 16-byte alignment (every run of a slice shares it: a slice is
// whole 512-element blocks).
__device__ __forceinline__ int shift16_of(const void* p) { return (int)(reinterpret_cast<u64>(p) & 15u); }
// The own input's 65th word, a warp's in each ring slot (its part of the slot holds 64 words).
__shared__ uint4 g_ring_edge[kRingDepth][ECHO_BLOCK / 32];
__device__ __forceinline__ uint4* warp_edge(int slot) { return &g_ring_edge[slot][threadIdx.x >> 5]; }
// unit16_copy_async of the run at p, off by `off`: its words 0 .. 63 into r, word 64 into *edge.
__device__ __forceinline__ void unit16_copy_async_at(uint4* r, uint4* edge, const void* p, int off) {
    const int lane = threadIdx.x & 31;
    const uint4* q = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(p) - off);
    cp_async16(r + stage_slot<2>(lane), q + lane);
    cp_async16(r + stage_slot<2>(lane + 32), q + lane + 32);
    if (lane == 31 && off != 0) cp_async16(edge, q + 64);
}
// This lane's unit of a run copied by unit16_copy_async_at, once every lane's copies landed and
// the warp synchronized.
__device__ __forceinline__ void unit16_read_at(const uint4* r, const uint4* edge, int off, uint4& a, uint4& b) {
    const int lane = threadIdx.x & 31;
    const uint4 c1 = r[stage_slot<2>(2 * lane + 1)];
    a = bytes_at(r[stage_slot<2>(2 * lane)], c1, off);
    b = bytes_at(c1, lane == 31 ? *edge : r[stage_slot<2>(2 * lane + 2)], off);
}
// The lanes' units (a, b) stored to the run at p, off by `off`, through r (unit16_stage): the
// run's whole words 1 .. 63 one 16-byte store a lane each, then its bytes in words 0 and 64 (which
// hold neighbouring runs' bytes) in one 2-byte store: lane h < 8 half h of word 0, lane 8 + h half h
// of word 64, where the run holds it.
__device__ __forceinline__ void unit16_store_at(uint4* r, void* p, int off, const uint4& a, const uint4& b) {
    const int lane = threadIdx.x & 31;
    unit16_stage(r, a, b);
    uint4* q = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(p) - off);
    if (off == 0) {
        q[lane] = r[stage_slot<2>(lane)];
        q[lane + 32] = r[stage_slot<2>(lane + 32)];
        return;
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {   // word m: the staged bytes from 16 m - off, in chunks m - 1 and m
        const int m = lane + 32 * k;
        if (m > 0) q[m] = bytes_at(r[stage_slot<2>(m - 1)], r[stage_slot<2>(m)], 16 - off);
    }
    const int h = lane & 7, lead = off >> 1;   // lead: the elements of word 0 before the run
    const int e = lane < 8 ? h - lead : 512 - lead + h;
    if (lane < 16 && (lane < 8 ? e >= 0 : h < lead))
        reinterpret_cast<u16*>(q + (lane < 8 ? 0 : 64))[h] = reinterpret_cast<const u16*>(r + stage_slot<2>(e >> 3))[e & 7];
}

}  // namespace echo

#endif  // ECHO_STAGING_CUH
