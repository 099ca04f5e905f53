// echonccl wire codec on the GPU: the bit-exact CUDA twin of echonccl/codec.py.
//
// The spec is the docstring of echonccl/codec.py; the reference is
// echonccl/kernels_numpy.py. Everything here reproduces those bit for bit:
//
//  * All float32 arithmetic goes through inline PTX with an explicit rounding
//    modifier and WITHOUT .ftz (add.rn / sub.rn / mul.rn / div.rn / rcp.rn,
//    cvt.rni). Explicit-rounding PTX ops are never contracted into FMA, and
//    inline asm is immune to compiler flags. This matters because CuPy
//    appends `-ftz=true` to every NVRTC compile (after the caller's options,
//    and the last occurrence wins): the __fadd_rn/__fdiv_rn intrinsics and
//    fabsf/fmaxf would then flush subnormals and break bit-exactness for fp32
//    subnormal inputs. With asm the result is the same under nvcc
//    (-ftz=false --fmad=false) and under CuPy's NVRTC.
//  * q = clip(rint(fl(v / scale)), -L, L) (L = 7; int7-h32: 63) is computed without a division per
//    element where that is provably identical (see the quantize step below):
//    fl(v * fl(1/scale)) rounded with the 1.5*2^23 trick, falling back to the
//    IEEE division when the quotient is within 2^-16 of a half-integer.
//    Codes are decoded to floats by bit tricks, not int->float conversions.
//  * |v|, max, isfinite and ==0 are integer operations on the IEEE bits
//    (again FTZ-immune; for non-negative floats the unsigned order of the
//    bits is the float order).
//  * float <-> half/bfloat16 conversions are the PTX cvt instructions that
//    __float2half_rn / __float2bfloat16_rn / __half2float compile to
//    (cvt.rn.f16.f32, cvt.rn.bf16.f32, cvt.f32.f16; round to nearest even,
//    subnormals kept). The 16-bit types are storage-only structs defined here,
//    so the code needs no CUDA header and compiles under NVRTC without an
//    include path.
//  * NaN bit patterns of dequantized outputs follow numpy on the host
//    (x86/Arm propagate the NaN operand of q*scale, quieted; numpy's
//    float->half keeps sign and top payload bits; ml_dtypes' float->bfloat16
//    gives 0x7fc0/0xffc0), so outputs are equal as bits, NaNs included.
//
// Thread mapping: one thread = 8 consecutive elements of a slice = one 32-bit
// word of packed codes (int7-h32: and a u16 and a byte of their high bits). A group of G elements = G/8 consecutive lanes of one
// warp; its amax / non-finite flag is reduced with __shfl_xor_sync among them.
// (reduce_quantize_block32, int4-h32's owner at G = 32: one thread = a 32-element block.)
// The host guarantees S % 512 == 0 (so the thread count is a multiple of 64
// and every warp is entirely inside or outside the grid-stride range: the
// full-mask shuffles are safe), and 4-byte aligned wire buffers (slices start
// 16-byte aligned inside them by construction).
#ifndef ECHO_CODEC_CUH
#define ECHO_CODEC_CUH

#ifndef ECHO_BLOCK
#define ECHO_BLOCK 256
#endif
// Software pipelining: load the next grid-stride chunk's own/residual while
// computing the current one (keeps bytes in flight during the arithmetic).
#ifndef ECHO_PREFETCH
#define ECHO_PREFETCH 1
#endif
// ... and, where incoming slices are taken one at a time (the fused kernel's owner), the next
// chunk's incoming code word and scale too (fused 1 GiB 1951 -> 1915 us on two H200s).
#ifndef ECHO_PREFETCH_IN
#define ECHO_PREFETCH_IN 1
#endif

