// echonccl codec: dequantize, a wire slice decoded (rotated back) into the output, or added to it:
// the bit-exact twin of NumpyKernels.dequantize.
#ifndef ECHO_DEQUANTIZE_CUH
#define ECHO_DEQUANTIZE_CUH

#include "codec_wire.cuh"
#include "rotation.cuh"

namespace echo {

// Chunks of 8 elements per thread and grid-stride step in dequantize (loads first), for 16-bit
// (ECHO_DQ_UNROLL16) and for float32 outputs (ECHO_DQ_UNROLL32): launch constants of
// echonccl/kernel_table.py, which sizes the dequantize grid with them.
#if !defined(ECHO_DQ_UNROLL16) || !defined(ECHO_DQ_UNROLL32)
#error "ECHO_DQ_UNROLL16/32 are not defined: compile the sources echonccl/kernel_table.py generates"
#endif

// The end of a decode, thread t's 8 elements at out[e0, e0 + 8) ∩ [0, count): decoded values v
// stored, or with kAcc added (add_keep_nan8). A NaN-scale unit goes to store_nan8 instead.
template <typename OutT, bool kAcc, bool kFull, bool kShift = false>
__device__ __forceinline__ void store_values8(OutT* __restrict__ out, i64 e0, i64 count, bool vec,
                                              const float (&v)[8]) {
    if constexpr (kAcc) {
        // Plain (coherent) loads: this kernel writes `out`.
        const Raw8<OutT> prev = load_raw8<OutT, false, kFull, kShift>(out, e0, count, vec);
        float p[8];
        unpack8<OutT>(prev.w, p);
        OutT o[8];
        add_keep_nan8<OutT>(prev, p, v, o);
        store8<OutT, kFull, kShift>(out, e0, count, vec, o);
    } else {
        store8f<OutT, kFull, kShift>(out, e0, count, vec, v);
    }
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
// kPeer (the fused kernels): the wire is in peer memory (ld_wire_u32's). kShift (the fused kernels'
// 8-element loops): a 16-bit `out` off 16-byte alignment is also written 8 elements at a time
// (store8's kShift).
template <typename OutT, int G, bool kAcc, int kCodec, bool kPeer, bool kFull, bool kShift>
__device__ __forceinline__ void dequantize_loop(const unsigned char* __restrict__ wire, OutT* __restrict__ out,
                                                i64 count, i64 S, i64 slice, i64 t_first, i64 t_end,
                                                i64 stride) {
    using W = Wire<G, kCodec>;
    constexpr bool kRot = W::kRot;
    constexpr int kLanes = W::kLanes;
    const unsigned char* sl = wire + slice * W::slice_bytes(S);
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
                w[u] = ld_codes<G, kCodec, kPeer>(sl, t);
                sbits[u] = ld_scale_bits<G, kCodec, kPeer>(sl, t, t / kLanes);
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
            if (nan_bits != 0u) {  // a NaN scale: a non-finite unit
                store_nan8<OutT, kFull, kShift>(out, base + (t << 3), count, vec, nan_bits);
            } else {
                if constexpr (!kRot) {
                    decode_codes<kCodec>(w[u], v);
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[i] = mul_rn(v[i], scale);
                }
                store_values8<OutT, kAcc, kFull, kShift>(out, base + (t << 3), count, vec, v);
            }
        }
    }
}

// How many steps ahead dequantize_loop16 copies a warp's wire into shared memory (cp.async: in flight
// without registers; register loads ahead did not shorten the decode, docs/notes/fused.md).
constexpr int kWireAhead = 2;

