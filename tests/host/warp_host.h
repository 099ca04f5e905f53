// Host stand-ins for the CUDA built-ins that cuda_src/staging.cuh uses, so that its warp-level
// data movement runs on a CPU: one std::thread a lane (run_warp), __syncwarp a barrier of the 32,
// `__shared__` memory a plain global, cp.async the sources' pre-sm_80 path (a plain copy).
// Include before the CUDA headers; define ECHO_BLOCK as kernel_table does.
#ifndef ECHO_WARP_HOST_H
#define ECHO_WARP_HOST_H

#include <barrier>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#define __CUDA_ARCH__ 700   // the sources' paths without inline PTX
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __shared__
#define __align__(n) alignas(n)

struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct HostDim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local HostDim3 threadIdx;
inline std::barrier<>* g_host_warp_barrier = nullptr;
inline void __syncwarp(unsigned = 0xffffffffu) { g_host_warp_barrier->arrive_and_wait(); }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    s &= 31u;
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> s);
}
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint4 __ldg(const uint4* p) { return *p; }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
template <typename T> T max(T a, T b) { return a > b ? a : b; }

// body(lane) on the 32 lanes of warp `warp` of a block, concurrently; returns when all are done.
inline void run_warp(int warp, const std::function<void(int)>& body) {
    std::barrier<> bar(32);
    g_host_warp_barrier = &bar;
    std::vector<std::thread> lanes;
    for (int l = 0; l < 32; ++l)
        lanes.emplace_back([&, l] {
            threadIdx.x = (unsigned)(32 * warp + l);
            body(l);
        });
    for (auto& t : lanes) t.join();
    g_host_warp_barrier = nullptr;
}

#endif  // ECHO_WARP_HOST_H
