// The fused kernels' 16-element loops and the general two-shot's phases run on the host, a warp
// at a time (warp_host.h). No argument: the shifted kernels' loops (kShift), on input and output
// at every shift off 16-byte alignment, must write the same bytes as the aligned loops on aligned
// copies of the same data (the contribution, int4-h32; the owner, int4-h32 in and int7-h32 sums,
// its output apart and in place; the decode, int7-h32), bytes outside a loop's elements left
// alone; prints one line per failure and a summary, exit status 1 on any failure. With a folder, a
// kernel (general, shift, whole, any), a type (bf16, f16) and a residual format (input, int8): that
// kernel's phases on a slice, their inputs and outputs written there for the numpy reference
// (dump). Built and run by tests/test_cuda_host.py.
#include "warp_host.h"

#include <cstdio>
#include <random>

#include "codec.cuh"
#include "fused_phases.cuh"

using namespace echo;

static int g_checks = 0, g_failures = 0;
static void check(bool ok, const char* what, long a = 0, long b = 0, long c = 0) {
    ++g_checks;
    if (!ok && ++g_failures <= 20) std::printf("FAIL %s (%ld, %ld, %ld)\n", what, a, b, c);
}

constexpr i64 S = 512 * 64;           // one slice: 2048 units, 8 steps of warp 0 (stride 256 units)
constexpr i64 kUnits = S / 16, kStride = 256;
constexpr int kMargin = 64;           // bytes before and after each buffer, left alone

// A byte buffer whose data starts `off` bytes past a 16-byte boundary, margins filled with 0xa5.
struct Buf {
    std::vector<unsigned char> mem;
    size_t off, n;
    Buf(size_t bytes, size_t off_) : mem(bytes + 2 * kMargin + 32, 0xa5), off(off_), n(bytes) {}
    unsigned char* base() {
        const uintptr_t a = ((uintptr_t)mem.data() + kMargin + 15) & ~(uintptr_t)15;
        return reinterpret_cast<unsigned char*>(a) + off;
    }
    // the data and the margins, for comparing
    std::vector<unsigned char> view() { return std::vector<unsigned char>(base() - kMargin, base() + n + kMargin); }
};

static std::mt19937 g_rng(1234);
template <typename T>
static u16 bits16_of(float v) { return IsSame<T, bf16_t>::v ? echo_host::f32_to_bf16(v) : echo_host::f32_to_f16(v); }
template <typename T>
static void fill_values(unsigned char* p, i64 n, float sigma) {
    std::normal_distribution<float> d(0.0f, sigma);
    u16* h = reinterpret_cast<u16*>(p);
    for (i64 i = 0; i < n; ++i) h[i] = bits16_of<T>(d(g_rng));
}
// Wire slices of codec (G, kCodec): random codes, bfloat16 scales in [2^-7, 2^-3).
template <int G, int kCodec>
static void fill_wire(unsigned char* p, int nslices) {
    using W = Wire<G, kCodec>;
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> sc(1.0f / 128, 1.0f / 8);
    for (i64 i = 0; i < nslices * W::slice_bytes(S); ++i) p[i] = (unsigned char)byte(g_rng);
    for (i64 c = 0; c < nslices * (S >> 9); ++c)
        for (int g = 0; g < W::kChunkGroups; ++g) {
            const u16 b = echo_host::f32_to_bf16(sc(g_rng));
            std::memcpy(p + c * W::kChunkBytes + W::kScaleOff + 2 * g, &b, 2);
        }
}

// Warp 0 of a block, one tile a slice: a lane's first unit unit_first(0, 1), stepping by kStride.
template <typename T, bool kOut, bool kShift>
static void rq(unsigned char* incoming, int n_in, int own_pos, unsigned char* own, unsigned char* res,
               unsigned char* wire, unsigned char* out) {
    constexpr int G = kOut ? 16 : 32, kCodec = kOut ? kInt7H32 : kInt4H32;
    run_warp(0, [&](int) {
        reduce_quantize_loop16<T, T, G, kCodec, kOut, 32, kInt4H32, false, false, kShift>(
            RqArgs<T, T, float, T>{incoming, n_in, own_pos, reinterpret_cast<const T*>(own), S,
                                   reinterpret_cast<T*>(res), wire, S, nullptr, 0, nullptr, 0, 0,
                                   reinterpret_cast<T*>(out), S},
            unit_first(0, 1), kUnits, kStride);
    });
}
template <typename T, bool kShift>
static void dq(const unsigned char* wire, unsigned char* out) {
    run_warp(0, [&](int) {
        dequantize_loop16<T, 16, false, kInt7H32, false, kShift>(wire, reinterpret_cast<T*>(out), S, 0,
                                                                  unit_first(0, 1), kUnits, kStride);
    });
}