// dequantize_loop for the fused kernels with 16 elements a thread (unit u: elements 16u .. 16u + 15
// of the slice, the half u & 1 of a rotation block: stage h = 8 inside the thread, h = 16 with
// lane ^ 1; reduce_quantize_loop16), over units [u_first, u_end) of slice `slice` that lie whole
// in `out`, 16-byte aligned unless kShift (u_end a multiple of 32), walked with `stride` (a multiple of 32); the
// wire of each warp's step kWireAhead steps ahead in ring slot 1 (WarpWire16). Same bits as dequantize_loop.
// kAny (the whole-slice kernels that take any count; never with kAcc): u_end is the slice's extent,
// the slice holding n valid elements of `out`, its last 512-element block maybe in part (g_tail),
// stored up to n. kShift (the shifted general kernels; never with kAcc): `out` may lie off 16-byte
// alignment (unit16_store_at).
template <typename OutT, int G, bool kAcc, int kCodec, bool kAny = false, bool kShift = false>
__device__ __forceinline__ void dequantize_loop16(const unsigned char* __restrict__ wire, OutT* __restrict__ out,
                                                  i64 S, i64 slice, i64 u_first, i64 u_end, i64 stride,
                                                  i64 n = 0) {
    static_assert(!(kAny && kAcc) && !(kShift && (kAny || kAcc)), "the whole-slice kernels do not accumulate");
    if constexpr (kAny) g_tail = (int)(n & 511);
    using W = Wire<G, kCodec>;
    static_assert(Traits<OutT>::kBytes == 2 && G <= 32, "16-bit outputs, groups of at most 32");
    const unsigned char* sl = wire + slice * W::slice_bytes(S);
    const i64 base = slice * S;
    const int hb = (int)(u_first & 1);
    const int lane = threadIdx.x & 31;
    uint4* const ring = warp_ring(1);   // kWireAhead + 1 of the warp's wire runs (slot 0 stages the stores)
    const WirePiece piece = wire16_piece<G, kCodec>(sl);
    for (int k = 0; k < kWireAhead; ++k) {
        const i64 uk = u_first + k * stride;
        if (uk < u_end) wire16_copy_async(ring + k * 32, piece, uk - lane);
        cp_async_commit();
    }
    int slot = 0;
    for (i64 u = u_first; u < u_end; u += stride, slot = slot == kWireAhead ? 0 : slot + 1) {
        cp_async_wait<kWireAhead - 1>();
        __syncwarp();   // every lane's copies of this step landed; every lane done reading the last step's
        const i64 ua = u + kWireAhead * stride;
        if (ua < u_end)
            wire16_copy_async(ring + (slot == 0 ? kWireAhead : slot - 1) * 32, piece, ua - lane);
        cp_async_commit();
        Codes8 c0, c1;
        wire16_codes<G, kCodec>(ring + slot * 32, c0, c1);
        const u32 sbits = wire16_scale_bits<G, kCodec>(ring + slot * 32);
        const float scale = scale_of<G, kCodec>(sbits, 2 * u);
        float v[2][8];
        decode_codes<kCodec>(c0, v[0]);
        decode_codes<kCodec>(c1, v[1]);
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) v[k][i] = mul_rn(v[k][i], scale);
        if constexpr (W::kRot) rot_inverse16(v, hb);
        const u32 nan_bits = unit_nan<G, kCodec>(sbits, 2 * u);
        const i64 e0 = base + (u << 4);
        if constexpr (kAcc) {   // a refinement round's: each lane its own 32 bytes
            if (nan_bits != 0u) {
                store_nan8<OutT, true>(out, e0, 0, true, nan_bits);
                store_nan8<OutT, true>(out, e0 + 8, 0, true, nan_bits);
            } else {
                store_values8<OutT, kAcc, true>(out, e0, 0, true, v[0]);
                store_values8<OutT, kAcc, true>(out, e0 + 8, 0, true, v[1]);
            }
        } else {
            uint4 ow[2];
            if (nan_bits != 0u) {
                const u32 nan = bits16(Traits<OutT>::nan_of_scale(nan_bits)) * 0x10001u;
                ow[0] = ow[1] = make_uint4(nan, nan, nan, nan);
            } else {
                pack8f<OutT>(v[0], &ow[0]);
                pack8f<OutT>(v[1], &ow[1]);
            }
            const i64 e = (u - lane) << 4;
            if constexpr (kShift) unit16_store_at(warp_ring(0), out + base + e, shift16_of(out), ow[0], ow[1]);
            else if (kAny && u - lane + 32 == u_end && g_tail != 0)
                unit16_store_n(warp_ring(0), out + base + e, ow[0], ow[1], g_tail);
            else unit16_store(warp_ring(0), out + base + e, ow[0], ow[1]);
        }
    }
    cp_async_wait<0>();
}

// The wire parts a decode sums (dequantize with terms > 1, the one-shot quantized all-reduce):
// part s of n at base + s * stride, each holding the same consecutive slices.
struct Terms {
    const unsigned char* base;
    i64 stride;
    int n;
};