// Separate loops for slices that lie whole in aligned buffers (no bounds test per load or
// store); 0: one loop with the tests for every call. reduce_quantize with float32 inputs or
// residuals keeps the one loop (the second made ptxas spill there: 2-4% slower on H200).
#ifndef ECHO_FULL_PATH
#define ECHO_FULL_PATH 1
#endif
// The owner of int4-h32 at G = 32 with 16-bit inputs, residuals and reference: one thread per
// 32-element block (reduce_quantize_block32) in the standalone kernels; 0: never.
#ifndef ECHO_BLOCK32
#define ECHO_BLOCK32 1
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
// fl(c +- a), the same bits as add_rn / sub_rn.
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}
// max(m, |d|) for non-NaN operands (a tie test's largest deviation).
__device__ __forceinline__ float max_abs(float m, float d) {
    float r;
    asm("{ .reg .f32 a; abs.f32 a, %2; max.f32 %0, %1, a; }" : "=f"(r) : "f"(m), "f"(d));
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

// Load elements [e0, e0+8) of p; those >= n read as +0 (all-zero bits). `vec`
// says p is 16-byte aligned (then e0 % 8 == 0 keeps every vector load aligned). kFull: the
// caller knows both (vec and e0 + 8 <= n), so only the vector load is compiled.
template <typename T, bool kReadOnly, bool kFull = false>
__device__ __forceinline__ Raw8<T> load_raw8(const T* p, i64 e0, i64 n, bool vec) {
    Raw8<T> r;
    if (kFull || (vec && e0 + 8 <= n)) {
        const uint4* q = reinterpret_cast<const uint4*>(p + e0);
#pragma unroll
        for (int i = 0; i < Raw8<T>::kVec; ++i) r.w[i] = kReadOnly ? ldg16(q + i) : q[i];
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

// Store 8 already-converted elements [e0, e0+8) to p, only those < n (kFull: as load_raw8).
template <typename T, bool kFull = false>
__device__ __forceinline__ void store8(T* p, i64 e0, i64 n, bool vec, const T (&v)[8]) {
    if (kFull || (vec && e0 + 8 <= n)) {
        if constexpr (Traits<T>::kBytes == 4) {
            uint4* q = reinterpret_cast<uint4*>(p + e0);
            const float* f = reinterpret_cast<const float*>(v);
            q[0] = make_uint4(fbits(f[0]), fbits(f[1]), fbits(f[2]), fbits(f[3]));
            q[1] = make_uint4(fbits(f[4]), fbits(f[5]), fbits(f[6]), fbits(f[7]));
        } else {
            *reinterpret_cast<uint4*>(p + e0) =
                make_uint4(bits16(v[0]) | (bits16(v[1]) << 16), bits16(v[2]) | (bits16(v[3]) << 16),
                           bits16(v[4]) | (bits16(v[5]) << 16), bits16(v[6]) | (bits16(v[7]) << 16));
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (e0 + i < n) p[e0 + i] = v[i];
    }
}

// Convert (nearest even) and store 8 floats to [e0, e0+8) of p, only those < n (kFull: as load_raw8).
template <typename T, bool kFull = false>
__device__ __forceinline__ void store8f(T* p, i64 e0, i64 n, bool vec, const float (&v)[8]) {
    if (kFull || (vec && e0 + 8 <= n)) {
        if constexpr (Traits<T>::kBytes == 4) {
            uint4* q = reinterpret_cast<uint4*>(p + e0);
            q[0] = make_uint4(fbits(v[0]), fbits(v[1]), fbits(v[2]), fbits(v[3]));
            q[1] = make_uint4(fbits(v[4]), fbits(v[5]), fbits(v[6]), fbits(v[7]));
        } else {
            *reinterpret_cast<uint4*>(p + e0) =
                make_uint4(Traits<T>::pack2(v[0], v[1]), Traits<T>::pack2(v[2], v[3]),
                           Traits<T>::pack2(v[4], v[5]), Traits<T>::pack2(v[6], v[7]));
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (e0 + i < n) p[e0 + i] = Traits<T>::from_f32(v[i]);
    }
}

// ------------------------------------------------- residuals in 8-bit blocks
// The int8 residual format (codec.py, "Residuals"): per 512 elements, 512 int8 mantissas then
// 16 exponent bytes (one per 32-element block, = 4 lanes). `i8res_t` marks a residual pointer
// of that format (bytes); the res_* functions below load / store any residual type for thread
// t of a slice (elements 8t .. 8t+7). res_store of i8res_t reduces over the 4 lanes of a block
// with full-mask shuffles: every lane of the warp must call it together.
struct i8res_t { unsigned char x; };
typedef i8res_t i8;
template <typename R> struct IsI8 { static constexpr bool v = false; };
template <> struct IsI8<i8res_t> { static constexpr bool v = true; };
constexpr i64 kResSuperBytes = 528;   // codec.RES_SUPER_BYTES

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

// float32 values: fl(max(m, -127) * 2^(min(max(x, 7), 254) - 133)) for i8res_t.
template <typename R>
__device__ __forceinline__ void res_unpack(const ResRaw<R>& r, float (&v)[8]) {
    if constexpr (IsI8<R>::v) {
        const u32 x = min(max(r.x, 7u), 254u);
        const float mul = bitsf((x - 6u) << 23);
        const u32 w[2] = {r.m.x, r.m.y};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int m = max((int)(signed char)((w[i >> 2] >> (8 * (i & 3))) & 0xffu), -127);
            v[i] = mul_rn((float)m, mul);
        }
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
        const u32 x = max(a >> 23, 7u);
        const float mul = bitsf((260u - x) << 23);
        u32 w[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int m = min(127, max(-127, rint_s32(mul_rn(e[i], mul))));
            w[i >> 2] |= ((u32)m & 0xffu) << (8 * (i & 3));
        }
        unsigned char* b = reinterpret_cast<unsigned char*>(p);
        *reinterpret_cast<uint2*>(b + i8_mant_off(t)) = make_uint2(w[0], w[1]);
        if ((t & 3) == 0) b[i8_exp_off(t)] = (unsigned char)x;
    } else {
        store8f<R, kFull>(p, t << 3, S, vec, e);
    }
}

// ------------------------------------------------------------- wire decoding
// The 8 codes of a packed 32-bit word as floats, exactly, with no conversion
// instruction and no per-code shift. Code j (0..3) of a 16-bit half h sits in
// bits 4j..4j+3; its nibble XOR 8 is q + 8 in [0, 15]. OR-ed into the mantissa
// of 1.5 * 2^(23-4j) (whose ulp is 2^-4j, so bit 4j weighs 1), it encodes
// 1.5 * 2^(23-4j) + q + 8, and one exact subtraction leaves q. Mask and XOR
// are one lop3 with the constant in a register.
template <u32 kMask>
__device__ __forceinline__ u32 mask_xor(u32 a, u32 x) {  // (a & kMask) ^ x
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(r) : "r"(a), "n"(kMask), "r"(x));
    return r;
}
template <int J>
__device__ __forceinline__ float code_in_half(u32 h) {
    constexpr u32 kBits = ((150u - 4u * J) << 23) | 0x400000u;  // 1.5 * 2^(23-4J)
    constexpr float kBias = (float)(3u << (22 - 4 * J)) + 8.0f;   // its value + 8, exact
    return sub_rn(bitsf(mask_xor<(0xfu << (4 * J))>(h, kBits | (8u << (4 * J)))), kBias);
}
__device__ __forceinline__ void decode8(u32 w, float (&q)[8]) {
    const u32 hi = w >> 16;
    q[0] = code_in_half<0>(w);  q[1] = code_in_half<1>(w);  q[2] = code_in_half<2>(w);  q[3] = code_in_half<3>(w);
    q[4] = code_in_half<0>(hi); q[5] = code_in_half<1>(hi); q[6] = code_in_half<2>(hi); q[7] = code_in_half<3>(hi);
}

// ------------------------------------------------------------- the codecs
// kCodec (codec.CODECS): int4, int4-h32 (rotated), int7-h32 (rotated; 7-bit codes in three
// sections, a bfloat16 scale per 16 elements: codec.py, "int7-h32").
constexpr int kInt4 = 0, kInt4H32 = 1, kInt7H32 = 2;

template <int G, int kCodec>
struct Wire {
    static constexpr bool kRot = kCodec != kInt4;
    static constexpr bool k7 = kCodec == kInt7H32;
    static_assert(k7 ? G == 16 : (G == 32 || G == 64 || G == 128), "group size of the codec");
    static constexpr int kLanes = G / 8;                // lanes per group
    static constexpr int kLevels = k7 ? 63 : 7;
    // |y - rint(y)| above this: y may be too close to a half-integer for the reciprocal
    // shortcut to be trusted (its error is < 2^-19 for |y| <= 7.5, < 2^-16 for |y| <= 63.5).
    static constexpr float kNearTie = k7 ? 0.5f - 1.0f / 16384.0f : 0.5f - 1.0f / 65536.0f;
    __device__ static __forceinline__ i64 codes_bytes(i64 S) { return k7 ? S - (S >> 3) : S >> 1; }
    __device__ static __forceinline__ i64 slice_bytes(i64 S) { return k7 ? S : (S >> 1) + 4 * (S / G); }
};

// A thread's 8 codes as stored: lo = the nibble word; int7-h32: hi = the u16 of bits 4-5
// (bits 0-15) | the byte of bit 6 (bits 16-23), even elements in the low half of each
// (codec.py, "int7-h32").
struct Codes8 { u32 lo, hi; };

// Bits 4-6 of the codes of elements 2j (odd: 2j + 1), j = 0..3, at bits 4-6 of byte j, from
// the byte of their bits 4-5 (2 bits a field, field j at bit 2j) and the nibble of their bit 6
// (bit j). Fields are spread to their bytes by multiplications whose shifted copies of the
// field bits never overlap (no carries), then masked.
__device__ __forceinline__ u32 spread_high3(u32 crumbs, u32 tops) {
    const u32 a = (crumbs & 0x33u) * 0x00010010u;   // fields 0, 2 -> bits 4-5 of bytes 0, 2
    const u32 b = (crumbs & 0xccu) * 0x00400400u;   // fields 1, 3 -> bits 4-5 of bytes 1, 3
    const u32 t = (tops & 0xfu) * 0x08102040u;      // bit j -> bit 6 of byte j
    return (a & 0x00300030u) | (b & 0x30003000u) | (t & 0x40404040u);
}
// int7-h32's 8 codes as floats, exactly: the offset codes u = q + 63 of the even and the odd
// elements assembled bytewise, each byte moved into the mantissa of 2^23 (one prmt with the
// constant 0x4b000000), and 2^23 + 63 subtracted.
__device__ __forceinline__ void decode8_7(const Codes8& c, float (&q)[8]) {
    const u32 ev = (c.lo & 0x0f0f0f0fu) | spread_high3(c.hi & 0xffu, c.hi >> 16);
    const u32 od = ((c.lo >> 4) & 0x0f0f0f0fu) | spread_high3((c.hi >> 8) & 0xffu, c.hi >> 20);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        q[2 * j] = sub_rn(bitsf(__byte_perm(ev, 0x4b000000u, 0x7440u + j)), 8388671.0f);
        q[2 * j + 1] = sub_rn(bitsf(__byte_perm(od, 0x4b000000u, 0x7440u + j)), 8388671.0f);
    }
}
template <int kCodec>
__device__ __forceinline__ void decode_codes(const Codes8& c, float (&q)[8]) {
    if constexpr (kCodec == kInt7H32) decode8_7(c, q);
    else decode8(c.lo, q);
}

// int7-h32: four offset codes u = q + 63 (one a byte) -> their bits 4-5 as the byte of 2-bit
// fields (field j at bit 2j) | their bit 6 as a nibble (bit j) at bits 8-11: the inverse of
// spread_high3, by multiplications that gather field j from bit 8j without overlapping copies.
__device__ __forceinline__ u32 gather_high3(u32 u) {
    const u32 crumbs = (((u >> 4) & 0x03030303u) * 0x00041041u) >> 18;   // bit 8j -> 2j + 18
    const u32 tops = (((u >> 6) & 0x01010101u) * 0x00204081u) >> 21;     // bit 8j -> j + 21
    return (crumbs & 0xffu) | ((tops & 0xfu) << 8);
}
// Pack 8 codes (code[i] holds q in two's complement in its low bits, or q + 1.5 * 2^23 as
// float bits: the same low bits) in the codec's format.
template <int kCodec>
__device__ __forceinline__ Codes8 pack_codes(const u32 (&code)[8]) {
    Codes8 c{0u, 0u};
    // The low bytes of the even and of the odd elements' codes, four to a word.
    const u32 ev = __byte_perm(__byte_perm(code[0], code[2], 0x0040u), __byte_perm(code[4], code[6], 0x0040u), 0x5410u);
    const u32 od = __byte_perm(__byte_perm(code[1], code[3], 0x0040u), __byte_perm(code[5], code[7], 0x0040u), 0x5410u);
    if constexpr (kCodec == kInt7H32) {
        // Offset by 63 bytewise: for q in [-63, 63] the low seven bits plus 63 stay below 256,
        // and bit 7 (set for q < 0) flipped back gives q + 63.
        const u32 ue = ((ev & 0x7f7f7f7fu) + 0x3f3f3f3fu) ^ (ev & 0x80808080u);
        const u32 uo = ((od & 0x7f7f7f7fu) + 0x3f3f3f3fu) ^ (od & 0x80808080u);
        const u32 he = gather_high3(ue), ho = gather_high3(uo);
        c.lo = (ue & 0x0f0f0f0fu) | ((uo & 0x0f0f0f0fu) << 4);
        c.hi = (he & 0xffu) | ((ho & 0xffu) << 8) | ((he >> 8) << 16) | ((ho >> 8) << 20);
    } else {
        c.lo = (ev & 0x0f0f0f0fu) | ((od << 4) & 0xf0f0f0f0u);   // nibbles interleaved
    }
    return c;
}

// Store thread t (of group grp) 's packed codes, and (the group's first lane) its scale, into
// slice sl of S elements whose scales start at byte codes_bytes.
template <int G, int kCodec>
__device__ __forceinline__ void st_codes(unsigned char* sl, i64 codes_bytes, i64 t, i64 grp, i64 S,
                                         const Codes8& c, float scale) {
    using W = Wire<G, kCodec>;
    reinterpret_cast<u32*>(sl)[t] = c.lo;
    if constexpr (W::k7) {
        reinterpret_cast<u16*>(sl + (S >> 1))[t] = (u16)(c.hi & 0xffffu);
        sl[(S >> 1) + (S >> 2) + t] = (unsigned char)(c.hi >> 16);
    }
    if ((t & (W::kLanes - 1)) == 0) {
        if constexpr (W::k7) reinterpret_cast<u16*>(sl + codes_bytes)[grp] = (u16)(fbits(scale) >> 16);
        else reinterpret_cast<float*>(sl + codes_bytes)[grp] = scale;
    }
}

// acc[i] += fl(q_i * scale): the decoded value of one incoming slice.
template <int kCodec>
__device__ __forceinline__ void add_decoded(float (&acc)[8], const Codes8& w, float scale) {
    float q[8];
    decode_codes<kCodec>(w, q);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = add_rn(acc[i], mul_rn(q[i], scale));
}
__device__ __forceinline__ void add_terms(float (&acc)[8], const float (&t)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = add_rn(acc[i], t[i]);
}

// ------------------------------------------- rotation (int4-h32, int7-h32)
// The rotated codec (codec.py, "Codecs"): every block of 32 consecutive elements
// of a slice is multiplied by a fixed sign-randomized Hadamard matrix before its
// first quantization and rotated back after its last decode. Thread mapping: a
// block is 4 consecutive lanes (lane-in-block lb = t & 3, elements 8*lb .. 8*lb+7),
// so a group of G elements holds G/32 whole blocks. Stages h = 1, 2, 4 are inside
// a thread, h = 8 and 16 exchange with lane ^ 1 and lane ^ 2: EVERY lane of the
// warp must call these functions together (full-mask shuffles), outside any
// branch that depends on the data. Both are bit-exact with codec.rotate/unrotate:
// add.rn/sub.rn/mul.rn only, each pair computed as fl(a + b), fl(a - b) in the
// same order as numpy, the signs applied as exact sign-bit flips.
constexpr u32 kRotSigns = 0x6A09E667u;   // bit i set: s_i = -1 (codec.ROT_SIGNS)
constexpr u32 kRotScale = 0x3d000000u;   // 2^-5, the forward's exact 1/32
constexpr int kRotLanes = 4;             // lanes per 32-element block

// The 8 sign bits (as float sign masks) of lane-in-block lb: bit j -> element 8*lb + j.
__device__ __forceinline__ u32 rot_sign_byte(int lb) { return (kRotSigns >> (8 * lb)) & 0xffu; }

// The stages h = 1, 2, 4 of 8 elements in a thread: fl(a + b), fl(a - b) per pair.
__device__ __forceinline__ void butterflies_in8(float (&v)[8]) {
#pragma unroll
    for (int h = 1; h < 8; h <<= 1) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if ((j & h) == 0) {
                const float a = v[j], b = v[j + h];
                v[j] = add_rn(a, b);
                v[j + h] = sub_rn(a, b);
            }
        }
    }
}

