// echonccl codec: reduce_quantize, the owner's sum and every quantization (contribution and owner),
// with error feedback: the bit-exact twin of NumpyKernels.reduce_quantize.
#ifndef ECHO_REDUCE_QUANTIZE_CUH
#define ECHO_REDUCE_QUANTIZE_CUH

#include "codec_wire.cuh"
#include "residual.cuh"
#include "rotation.cuh"

namespace echo {

// Incoming slices are consumed in batches of this many, so their loads are in flight together
// (the standalone kernels; the fused owner takes one at a time: fewer registers).
constexpr int kInBatch = 4;

// True when every residual v - ref of a group is finite by construction, so reduce_quantize may
// skip its 8 tests: no base, and the group's amax (as bits) so small that no step overflows:
// |fl(q * scale)| <= amax (1 + 2^-22), rotated back (int4-h32, 32 terms) <= 32 amax (1 + 2^-20),
// rounded to RefT (float16: finite below 65504, so amax < 2^10; else amax < 2^120), rotated
// again and subtracted from |v| <= amax: below 2^127; a float32 ref is not rotated at all. The
// caller leaves out int7-h32 with a 16-bit ref (its rotation block spans two groups, whose amax
// this thread does not see) and float32 inputs (8 bytes spilled with the second path, no faster
// on H200).
template <typename RefT> struct PlainAmax { static constexpr u32 kBits = 0x7b800000u; };   // 2^120
template <> struct PlainAmax<half_t> { static constexpr u32 kBits = 0x44800000u; };        // 2^10
template <typename RefT>
__device__ __forceinline__ bool plain_residual(u32 amax_bits, bool has_base) {
    return !has_base && amax_bits < PlainAmax<RefT>::kBits;
}

// The quantizer of one group: returns its scale (NaN for a non-finite group; amax = the group's
// largest |v| as bits, finite = amax < Inf) and q_i = rint(fl(v_i * fl(1 / scale))) for a normal
// scale, clip(rint(fl(v_i / scale)), -L, L) for a subnormal one (L = 7, int7-h32: 63; codec.py) of
// this thread's M values as floats (qf) and in the low bits of code[i];
// q = 0 for scale == 0 and for a non-finite group.
template <typename W, int M>
__device__ __forceinline__ float quantize_values(const float (&v)[M], u32 amax, bool finite, float (&qf)[M],
                                                 u32 (&code)[M]) {
    float scale = bitsf(kScaleNaN);
#pragma unroll
    for (int i = 0; i < M; ++i) { qf[i] = 0.0f; code[i] = 0u; }
    if (finite) {
        scale = div_rn(bitsf(amax), (float)W::kLevels);
        if constexpr (W::kBf16Scale) scale = bitsf(fbits(scale) & 0xffff0000u);   // truncated to a bfloat16
        // scale = max(amax / L, 2^-149) (bfloat16 scales: max(trunc_bf16(amax / L), 2^-133)) for
        // amax > 0: tiny subnormal groups must not collapse.
        if (amax != 0u && fbits(scale) == 0u) scale = bitsf(W::kBf16Scale ? 0x00010000u : 0x00000001u);
        if (fbits(scale) >= 0x00800000u) {
            // Normal scale: q = rint(fl(v * fl(1 / scale))) (codec.py), |q| <= L with no clip.
            const float r = rcp_rn(scale);
#pragma unroll
            for (int i = 0; i < M; ++i) {
                const float m = add_rn(mul_rn(v[i], r), kMagic);
                qf[i] = sub_rn(m, kMagic);
                code[i] = fbits(m);
            }
        } else if (fbits(scale) != 0u) {
            // Subnormal scale (|v| < L * 2^-126): the quotient can exceed L + 0.5; divide and clip.
#pragma unroll
            for (int i = 0; i < M; ++i) {
                const int q = min(W::kLevels, max(-W::kLevels, rint_s32(div_rn(v[i], scale))));
                qf[i] = i2f(q);
                code[i] = (u32)q;
            }
        }
    }
    return scale;
}

// The kernels that run a block a thread (reduce_quantize_block32, where the standalone kernels'
// reduce_quantize_body finds the slice whole): int4-h32 at G = 32 with 16-bit input and reference
// and a 16-bit or float32 residual, or float32 input, residual and reference.
// echo_kernels.cu gives these kernels their registers by it.
template <typename InT, typename ResT, typename RefT, int G, int kCodec>
constexpr bool kBlock32Rq =
    kCodec == kInt4H32 && G == 32 && ECHO_BLOCK <= 512 &&
    ((sizeof(InT) == 2 && sizeof(RefT) == 2 && (sizeof(ResT) == 2 || sizeof(ResT) == 4)) ||
     (sizeof(InT) == 4 && sizeof(RefT) == 4 && sizeof(ResT) == 4));

// The buffers of one reduce_quantize (see reduce_quantize_loop), what every caller passes.
// OutT: the output's type (base, out_p), RefT's unless the owner's ref is float32 with a 16-bit
// output (the fused owner without its output's rounding in the residual).
template <typename InT, typename ResT, typename RefT, typename OutT = RefT>
struct RqArgs {
    const unsigned char* incoming;   // n_in wire slices
    i64 n_in, own_pos;               // the own term's place among them
    const InT* own;                  // own_n valid elements
    i64 own_n;
    ResT* residual;                  // null: no feedback
    unsigned char* wire_out;         // the slice made
    i64 S;                           // elements per slice
    const OutT* base;                // null, or the refinement round's base (base_n elements)
    i64 base_n;
    unsigned char* const* copies;    // the fused kernel's: wire_out also to copies[c] + copy_off
    int ncopies;
    i64 copy_off;
    OutT* out_p;                     // the fused kernel's owner: its output slice (out_n elements)
    i64 out_n;
};

// reduce_quantize: see echonccl/kernels.py. S elements per slice, slice i of
// `incoming` at byte i * slice_bytes(S, G); `own` has own_n valid elements;
// `base` (may be null; only read with a residual) has base_n. kCodec: the codec (`Wire`);
// rotated ones rotate own before the sum and measure the owner's ref in the values'
// domain, rotated back, when it is rounded or has a base.
// The threads [t_first, t_end) of a slice (one thread = 8 elements = one code word),
// walked with `stride`: a standalone kernel passes its grid-stride range over all S / 8
// threads, the fused kernel one tile per block. Ranges hold whole warps. The codes and
// scales written to wire_out also go to copies[c] + copy_off, c < ncopies (the fused
// kernel's peers), as they are made.
// kBatch: incoming slices loaded together (the fused kernel's owner passes 1: fewer registers
// and spills, faster with two ranks; the standalone kernels use kInBatch).
// kFull: every buffer holds the whole slice and is 16-byte aligned (reduce_quantize_body
// checks), so no load or store tests its bounds. `stride` is a multiple of 4 (whole warps).
// GIn, kInCodec: the incoming slices' codec (default: G, kCodec, the codec of wire_out); another
// one of the same domain for an owner of a mixed codec (int4-h32 contributions, int7-h32 sums).
// kShift (the fused kernels): 16-bit `own`, `base` and `out_p` off 16-byte alignment read and written
// 8 elements at a time (load_raw8's kShift).
template <typename InT, typename ResT, typename RefT, int G, int kCodec, bool kPeer, bool kOut, int kBatch,
          bool kFull, typename OutT = RefT, int GIn = G, int kInCodec = kCodec, bool kShift = false>
__device__ __forceinline__ void reduce_quantize_loop(const RqArgs<InT, ResT, RefT, OutT>& a, i64 t_first, i64 t_end,
                                                     i64 stride) {
    const unsigned char* __restrict__ incoming = a.incoming;
    const InT* __restrict__ own = a.own;
    ResT* __restrict__ residual = a.residual;
    unsigned char* __restrict__ wire_out = a.wire_out;
    const OutT* __restrict__ base = a.base;
    OutT* __restrict__ out_p = a.out_p;
    const i64 n_in = a.n_in, own_pos = a.own_pos, own_n = a.own_n, S = a.S, base_n = a.base_n, out_n = a.out_n;
    unsigned char* const* copies = a.copies;
    const int ncopies = a.ncopies;
    const i64 copy_off = a.copy_off;
    using W = Wire<G, kCodec>;
    constexpr bool kRot = W::kRot;
    constexpr int kLanes = W::kLanes;
    const i64 nthreads = t_end;
    using WIn = Wire<GIn, kInCodec>;
    static_assert(WIn::kRot == kRot, "incoming and outgoing slices in one domain");
    const i64 in_slice_bytes = WIn::slice_bytes(S);
    const bool own_vec = aligned16(own);
    const bool res_vec = residual != nullptr && aligned16(residual);
    const int nin = (int)n_in, opos = (int)own_pos;

    const int lb = (int)(t_first & (kRotLanes - 1));   // the lane in its rotation block, fixed
    const u32 z16 = rot_sign_word16(lb);
    // Software pipelining: the next grid-stride chunk's own input and residual are loaded while
    // this one is computed (bytes in flight during the arithmetic): with 16-bit input and residual
    // through the shared-memory ring (staging.cuh), whatever of them lies whole and aligned
    // (the rest is loaded when used), else into registers.
    constexpr bool kRing = sizeof(InT) == 2 && sizeof(ResT) == 2;
    const bool has_res = residual != nullptr;
    auto own_ring = [&](i64 tt) { return kFull || (own_vec && (tt << 3) + 8 <= own_n); };
    const bool res_ring = kFull || res_vec;
    auto ring_issue = [&](i64 tt, int slot) {
        if (tt < nthreads) {
            if (own_ring(tt)) cp_async16(&g_ring[slot][0][threadIdx.x], own + (tt << 3));
            if (has_res && res_ring) cp_async16(&g_ring[slot][1][threadIdx.x], residual + (tt << 3));
        }
        cp_async_commit();   // empty groups too: every step waits for the same count
    };
    i64 t = t_first;
    int slot = 0;
    Raw8<InT> own_next;
    ResRaw<ResT> res_next;
    if constexpr (kRing) {
#pragma unroll
        for (int d = 0; d + 1 < kRingDepth; ++d) ring_issue(t + d * stride, d);
    } else if (t < nthreads) {
        own_next = load_raw8<InT, true, kFull, kShift>(own, t << 3, own_n, own_vec);
        if (has_res) res_next = res_load<ResT, kFull>(residual, t, S, res_vec);
    }
    for (; t < nthreads; t += stride) {
        const i64 e0 = t << 3;
        const i64 grp = t / kLanes;

        Raw8<InT> own_r;
        ResRaw<ResT> res_r;
        if constexpr (kRing) {
            ring_issue(t + (kRingDepth - 1) * stride, slot == 0 ? kRingDepth - 1 : slot - 1);
            cp_async_wait<kRingDepth - 1>();
            if (own_ring(t)) own_r.w[0] = g_ring[slot][0][threadIdx.x];
            else own_r = load_raw8<InT, true, kFull, kShift>(own, e0, own_n, own_vec);
            if (has_res) {
                if (res_ring) res_r.r.w[0] = g_ring[slot][1][threadIdx.x];
                else res_r = res_load<ResT, kFull>(residual, t, S, res_vec);
            }
            slot = slot + 1 == kRingDepth ? 0 : slot + 1;
        } else {
            own_r = own_next;
            res_r = res_next;
            if (t + stride < nthreads) {
                own_next = load_raw8<InT, true, kFull, kShift>(own, e0 + (stride << 3), own_n, own_vec);
                if (has_res) res_next = res_load<ResT, kFull>(residual, t + stride, S, res_vec);
            }
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
                if (b0 + u < nin) {
                    const unsigned char* sl = incoming + (i64)(b0 + u) * in_slice_bytes;
                    w[u] = ld_codes<GIn, kInCodec, kPeer>(sl, t);
                    sc[u] = scale_of<GIn, kInCodec>(
                        ld_scale_bits<GIn, kInCodec, kPeer>(sl, t, t / WIn::kLanes), t);
                }
            }
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                if (b0 + u < nin) {
                    if (b0 + u == opos) add_terms(acc, own_v);
                    add_decoded<kInCodec>(acc, w[u], sc[u]);
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

        float qf[8];
        u32 code[8];
        const float scale = quantize_values<W>(acc, amax, finite, qf, code);
        const Codes8 packed = pack_codes<kCodec>(code);
        st_codes<G, kCodec>(wire_out, t, grp, packed, scale);
        for (int c = 0; c < ncopies; ++c) st_codes<G, kCodec>(copies[c] + copy_off, t, grp, packed, scale);

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
            Raw8<OutT> braw;
            float b[8];
            if (base != nullptr) {
                braw = load_raw8<OutT, true, kFull, kShift>(base, e0, base_n, aligned16(base));
                unpack8<OutT>(braw.w, b);
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
                    store_nan8<OutT, kFull, kShift>(out_p, e0, out_n, vec, W::k7 ? kScaleNaN : fbits(scale));
                } else if (base != nullptr) {
                    OutT w[8];
                    add_keep_nan8<OutT>(braw, b, o, w);
                    store8<OutT, kFull, kShift>(out_p, e0, out_n, vec, w);
                } else {
                    store8f<OutT, kFull, kShift>(out_p, e0, out_n, vec, o);
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
                constexpr bool kMayPlain = (!W::k7 || !kRound) && Traits<InT>::kBytes == 2;
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
                res_store<ResT, kFull>(residual, t, S, res_vec, e, i8_scale_exp(scale, finite));
            }
        }
    }
    if constexpr (kRing) cp_async_wait<0>();
}

// reduce_quantize_loop for the fused kernels (kBatch = 1; 16-bit input, residuals of its type or int8; a float32 ref,
// no base) with 16 elements a thread: unit u holds elements 16u .. 16u + 15,
// the half u & 1 of a 32-element rotation block, so the rotation's stage h = 8 stays inside the
// thread and only h = 16 crosses lanes (lane ^ 1), and an int7-h32 group of 16 is one thread (no
// shuffle for its amax, one scale a thread). Same bits as reduce_quantize_loop: the same operations
// on the same operands, in the same order (a lane pair's h = 8 stage, fl(a + b) and fl(a - b), is
// the in-thread pair's). kOut: the owner (incoming slices read as peer memory, its output slice
// written); else a contribution (no incoming). Units [u_first, u_end) that lie whole in every
// buffer, all 16-byte aligned but where kShift says (u_end a multiple of 32), walked with `stride` (a multiple of 32);
// the ring (g_ring) holds a unit's own input and residual. kEarly (the whole-slice kernels): the
// owner issues its first incoming slice's loads at the step's start, in flight during the ring's wait
// and the rotation (two ranks, one alone: 3-4% faster; the general kernels' owner spills with it).
// kAny (the whole-slice kernels that take any count): u_end is the slice's extent, and `own` and
// `out_p` hold a.own_n valid elements, the last 512-element block maybe in part (g_tail): its input
// read zero-filled, its output stored up to own_n. kShift (the shifted kernels): `own` and `out_p`
// may lie off 16-byte alignment, each by its own shift (unit16_copy_async_at, unit16_store_at).
template <typename T, typename ResT, int G, int kCodec, bool kOut, int GIn = G, int kInCodec = kCodec,
          bool kEarly = false, bool kAny = false, bool kShift = false>
__device__ __forceinline__ void reduce_quantize_loop16(const RqArgs<T, ResT, float, T>& a, i64 u_first, i64 u_end,
                                                       i64 stride) {
    const unsigned char* __restrict__ incoming = a.incoming;
    const T* __restrict__ own = a.own;
    ResT* __restrict__ residual = a.residual;
    unsigned char* __restrict__ wire_out = a.wire_out;
    T* __restrict__ out_p = a.out_p;
    const i64 S = a.S;
    unsigned char* const* copies = a.copies;
    const int ncopies = a.ncopies;
    const i64 copy_off = a.copy_off;
    using W = Wire<G, kCodec>;
    using WIn = Wire<GIn, kInCodec>;
    constexpr bool kRot = W::kRot;
    constexpr bool kI8 = IsI8<ResT>::v;
    static_assert(WIn::kRot == kRot && sizeof(T) == 2 && G <= 32 && GIn <= 32 && (kI8 || IsSame<ResT, T>::v),
                  "a 16-bit, one-domain owner; residuals of its type or int8");
    const i64 in_slice_bytes = WIn::slice_bytes(S);
    const int nin = kOut || !kEarly ? (int)a.n_in : 0, opos = (int)a.own_pos;
    const bool has_res = residual != nullptr;
    if constexpr (kAny) g_tail = (int)(a.own_n & 511);
    static_assert(!(kShift && (kAny || kEarly)), "the general kernels' loop");

    const int hb = (int)(u_first & 1);   // the half of its rotation block, fixed
    const int lane = threadIdx.x & 31;
    auto ring_issue = [&](i64 uu, int slot) {
        __syncwarp();   // every lane is done with the slot (its reads, the stores staged through it)
        if (uu < u_end) {   // whole warps
            uint4* r = warp_ring(slot);
            const i64 e = (uu - lane) << 4;
            if constexpr (kShift) unit16_copy_async_at(r, warp_edge(slot), own + e, shift16_of(own));
            else if (kAny && uu - lane + 32 == u_end && g_tail != 0) unit16_copy_async_n(r, own + e, g_tail);
            else unit16_copy_async(r, own + e);
            if (has_res) {
                if constexpr (kI8) res16_copy_async(r + 64, i8_run(residual, uu - lane));
                else unit16_copy_async(r + 64, residual + e);
            }
        }
        cp_async_commit();
    };
    int slot = 0;
#pragma unroll
    for (int d = 0; d + 1 < kRingDepth; ++d) ring_issue(u_first + d * stride, d);
    auto ld_incoming = [&](i64 uu, int b, Codes8& c0, Codes8& c1, u32& sb) {   // incoming slice b's unit uu
        const unsigned char* sl = incoming + (i64)b * in_slice_bytes;
        ld_codes16<GIn, kInCodec, true>(sl, uu, c0, c1);
        sb = ld_scale_bits<GIn, kInCodec, true>(sl, 2 * uu, (2 * uu) / WIn::kLanes);
    };
    for (i64 u = u_first; u < u_end; u += stride) {
        Codes8 c0, c1;
        u32 sb = 0u;
        if constexpr (kOut && kEarly) {
            if (nin > 0) ld_incoming(u, 0, c0, c1, sb);
        }
        ring_issue(u + (kRingDepth - 1) * stride, slot == 0 ? kRingDepth - 1 : slot - 1);
        cp_async_wait<kRingDepth - 1>();
        __syncwarp();
        uint4* const r = warp_ring(slot);
        uint4 w0, w1;
        if constexpr (kShift) unit16_read_at(r, warp_edge(slot), shift16_of(own), w0, w1);
        else unit16_read(r, w0, w1);
        slot = slot + 1 == kRingDepth ? 0 : slot + 1;
        float own_v[2][8];
        if constexpr (kRot) {
            rot_forward16_raw<T>(w0, w1, own_v, hb);
        } else {
            unpack8_16<T>(w0, own_v[0]);
            unpack8_16<T>(w1, own_v[1]);
        }

        // Terms in order, own at own_pos, from acc = -0 (see reduce_quantize_loop).
        float acc[2][8];
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[k][i] = -0.0f;
        for (int b = 0; b < nin; ++b) {
            if (!kEarly || b > 0) ld_incoming(u, b, c0, c1, sb);
            const float sc = scale_of<GIn, kInCodec>(sb, 2 * u);
            if (b == opos) {
                add_terms(acc[0], own_v[0]);
                add_terms(acc[1], own_v[1]);
            }
            add_decoded<kInCodec>(acc[0], c0, sc);
            add_decoded<kInCodec>(acc[1], c1, sc);
        }
        if (opos >= nin) {
            add_terms(acc[0], own_v[0]);
            add_terms(acc[1], own_v[1]);
        }
        if (has_res) {
            if constexpr (kI8) {
                res16_add(r + 64, 0, acc[0]);
                res16_add(r + 64, 1, acc[1]);
            } else {
                unit16_read(r + 64, w0, w1);
                float rv[8];
                unpack8_16<T>(w0, rv);
                add_terms(acc[0], rv);
                unpack8_16<T>(w1, rv);
                add_terms(acc[1], rv);
            }
        }

        u32 amax = 0;
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) amax = max(amax, abs_bits(acc[k][i]));
        if constexpr (G == 32) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        const bool finite = amax < 0x7f800000u;

        float qf[16];
        u32 code[16];
        const float scale = quantize_values<W>(reinterpret_cast<const float (&)[16]>(acc), amax, finite, qf, code);
        const Codes8 p0 = pack_codes<kCodec>(reinterpret_cast<const u32 (&)[8]>(code[0]));
        const Codes8 p1 = pack_codes<kCodec>(reinterpret_cast<const u32 (&)[8]>(code[8]));
        st_codes16<G, kCodec>(wire_out, u, p0, p1, scale);
        for (int c = 0; c < ncopies; ++c) st_codes16<G, kCodec>(copies[c] + copy_off, u, p0, p1, scale);

        float e[2][8];
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) e[k][i] = mul_rn(qf[8 * k + i], scale);
        if (has_res) {
            // residual = v - fl(q * scale), in the rotated domain; non-finite -> 0
            const bool plain = plain_residual<float>(amax, false);
            if constexpr (kI8) {
                u32 sx = i8_scale_exp(scale, finite);
                if constexpr (G == 16) sx = max(sx, __shfl_xor_sync(0xffffffffu, sx, 1));   // the block's two groups
                if constexpr (W::kBf16Scale) {   // a finite group's d is never NaN (acc and e are not)
                    res16_store<true>(i8_run(residual, u - lane), sx, [&](int i) {
                        return sub_rn(acc[i >> 3][i & 7], e[i >> 3][i & 7]);
                    }, !finite);
                } else {
                    res16_store<false>(i8_run(residual, u - lane), sx, [&](int i) {
                        const float d = sub_rn(acc[i >> 3][i & 7], e[i >> 3][i & 7]);
                        return plain || (finite && is_finite(d)) ? d : 0.0f;
                    });
                }
            } else {
                uint4 rw[2];
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    float d[8];
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        d[i] = sub_rn(acc[k][i], e[k][i]);
                        if (!plain) d[i] = (finite && is_finite(d[i])) ? d[i] : 0.0f;
                    }
                    pack8f<T>(d, &rw[k]);
                }
                unit16_store(r + 64, residual + ((u - lane) << 4), rw[0], rw[1]);
            }
        }
        if constexpr (!kOut) continue;
        // The owner's own slice of the output: e rotated back (dequantize_body's bits).
        bool unit_finite = finite;
        if constexpr (kRot) {
            rot_inverse16(e, hb);
            if constexpr (W::k7) {   // every lane shuffles (no short-circuit before it)
                const int partner = __shfl_xor_sync(0xffffffffu, (int)finite, 1);
                unit_finite = finite && partner != 0;
            }
        }
        uint4 ow[2];
        if (!unit_finite) {
            const u32 nan = bits16(Traits<T>::nan_of_scale(W::k7 ? kScaleNaN : fbits(scale))) * 0x10001u;
            ow[0] = ow[1] = make_uint4(nan, nan, nan, nan);
        } else {
            pack8f<T>(e[0], &ow[0]);
            pack8f<T>(e[1], &ow[1]);
        }
        const i64 e_out = (u - lane) << 4;
        if constexpr (kShift) unit16_store_at(r, out_p + e_out, shift16_of(out_p), ow[0], ow[1]);
        else if (kAny && u - lane + 32 == u_end && g_tail != 0) unit16_store_n(r, out_p + e_out, ow[0], ow[1], g_tail);
        else unit16_store(r, out_p + e_out, ow[0], ow[1]);
    }
    cp_async_wait<0>();
}