// dequantize_loop of the sum of the parts `terms`: per element, the decoded values fl(q * scale) of
// every part added in float32 in part order (from -0, so one part decodes as dequantize_loop does),
// rotated back once; a unit whose scale is NaN in any part stores the first such part's NaN, and a
// unit whose sum overflows float32 stores the NaN of the codec's NaN scale (what a two-shot owner's
// quantizer makes of it). Same thread ranges, kPeer, kFull and kShift as dequantize_loop; every lane of
// a warp runs, whatever the codec (the rotation, the unit's overflow test).
template <typename OutT, int G, bool kAcc, int kCodec, bool kPeer, bool kFull, bool kShift>
__device__ __forceinline__ void dequantize_sum_loop(const Terms& terms, OutT* __restrict__ out, i64 count, i64 S,
                                                    i64 slice, i64 t_first, i64 t_end, i64 stride) {
    using W = Wire<G, kCodec>;
    constexpr int kLanes = W::kLanes;
    constexpr int kUnitLanes = W::k7 ? kRotLanes : kLanes;   // the NaN/Inf unit: group, int7-h32's block
    const i64 off = slice * W::slice_bytes(S);
    const i64 base = slice * S;
    i64 nthreads = S >> 3;
    if (count - base < S) nthreads = (count - base + 7) >> 3;
    nthreads = (nthreads + 31) & ~(i64)31;   // whole warps: still <= S / 8 (a multiple of 64)
    if (t_end < nthreads) nthreads = t_end;
    const bool vec = aligned16(out);
    for (i64 t = t_first; t < nthreads; t += stride) {
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = -0.0f;
        u32 nan_bits = 0u;
        for (int s0 = 0; s0 < terms.n; s0 += 2) {   // two parts' loads in flight
            Codes8 w[2];
            u32 sbits[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                if (u == 0 || s0 + 1 < terms.n) {
                    const unsigned char* sl = terms.base + (s0 + u) * terms.stride + off;
                    w[u] = ld_codes<G, kCodec, kPeer>(sl, t);
                    sbits[u] = ld_scale_bits<G, kCodec, kPeer>(sl, t, t / kLanes);
                }
            }
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                if (u == 0 || s0 + 1 < terms.n) {
                    const float scale = scale_of<G, kCodec>(sbits[u], t);
                    float v[8];
                    decode_codes<kCodec>(w[u], v);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] = add_rn(acc[i], mul_rn(v[i], scale));
                    if (nan_bits == 0u) nan_bits = unit_nan<G, kCodec>(sbits[u], t);
                }
            }
        }
        u32 amax = 0u;   // >= 0x7f800000: a sum overflowed (or a part's unit is NaN)
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = max(amax, abs_bits(acc[i]));
#pragma unroll
        for (int o = 1; o < kUnitLanes; o <<= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if (nan_bits == 0u && amax >= 0x7f800000u) nan_bits = kScaleNaN;   // (a bfloat16 scale's too)
        if constexpr (W::kRot) rot_inverse8(acc, (int)(t & (kRotLanes - 1)));
        if (nan_bits != 0u)
            store_nan8<OutT, kFull, kShift>(out, base + (t << 3), count, vec, nan_bits);
        else
            store_values8<OutT, kAcc, kFull, kShift>(out, base + (t << 3), count, vec, acc);
    }
}

// The kernels whose dequantize runs a block a thread (dequantize_block32, on whole aligned slices):
// int4-h32 at G = 32 into 16 bits. echo_kernels.cu gives these kernels their registers by it.
template <typename OutT, int G, int kCodec>
constexpr bool kBlock32Dequantize = kCodec == kInt4H32 && G == 32 && sizeof(OutT) == 2 &&
                                    ECHO_BLOCK <= 512;   // the staging area is static shared memory