// The five butterfly stages h = 1, 2, 4, 8, 16 (unnormalized Walsh-Hadamard) of one block.
__device__ __forceinline__ void rot_butterflies8(float (&v)[8], int lb) {
    butterflies_in8(v);
#pragma unroll
    for (int x = 1; x < kRotLanes; x <<= 1) {   // h = 8 (lane ^ 1), h = 16 (lane ^ 2)
        // The lower lane of a pair keeps fl(a + b) = fl(b + a), the upper one fl(a - b) =
        // fl(a + (-b)) (IEEE: exact identities for every non-NaN operand; a NaN's group is
        // replaced by its scale's NaN anyway): one fma of our own value by +-1 (exact) onto
        // the partner's, instead of two ops and a select.
        const float sgn = (lb & x) != 0 ? -1.0f : 1.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float o = __shfl_xor_sync(0xffffffffu, v[j], x);
            v[j] = fma_rn(v[j], sgn, o);
        }
    }
}

// u_i = fl(x_i * (s_i 2^-5)): the forward's first step.
__device__ __forceinline__ void rot_sign_scale8(float (&v)[8], int lb) {
    const u32 sb = rot_sign_byte(lb);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = mul_rn(v[j], bitsf(kRotScale | (((sb >> j) & 1u) << 31)));
}

