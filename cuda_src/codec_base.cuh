// echonccl codec, the base of the CUDA twin of echonccl/codec.py (codec.cuh has the rules every part
// keeps): the launch constants, float32 operations with explicit rounding, the element types, and
// loads / stores of 8 elements and of the int8 residual format.
#ifndef ECHO_CODEC_BASE_CUH
#define ECHO_CODEC_BASE_CUH

// The launch constants come from echonccl/kernel_table.py, which writes them at the top of every
// source it generates (ECHO_BLOCK: threads per block of every kernel).
#ifndef ECHO_BLOCK
#error "ECHO_BLOCK is not defined: compile the sources echonccl/kernel_table.py generates"
#endif

namespace echo {

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
typedef long long i64;

// ---------------------------------------------------------------- float32 ops
// One inline-PTX instruction per operation: .rn rounding, no .ftz, never contracted into an fma.
#define ECHO_F32_BINOP(NAME, INSTR)                                          \
    __device__ __forceinline__ float NAME(float a, float b) {               \
        float r;                                                             \
        asm(INSTR " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                \
        return r;                                                            \
    }
ECHO_F32_BINOP(add_rn, "add.rn.f32")
ECHO_F32_BINOP(sub_rn, "sub.rn.f32")
ECHO_F32_BINOP(mul_rn, "mul.rn.f32")
ECHO_F32_BINOP(div_rn, "div.rn.f32")  // IEEE-754 division, correctly rounded, subnormals kept
#undef ECHO_F32_BINOP
// fl(a * b + c), rounded once (no .ftz): with b = +-1 the product is exact, so this is
// fl(c +- a), the same bits as add_rn / sub_rn (the rotations); with b a power of two too (i8_encode).
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}
// rint (nearest, ties to even) straight to int; saturating, NaN -> 0.
__device__ __forceinline__ int rint_s32(float a) {
    int r;
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(a));
    return r;
}
// IEEE-754 reciprocal, correctly rounded, subnormals kept.
__device__ __forceinline__ float rcp_rn(float a) {
    float r;
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ float i2f(int q) { return (float)q; }  // exact for |q| < 2^24

__device__ __forceinline__ u32 fbits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float bitsf(u32 b) { return __uint_as_float(b); }
__device__ __forceinline__ u32 abs_bits(float x) { return fbits(x) & 0x7fffffffu; }
__device__ __forceinline__ bool is_finite(float x) { return abs_bits(x) < 0x7f800000u; }

// The NaN numpy writes for a non-finite group's scale: float32(np.nan).
constexpr u32 kScaleNaN = 0x7fc00000u;
// x + 1.5*2^23 rounds x to an integer, ties to even, for |x| < 2^22: the float
// add does rint on the full-rate FP pipe (no conversion instruction), the low
// bits of the sum's encoding are the integer in two's complement, and
// subtracting the constant back gives rint(x) as a float, exactly.
constexpr float kMagic = 12582912.0f;  // 0x4b400000

// ------------------------------------------------------------ element types
// Storage-only 16-bit types (same layout as __half / __nv_bfloat16).
struct __align__(2) half_t { u16 x; };
struct __align__(2) bf16_t { u16 x; };

template <typename A, typename B> struct IsSame { static constexpr bool v = false; };
template <typename A> struct IsSame<A, A> { static constexpr bool v = true; };
template <bool C, typename A, typename B> struct Pick { using type = A; };      // C ? A : B
template <typename A, typename B> struct Pick<false, A, B> { using type = B; };
typedef half_t f16;
typedef bf16_t bf16;
typedef float f32;

template <typename T> struct Traits;

template <> struct Traits<float> {
    static constexpr int kBytes = 4;
    __device__ static __forceinline__ float to_f32(float v) { return v; }
    __device__ static __forceinline__ float from_f32(float v) { return v; }
    // numpy: q * NaN returns the NaN operand, quieted.
    __device__ static __forceinline__ float nan_of_scale(u32 s) { return bitsf(s | 0x00400000u); }
    __device__ static __forceinline__ float round2(float v) { return v; }
};

template <> struct Traits<half_t> {
    static constexpr int kBytes = 2;
    __device__ static __forceinline__ float to_f32(half_t v) {
        float r;
        asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(r) : "h"(v.x));
        return r;
    }
    __device__ static __forceinline__ half_t from_f32(float v) {  // __float2half_rn
        u16 r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
        return half_t{r};
    }
    // Two conversions in one instruction: lo in bits 0-15, hi in bits 16-31.
    __device__ static __forceinline__ u32 pack2(float lo, float hi) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#else
        return (u32)from_f32(lo).x | ((u32)from_f32(hi).x << 16);
#endif
    }
    __device__ static __forceinline__ float lo_f32(u32 p) { return to_f32(half_t{(u16)(p & 0xffffu)}); }
    __device__ static __forceinline__ float hi_f32(u32 p) { return to_f32(half_t{(u16)(p >> 16)}); }
    __device__ static __forceinline__ half_t nan_of_scale(u32 s) {
        // numpy npy_floatbits_to_halfbits on the quieted NaN s | 0x400000.
        u32 f = s | 0x00400000u;
        return half_t{(u16)(((f >> 16) & 0x8000u) | 0x7c00u | ((f & 0x007fffffu) >> 13))};
    }
};