// dequantize_loop for int4-h32 at G = 32 into 16 bits with one thread per 32-element block (= group):
// the inverse rotation's h = 8 and 16 stages stay inside the thread (no shuffle), and the output
// (and kAcc's prior output) goes through a warp's staging area (store_block), coalesced.
// Same bits as dequantize_loop (the same operations on the same operands). Slice `slice` lies whole
// in `out`, both 16-byte aligned; units [u_first - lane, S / 32) walked by whole warps with `stride`
// (a multiple of 32).
template <typename OutT, bool kAcc>
__device__ __forceinline__ void dequantize_block32(const unsigned char* __restrict__ wire, OutT* __restrict__ out,
                                                   i64 S, i64 slice, i64 u_first, i64 stride) {
    using W = Wire<32, kInt4H32>;
    __shared__ uint4 stage_all[ECHO_BLOCK / 32][4 * 32];
    uint4* stage = stage_all[threadIdx.x >> 5];
    const int lane = threadIdx.x & 31;
    const unsigned char* sl = wire + slice * W::slice_bytes(S);
    uint4* o = reinterpret_cast<uint4*>(out + slice * S);
    const i64 u_end = S >> 5;
    for (i64 u0 = u_first - lane; u0 < u_end; u0 += stride) {
        const i64 u = u0 + lane;
        const int nvalid = warp_blocks(u0, u_end);
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        u32 sbits = 0u;
        if (u < u_end) {
            w = ldg16(reinterpret_cast<const uint4*>(sl + W::chunk(u << 5)) + (u & 15));
            sbits = ld_scale_bits<32, kInt4H32, false>(sl, 4 * u, u);
        }
        uint4 prev[4];
        if constexpr (kAcc) {
            load_chunks<4, false>(o + (u0 << 2), nvalid, prev);   // plain loads: this kernel writes out
            chunks_to_block<4>(stage, prev, prev);
        }
        const float scale = scale_of<32, kInt4H32>(sbits, 0);
        const u32 words[4] = {w.x, w.y, w.z, w.w};
        float v[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            decode_codes<kInt4H32>(Codes8{words[k], 0u}, v[k]);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[k][i] = mul_rn(v[k][i], scale);
        }
        butterflies32(v);
        const u32 nan_bits = unit_nan<32, kInt4H32>(sbits, 0);
        uint4 r[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            rot_signs8(v[k], k);
            OutT o8[8];
            if (nan_bits != 0u) {   // a NaN scale: a non-finite group, numpy's NaN bits
#pragma unroll
                for (int i = 0; i < 8; ++i) o8[i] = Traits<OutT>::nan_of_scale(nan_bits);
                r[k] = pack8_16(o8);
            } else if constexpr (kAcc) {
                const Raw8<OutT> pr{{prev[k]}};
                float p[8];
                unpack8<OutT>(pr.w, p);
                add_keep_nan8<OutT>(pr, p, v[k], o8);
                r[k] = pack8_16(o8);
            } else {
                pack8f<OutT>(v[k], &r[k]);
            }
        }
        store_block<4>(stage, o + (u0 << 2), nvalid, r);
    }
}

template <typename OutT, int G, bool kAcc, int kCodec = kInt4>
__device__ __forceinline__ void dequantize_body(const unsigned char* __restrict__ wire, OutT* __restrict__ out,
                                                i64 count, i64 S, i64 slice, i64 t_first, i64 t_end,
                                                i64 stride) {
    if constexpr (kBlock32Dequantize<OutT, G, kCodec>) {
        if (aligned16(out) && aligned16(wire) && count - slice * S >= S) {
            dequantize_block32<OutT, kAcc>(wire, out, S, slice, t_first, stride);
            return;
        }
    }
    if (aligned16(out) && count - slice * S >= S)
        dequantize_loop<OutT, G, kAcc, kCodec, false, true, false>(wire, out, count, S, slice, t_first, t_end, stride);
    else
        dequantize_loop<OutT, G, kAcc, kCodec, false, false, false>(wire, out, count, S, slice, t_first, t_end, stride);
}

// dequantize_sum_loop without bounds tests where the slice lies whole in an aligned `out` (as
// dequantize_body picks dequantize_loop's).
template <typename OutT, int G, bool kAcc, int kCodec>
__device__ __forceinline__ void dequantize_sum_body(const Terms& terms, OutT* __restrict__ out, i64 count, i64 S,
                                                    i64 slice, i64 t_first, i64 t_end, i64 stride) {
    if (aligned16(out) && count - slice * S >= S)
        dequantize_sum_loop<OutT, G, kAcc, kCodec, false, true, false>(terms, out, count, S, slice, t_first, t_end,
                                                                      stride);
    else
        dequantize_sum_loop<OutT, G, kAcc, kCodec, false, false, false>(terms, out, count, S, slice, t_first, t_end,
                                                                       stride);
}

}  // namespace echo

#endif  // ECHO_DEQUANTIZE_CUH