// reduce_quantize_loop with one thread per 32-element rotation block (= group): the rotation's
// h = 8 and 16 stages and the group's amax stay inside the thread (no shuffle). Same bits as
// reduce_quantize_loop (the same operations on the same operands, in the same order). For the
// standalone kernels of int4-h32 at G = 32 (kBlock32Rq), no base, every buffer whole and 16-byte
// aligned (its kFull). kStage (float32 data, or bfloat16 input): the own input comes through a
// warp's staging area and the residual is copied into it while the sum runs (staging.cuh:
// load_chunks, stage_chunks_async), coalesced and in no register until it is added; float16 data
// (each thread loads and stores its own 64 bytes) was measured faster unstaged. Incoming slices
// are loaded kAhead slices ahead of their use. 128 registers (2 blocks of 256 a SM); the choices
// measured on H200 (BENCHMARKS.md, "Why the kernels are as they are"). Not in the fused kernel: there it
// spills, and its other phases lose their occupancy (+16%). Units from u_first (kStage: its
// warp's first) to S / 32, walked with `stride` (a multiple of 32).
template <typename InT, typename ResT, typename RefT>
__device__ __forceinline__ void reduce_quantize_block32(const RqArgs<InT, ResT, RefT>& a, i64 u_first, i64 stride) {
    const unsigned char* __restrict__ incoming = a.incoming;
    const InT* __restrict__ own = a.own;
    ResT* __restrict__ residual = a.residual;
    unsigned char* __restrict__ wire_out = a.wire_out;
    const i64 n_in = a.n_in, own_pos = a.own_pos, S = a.S;
    static_assert(Traits<InT>::kBytes == Traits<RefT>::kBytes && !IsI8<ResT>::v,
                  "16-bit input and reference, or float32 input and reference; no int8 residual");
    constexpr int ON = Traits<InT>::kBytes * 2;    // own chunks of 16 bytes a block
    constexpr int RN = Traits<ResT>::kBytes * 2;   // residual chunks
    constexpr int kMaxN = ON > RN ? ON : RN;
    constexpr bool kStage = kMaxN == 8 || IsSame<InT, bf16_t>::v;
    constexpr int kAhead = RN == 8 ? 6 : 2;   // 16-bit residuals: 1 ahead 4-5% slower, 4 no faster; float32: 2-4 3-10% slower
    __shared__ uint4 stage_all[kStage ? ECHO_BLOCK / 32 : 1][kStage ? 32 * kMaxN : 1];
    uint4* stage = stage_all[kStage ? threadIdx.x >> 5 : 0];
    using W = Wire<32, kInt4H32>;
    const i64 slice_bytes = W::slice_bytes(S);
    const int nin = (int)n_in, opos = (int)own_pos;
    const int lane = threadIdx.x & 31;
    const i64 u_end = S >> 5;
    for (i64 u0 = kStage ? u_first - lane : u_first; u0 < u_end; u0 += stride) {
        const i64 u = kStage ? u0 + lane : u0;
        const bool valid = !kStage || u < u_end;
        const int nvalid = warp_blocks(u0, u_end);
        const i64 e0 = u << 5;
        uint4 own_r[ON], res_r[RN];
        if constexpr (kStage) {
            load_chunks<ON, true>(reinterpret_cast<const uint4*>(own) + u0 * ON, nvalid, own_r);
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) own_r[k] = ldg16(own + e0 + 8 * k);
            if (residual != nullptr) {
#pragma unroll
                for (int k = 0; k < RN; ++k) res_r[k] = reinterpret_cast<const uint4*>(residual + e0)[k];
            }
        }
        // Incoming slice b's code words and scale, loaded kAhead slices ahead of their use.
        auto ld_in = [&](int b, uint4& w, u32& sc) {   // sc: the stored bits (ld_scale_bits)
            const unsigned char* sl = incoming + (i64)b * slice_bytes;
            w = ldg16(reinterpret_cast<const uint4*>(sl + W::chunk(u << 5)) + (u & 15));
            sc = ld_scale_bits<32, kInt4H32, false>(sl, 4 * u, u);
        };
        uint4 w_ring[kAhead];
        u32 sc_ring[kAhead];
#pragma unroll
        for (int j = 0; j < kAhead; ++j) {
            w_ring[j] = make_uint4(0u, 0u, 0u, 0u);
            sc_ring[j] = 0u;
            if (valid && nin > j) ld_in(j, w_ring[j], sc_ring[j]);
        }
        if constexpr (kStage) {
            chunks_to_block<ON>(stage, own_r, own_r);
            if (residual != nullptr)
                stage_chunks_async<RN>(stage, reinterpret_cast<const uint4*>(residual) + u0 * RN, nvalid);
        }
        float own_v[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if constexpr (ON == 4) {   // signs on the packed pairs (see reduce_quantize_loop)
                unpack8_16<InT>(rot_signs16(own_r[k], rot_sign_word16(k)), own_v[k]);
                rot_scale8(own_v[k]);
            } else {
                unpack8<float>(own_r + 2 * k, own_v[k]);
                rot_sign_scale8(own_v[k], k);
            }
        }
        butterflies32(own_v);

        // The terms in order, own at own_pos, from acc = -0 (see reduce_quantize_loop).
        float acc[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[k][i] = -0.0f;
        for (int b = 0; b < nin; ++b) {
            const uint4 w = w_ring[0];
            const float sc = scale_of<32, kInt4H32>(sc_ring[0], 0);
#pragma unroll
            for (int j = 0; j + 1 < kAhead; ++j) {
                w_ring[j] = w_ring[j + 1];
                sc_ring[j] = sc_ring[j + 1];
            }
            if (valid && b + kAhead < nin) ld_in(b + kAhead, w_ring[kAhead - 1], sc_ring[kAhead - 1]);
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
            if constexpr (kStage) stage_wait_block<RN>(stage, res_r);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float r[8];
                if constexpr (RN == 4) unpack8_16<ResT>(res_r[k], r);
                else unpack8<float>(res_r + 2 * k, r);
                add_terms(acc[k], r);
            }
        }

        u32 amax = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) amax = max(amax, abs_bits(acc[k][i]));
        const bool finite = amax < 0x7f800000u;

        // The quantizer, the 32 values at once.
        float qf[4][8];
        u32 code[4][8];
        const float scale = quantize_values<W>(reinterpret_cast<const float (&)[32]>(acc), amax, finite,
                                               reinterpret_cast<float (&)[32]>(qf), reinterpret_cast<u32 (&)[32]>(code));
        if (valid) {
            unsigned char* ch = wire_out + W::chunk(u << 5);
            reinterpret_cast<uint4*>(ch)[u & 15] =
                make_uint4(pack_codes<kInt4H32>(code[0]).lo, pack_codes<kInt4H32>(code[1]).lo,
                           pack_codes<kInt4H32>(code[2]).lo, pack_codes<kInt4H32>(code[3]).lo);
            st_scale<W>(ch, u, scale);
        }
        if (residual == nullptr) continue;

        // residual = v - ref, ref = fl(q * scale); a 16-bit ref rotated back, rounded through RefT
        // and rotated again, without the signs, which cancel (see reduce_quantize_loop).
        float e[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int i = 0; i < 8; ++i) e[k][i] = mul_rn(qf[k][i], scale);
        if constexpr (Traits<RefT>::kBytes == 2) {
            butterflies32(e);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                round_through8<RefT>(e[k]);
                rot_scale8(e[k]);
            }
            butterflies32(e);
        }
        const bool plain = ON == 4 && plain_residual<RefT>(amax, false);
        uint4 out_r[RN];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float d = sub_rn(acc[k][i], e[k][i]);
                e[k][i] = (plain || (finite && is_finite(d))) ? d : 0.0f;
            }
            if constexpr (kStage) pack8f<ResT>(e[k], out_r + k * (RN / 4));
            else store8f<ResT, true>(residual, e0 + 8 * k, 0, true, e[k]);
        }
        if constexpr (kStage) store_block<RN>(stage, reinterpret_cast<uint4*>(residual) + u0 * RN, nvalid, out_r);
    }
}

