// echonccl codec: the 32-point signed Hadamard rotation of the rotated codecs (int4-h32, int7-h32),
// bit-exact with codec.rotate / codec.unrotate.
#ifndef ECHO_ROTATION_CUH
#define ECHO_ROTATION_CUH

#include "codec_base.cuh"

namespace echo {

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

// ------------------------------------- 16 elements a thread: half hb of a block per lane
// The fused kernels' whole-slice loops (reduce_quantize_loop16, dequantize_loop16) hold elements
// 16 hb .. 16 hb + 15 of a block as two chunks of 8 (lane-in-block 2 hb and 2 hb + 1): the stage
// h = 8 pairs the chunks inside the thread (the same fl(a + b), fl(a - b) as the lane pair of
// rot_butterflies8), h = 16 exchanges with lane ^ 1 (full-mask shuffles: every lane calls these).
__device__ __forceinline__ void rot_butterflies16(float (&v)[2][8], int hb) {
    butterflies_in8(v[0]);
    butterflies_in8(v[1]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float a = v[0][j], b = v[1][j];
        v[0][j] = add_rn(a, b);
        v[1][j] = sub_rn(a, b);
    }
    const float sgn = hb ? -1.0f : 1.0f;
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int j = 0; j < 8; ++j) v[k][j] = fma_rn(v[k][j], sgn, __shfl_xor_sync(0xffffffffu, v[k][j], 1));
}
// The forward from 16-bit elements w0, w1 as loaded (chunks 2 hb and 2 hb + 1): signs on the packed
// pairs, the factor 2^-5, the butterflies.
template <typename T16>
__device__ __forceinline__ void rot_forward16_raw(const uint4& w0, const uint4& w1, float (&v)[2][8], int hb) {
    unpack8_16<T16>(rot_signs16(w0, rot_sign_word16(2 * hb)), v[0]);
    unpack8_16<T16>(rot_signs16(w1, rot_sign_word16(2 * hb + 1)), v[1]);
    rot_scale8(v[0]);
    rot_scale8(v[1]);
    rot_butterflies16(v, hb);
}
// Inverse: the butterflies, then the signs.
__device__ __forceinline__ void rot_inverse16(float (&v)[2][8], int hb) {
    rot_butterflies16(v, hb);
    rot_signs8(v[0], 2 * hb);
    rot_signs8(v[1], 2 * hb + 1);
}

// ------------------------------------- int4-h32, G = 32: a whole block per thread
// The kernels where that mapping wins (the standalone owner with a 16-bit reference,
// reduce_quantize_block32; the standalone dequantize into 16 bits, dequantize_block32) use it
// on whole, aligned slices.

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

}  // namespace echo

#endif  // ECHO_ROTATION_CUH