// Forward: u_i = fl(x_i * (s_i 2^-5)), then the butterflies.
__device__ __forceinline__ void rot_forward8(float (&v)[8], int lb) {
    rot_sign_scale8(v, lb);
    rot_butterflies8(v, lb);
}

// x_i = w_i with its sign bit flipped where s_i = -1.
__device__ __forceinline__ void rot_signs8(float (&v)[8], int lb) {
    const u32 sb = rot_sign_byte(lb);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = bitsf(fbits(v[j]) ^ (((sb >> j) & 1u) << 31));
}

// Inverse: the butterflies, then the signs.
__device__ __forceinline__ void rot_inverse8(float (&v)[8], int lb) {
    rot_butterflies8(v, lb);
    rot_signs8(v, lb);
}

// The forward's factor 2^-5 alone, for values whose signs are applied already (or cancel:
// rounding to nearest is symmetric, so s * round(s * w) = round(w) bit for bit).
__device__ __forceinline__ void rot_scale8(float (&v)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = mul_rn(v[j], bitsf(kRotScale));
}

// lb's signs for packed 16-bit pairs: bit 15 - k holds s of element 2k, bit 31 - k that of
// element 2k + 1, so that (z << k) & 0x80008000 flips pair k (the k-th 32-bit word).
__device__ __forceinline__ u32 rot_sign_word16(int lb) {
    const u32 sb = rot_sign_byte(lb);
    u32 z = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) z |= (((sb >> (2 * k)) & 1u) << (15 - k)) | (((sb >> (2 * k + 1)) & 1u) << (31 - k));
    return z;
}
// 8 loaded 16-bit elements with their signs flipped where s_i = -1 (z: rot_sign_word16).
__device__ __forceinline__ uint4 rot_signs16(uint4 w, u32 z) {
    w.x ^= z & 0x80008000u;
    w.y ^= (z << 1) & 0x80008000u;
    w.z ^= (z << 2) & 0x80008000u;
    w.w ^= (z << 3) & 0x80008000u;
    return w;
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

// Incoming slices are consumed in batches of this many, so their loads are in flight together.
#ifndef ECHO_IN_BATCH
#define ECHO_IN_BATCH 4
#endif
constexpr int kInBatch = ECHO_IN_BATCH;
// Chunks of 8 elements per thread and grid-stride step in dequantize (loads
// first), for 16-bit and for float32 outputs (measured best on H200: 2 and 1).
// echonccl/kernels_cuda.py sizes the dequantize grid with the same numbers.
#ifndef ECHO_DQ_UNROLL16
#define ECHO_DQ_UNROLL16 2
#endif
#ifndef ECHO_DQ_UNROLL32
#define ECHO_DQ_UNROLL32 1
#endif

// -------------------------------------------------------------- the kernels
// reduce_quantize: see echonccl/kernels.py. S elements per slice, slice i of
// `incoming` at byte i * slice_bytes(S, G); `own` has own_n valid elements;
// `base` (may be null; only read with a residual) has base_n. kCodec: the codec (`Wire`);
// rotated ones rotate own before the sum and measure the owner's ref in the values'
// domain, rotated back, when it is rounded or has a base.
// Loads of wire bytes: read-only cache path, or L2 only (kPeer: written by another GPU
// during this kernel, which the non-coherent L1/texture path may not see).
template <bool kPeer>
__device__ __forceinline__ u32 ld_wire_u32(const void* p) {
    if constexpr (kPeer) return __ldcg(reinterpret_cast<const u32*>(p));
    else return __ldg(reinterpret_cast<const u32*>(p));
}
template <bool kPeer>
__device__ __forceinline__ float ld_wire_f32(const void* p) {
    if constexpr (kPeer) return __ldcg(reinterpret_cast<const float*>(p));
    else return __ldg(reinterpret_cast<const float*>(p));
}
template <bool kPeer>
__device__ __forceinline__ u32 ld_wire_u16(const void* p) {
    if constexpr (kPeer) return __ldcg(reinterpret_cast<const unsigned short*>(p));
    else return __ldg(reinterpret_cast<const unsigned short*>(p));
}
template <bool kPeer>
__device__ __forceinline__ u32 ld_wire_u8(const void* p) {
    if constexpr (kPeer) return __ldcg(reinterpret_cast<const unsigned char*>(p));
    else return __ldg(reinterpret_cast<const unsigned char*>(p));
}

// Thread t's codes in slice sl.
template <int G, int kCodec, bool kPeer>
__device__ __forceinline__ Codes8 ld_codes(const unsigned char* sl, i64 t, i64 S) {
    Codes8 c;
    c.lo = ld_wire_u32<kPeer>(reinterpret_cast<const u32*>(sl) + t);
    c.hi = 0u;
    if constexpr (Wire<G, kCodec>::k7)
        c.hi = ld_wire_u16<kPeer>(sl + (S >> 1) + 2 * t) | (ld_wire_u8<kPeer>(sl + (S >> 1) + (S >> 2) + t) << 16);
    return c;
}
// From a slice's scales sc, for thread t of group grp: the int4 codecs' group scale (float32
// bits); int7-h32's two bfloat16 scales of the rotation block (t / 4) as one word, the lower
// group's in bits 0-15.
template <int G, int kCodec, bool kPeer>
__device__ __forceinline__ u32 ld_scale_bits(const unsigned char* sc, i64 t, i64 grp) {
    if constexpr (Wire<G, kCodec>::k7) return ld_wire_u32<kPeer>(reinterpret_cast<const u32*>(sc) + (t >> 2));
    else return fbits(ld_wire_f32<kPeer>(reinterpret_cast<const float*>(sc) + grp));
}
// Thread t's scale as a float, from ld_scale_bits.
template <int G, int kCodec>
__device__ __forceinline__ float scale_of(u32 bits, i64 t) {
    if constexpr (Wire<G, kCodec>::k7) return bitsf((t & 2) ? (bits & 0xffff0000u) : (bits << 16));
    else return bitsf(bits);
}
// The NaN of thread t's NaN/Inf unit as float32 bits, or 0 when none of its scales is NaN:
// the group's scale (int4 codecs), the first NaN of the block's two (int7-h32).
template <int G, int kCodec>
__device__ __forceinline__ u32 unit_nan(u32 bits, i64 t) {
    if constexpr (Wire<G, kCodec>::k7) {
        const u32 lo = bits << 16, hi = bits & 0xffff0000u;
        return (lo & 0x7fffffffu) > 0x7f800000u ? lo : (hi & 0x7fffffffu) > 0x7f800000u ? hi : 0u;
    } else {
        return (bits & 0x7fffffffu) > 0x7f800000u ? bits : 0u;
    }
}

// True when every residual v - ref of a group is finite by construction, so reduce_quantize may
// skip its 8 tests: no base, and the group's amax (as bits) so small that no step overflows:
// |fl(q * scale)| <= amax (1 + 2^-22), rotated back (int4-h32, 32 terms) <= 32 amax (1 + 2^-20),
// rounded to RefT (float16: finite below 65504, so amax < 2^10; else amax < 2^120), rotated
// again and subtracted from |v| <= amax: below 2^127. The caller leaves out int7-h32 (its
// rotation block spans two groups, whose amax this thread does not see) and float32 inputs
// (8 bytes spilled with the second path, no faster on H200: BENCHMARKS.md, eighth pass).
template <typename RefT> struct PlainAmax { static constexpr u32 kBits = 0x7b800000u; };   // 2^120
template <> struct PlainAmax<half_t> { static constexpr u32 kBits = 0x44800000u; };        // 2^10
template <typename RefT>
__device__ __forceinline__ bool plain_residual(u32 amax_bits, bool has_base) {
    return !has_base && amax_bits < PlainAmax<RefT>::kBits;
}

// The threads [t_first, t_end) of a slice (one thread = 8 elements = one code word),
// walked with `stride`: a standalone kernel passes its grid-stride range over all S / 8
// threads, the fused kernel one tile per block. Ranges hold whole warps. The codes and
// scales written to wire_out also go to copies[c] + copy_off, c < ncopies (the fused
// kernel's peers), as they are made.
// kBatch: incoming slices loaded together (the fused kernel passes ECHO_FUSED_IN_BATCH = 1:
// fewer registers and spills, faster with two ranks; the standalone kernels use kInBatch).
// kFull: every buffer holds the whole slice and is 16-byte aligned (reduce_quantize_body
// checks), so no load or store tests its bounds. `stride` is a multiple of 4 (whole warps).
template <typename InT, typename ResT, typename RefT, int G, int kCodec, bool kPeer, bool kOut, int kBatch,
          bool kFull>
__device__ __forceinline__ void reduce_quantize_loop(const unsigned char* __restrict__ incoming, i64 n_in,
                                                     i64 own_pos, const InT* __restrict__ own, i64 own_n,
                                                     ResT* __restrict__ residual,
                                                     unsigned char* __restrict__ wire_out, i64 S,
                                                     const RefT* __restrict__ base, i64 base_n,
                                                     i64 t_first, i64 t_end, i64 stride,
                                                     unsigned char* const* copies, int ncopies,
                                                     i64 copy_off, RefT* __restrict__ out_p,
                                                     i64 out_n) {
    using W = Wire<G, kCodec>;
    constexpr bool kRot = W::kRot;
    constexpr int kLanes = W::kLanes;
    const i64 nthreads = t_end;
    const i64 slice_bytes = W::slice_bytes(S);
    const i64 codes_bytes = W::codes_bytes(S);
    const bool own_vec = aligned16(own);
    const bool res_vec = residual != nullptr && aligned16(residual);
    const int nin = (int)n_in, opos = (int)own_pos;

    // With one incoming slice at a time, its code word and scale are prefetched too.
    constexpr bool kPfIn = ECHO_PREFETCH && ECHO_PREFETCH_IN && kBatch == 1;
    const int lb = (int)(t_first & (kRotLanes - 1));   // the lane in its rotation block, fixed
    const u32 z16 = rot_sign_word16(lb);
    i64 t = t_first;
    Raw8<InT> own_next;
    ResRaw<ResT> res_next;
    Codes8 in_w_next{0u, 0u};
    float in_sc_next = 0.0f;
    if (ECHO_PREFETCH && t < nthreads) {
        own_next = load_raw8<InT, true, kFull>(own, t << 3, own_n, own_vec);
        if (residual != nullptr) res_next = res_load<ResT, kFull>(residual, t, S, res_vec);
        if (kPfIn && nin > 0) {
            in_w_next = ld_codes<G, kCodec, kPeer>(incoming, t, S);
            in_sc_next = scale_of<G, kCodec>(ld_scale_bits<G, kCodec, kPeer>(incoming + codes_bytes, t, t / kLanes), t);
        }
    }
    for (; t < nthreads; t += stride) {
        const i64 e0 = t << 3;
        const i64 grp = t / kLanes;

        Raw8<InT> own_r;
        ResRaw<ResT> res_r;
        const Codes8 in_w = in_w_next;
        const float in_sc = in_sc_next;
        if (ECHO_PREFETCH) {
            own_r = own_next;
            res_r = res_next;
            if (t + stride < nthreads) {
                own_next = load_raw8<InT, true, kFull>(own, e0 + (stride << 3), own_n, own_vec);
                if (residual != nullptr) res_next = res_load<ResT, kFull>(residual, t + stride, S, res_vec);
                if (kPfIn && nin > 0) {
                    in_w_next = ld_codes<G, kCodec, kPeer>(incoming, t + stride, S);
                    in_sc_next = scale_of<G, kCodec>(
                        ld_scale_bits<G, kCodec, kPeer>(incoming + codes_bytes, t + stride, (t + stride) / kLanes),
                        t + stride);
                }
            }
        } else {
            own_r = load_raw8<InT, true, kFull>(own, e0, own_n, own_vec);
            if (residual != nullptr) res_r = res_load<ResT, kFull>(residual, t, S, res_vec);
        }
        float own_v[8], res_v[8];
        if constexpr (kRot && Traits<InT>::kBytes == 2) {   // signs on the packed pairs: 4 ops, not 8
            const uint4 w = rot_signs16(own_r.w[0], z16);
            unpack8_16<InT>(w, own_v);
            rot_scale8(own_v);
            rot_butterflies8(own_v, lb);
        } else {
            unpack8<InT>(own_r.w, own_v);
            if constexpr (kRot) rot_forward8(own_v, lb);
        }

        // Terms in order, own at own_pos; acc starts at -0.0f, which makes the
        // first addition exact (-0 + x == x for every x, signed zeros included),
        // i.e. "the first term taken as is".
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = -0.0f;
        for (int b0 = 0; b0 < nin; b0 += kBatch) {
            Codes8 w[kBatch];
            float sc[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                if (kPfIn && b0 == 0) {
                    w[u] = in_w;
                    sc[u] = in_sc;
                } else if (b0 + u < nin) {
                    const unsigned char* sl = incoming + (i64)(b0 + u) * slice_bytes;
                    w[u] = ld_codes<G, kCodec, kPeer>(sl, t, S);
                    sc[u] = scale_of<G, kCodec>(ld_scale_bits<G, kCodec, kPeer>(sl + codes_bytes, t, grp), t);
                }
            }
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                if (b0 + u < nin) {
                    if (b0 + u == opos) add_terms(acc, own_v);
                    add_decoded<kCodec>(acc, w[u], sc[u]);
                }
            }
        }
        if (opos >= nin) add_terms(acc, own_v);
        if (residual != nullptr) {
            res_unpack<ResT>(res_r, res_v);
            add_terms(acc, res_v);
        }

        // Group amax over |v| as bits; a NaN/Inf anywhere makes it >= 0x7f800000.
        u32 amax = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = max(amax, abs_bits(acc[i]));
#pragma unroll
        for (int off = 1; off < kLanes; off <<= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        const bool finite = amax < 0x7f800000u;

        // q_i = clip(rint(fl(v_i / scale)), -L, L) (L = 7, int7-h32: 63) as a float (qf) and in
        // the low bits of code[i]; q = 0 for scale == 0 and for a non-finite group.
        float scale = bitsf(kScaleNaN);
        float qf[8];
        u32 code[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) { qf[i] = 0.0f; code[i] = 0u; }
        if (finite) {
            scale = div_rn(bitsf(amax), (float)W::kLevels);
            if constexpr (W::k7) scale = bitsf(fbits(scale) & 0xffff0000u);   // truncated to a bfloat16
            // scale = max(amax / L, 2^-149) (int7-h32: max(trunc_bf16(amax / L), 2^-133)) for
            // amax > 0: tiny subnormal groups must not collapse.
            if (amax != 0u && fbits(scale) == 0u) scale = bitsf(W::k7 ? 0x00010000u : 0x00000001u);
            if (fbits(scale) >= 0x00800000u) {
                // Normal scale: |v / scale| < L + 0.5, so no clipping. y = fl(v * fl(1/scale))
                // is within 3 * 2^-24 * |y| of the exact quotient; unless y is within W::kNearTie
                // of a half-integer, rint(y) == rint(fl(v / scale)). Otherwise divide exactly.
                // The test is one branch for the 8 quotients (their largest deviation), taken
                // about once in 2^12 chunks (int7-h32: 2^10).
                const float r = rcp_rn(scale);
                float dev = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float y = mul_rn(acc[i], r);
                    const float m = add_rn(y, kMagic);
                    qf[i] = sub_rn(m, kMagic);
                    code[i] = fbits(m);
                    dev = max_abs(dev, sub_rn(y, qf[i]));
                }
                if (fbits(dev) > fbits(W::kNearTie)) {   // dev >= 0: the bits order as the values
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        if (abs_bits(sub_rn(mul_rn(acc[i], r), qf[i])) > fbits(W::kNearTie)) {
                            const float m = add_rn(div_rn(acc[i], scale), kMagic);
                            qf[i] = sub_rn(m, kMagic);
                            code[i] = fbits(m);
                        }
                    }
                }
            } else if (fbits(scale) != 0u) {
                // Subnormal scale (|v| < L * 2^-126): the quotient can exceed L + 0.5; divide and clip.
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const int q = min(W::kLevels, max(-W::kLevels, rint_s32(div_rn(acc[i], scale))));
                    qf[i] = i2f(q);
                    code[i] = (u32)q;
                }
            }
        }
        const Codes8 packed = pack_codes<kCodec>(code);
        st_codes<G, kCodec>(wire_out, codes_bytes, t, grp, S, packed, scale);
        for (int c = 0; c < ncopies; ++c) st_codes<G, kCodec>(copies[c] + copy_off, codes_bytes, t, grp, S, packed, scale);

        if (residual != nullptr || (kOut && out_p != nullptr)) {   // warp-uniform
            // The decoded values fl(q * scale), in the values' domain where the output or the
            // owner's ref needs them (rotated codecs; warp-uniform conditions: rotations need every lane).
            constexpr bool kRound = Traits<RefT>::kBytes == 2;
            const bool ref_in_values = kRot && (kRound || base != nullptr);
            // Without a base the signs cancel in the ref (rotated back, rounded, rotated again:
            // see rot_scale8), so e stays without them and only the output applies them.
            const bool signless = kRot && kRound && base == nullptr;
            float e[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) e[i] = mul_rn(qf[i], scale);
            if (ref_in_values) {
                rot_butterflies8(e, lb);
                if (!signless) rot_signs8(e, lb);
            }
            Raw8<RefT> braw;
            float b[8];
            if (base != nullptr) {
                braw = load_raw8<RefT, true, kFull>(base, e0, base_n, aligned16(base));
                unpack8<RefT>(braw.w, b);
            }
            if (kOut && out_p != nullptr) {
                // The owner's own slice of the output, as dequantize_body would decode it from the
                // codes just made (kAcc when there is a base: the base is that output).
                float o[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) o[i] = e[i];
                if (kRot && !ref_in_values) rot_inverse8(o, lb);
                if (signless) rot_signs8(o, lb);
                const bool vec = aligned16(out_p);
                // The NaN/Inf unit: the group, or (int7-h32) the rotation block of two groups.
                bool unit_finite = finite;
                if constexpr (W::k7) {   // every lane shuffles (no short-circuit before it)
                    const int partner = __shfl_xor_sync(0xffffffffu, (int)finite, 2);
                    unit_finite = finite && partner != 0;
                }
                if (!unit_finite) {
                    RefT nan[8];
#pragma unroll
                    for (int i = 0; i < 8; ++i) nan[i] = Traits<RefT>::nan_of_scale(W::k7 ? kScaleNaN : fbits(scale));
                    store8<RefT, kFull>(out_p, e0, out_n, vec, nan);
                } else if (base != nullptr) {
                    RefT w[8];
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        w[i] = abs_bits(b[i]) > 0x7f800000u ? raw_elem<RefT>(braw, i) : Traits<RefT>::from_f32(add_rn(b[i], o[i]));
                    store8<RefT, kFull>(out_p, e0, out_n, vec, w);
                } else {
                    store8f<RefT, kFull>(out_p, e0, out_n, vec, o);
                }
            }
            if (residual != nullptr) {
                // residual = v - ref, ref = fl(q * scale) rounded through RefT; with a base,
                // ref = round_RefT(base + fl(q * scale)) - base instead; non-finite -> 0.
                if (base != nullptr) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) e[i] = add_rn(b[i], e[i]);
                    round_through8<RefT>(e);
#pragma unroll
                    for (int i = 0; i < 8; ++i) e[i] = sub_rn(e[i], b[i]);
                } else {
                    round_through8<RefT>(e);
                }
                if (ref_in_values) {
                    if (signless) rot_scale8(e);
                    else rot_sign_scale8(e, lb);
                    rot_butterflies8(e, lb);
                }
                constexpr bool kMayPlain = !W::k7 && Traits<InT>::kBytes == 2;
                if (kMayPlain && plain_residual<RefT>(amax, base != nullptr)) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) e[i] = sub_rn(acc[i], e[i]);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const float d = sub_rn(acc[i], e[i]);
                        e[i] = (finite && is_finite(d)) ? d : 0.0f;
                    }
                }
                res_store<ResT, kFull>(residual, t, S, res_vec, e);
            }
        }
    }
}

