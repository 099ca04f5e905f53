// echonccl codec, the base of the CUDA twin of echonccl/codec.py (codec.cuh has the rules every part
// keeps): the launch constants, float32 operations with explicit rounding, the element types, and
// loads / stores of 8 elements.
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

// Bytes [off, off + 16) of the 32 bytes lo then hi (0 <= off < 16): a run off 16-byte alignment
// put together from the aligned words that hold it.
__device__ __forceinline__ uint4 bytes_at(uint4 lo, uint4 hi, int off) {
    if (off & 8) lo = make_uint4(lo.z, lo.w, hi.x, hi.y), hi = make_uint4(hi.z, hi.w, 0u, 0u);
    if (off & 4) lo = make_uint4(lo.y, lo.z, lo.w, hi.x), hi.x = hi.y;
    const u32 b = (u32)(off & 3) * 8u;
    return make_uint4(__funnelshift_r(lo.x, lo.y, b), __funnelshift_r(lo.y, lo.z, b), __funnelshift_r(lo.z, lo.w, b),
                      __funnelshift_r(lo.w, hi.x, b));
}

// The 16 bytes at a (2-byte aligned) from the one or two aligned 16-byte words that hold them
// (never a word past the one holding a + 15, so no read leaves the 16-byte blocks the caller's
// bytes lie in), shifted into place: what a misaligned 16-bit buffer reads 8 elements with.
template <bool kReadOnly>
__device__ __forceinline__ uint4 load16_shifted(const void* a) {
    const unsigned long long u = reinterpret_cast<unsigned long long>(a);
    const int off = (int)(u & 15u);
    const uint4* q = reinterpret_cast<const uint4*>(u - off);
    const uint4 lo = kReadOnly ? ldg16(q) : q[0];
    if (off == 0) return lo;
    return bytes_at(lo, kReadOnly ? ldg16(q + 1) : q[1], off);
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

}  // namespace echo

#endif  // ECHO_CODEC_BASE_CUH