// reduce_quantize over the threads [t_first, t_end) of a slice, walked with `stride` (see
// reduce_quantize_loop): the loop without bounds tests when every buffer holds the slice.
// kMayBlock32 (the standalone kernels, whose t_first and stride are the grid's):
// reduce_quantize_block32 where it applies, with the same grid over S / 32 units. GIn, kInCodec:
// the incoming slices' codec (reduce_quantize_loop).
template <typename InT, typename ResT, typename RefT, int G, int kCodec = kInt4, bool kPeer = false,
          bool kOut = false, int kBatch = kInBatch, bool kMayBlock32 = false, int GIn = G, int kInCodec = kCodec>
__device__ __forceinline__ void reduce_quantize_body(const RqArgs<InT, ResT, RefT>& a, i64 t_first, i64 t_end,
                                                     i64 stride) {
    const bool whole = aligned16(a.own) && a.own_n >= a.S && (a.residual == nullptr || aligned16(a.residual)) &&
                       (a.base == nullptr || (aligned16(a.base) && a.base_n >= a.S)) &&
                       (!kOut || a.out_p == nullptr || (aligned16(a.out_p) && a.out_n >= a.S));
    if constexpr (kMayBlock32 && kBlock32Rq<InT, ResT, RefT, G, kCodec> && !kPeer && !kOut && kInCodec == kCodec) {
        if (whole && a.base == nullptr && aligned16(a.incoming) && aligned16(a.wire_out) && a.ncopies == 0) {
            reduce_quantize_block32<InT, ResT, RefT>(a, t_first, stride);
            return;
        }
    }
    constexpr bool kTwoLoops = sizeof(InT) == 2 && sizeof(ResT) != 4;
    if (kTwoLoops && whole)
        reduce_quantize_loop<InT, ResT, RefT, G, kCodec, kPeer, kOut, kBatch, true, RefT, GIn, kInCodec>(
            a, t_first, t_end, stride);
    else
        reduce_quantize_loop<InT, ResT, RefT, G, kCodec, kPeer, kOut, kBatch, false, RefT, GIn, kInCodec>(
            a, t_first, t_end, stride);
}

}  // namespace echo

#endif  // ECHO_REDUCE_QUANTIZE_CUH