// ------------------------------------- int4-h32, G = 32: a whole block per thread
// The five butterfly stages of a 32-element block held as 4 chunks of 8 (h = 8: chunk ^ 1, h = 16:
// chunk ^ 2).
__device__ __forceinline__ void butterflies32(float (&v)[4][8]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) butterflies_in8(v[k]);
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if ((k & x) == 0) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float a = v[k][j], b = v[k + x][j];
                    v[k][j] = add_rn(a, b);
                    v[k + x][j] = sub_rn(a, b);
                }
            }
        }
    }
}

// reduce_quantize_loop's owner with one thread per 32-element rotation block (= group): the
// rotation's h = 8 and 16 stages and the group's amax stay inside the thread (no shuffle). Same
// bits as reduce_quantize_loop (the same operations on the same operands, in the same order).
// For the standalone kernels' owner of int4-h32 at G = 32: 16-bit input, residual and reference,
// no base, every buffer whole and 16-byte aligned (its kFull). 128 registers (2 blocks of 256 a
// SM): on H200 5-26% less time than reduce_quantize_loop at 64 (BENCHMARKS.md, ninth pass). Not in
// the fused kernel: there it spills, and its other phases lose their occupancy (+16%). Units
// [u_first, u_end) of 32 elements, walked with `stride`; no warp-wide operation.
template <typename InT, typename ResT, typename RefT>
__device__ __forceinline__ void reduce_quantize_block32(const unsigned char* __restrict__ incoming, i64 n_in,
                                                        i64 own_pos, const InT* __restrict__ own,
                                                        ResT* __restrict__ residual,
                                                        unsigned char* __restrict__ wire_out, i64 S,
                                                        i64 u_first, i64 u_end, i64 stride) {
    static_assert(Traits<InT>::kBytes == 2 && Traits<ResT>::kBytes == 2 && Traits<RefT>::kBytes == 2,
                  "16-bit input, residual and reference");
    using W = Wire<32, kInt4H32>;
    const i64 slice_bytes = W::slice_bytes(S);
    const i64 codes_bytes = W::codes_bytes(S);
    const int nin = (int)n_in, opos = (int)own_pos;
    for (i64 u = u_first; u < u_end; u += stride) {
        const i64 e0 = u << 5;
        uint4 own_r[4], res_r[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) own_r[k] = ldg16(own + e0 + 8 * k);
        if (residual != nullptr) {
#pragma unroll
            for (int k = 0; k < 4; ++k) res_r[k] = *reinterpret_cast<const uint4*>(residual + e0 + 8 * k);
        }
        // Incoming slice b's code words and scale, loaded two slices ahead of their use
        // (one ahead: the owner of 4 and of 8 ranks 4-5% slower).
        auto ld_in = [&](int b, uint4& w, float& sc) {
            const unsigned char* sl = incoming + (i64)b * slice_bytes;
            w = ldg16(reinterpret_cast<const uint4*>(sl) + u);
            sc = ld_wire_f32<false>(reinterpret_cast<const float*>(sl + codes_bytes) + u);
        };
        uint4 w_next = make_uint4(0u, 0u, 0u, 0u), w_next2 = make_uint4(0u, 0u, 0u, 0u);
        float sc_next = 0.0f, sc_next2 = 0.0f;
        if (nin > 0) ld_in(0, w_next, sc_next);
        if (nin > 1) ld_in(1, w_next2, sc_next2);
        float own_v[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            unpack8_16<InT>(rot_signs16(own_r[k], rot_sign_word16(k)), own_v[k]);
            rot_scale8(own_v[k]);
        }
        butterflies32(own_v);

        // The terms in order, own at own_pos, from acc = -0 (see reduce_quantize_loop).
        float acc[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[k][i] = -0.0f;
        for (int b = 0; b < nin; ++b) {
            const uint4 w = w_next;
            const float sc = sc_next;
            w_next = w_next2;
            sc_next = sc_next2;
            if (b + 2 < nin) ld_in(b + 2, w_next2, sc_next2);
            const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                if (b == opos) add_terms(acc[k], own_v[k]);
                add_decoded<kInt4H32>(acc[k], Codes8{words[k], 0u}, sc);
            }
        }
        if (opos >= nin) {
#pragma unroll
            for (int k = 0; k < 4; ++k) add_terms(acc[k], own_v[k]);
        }
        if (residual != nullptr) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float r[8];
                unpack8_16<ResT>(res_r[k], r);
                add_terms(acc[k], r);
            }
        }

        u32 amax = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) amax = max(amax, abs_bits(acc[k][i]));
        const bool finite = amax < 0x7f800000u;

        // The quantizer of reduce_quantize_loop (see there), the 32 values at once.
        float scale = bitsf(kScaleNaN);
        float qf[4][8];
        u32 code[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) { qf[k][i] = 0.0f; code[k][i] = 0u; }
        if (finite) {
            scale = div_rn(bitsf(amax), (float)W::kLevels);
            if (amax != 0u && fbits(scale) == 0u) scale = bitsf(0x00000001u);
            if (fbits(scale) >= 0x00800000u) {
                const float r = rcp_rn(scale);
                float dev = 0.0f;
#pragma unroll
                for (int k = 0; k < 4; ++k)
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const float y = mul_rn(acc[k][i], r);
                        const float m = add_rn(y, kMagic);
                        qf[k][i] = sub_rn(m, kMagic);
                        code[k][i] = fbits(m);
                        dev = max_abs(dev, sub_rn(y, qf[k][i]));
                    }
                if (fbits(dev) > fbits(W::kNearTie)) {
#pragma unroll
                    for (int k = 0; k < 4; ++k)
#pragma unroll
                        for (int i = 0; i < 8; ++i) {
                            if (abs_bits(sub_rn(mul_rn(acc[k][i], r), qf[k][i])) > fbits(W::kNearTie)) {
                                const float m = add_rn(div_rn(acc[k][i], scale), kMagic);
                                qf[k][i] = sub_rn(m, kMagic);
                                code[k][i] = fbits(m);
                            }
                        }
                }
            } else if (fbits(scale) != 0u) {
#pragma unroll
                for (int k = 0; k < 4; ++k)
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const int q = min(W::kLevels, max(-W::kLevels, rint_s32(div_rn(acc[k][i], scale))));
                        qf[k][i] = i2f(q);
                        code[k][i] = (u32)q;
                    }
            }
        }
        const uint4 packed = make_uint4(pack_codes<kInt4H32>(code[0]).lo, pack_codes<kInt4H32>(code[1]).lo,
                                        pack_codes<kInt4H32>(code[2]).lo, pack_codes<kInt4H32>(code[3]).lo);
        reinterpret_cast<uint4*>(wire_out)[u] = packed;
        reinterpret_cast<float*>(wire_out + codes_bytes)[u] = scale;
        if (residual == nullptr) continue;

        // residual = v - ref, ref = fl(q * scale) rotated back, rounded through RefT and rotated
        // again; without the signs, which cancel (see reduce_quantize_loop).
        float e[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) e[k][i] = mul_rn(qf[k][i], scale);
        butterflies32(e);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            round_through8<RefT>(e[k]);
            rot_scale8(e[k]);
        }
        butterflies32(e);
        const bool plain = plain_residual<RefT>(amax, false);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float d = sub_rn(acc[k][i], e[k][i]);
                e[k][i] = (plain || (finite && is_finite(d))) ? d : 0.0f;
            }
            store8f<ResT, true>(residual, e0 + 8 * k, 0, true, e[k]);
        }
    }
}

