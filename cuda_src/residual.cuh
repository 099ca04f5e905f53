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
// with full-mask shuffles: every lane of the warp must call it together. A block's exponent
// follows its groups' scales (codec.py, "Residuals").
struct i8res_t { unsigned char x; };
typedef i8res_t i8;
template <typename R> using IsI8 = IsSame<R, i8res_t>;
constexpr i64 kResSuperBytes = 528;   // codec.RES_SUPER_BYTES
constexpr u32 kResMinExp = 7;         // codec.RES_MIN_EXP
constexpr u32 kResMaxExp = 254;       // codec.RES_MAX_EXP

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
// byte (m + 128 unsigned), less 2^23 + 128 (exact: m), then scaled (exact: mul is a power of two
// and |m| <= 127, so m * mul is a normal float or zero; added to a sum, one fma is fl(acc + m mul)).
// The bytes are the encoder's (codec.check_residual_bytes guards what comes from outside).
// Encode: fl(e * mul + 1.5 * 2^23) rounds the product (exact, or below 2^-126 where rint gives 0
// too) to an integer, ties to even, as rint(fl(e * mul)) does; the float's low byte is m. Clamped
// to +-127 where a block may need it (i8_encode_clip; the clamps compare the floats' bits as
// integers: positive floats order as their bits do; no float min / max, which NVRTC's -ftz=true
// would flush).
__device__ __forceinline__ float i8_mant(u32 w, int i) {
    return add_rn(bitsf(__byte_perm(w, 0x4B000000u, 0x7440u | (u32)i)), -8388736.0f);   // w: bytes ^ 0x80
}
__device__ __forceinline__ u32 i8_encode(float e, float mul) { return fbits(fma_rn(e, mul, 12582912.0f)); }
__device__ __forceinline__ u32 i8_encode_clip(float e, float mul) {
    return min(max(i8_encode(e, mul), 0x4B3FFF81u), 0x4B40007Fu);   // 1.5 * 2^23 -+ 127
}
// A block's exponent byte: x = min(max(S, E + 1, 7), 254) from c = max(S, E + 1) over its lanes
// (codec.py, "Residuals"); the decoder's 2^(x - 133) and the encoder's 2^(133 - x).
__device__ __forceinline__ u32 i8_exp_candidate(u32 scale_exp, u32 amax_bits) {
    return max(scale_exp, (amax_bits >> 23) + 1u);
}
__device__ __forceinline__ u32 i8_block_exp(u32 c) { return min(max(c, kResMinExp), kResMaxExp); }
__device__ __forceinline__ float i8_decode_mul(u32 x) { return bitsf((x - 6u) << 23); }
__device__ __forceinline__ float i8_encode_mul(u32 x) { return bitsf((260u - x) << 23); }
// S of one group: the biased exponent of its scale, 0 for a non-finite group (its residuals are 0).
__device__ __forceinline__ u32 i8_scale_exp(float scale, bool finite) { return finite ? fbits(scale) >> 23 : 0u; }
// Four encoded mantissas (i8_encode) as the bytes of one word, in order.
__device__ __forceinline__ u32 i8_pack4(u32 a, u32 b, u32 c, u32 d) {
    return __byte_perm(__byte_perm(a, b, 0x0040u), __byte_perm(c, d, 0x0040u), 0x5410u);
}

// float32 values: fl(m * 2^(x - 133)) for i8res_t.
template <typename R>
__device__ __forceinline__ void res_unpack(const ResRaw<R>& r, float (&v)[8]) {
    if constexpr (IsI8<R>::v) {
        const float mul = i8_decode_mul(r.x);
        const u32 wx = r.m.x ^ 0x80808080u, wy = r.m.y ^ 0x80808080u;
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = mul_rn(i8_mant(i < 4 ? wx : wy, i & 3), mul);
    } else {
        unpack8<R>(r.r.w, v);
    }
}

// Store 8 finite residuals e (rounded to R; for i8res_t: the block's exponent from the 4 lanes'
// largest |e| and the exponents scale_exp of their groups' scales, `i8_scale_exp`).
template <typename R, bool kFull = false>
__device__ __forceinline__ void res_store(R* p, i64 t, i64 S, bool vec, const float (&e)[8], u32 scale_exp) {
    if constexpr (IsI8<R>::v) {
        u32 a = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) a = max(a, abs_bits(e[i]));
        u32 c = i8_exp_candidate(scale_exp, a);
        c = max(c, __shfl_xor_sync(0xffffffffu, c, 1));
        c = max(c, __shfl_xor_sync(0xffffffffu, c, 2));
        const u32 x = i8_block_exp(c);
        const float mul = i8_encode_mul(x);
        u32 m[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) m[i] = i8_encode_clip(e[i], mul);
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
// This lane's residuals 8 k .. 8 k + 7 from r, once the warp's copies have landed and it
// synchronized, added to acc: fl(acc_i + m_i 2^(x - 133)), one fma each.
__device__ __forceinline__ void res16_add(const uint4* r, int k, float (&acc)[8]) {
    const int lane = threadIdx.x & 31;
    const uint2 m = reinterpret_cast<const uint2*>(r + lane)[k];
    const float mul = i8_decode_mul(reinterpret_cast<const unsigned char*>(r + 32)[lane >> 1]);
    const u32 wx = m.x ^ 0x80808080u, wy = m.y ^ 0x80808080u;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = fma_rn(i8_mant(i < 4 ? wx : wy, i & 3), mul, acc[i]);
}
// This lane's 16 residuals e(i), i < 16, stored at p (the warp's 528 bytes; every lane calls
// it together); scale_exp: S of the lane's 32-element block (`i8_scale_exp`, the larger of the
// lane pair's). kScaleBound: every finite |e| < 2^(S - 127) (a rotated codec's residual of the
// fl(q * scale) it quantized: codec.py, "Residuals"), so x = max(S, 7) and no mantissa needs the
// clip; an infinite e encodes as 0 (fl(+-inf * mul + 1.5 * 2^23)'s low byte), the value a non-finite
// residual stores, and `zero` stores 0 for all 16 (a non-finite group: NaN must not reach the
// encoder, whose low byte of NaN is not 0). Otherwise e is finite, evaluated twice an element (for
// the block's exponent, then its mantissa), so that the 16 values need not be held at once.
template <bool kScaleBound, typename E>
__device__ __forceinline__ void res16_store(unsigned char* p, u32 scale_exp, const E& e, bool zero = false) {
    const int lane = threadIdx.x & 31;
    u32 x;
    if constexpr (kScaleBound) {
        x = max(scale_exp, kResMinExp);
    } else {
        u32 a = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) a = max(a, abs_bits(e(i)));
        u32 c = i8_exp_candidate(scale_exp, a);
        c = max(c, __shfl_xor_sync(0xffffffffu, c, 1));
        x = i8_block_exp(c);
    }
    const float mul = i8_encode_mul(x);
    auto enc = [&](int i) { return kScaleBound ? i8_encode(e(i), mul) : i8_encode_clip(e(i), mul); };
    u32 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        w[k] = i8_pack4(enc(4 * k), enc(4 * k + 1), enc(4 * k + 2), enc(4 * k + 3));
        if constexpr (kScaleBound) w[k] = zero ? 0u : w[k];
    }
    reinterpret_cast<uint4*>(p)[lane] = make_uint4(w[0], w[1], w[2], w[3]);
    if ((lane & 1) == 0) p[512 + (lane >> 1)] = (unsigned char)x;
}

}  // namespace echo

#endif  // ECHO_RESIDUAL_CUH