template <> struct Traits<bf16_t> {
    static constexpr int kBytes = 2;
    __device__ static __forceinline__ float to_f32(bf16_t v) { return bitsf((u32)v.x << 16); }
    __device__ static __forceinline__ bf16_t from_f32(float v) {  // __float2bfloat16_rn
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
        u16 r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
        return bf16_t{r};
#else
        u32 b = fbits(v);  // only finite values reach this (NaN handled by callers)
        b += 0x7fffu + ((b >> 16) & 1u);
        return bf16_t{(u16)(b >> 16)};
#endif
    }
    __device__ static __forceinline__ u32 pack2(float lo, float hi) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#else
        return (u32)from_f32(lo).x | ((u32)from_f32(hi).x << 16);
#endif
    }
    __device__ static __forceinline__ float lo_f32(u32 p) { return bitsf(p << 16); }
    __device__ static __forceinline__ float hi_f32(u32 p) { return bitsf(p & 0xffff0000u); }
    __device__ static __forceinline__ bf16_t nan_of_scale(u32 s) {
        return bf16_t{(u16)((s & 0x80000000u) ? 0xffc0u : 0x7fc0u)};  // ml_dtypes / Eigen
    }
};

// v[i] rounded (nearest even) through RefT and back to float; identity for float.
template <typename RefT>
__device__ __forceinline__ void round_through8(float (&v)[8]) {
    if constexpr (Traits<RefT>::kBytes == 2) {
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
            const u32 p = Traits<RefT>::pack2(v[i], v[i + 1]);
            v[i] = Traits<RefT>::lo_f32(p);
            v[i + 1] = Traits<RefT>::hi_f32(p);
        }
    }
}

// ------------------------------------------------------- 8-element vectors I/O
__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<u64>(p) & 15ull) == 0;
}

// Read-only (non-coherent) 16-byte load.
__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

template <typename T>
__device__ __forceinline__ void unpack8(const uint4* w, float (&v)[8]);

template <>
__device__ __forceinline__ void unpack8<float>(const uint4* w, float (&v)[8]) {
    v[0] = bitsf(w[0].x); v[1] = bitsf(w[0].y); v[2] = bitsf(w[0].z); v[3] = bitsf(w[0].w);
    v[4] = bitsf(w[1].x); v[5] = bitsf(w[1].y); v[6] = bitsf(w[1].z); v[7] = bitsf(w[1].w);
}
template <typename T16>
__device__ __forceinline__ void unpack8_16(const uint4& w, float (&v)[8]) {
    const u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = Traits<T16>::to_f32(T16{(u16)(a[i] & 0xffffu)});
        v[2 * i + 1] = Traits<T16>::to_f32(T16{(u16)(a[i] >> 16)});
    }
}
template <>
__device__ __forceinline__ void unpack8<half_t>(const uint4* w, float (&v)[8]) { unpack8_16<half_t>(w[0], v); }
template <>
__device__ __forceinline__ void unpack8<bf16_t>(const uint4* w, float (&v)[8]) { unpack8_16<bf16_t>(w[0], v); }