// One case: the input at in_off, the output at out_off (in place: out_off < 0).
template <typename T, bool kOut>
static void loop_case(int in_off, int out_off, int own_pos) {
    const size_t vb = 2 * S, wb = Wire<kOut ? 16 : 32, kOut ? kInt7H32 : kInt4H32>::slice_bytes(S);
    const int n_in = kOut ? 2 : 0;
    Buf incoming(n_in * Wire<32, kInt4H32>::slice_bytes(S) + 16, 0);
    if (kOut) fill_wire<32, kInt4H32>(incoming.base(), n_in);
    Buf own_a(vb, 0), own_s(vb, in_off), res_a(vb, 0), res_s(vb, 0), wire_a(wb, 0), wire_s(wb, 0);
    Buf out_a(vb, 0), out_s(vb, out_off < 0 ? 0 : out_off);
    fill_values<T>(own_a.base(), S, 1.0f);
    fill_values<T>(res_a.base(), S, 0.01f);
    std::memcpy(own_s.base(), own_a.base(), vb);
    std::memcpy(res_s.base(), res_a.base(), vb);
    const bool in_place = out_off < 0;
    unsigned char* oa = in_place ? own_a.base() : out_a.base();
    unsigned char* os = in_place ? own_s.base() : out_s.base();
    rq<T, kOut, false>(incoming.base(), n_in, own_pos, own_a.base(), res_a.base(), wire_a.base(), oa);
    rq<T, kOut, true>(incoming.base(), n_in, own_pos, own_s.base(), res_s.base(), wire_s.base(), os);
    const long k = kOut * 100 + own_pos * 10 + in_place;
    check(wire_s.view() == wire_a.view(), "the codes at a shift", k, in_off, out_off);
    check(res_s.view() == res_a.view(), "the residuals at a shift", k, in_off, out_off);
    check(own_s.view() == own_a.view(), "the input (or in place the output) at a shift", k, in_off, out_off);
    if (kOut && !in_place) check(out_s.view() == out_a.view(), "the owner's output at a shift", k, in_off, out_off);
    if (!kOut) return;
    Buf dec_a(vb, 0), dec_s(vb, in_off);
    dq<T, false>(wire_a.base(), dec_a.base());
    dq<T, true>(wire_a.base(), dec_s.base());
    check(dec_s.view() == dec_a.view(), "the decode at a shift", k, in_off);
    check(dec_a.view() != Buf(vb, 0).view(), "the decode wrote", k, in_off);   // the test sees the loop's work
}

// Residuals of type R for one slice: the input's type (sigma 0.01), or the int8 block format
// (codec.py: per 512 elements 512 mantissas, then 16 exponent bytes, here 115-122: about 0.01).
template <typename R>
static size_t res_bytes() { return IsI8<R>::v ? (S / 512) * 528 : 2 * S; }
template <typename R>
static void fill_residuals(unsigned char* p) {
    if constexpr (IsI8<R>::v) {
        std::uniform_int_distribution<int> m(-127, 127), x(115, 122);
        for (i64 r = 0; r < S / 512; ++r) {
            for (int i = 0; i < 512; ++i) p[528 * r + i] = (unsigned char)(signed char)m(g_rng);
            for (int i = 0; i < 16; ++i) p[528 * r + 512 + i] = (unsigned char)x(g_rng);
        }
    } else {
        fill_values<R>(p, S, 0.01f);
    }
}

