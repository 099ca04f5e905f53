// cuda_src/staging.cuh's 16-element unit helpers (aligned and at a shift) run on the host, a warp
// at a time (warp_host.h): what each lane reads from a warp's run, and what the warp's stores
// leave in memory, against the byte layout their comments state. Buffers sit against
// inaccessible pages, so that a read or a write past the bytes a helper may touch faults. Prints
// one line per failure and a summary; exit status 1 on any failure. Built and run by
// tests/test_cuda_host.py.
#include "warp_host.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "staging.cuh"

using echo::u16;

static int g_checks = 0, g_failures = 0;
static void check(bool ok, const char* what, long a = 0, long b = 0, long c = 0) {
    ++g_checks;
    if (!ok && ++g_failures <= 20) std::printf("FAIL %s (%ld, %ld, %ld)\n", what, a, b, c);
}

// One accessible page between two inaccessible ones: lo .. hi.
struct Page {
    char *lo, *hi;
    Page() {
        const long ps = sysconf(_SC_PAGESIZE);
        char* m = static_cast<char*>(mmap(nullptr, 3 * ps, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
        if (m == MAP_FAILED) std::abort();
        mprotect(m, ps, PROT_NONE);
        mprotect(m + 2 * ps, ps, PROT_NONE);
        lo = m + ps, hi = m + 2 * ps;
    }
};

static u16 pattern(long i) { return (u16)(0x8000u ^ (unsigned)(i * 2654435761u >> 7)); }
static u16 half(const uint4& w, int i) {
    const unsigned v = i < 2 ? w.x : i < 4 ? w.y : i < 6 ? w.z : w.w;
    return (u16)((i & 1) ? v >> 16 : v & 0xffffu);
}
static uint4 chunk_of(long e0) {   // 8 pattern elements from e0, as stored
    unsigned v[4];
    for (int k = 0; k < 4; ++k) v[k] = pattern(e0 + 2 * k) | ((unsigned)pattern(e0 + 2 * k + 1) << 16);
    return make_uint4(v[0], v[1], v[2], v[3]);
}

// Copy (whole, or the first n elements) then read: lane l's unit is elements 16 l .. 16 l + 15.
static void copy_read(char* run, int n, int warp) {
    u16* p = reinterpret_cast<u16*>(run);
    for (int i = 0; i < 512; ++i) p[i] = pattern(i);
    uint4 got[32][2];
    run_warp(warp, [&](int lane) {
        uint4* r = echo::warp_ring(1);
        if (n == 512) echo::unit16_copy_async(r, p);
        else echo::unit16_copy_async_n(r, p, n);
        echo::cp_async_commit();
        echo::cp_async_wait<0>();
        __syncwarp();
        echo::unit16_read(r, got[lane][0], got[lane][1]);
    });
    for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 16; ++i) {
            const long e = 16 * l + i;
            check(half(got[l][i / 8], i % 8) == (e < n ? pattern(e) : 0), "unit16 copy/read", n, warp, e);
        }
}

// Store the lanes' units (all 512 elements, or the first n): those bytes written, no other.
static void store(char* run, int n, int warp) {
    u16* p = reinterpret_cast<u16*>(run);
    for (int i = -8; i < 520; ++i) p[i] = 0xa5a5;
    run_warp(warp, [&](int lane) {
        uint4* r = echo::warp_ring(0);
        const uint4 a = chunk_of(16 * lane), b = chunk_of(16 * lane + 8);
        if (n == 512) echo::unit16_store(r, p, a, b);
        else echo::unit16_store_n(r, p, a, b, n);
    });
    for (int i = -8; i < 520; ++i)
        check(p[i] == (i >= 0 && i < n ? pattern(i) : 0xa5a5), "unit16 store", n, warp, i);
}

// The same for a run at base + off (off even, below 16): the aligned words base .. base + 1040
// (1024 where off is 0) hold it; `base` is 16-byte aligned.
static void copy_read_at(char* base, int off, int warp) {
    u16* p = reinterpret_cast<u16*>(base + off);
    const int words = off ? 65 : 64;
    for (int i = 0; i < 8 * words; ++i) reinterpret_cast<u16*>(base)[i] = 0x5a5a;   // the neighbours'
    for (int i = 0; i < 512; ++i) p[i] = pattern(i);
    uint4 got[32][2];
    run_warp(warp, [&](int lane) {
        uint4* r = echo::warp_ring(1);
        echo::unit16_copy_async_at(r, echo::warp_edge(1), p, off);
        echo::cp_async_commit();
        echo::cp_async_wait<0>();
        __syncwarp();
        echo::unit16_read_at(r, echo::warp_edge(1), off, got[lane][0], got[lane][1]);
    });
    for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 16; ++i)
            check(half(got[l][i / 8], i % 8) == pattern(16 * l + i), "unit16 copy/read at a shift", off, warp,
                  16 * l + i);
}
static void store_at(char* base, int off, int warp) {
    u16* p = reinterpret_cast<u16*>(base + off);
    const int words = off ? 65 : 64;
    u16* w = reinterpret_cast<u16*>(base);
    for (int i = 0; i < 8 * words; ++i) w[i] = 0xa5a5;
    run_warp(warp, [&](int lane) {
        echo::unit16_store_at(echo::warp_ring(0), p, off, chunk_of(16 * lane), chunk_of(16 * lane + 8));
    });
    for (int i = 0; i < 8 * words; ++i) {
        const int e = i - off / 2;
        check(w[i] == (e >= 0 && e < 512 ? pattern(e) : 0xa5a5), "unit16 store at a shift", off, warp, e);
    }
}

int main() {
    Page page;
    const int ns[] = {1, 7, 8, 9, 255, 256, 263, 504, 511, 512};
    for (int warp : {0, 5}) {
        for (int n : ns) {
            copy_read(page.lo, n, warp);                           // a run at the page's start
            copy_read(page.hi - 1024, n, warp);                    // and at its end
            store(page.lo + 16, n, warp);
            store(page.hi - 1024 - 16, n, warp);
        }
        for (int off = 0; off < 16; off += 2) {
            const int bytes = off ? 1040 : 1024;
            copy_read_at(page.lo, off, warp);                      // the run's words at the page's start
            copy_read_at(page.hi - bytes, off, warp);              // and at its end
            store_at(page.lo, off, warp);
            store_at(page.hi - bytes, off, warp);
        }
    }
    std::printf("%d checks, %d failed\n", g_checks, g_failures);
    return g_failures ? 1 : 0;
}