// reduce_quantize over the threads [t_first, t_end) of a slice, walked with `stride` (see
// reduce_quantize_loop): the loop without bounds tests when every buffer holds the slice.
// kMayBlock32 (the standalone kernels, whose t_first and stride are the grid's): the owner's
// reduce_quantize_block32 where it applies, with the same grid over S / 32 units.
template <typename InT, typename ResT, typename RefT, int G, int kCodec = kInt4, bool kPeer = false,
          bool kOut = false, int kBatch = kInBatch, bool kMayBlock32 = false>
__device__ __forceinline__ void reduce_quantize_body(const unsigned char* __restrict__ incoming, i64 n_in,
                                                     i64 own_pos, const InT* __restrict__ own, i64 own_n,
                                                     ResT* __restrict__ residual,
                                                     unsigned char* __restrict__ wire_out, i64 S,
                                                     const RefT* __restrict__ base, i64 base_n,
                                                     i64 t_first, i64 t_end, i64 stride,
                                                     unsigned char* const* copies = nullptr, int ncopies = 0,
                                                     i64 copy_off = 0, RefT* __restrict__ out_p = nullptr,
                                                     i64 out_n = 0) {
    const bool whole = aligned16(own) && own_n >= S && (residual == nullptr || aligned16(residual)) &&
                       (base == nullptr || (aligned16(base) && base_n >= S)) &&
                       (!kOut || out_p == nullptr || (aligned16(out_p) && out_n >= S));
    if constexpr (kMayBlock32 && ECHO_BLOCK32 && kCodec == kInt4H32 && G == 32 && sizeof(InT) == 2 &&
                  sizeof(ResT) == 2 && sizeof(RefT) == 2 && !kPeer && !kOut) {
        if (whole && base == nullptr && aligned16(incoming) && aligned16(wire_out) && ncopies == 0) {
            reduce_quantize_block32<InT, ResT, RefT>(incoming, n_in, own_pos, own, residual, wire_out, S, t_first,
                                                     S >> 5, stride);
            return;
        }
    }
    constexpr bool kTwoLoops = sizeof(InT) == 2 && sizeof(ResT) != 4;
    if (ECHO_FULL_PATH && kTwoLoops && whole)
        reduce_quantize_loop<InT, ResT, RefT, G, kCodec, kPeer, kOut, kBatch, true>(
            incoming, n_in, own_pos, own, own_n, residual, wire_out, S, base, base_n, t_first, t_end, stride,
            copies, ncopies, copy_off, out_p, out_n);
    else
        reduce_quantize_loop<InT, ResT, RefT, G, kCodec, kPeer, kOut, kBatch, false>(
            incoming, n_in, own_pos, own, own_n, residual, wire_out, S, base, base_n, t_first, t_end, stride,
            copies, ncopies, copy_off, out_p, out_n);
}