// 8 consecutive elements as loaded, before conversion (16 or 32 bytes).
template <typename T>
struct Raw8 {
    static constexpr int kVec = (8 * Traits<T>::kBytes) / 16;  // 1 or 2 uint4
    uint4 w[kVec];
};

template <typename T>
__device__ __forceinline__ u32 raw_bits(const T* p) {
    if constexpr (Traits<T>::kBytes == 4) return fbits(*reinterpret_cast<const float*>(p));
    else return *reinterpret_cast<const u16*>(p);
}

// The 16 bytes at a (2-byte aligned) from the one or two aligned 16-byte words that hold them
// (never a word past the one holding a + 15, so no read leaves the 16-byte blocks the caller's
// bytes lie in), shifted into place: what a misaligned 16-bit buffer reads 8 elements with.
template <bool kReadOnly>
__device__ __forceinline__ uint4 load16_shifted(const void* a) {
    const unsigned long long u = reinterpret_cast<unsigned long long>(a);
    const int off = (int)(u & 15u);
    const uint4* q = reinterpret_cast<const uint4*>(u - off);
    uint4 lo = kReadOnly ? ldg16(q) : q[0];
    if (off == 0) return lo;
    uint4 hi = kReadOnly ? ldg16(q + 1) : q[1];
    if (off & 8) lo = make_uint4(lo.z, lo.w, hi.x, hi.y), hi = make_uint4(hi.z, hi.w, 0u, 0u);
    if (off & 4) lo = make_uint4(lo.y, lo.z, lo.w, hi.x), hi.x = hi.y;
    const u32 b = (u32)(off & 3) * 8u;
    return make_uint4(__funnelshift_r(lo.x, lo.y, b), __funnelshift_r(lo.y, lo.z, b), __funnelshift_r(lo.z, lo.w, b),
                      __funnelshift_r(lo.w, hi.x, b));
}

// Store the 16 bytes w at a (2-byte aligned, not 16): four 4-byte stores, or where a is not
// 4-byte aligned one 2-byte store, three 4-byte ones and one 2-byte one.
__device__ __forceinline__ void store16_misaligned(void* a, const uint4& w) {
    const unsigned long long u = reinterpret_cast<unsigned long long>(a);
    if ((u & 3u) == 0u) {
        u32* q = reinterpret_cast<u32*>(a);
        q[0] = w.x, q[1] = w.y, q[2] = w.z, q[3] = w.w;
    } else {
        u16* h = reinterpret_cast<u16*>(a);
        u32* q = reinterpret_cast<u32*>(h + 1);
        h[0] = (u16)(w.x & 0xffffu);
        q[0] = __funnelshift_r(w.x, w.y, 16), q[1] = __funnelshift_r(w.y, w.z, 16), q[2] = __funnelshift_r(w.z, w.w, 16);
        h[7] = (u16)(w.w >> 16);
    }
}