// The two-shot's phases (fused_phases.cuh) on one slice of n valid elements of type T with
// residuals of type R (T, or the int8 format), every warp of the block in turn, one tile: the
// general kernels' (kWhole false) on n not a multiple of 512 with the input and outputs off 16-byte
// alignment (the 8-element loops alone; their shifted twins', kShift: the 16-element loops, then
// the 8-element ones for the rest); the whole kernels' on aligned buffers, and their any-count
// twins' (kAny) on n not a multiple of 512.
// Inputs and outputs go to dir for the numpy reference (tests/test_cuda_host.py): x, r0 (the
// residuals before), incoming (two int4-h32 slices), wire4 and res4 (the contribution), wire7,
// res7 and out (the owner, own_pos 1), dec (the decode of wire7); n in n.txt.
template <typename T, typename R, bool kWhole, bool kAny, bool kShift>
static void dump(const std::string& dir, i64 n) {
    constexpr int kX = kWhole ? 0 : 6, kOut = kWhole ? 0 : 10, kDec = kWhole ? 0 : 14;
    const size_t vb = 2 * S, rb = res_bytes<R>(), b4 = Wire<32, kInt4H32>::slice_bytes(S),
                 b7 = Wire<16, kInt7H32>::slice_bytes(S);
    Buf x(vb, kX), r0(rb, 0), incoming(2 * b4, 0), wire4(b4, 0), res4(rb, 0), wire7(b7, 0), res7(rb, 0),
        out(vb, kOut), dec(vb, kDec);
    fill_values<T>(x.base(), n, 1.0f);
    // groups that plain_residual does not pass, so the residuals' non-finite tests run: +inf, NaN,
    // 2^125 (float16: +inf)
    const float special[] = {INFINITY, NAN, 0x1p125f};
    for (int i = 0; i < 3; ++i) reinterpret_cast<u16*>(x.base())[1000 + 1100 * i] = bits16_of<T>(special[i]);
    fill_residuals<R>(r0.base());
    fill_wire<32, kInt4H32>(incoming.base(), 2);
    std::memcpy(res4.base(), r0.base(), rb);
    std::memcpy(res7.base(), r0.base(), rb);
    const T* own = reinterpret_cast<const T*>(x.base());
    run_block([&] {
        phase_contribute<T, R, 32, kInt4H32, kWhole, kAny, kShift>(own, n, reinterpret_cast<R*>(res4.base()),
                                                                   wire4.base(), S, 0, 1);
    });
    run_block([&] {
        phase_reduce<T, R, float, 16, kInt7H32, 32, kInt4H32, kWhole, kAny, kShift>(
            incoming.base(), 2, 1, own, n, reinterpret_cast<R*>(res7.base()), wire7.base(), S, nullptr, 0, 0, 1,
            nullptr, 0, 0, reinterpret_cast<T*>(out.base()), n);
    });
    run_block([&] {
        phase_decode<T, 16, kInt7H32, kWhole, false, kAny, kShift>(wire7.base(), reinterpret_cast<T*>(dec.base()),
                                                                    n, S, 0, 0, 1, 0);
    });
    const std::pair<const char*, Buf*> files[] = {
        {"x", &x}, {"r0", &r0}, {"incoming", &incoming}, {"wire4", &wire4}, {"res4", &res4},
        {"wire7", &wire7}, {"res7", &res7}, {"out", &out}, {"dec", &dec}};
    for (const auto& [name, b] : files) {
        FILE* f = std::fopen((dir + "/" + name + ".bin").c_str(), "wb");
        if (!f || std::fwrite(b->base(), 1, b->n, f) != b->n) std::abort();
        std::fclose(f);
    }
    FILE* f = std::fopen((dir + "/n.txt").c_str(), "w");
    std::fprintf(f, "%lld\n", n);
    std::fclose(f);
}
template <typename T, typename R>
static int dump_kernel(const std::string& dir, const std::string& kernel) {
    if (kernel == "general") dump<T, R, false, false, false>(dir, S - 300);
    else if (kernel == "shift") dump<T, R, false, false, true>(dir, S - 300);
    else if (kernel == "whole") dump<T, R, true, false, false>(dir, S);
    else if (kernel == "any") dump<T, R, true, true, false>(dir, S - 300);
    else return 2;
    return 0;
}

int main(int argc, char** argv) {
    if (argc > 4) {   // folder, general | shift | whole | any, bf16 | f16, input | int8
        const std::string dir = argv[1], kernel = argv[2], t = argv[3], r = argv[4];
        if (t == "bf16" && r == "int8") return dump_kernel<bf16_t, i8res_t>(dir, kernel);
        if (t == "bf16") return dump_kernel<bf16_t, bf16_t>(dir, kernel);
        if (t == "f16" && r == "int8") return dump_kernel<half_t, i8res_t>(dir, kernel);
        if (t == "f16") return dump_kernel<half_t, half_t>(dir, kernel);
        return 2;
    }
    for (int in_off = 0; in_off < 16; in_off += 2) {
        loop_case<bf16_t, false>(in_off, 0, 0);
        loop_case<bf16_t, true>(in_off, (in_off + 6) % 16, 0);
        loop_case<bf16_t, true>(in_off, in_off, 1);
        loop_case<bf16_t, true>(in_off, -1, 1);   // in place
        loop_case<half_t, true>(in_off, -1, 0);
    }
    std::printf("%d checks, %d failed\n", g_checks, g_failures);
    return g_failures ? 1 : 0;
}
