// echonccl codec: dequantize, a wire slice decoded (rotated back) into the output, or added to it:
// the bit-exact twin of NumpyKernels.dequantize.
#ifndef ECHO_DEQUANTIZE_CUH
#define ECHO_DEQUANTIZE_CUH

#include "codec_wire.cuh"
#include "rotation.cuh"

namespace echo {

// Chunks of 8 elements per thread and grid-stride step in dequantize (loads
// first), for 16-bit and for float32 outputs (measured best on H200: 2 and 1).
// echonccl/kernels_cuda.py sizes the dequantize grid with the same numbers.
#ifndef ECHO_DQ_UNROLL16
#define ECHO_DQ_UNROLL16 2
#endif
#ifndef ECHO_DQ_UNROLL32
#define ECHO_DQ_UNROLL32 1
#endif

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

#endif  // ECHO_DEQUANTIZE_CUH