// Load elements [e0, e0+8) of p; those >= n read as +0 (all-zero bits). `vec`
// says p is 16-byte aligned (then e0 % 8 == 0 keeps every vector load aligned). kFull: the
// caller knows both (vec and e0 + 8 <= n), so only the vector load is compiled. kShift: 16-bit
// elements off that alignment, all 8 below n, by load16_shifted (the fused kernels' general loops;
// in the standalone decodes, 32 registers a thread, it made them spill).
template <typename T, bool kReadOnly, bool kFull = false, bool kShift = false>
__device__ __forceinline__ Raw8<T> load_raw8(const T* p, i64 e0, i64 n, bool vec) {
    Raw8<T> r;
    if (kFull || (vec && e0 + 8 <= n)) {
        const uint4* q = reinterpret_cast<const uint4*>(p + e0);
#pragma unroll
        for (int i = 0; i < Raw8<T>::kVec; ++i) r.w[i] = kReadOnly ? ldg16(q + i) : q[i];
    } else if (kShift && Raw8<T>::kVec == 1 && e0 + 8 <= n) {
        r.w[0] = load16_shifted<kReadOnly>(p + e0);
    } else {
        u32 b[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = (e0 + i < n) ? raw_bits(p + e0 + i) : 0u;
        if constexpr (Raw8<T>::kVec == 2) {
            r.w[0] = make_uint4(b[0], b[1], b[2], b[3]);
            r.w[1] = make_uint4(b[4], b[5], b[6], b[7]);
        } else {
            r.w[0] = make_uint4(b[0] | (b[1] << 16), b[2] | (b[3] << 16), b[4] | (b[5] << 16), b[6] | (b[7] << 16));
        }
    }
    return r;
}

template <typename T>
__device__ __forceinline__ u32 bits16(T v);
template <> __device__ __forceinline__ u32 bits16<half_t>(half_t v) { return v.x; }
template <> __device__ __forceinline__ u32 bits16<bf16_t>(bf16_t v) { return v.x; }

// 8 16-bit elements as stored (element 2k in the low half of word k).
template <typename T>
__device__ __forceinline__ uint4 pack8_16(const T (&v)[8]) {
    return make_uint4(bits16(v[0]) | (bits16(v[1]) << 16), bits16(v[2]) | (bits16(v[3]) << 16),
                      bits16(v[4]) | (bits16(v[5]) << 16), bits16(v[6]) | (bits16(v[7]) << 16));
}

// Store 8 already-converted elements [e0, e0+8) to p, only those < n (kFull, kShift: as load_raw8;
// kShift by store16_misaligned).
template <typename T, bool kFull = false, bool kShift = false>
__device__ __forceinline__ void store8(T* p, i64 e0, i64 n, bool vec, const T (&v)[8]) {
    if (kFull || (vec && e0 + 8 <= n)) {
        if constexpr (Traits<T>::kBytes == 4) {
            uint4* q = reinterpret_cast<uint4*>(p + e0);
            const float* f = reinterpret_cast<const float*>(v);
            q[0] = make_uint4(fbits(f[0]), fbits(f[1]), fbits(f[2]), fbits(f[3]));
            q[1] = make_uint4(fbits(f[4]), fbits(f[5]), fbits(f[6]), fbits(f[7]));
        } else {
            *reinterpret_cast<uint4*>(p + e0) = pack8_16(v);
        }
        return;
    }
    if constexpr (kShift && Traits<T>::kBytes == 2) {
        if (e0 + 8 <= n) {
            store16_misaligned(p + e0, pack8_16(v));
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (e0 + i < n) p[e0 + i] = v[i];
}

// 8 floats converted (nearest even) to T, as stored: Raw8<T>::kVec 16-byte words at w.
template <typename T>
__device__ __forceinline__ void pack8f(const float (&v)[8], uint4* w) {
    if constexpr (Traits<T>::kBytes == 4) {
        w[0] = make_uint4(fbits(v[0]), fbits(v[1]), fbits(v[2]), fbits(v[3]));
        w[1] = make_uint4(fbits(v[4]), fbits(v[5]), fbits(v[6]), fbits(v[7]));
    } else {
        w[0] = make_uint4(Traits<T>::pack2(v[0], v[1]), Traits<T>::pack2(v[2], v[3]), Traits<T>::pack2(v[4], v[5]),
                          Traits<T>::pack2(v[6], v[7]));
    }
}

// Convert (nearest even) and store 8 floats to [e0, e0+8) of p, only those < n (kFull, kShift: as store8).
template <typename T, bool kFull = false, bool kShift = false>
__device__ __forceinline__ void store8f(T* p, i64 e0, i64 n, bool vec, const float (&v)[8]) {
    if (kFull || (vec && e0 + 8 <= n)) {
        pack8f<T>(v, reinterpret_cast<uint4*>(p + e0));
        return;
    }
    if constexpr (kShift && Traits<T>::kBytes == 2) {
        if (e0 + 8 <= n) {
            uint4 w;
            pack8f<T>(v, &w);
            store16_misaligned(p + e0, w);
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (e0 + i < n) p[e0 + i] = Traits<T>::from_f32(v[i]);
}

// Element i of 8 loaded elements, as its type (bits unchanged).
template <typename T>
__device__ __forceinline__ T raw_elem(const Raw8<T>& r, int i) {
    const uint4& q = r.w[(i * Traits<T>::kBytes) / 16];
    const int k = ((i * Traits<T>::kBytes) % 16) / 4;
    const u32 word = k == 0 ? q.x : k == 1 ? q.y : k == 2 ? q.z : q.w;
    if constexpr (Traits<T>::kBytes == 4) return bitsf(word);
    else return T{(u16)((i & 1) ? word >> 16 : word & 0xffffu)};
}

// The accumulate rule of every decode (dequantize's kAcc, the fused owner's own output over a
// base): o = round(prev + v) per element, an element that is NaN in prev keeping its bits.
// prev: the 8 elements as loaded; pv: the same as floats.
template <typename T>
__device__ __forceinline__ void add_keep_nan8(const Raw8<T>& prev, const float (&pv)[8], const float (&v)[8],
                                              T (&o)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
        o[i] = abs_bits(pv[i]) > 0x7f800000u ? raw_elem<T>(prev, i) : Traits<T>::from_f32(add_rn(pv[i], v[i]));
}

// A decoded unit whose scale is NaN (a non-finite unit): its 8 elements stored as the NaN that
// scale bits `nan_bits` stand for (Traits::nan_of_scale, numpy's bits), only those < n.
template <typename T, bool kFull, bool kShift = false>
__device__ __forceinline__ void store_nan8(T* p, i64 e0, i64 n, bool vec, u32 nan_bits) {
    T o[8];
    const T nan = Traits<T>::nan_of_scale(nan_bits);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = nan;
    store8<T, kFull, kShift>(p, e0, n, vec, o);
}

// ------------------------------------------------- residuals in 8-bit blocks
// The int8 residual format (codec.py, "Residuals"): per 512 elements, 512 int8 mantissas then
// 16 exponent bytes (one per 32-element block, = 4 lanes). `i8res_t` marks a residual pointer
// of that format (bytes); the res_* functions below load / store any residual type for thread
// t of a slice (elements 8t .. 8t+7). res_store of i8res_t reduces over the 4 lanes of a block
// with full-mask shuffles: every lane of the warp must call it together.
struct i8res_t { unsigned char x; };
typedef i8res_t i8;
template <typename R> using IsI8 = IsSame<R, i8res_t>;
constexpr i64 kResSuperBytes = 528;   // codec.RES_SUPER_BYTES
constexpr u32 kResMinExp = 7;         // codec.RES_MIN_EXP

__device__ __forceinline__ i64 i8_mant_off(i64 t) { return (t >> 6) * kResSuperBytes + ((t & 63) << 3); }
__device__ __forceinline__ i64 i8_exp_off(i64 t) { return (t >> 6) * kResSuperBytes + 512 + ((t & 63) >> 2); }

// Residual pointer p advanced by `elems` residuals (a multiple of 512 for i8res_t).
template <typename R>
__device__ __forceinline__ R* res_at(R* p, i64 elems) {
    if constexpr (IsI8<R>::v) return reinterpret_cast<R*>(reinterpret_cast<unsigned char*>(p) + (elems >> 9) * kResSuperBytes);
    else return p + elems;
}

template <typename R> struct ResRaw { Raw8<R> r; };
template <> struct ResRaw<i8res_t> { uint2 m; u32 x; };

template <typename R, bool kFull = false>
__device__ __forceinline__ ResRaw<R> res_load(const R* p, i64 t, i64 S, bool vec) {
    ResRaw<R> r;
    if constexpr (IsI8<R>::v) {
        const unsigned char* b = reinterpret_cast<const unsigned char*>(p);
        r.m = *reinterpret_cast<const uint2*>(b + i8_mant_off(t));
        r.x = b[i8_exp_off(t)];
    } else {
        r.r = load_raw8<R, false, kFull>(p, t << 3, S, vec);
    }
    return r;
}

// The int8 format's arithmetic without conversion instructions (a fraction of the issue rate on
// sm_90): a mantissa m is the low byte of a float's bits. Decode: 2^23 + 128 + m built from the
// byte (m + 128 unsigned), max(m, -127) = fl(max(that, 2^23 + 1) - (2^23 + 128)) exactly, then
// scaled (exact: mul is a power of two; the bias is taken off before, as (2^23 + 128) mul
// overflows for the largest exponents).
// Encode: fl(e * mul + 1.5 * 2^23) rounds the product (exact, or below 2^-126 where rint gives 0
// too) to an integer, ties to even, as rint(fl(e * mul)) does; clamped to +-127, the float's low
// byte is m.
// (The clamps compare the floats' bits as integers: positive floats order as their bits do; no
// float min / max, which NVRTC's -ftz=true would flush.)
__device__ __forceinline__ float i8_decode(u32 w, int i, float mul) {
    const u32 f = max(__byte_perm(w ^ 0x80808080u, 0x4B000000u, 0x7440u | (u32)i), 0x4B000001u);   // 2^23 + 1
    return mul_rn(add_rn(bitsf(f), -8388736.0f), mul);
}
__device__ __forceinline__ u32 i8_encode(float e, float mul) {
    return min(max(fbits(fma_rn(e, mul, 12582912.0f)), 0x4B3FFF81u), 0x4B40007Fu);   // 1.5 * 2^23 -+ 127
}
// A block's exponent byte x from the bits of its largest magnitude, and the encoder's 2^(133 - x).
__device__ __forceinline__ u32 i8_block_exp(u32 amax_bits) { return max(amax_bits >> 23, kResMinExp); }
__device__ __forceinline__ float i8_encode_mul(u32 x) { return bitsf((260u - x) << 23); }
// Four encoded mantissas (i8_encode) as the bytes of one word, in order.
__device__ __forceinline__ u32 i8_pack4(u32 a, u32 b, u32 c, u32 d) {
    return __byte_perm(__byte_perm(a, b, 0x0040u), __byte_perm(c, d, 0x0040u), 0x5410u);
}

// float32 values: fl(max(m, -127) * 2^(min(max(x, 7), 254) - 133)) for i8res_t.
template <typename R>
__device__ __forceinline__ void res_unpack(const ResRaw<R>& r, float (&v)[8]) {
    if constexpr (IsI8<R>::v) {
        const u32 x = min(max(r.x, kResMinExp), 254u);
        const float mul = bitsf((x - 6u) << 23);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = i8_decode(i < 4 ? r.m.x : r.m.y, i & 3, mul);
    } else {
        unpack8<R>(r.r.w, v);
    }
}

// Store 8 finite residuals e (rounded to R; for i8res_t: the block's exponent from the 4 lanes'
// largest |e|, x = max(E, 7), m = clip(rint(fl(e * 2^(133 - x))), -127, 127)).
template <typename R, bool kFull = false>
__device__ __forceinline__ void res_store(R* p, i64 t, i64 S, bool vec, const float (&e)[8]) {
    if constexpr (IsI8<R>::v) {
        u32 a = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) a = max(a, abs_bits(e[i]));
        a = max(a, __shfl_xor_sync(0xffffffffu, a, 1));
        a = max(a, __shfl_xor_sync(0xffffffffu, a, 2));
        const u32 x = i8_block_exp(a);
        const float mul = i8_encode_mul(x);
        u32 m[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) m[i] = i8_encode(e[i], mul);
        unsigned char* b = reinterpret_cast<unsigned char*>(p);
        *reinterpret_cast<uint2*>(b + i8_mant_off(t)) =
            make_uint2(i8_pack4(m[0], m[1], m[2], m[3]), i8_pack4(m[4], m[5], m[6], m[7]));
        if ((t & 3) == 0) b[i8_exp_off(t)] = (unsigned char)x;
    } else {
        store8f<R, kFull>(p, t << 3, S, vec, e);
    }
}

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
// The lanes' units (a, b) stored to the warp's 1 KiB at p through r.
__device__ __forceinline__ void unit16_store(uint4* r, void* p, const uint4& a, const uint4& b) {
    const int lane = threadIdx.x & 31;
    __syncwarp();
    r[stage_slot<2>(2 * lane)] = a;
    r[stage_slot<2>(2 * lane + 1)] = b;
    __syncwarp();
    reinterpret_cast<uint4*>(p)[lane] = r[stage_slot<2>(lane)];
    reinterpret_cast<uint4*>(p)[lane + 32] = r[stage_slot<2>(lane + 32)];
}
// unit16_store of a partial 512-element block: only its first n 16-bit elements (0 < n < 512) stored.
__device__ __forceinline__ void unit16_store_n(uint4* r, void* p, const uint4& a, const uint4& b, int n) {
    const int lane = threadIdx.x & 31;
    __syncwarp();
    r[stage_slot<2>(2 * lane)] = a;
    r[stage_slot<2>(2 * lane + 1)] = b;
    __syncwarp();
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

// int8 residuals, 16 elements a thread: a warp's 32 units are one 512-element block of the format
// (528 bytes at i8_run), lane l's mantissas its bytes 16 l .. 16 l + 15 (a 16-byte access a lane:
// 512 contiguous bytes a warp), the exponent of lanes l and l ^ 1 (one 32-element block) byte
// 512 + l / 2. The same values as res_unpack / res_store of the 8-element threads.
__device__ __forceinline__ unsigned char* i8_run(i8res_t* p, i64 u_warp) {   // u_warp: lane 0's unit
    return reinterpret_cast<unsigned char*>(p) + (u_warp >> 5) * kResSuperBytes;
}
// The warp's 528 bytes at p copied into r (33 chunks) in flight (cp.async; the caller commits).
__device__ __forceinline__ void res16_copy_async(uint4* r, const unsigned char* p) {
    const int lane = threadIdx.x & 31;
    cp_async16(r + lane, reinterpret_cast<const uint4*>(p) + lane);
    if (lane == 0) cp_async16(r + 32, reinterpret_cast<const uint4*>(p) + 32);
}
// This lane's residuals 8 k .. 8 k + 7 from r, once the warp's copies have landed and it synchronized.
__device__ __forceinline__ void res16_unpack(const uint4* r, int k, float (&v)[8]) {
    const int lane = threadIdx.x & 31;
    const uint2 m = reinterpret_cast<const uint2*>(r + lane)[k];
    res_unpack<i8res_t>(ResRaw<i8res_t>{m, reinterpret_cast<const unsigned char*>(r + 32)[lane >> 1]}, v);
}
// This lane's 16 finite residuals e(i), i < 16, stored at p (the warp's 528 bytes; every lane calls
// it together). e is evaluated twice an element (for the block's exponent, then its mantissa), so
// that the 16 values need not be held at once.
template <typename E>
__device__ __forceinline__ void res16_store(unsigned char* p, const E& e) {
    const int lane = threadIdx.x & 31;
    u32 a = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) a = max(a, abs_bits(e(i)));
    a = max(a, __shfl_xor_sync(0xffffffffu, a, 1));
    const u32 x = i8_block_exp(a);
    const float mul = i8_encode_mul(x);
    u32 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
        w[k] = i8_pack4(i8_encode(e(4 * k), mul), i8_encode(e(4 * k + 1), mul), i8_encode(e(4 * k + 2), mul),
                        i8_encode(e(4 * k + 3), mul));
    reinterpret_cast<uint4*>(p)[lane] = make_uint4(w[0], w[1], w[2], w[3]);
    if ((lane & 1) == 0) p[512 + (lane >> 1)] = (unsigned char)x;
}

}  // namespace echo

#endif  // ECHO_CODEC_BASE_CUH