// dequantize: decode slice blockIdx.y of `wire` into out[y*S, y*S + S) ∩ [0, count).
// kAcc (accumulate): out = round(float(out) + decoded) instead, except that an
// out element that is NaN keeps its bits (a non-finite group's NaN, whatever
// its payload) and a NaN-scale unit (group; int7-h32: block) writes its NaN as without kAcc.
// Threads [t_first, t_end) of the slice, walked with `stride` (see reduce_quantize_body).
// Rotated codecs: the decoded block is rotated back before the output; every
// lane of a warp then runs (the thread count is rounded up to whole warps, the
// stores still stop at count) and rotates before the NaN-scale branch.
// kFull: the slice lies whole inside `out`, which is 16-byte aligned (dequantize_body checks).
template <typename OutT, int G, bool kAcc, int kCodec, bool kPeer, bool kFull>
__device__ __forceinline__ void dequantize_loop(const unsigned char* __restrict__ wire, OutT* __restrict__ out,
                                                i64 count, i64 S, i64 slice, i64 t_first, i64 t_end,
                                                i64 stride) {
    using W = Wire<G, kCodec>;
    constexpr bool kRot = W::kRot;
    constexpr int kLanes = W::kLanes;
    const unsigned char* sl = wire + slice * W::slice_bytes(S);
    const unsigned char* scales = sl + W::codes_bytes(S);
    const i64 base = slice * S;
    i64 nthreads = S >> 3;
    if (count - base < S) nthreads = (count - base + 7) >> 3;
    if (kRot) nthreads = (nthreads + 31) & ~(i64)31;   // whole warps; still <= S / 8 (a multiple of 64)
    if (t_end < nthreads) nthreads = t_end;
    const bool vec = aligned16(out);

    constexpr int kU = Traits<OutT>::kBytes == 2 ? ECHO_DQ_UNROLL16 : ECHO_DQ_UNROLL32;
    for (i64 t0 = t_first; t0 < nthreads; t0 += kU * stride) {
        Codes8 w[kU];
        u32 sbits[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const i64 t = t0 + u * stride;
            if (u == 0 || t < nthreads) {
                w[u] = ld_codes<G, kCodec, kPeer>(sl, t, S);
                sbits[u] = ld_scale_bits<G, kCodec, kPeer>(scales, t, t / kLanes);
            }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const i64 t = t0 + u * stride;
            if (u > 0 && t >= nthreads) break;
            const float scale = scale_of<G, kCodec>(sbits[u], t);
            float v[8];
            if constexpr (kRot) {   // all lanes: decode and rotate back before any data-dependent branch
                decode_codes<kCodec>(w[u], v);
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = mul_rn(v[i], scale);
                rot_inverse8(v, (int)(t & (kRotLanes - 1)));
            }
            const u32 nan_bits = unit_nan<G, kCodec>(sbits[u], t);
            if (nan_bits != 0u) {  // a NaN scale: a non-finite unit, numpy's NaN bits
                OutT o[8];
                const OutT nan = Traits<OutT>::nan_of_scale(nan_bits);
#pragma unroll
                for (int i = 0; i < 8; ++i) o[i] = nan;
                store8<OutT, kFull>(out, base + (t << 3), count, vec, o);
            } else {
                if constexpr (!kRot) {
                    decode_codes<kCodec>(w[u], v);
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[i] = mul_rn(v[i], scale);
                }
                if constexpr (kAcc) {
                    // Plain (coherent) loads: this kernel writes `out`.
                    const Raw8<OutT> prev = load_raw8<OutT, false, kFull>(out, base + (t << 3), count, vec);
                    float p[8];
                    unpack8<OutT>(prev.w, p);
                    OutT o[8];
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        o[i] = abs_bits(p[i]) > 0x7f800000u ? raw_elem<OutT>(prev, i)
                                                            : Traits<OutT>::from_f32(add_rn(p[i], v[i]));
                    store8<OutT, kFull>(out, base + (t << 3), count, vec, o);
                } else {
                    store8f<OutT, kFull>(out, base + (t << 3), count, vec, v);
                }
            }
        }
    }
}

template <typename OutT, int G, bool kAcc, int kCodec = kInt4, bool kPeer = false>
__device__ __forceinline__ void dequantize_body(const unsigned char* __restrict__ wire, OutT* __restrict__ out,
                                                i64 count, i64 S, i64 slice, i64 t_first, i64 t_end,
                                                i64 stride) {
    if (ECHO_FULL_PATH && aligned16(out) && count - slice * S >= S)
        dequantize_loop<OutT, G, kAcc, kCodec, kPeer, true>(wire, out, count, S, slice, t_first, t_end, stride);
    else
        dequantize_loop<OutT, G, kAcc, kCodec, kPeer, false>(wire, out, count, S, slice, t_first, t_end, stride);
}

}  // namespace echo

#endif  // ECHO_CODEC_CUH
