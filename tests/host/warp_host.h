// Host stand-ins for the CUDA built-ins of cuda_src/, so that its device code runs on a CPU: one
// std::thread a lane, a warp at a time (run_warp: __syncthreads is the warp's barrier, the warp the
// block) or a whole block at once (run_block_at_once: its warps concurrent, __syncthreads a barrier
// of all of them); __syncwarp a barrier of the warp's 32, __shfl_xor_sync an exchange between two
// of them, `__shared__` memory a static (one block at a time in a process: tests/host/fused_check.cpp
// runs each block in a process of its own), atomics the compiler's, and inline PTX (made calls of
// echo_host::ptx by hostify.py) interpreted here: the sm_90 paths (__CUDA_ARCH__ 900), cp.async a
// copy at issue. Include before the hostified headers; define ECHO_BLOCK as kernel_table does.
#ifndef ECHO_WARP_HOST_H
#define ECHO_WARP_HOST_H

#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define __CUDA_ARCH__ 900
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__
#define __shared__ [[maybe_unused]] static
#define __align__(n) alignas(n)
#define __launch_bounds__(...)

struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct alignas(8) uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
struct HostDim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local HostDim3 threadIdx;
inline HostDim3 blockIdx, blockDim{ECHO_BLOCK, 1, 1}, gridDim{1, 1, 1};
// The calling lane's warp: its barrier, its block's, its shuffle slots (set by run_warp and run_block_at_once).
inline thread_local std::barrier<>* t_warp_barrier = nullptr;
inline thread_local std::barrier<>* t_block_barrier = nullptr;
inline thread_local unsigned* t_shfl_slots = nullptr;
inline void __syncwarp(unsigned = 0xffffffffu) { t_warp_barrier->arrive_and_wait(); }
// g_late_thread (fused_check's ECHO_HOST_LATE_THREAD): the thread of that index lingers 20 ms after
// each block barrier, as a warp the GPU runs late would: a read of what another thread writes
// after the same barrier, unordered by the next one, then sees the later value.
inline int g_late_thread = -1;
inline void __syncthreads() {
    t_block_barrier->arrive_and_wait();
    if ((int)threadIdx.x == g_late_thread) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    s &= 31u;
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> s);
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long b = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((b >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
template <typename T> T __ldg(const T* p) { return *p; }
template <typename T> T __ldcg(const T* p) { return *p; }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
template <typename T> T max(T a, T b) { return a > b ? a : b; }
template <typename T>
T __shfl_xor_sync(unsigned, T v, int m, int = 32) {
    static_assert(sizeof(T) == 4, "32-bit shuffles");
    unsigned* slots = t_shfl_slots;
    const int lane = (int)(threadIdx.x & 31);
    __syncwarp();
    std::memcpy(&slots[lane], &v, 4);
    __syncwarp();
    T r;
    std::memcpy(&r, &slots[lane ^ m], 4);
    return r;
}

// body(lane) on the 32 lanes of warp `warp` of a block, concurrently; returns when all are done.
inline void run_warp(int warp, const std::function<void(int)>& body) {
    std::barrier<> bar(32);
    unsigned slots[32];
    std::vector<std::thread> lanes;
    for (int l = 0; l < 32; ++l)
        lanes.emplace_back([&, l] {
            threadIdx.x = (unsigned)(32 * warp + l);
            t_warp_barrier = t_block_barrier = &bar;
            t_shfl_slots = slots;
            body(l);
        });
    for (auto& t : lanes) t.join();
}
// body() on every warp of a block (ECHO_BLOCK threads), one warp after another: stricter than
// the warps running at once, so right for code whose warps share nothing between barriers.
inline void run_block(const std::function<void()>& body) {
    for (int w = 0; w < ECHO_BLOCK / 32; ++w) run_warp(w, [&](int) { body(); });
}
// body() on the ECHO_BLOCK threads of a block at once, its warps concurrent: what a kernel's item
// loop needs (its barriers order the warps).
inline void run_block_at_once(const std::function<void()>& body) {
    constexpr int kWarps = ECHO_BLOCK / 32;
    std::barrier<> block(ECHO_BLOCK);
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (int w = 0; w < kWarps; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
    std::vector<unsigned> slots(ECHO_BLOCK);
    std::vector<std::thread> threads;
    for (int t = 0; t < ECHO_BLOCK; ++t)
        threads.emplace_back([&, t] {
            threadIdx.x = (unsigned)t;
            t_warp_barrier = warps[t / 32].get();
            t_block_barrier = &block;
            t_shfl_slots = &slots[t & ~31];
            body();
        });
    for (auto& t : threads) t.join();
}

namespace echo_host {
typedef unsigned long long u64;

// An operand of an asm statement: an output's address, or an input's bits (pointers as addresses).
struct Op {
    void* p = nullptr;
    int bytes = 0;
    u64 bits = 0;
};
template <typename T> Op out(T& x) { return Op{&x, (int)sizeof(T), 0}; }
template <typename T> Op in(const T& x) {
    Op o{nullptr, (int)sizeof(T), 0};
    if constexpr (std::is_pointer_v<T>) o.bits = (u64)(uintptr_t)x;
    else std::memcpy(&o.bits, &x, sizeof(T));
    return o;
}
inline float f32(const Op& o) { float f; std::memcpy(&f, &o.bits, 4); return f; }
inline unsigned u32(const Op& o) { return (unsigned)o.bits; }
template <typename T> void set(const Op& o, T v) {
    std::memcpy(o.p, &v, o.bytes < (int)sizeof(T) ? o.bytes : sizeof(T));
}

// Shared-window addresses (cvta.to.shared): offsets from an anchor in this program's data.
inline char g_anchor;
inline unsigned to_shared(u64 p) { return (unsigned)(p - (u64)(uintptr_t)&g_anchor); }
inline void* from_shared(unsigned a) { return reinterpret_cast<void*>((uintptr_t)&g_anchor + (long long)(int)a); }

inline unsigned short f32_to_f16(float f) {   // round to nearest even; NaN -> 0x7fff
    unsigned x = __float_as_uint(f), s = (x >> 16) & 0x8000u;
    const unsigned a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fff;
    if (a >= 0x477ff000u) return (unsigned short)(s | 0x7c00u);   // rounds to or past 65520
    if (a < 0x38800000u) {   // subnormal or zero in half: value / 2^-24, rounded
        const float q = std::nearbyint(__uint_as_float(a) * 16777216.0f);
        return (unsigned short)(s | (unsigned)q);
    }
    const unsigned r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;
    return (unsigned short)(s | (r >> 13));
}
inline float f16_to_f32(unsigned short h) {
    const unsigned s = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return __uint_as_float(s) + (s ? -1.0f : 1.0f) * (float)m * 5.9604644775390625e-8f;
    if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13));
    return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}
inline unsigned short f32_to_bf16(float f) {   // round to nearest even; NaN -> 0x7fff
    const unsigned x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline std::string norm(const char* t) {
    std::string s;
    for (const char* c = t; *c; ++c)
        if (!(*c == ' ' && (s.empty() || s.back() == ' '))) s += *c;
    return s;
}

// One inline PTX statement of cuda_src/: its template and operands (%0 .. in order).
inline void ptx(const char* tmpl, std::initializer_list<Op> list) {
    const std::vector<Op> o(list);
    const std::string t = norm(tmpl);
    auto is = [&](const char* s) { return t == s; };
    if (is("add.rn.f32 %0, %1, %2;")) return set(o[0], f32(o[1]) + f32(o[2]));
    if (is("sub.rn.f32 %0, %1, %2;")) return set(o[0], f32(o[1]) - f32(o[2]));
    if (is("mul.rn.f32 %0, %1, %2;")) return set(o[0], f32(o[1]) * f32(o[2]));
    if (is("div.rn.f32 %0, %1, %2;")) return set(o[0], f32(o[1]) / f32(o[2]));
    if (is("fma.rn.f32 %0, %1, %2, %3;")) return set(o[0], std::fma(f32(o[1]), f32(o[2]), f32(o[3])));
    if (is("rcp.rn.f32 %0, %1;")) return set(o[0], 1.0f / f32(o[1]));
    if (is("cvt.rni.s32.f32 %0, %1;")) {   // NaN -> 0, out of range saturated
        const float v = f32(o[1]);
        if (std::isnan(v)) return set(o[0], 0);
        if (v >= 2147483647.0f) return set(o[0], 2147483647);
        if (v <= -2147483648.0f) return set(o[0], (int)0x80000000);
        return set(o[0], (int)std::nearbyint(v));
    }
    if (is("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }"))
        return set(o[0], f16_to_f32((unsigned short)o[1].bits));
    if (is("cvt.rn.f16.f32 %0, %1;")) return set(o[0], f32_to_f16(f32(o[1])));
    if (is("cvt.rn.bf16.f32 %0, %1;")) return set(o[0], f32_to_bf16(f32(o[1])));
    if (is("cvt.rn.f16x2.f32 %0, %1, %2;"))
        return set(o[0], (unsigned)f32_to_f16(f32(o[1])) << 16 | f32_to_f16(f32(o[2])));
    if (is("cvt.rn.bf16x2.f32 %0, %1, %2;"))
        return set(o[0], (unsigned)f32_to_bf16(f32(o[1])) << 16 | f32_to_bf16(f32(o[2])));
    if (t.rfind("lop3.b32 %0, %1, %2, %3, ", 0) == 0) {
        const unsigned lut = (unsigned)std::stoul(t.substr(24), nullptr, 0), a = u32(o[1]), b = u32(o[2]), c = u32(o[3]);
        unsigned r = 0;
        for (int i = 0; i < 8; ++i)
            if (lut >> i & 1u) r |= ((i & 4) ? a : ~a) & ((i & 2) ? b : ~b) & ((i & 1) ? c : ~c);
        return set(o[0], r);
    }
    if (is("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }")) return set(o[0], to_shared(o[1].bits));
    if (is("cp.async.cg.shared.global [%0], [%1], 16;") || is("cp.async.cg.shared.global [%0], [%1], 16, %2;")) {
        const unsigned n = o.size() > 2 ? u32(o[2]) : 16u;
        unsigned char* d = static_cast<unsigned char*>(from_shared(u32(o[0])));
        std::memset(d, 0, 16);
        if (n) std::memcpy(d, reinterpret_cast<const void*>((uintptr_t)o[1].bits), n);
        return;
    }
    if (is("cp.async.commit_group;") || t.rfind("cp.async.wait_group", 0) == 0) return;
    if (is("ld.acquire.sys.global.u32 %0, [%1];")) {   // a flag's spin: the lanes it waits for get the CPU
        std::this_thread::yield();
        return set(o[0], __atomic_load_n(reinterpret_cast<unsigned*>((uintptr_t)o[1].bits), __ATOMIC_ACQUIRE));
    }
    if (is("st.release.sys.global.u32 [%0], %1;"))
        return __atomic_store_n(reinterpret_cast<unsigned*>((uintptr_t)o[0].bits), u32(o[1]), __ATOMIC_RELEASE);
    // the low-latency one-shot's 8-byte lines {data, epoch}: one store, one load (single-copy atomic)
    if (is("st.volatile.global.v2.u32 [%0], {%1, %2};"))
        return __atomic_store_n(reinterpret_cast<u64*>((uintptr_t)o[0].bits), (u64)u32(o[2]) << 32 | u32(o[1]),
                                __ATOMIC_RELAXED);
    if (is("ld.volatile.global.v2.u32 {%0, %1}, [%2];")) {   // a line's spin
        std::this_thread::yield();
        const u64 v = __atomic_load_n(reinterpret_cast<const u64*>((uintptr_t)o[2].bits), __ATOMIC_RELAXED);
        set(o[0], (unsigned)v);
        return set(o[1], (unsigned)(v >> 32));
    }
    if (is("mov.u64 %0, %%globaltimer;"))
        return set(o[0], (u64)std::chrono::steady_clock::now().time_since_epoch().count());
    std::fprintf(stderr, "warp_host.h: no host version of the PTX \"%s\"\n", tmpl);
    std::abort();
}
}  // namespace echo_host

#endif  // ECHO_WARP_HOST_H
