// echonccl codec: the residual formats (the input's type, float32, and int8 blocks: codec.py,
// "Residuals"), loaded and stored 8 elements a thread and, for int8, 16 a thread.
#ifndef ECHO_RESIDUAL_CUH
#define ECHO_RESIDUAL_CUH

#include "staging.cuh"

namespace echo {

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

#endif  // ECHO_RESIDUAL_CUH
