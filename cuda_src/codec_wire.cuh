// echonccl codec: the wire format on the GPU (codec.py, "Slices" and "Codecs"): codes packed and
// decoded, the codecs' geometry (Wire: a slice's 512-element chunks), and the loads and stores of
// codes and scales in a wire slice.
#ifndef ECHO_CODEC_WIRE_CUH
#define ECHO_CODEC_WIRE_CUH

#include "staging.cuh"

namespace echo {

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
// kCodec (codec.CODECS): int4, int4-h32 (rotated; a bfloat16 scale per group), int7-h32 (rotated;
// 7-bit codes in three sections, a bfloat16 scale per 16 elements: codec.py, "int7-h32").
constexpr int kInt4 = 0, kInt4H32 = 1, kInt7H32 = 2;

// A slice of S elements (a multiple of 512) is S / 512 chunks of kChunkBytes, one per 512 elements
// in order: the chunk's 256 bytes of nibbles, int7-h32's 128 bytes of bits 4-5 (kMid) and 64 of bit
// 6 (kTop), then its scales (kScaleOff, one per group in order). A warp's 32 units of 16 elements
// are one chunk, contiguous.
template <int G, int kCodec>
struct Wire {
    static constexpr bool kRot = kCodec != kInt4;
    static constexpr bool k7 = kCodec == kInt7H32;
    static constexpr bool kBf16Scale = kRot;            // truncated bfloat16 scales; int4: float32
    static_assert(k7 ? G == 16 : (G == 32 || G == 64 || G == 128), "group size of the codec");
    static constexpr int kLanes = G / 8;                // lanes per group
    static constexpr int kLevels = k7 ? 63 : 7;
    static constexpr int kScaleBytes = kBf16Scale ? 2 : 4;
    static constexpr int kMid = 256, kTop = 384;        // int7-h32's sections in a chunk
    static constexpr int kScaleOff = k7 ? 448 : 256;
    static constexpr int kChunkGroups = 512 / G;
    static constexpr int kChunkBytes = kScaleOff + kScaleBytes * kChunkGroups;
    __device__ static __forceinline__ i64 slice_bytes(i64 S) { return (S >> 9) * kChunkBytes; }
    // Byte offset of the chunk holding element e; of group grp's scale in its chunk.
    __device__ static __forceinline__ i64 chunk(i64 e) { return (e >> 9) * kChunkBytes; }
    __device__ static __forceinline__ int scale_in_chunk(i64 grp) {
        return kScaleOff + kScaleBytes * (int)(grp & (kChunkGroups - 1));
    }
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

// Store group grp's scale into its chunk ch (a bfloat16 scale is a truncated float32 already).
template <typename W>
__device__ __forceinline__ void st_scale(unsigned char* ch, i64 grp, float scale) {
    if constexpr (W::kBf16Scale) *reinterpret_cast<u16*>(ch + W::scale_in_chunk(grp)) = (u16)(fbits(scale) >> 16);
    else *reinterpret_cast<float*>(ch + W::scale_in_chunk(grp)) = scale;
}

// Store thread t (of group grp) 's packed codes, and (the group's first lane) its scale, into slice sl.
template <int G, int kCodec>
__device__ __forceinline__ void st_codes(unsigned char* sl, i64 t, i64 grp, const Codes8& c, float scale) {
    using W = Wire<G, kCodec>;
    unsigned char* ch = sl + W::chunk(t << 3);
    const int i = (int)(t & 63);
    reinterpret_cast<u32*>(ch)[i] = c.lo;
    if constexpr (W::k7) {
        reinterpret_cast<u16*>(ch + W::kMid)[i] = (u16)(c.hi & 0xffffu);
        ch[W::kTop + i] = (unsigned char)(c.hi >> 16);
    }
    if ((t & (W::kLanes - 1)) == 0) st_scale<W>(ch, grp, scale);
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
__device__ __forceinline__ Codes8 ld_codes(const unsigned char* sl, i64 t) {
    using W = Wire<G, kCodec>;
    const unsigned char* ch = sl + W::chunk(t << 3);
    const int i = (int)(t & 63);
    Codes8 c;
    c.lo = ld_wire_u32<kPeer>(ch + 4 * i);
    c.hi = 0u;
    if constexpr (W::k7) c.hi = ld_wire_u16<kPeer>(ch + W::kMid + 2 * i) | (ld_wire_u8<kPeer>(ch + W::kTop + i) << 16);
    return c;
}
// The 16-element loops' (reduce_quantize_loop16, dequantize_loop16) unit u = threads 2u and 2u + 1:
// their codes stored (and the scale, by the group's first unit) / loaded, as st_codes / ld_codes do.
template <int G, int kCodec>
__device__ __forceinline__ void st_codes16(unsigned char* sl, i64 u, const Codes8& c0, const Codes8& c1, float scale) {
    using W = Wire<G, kCodec>;
    unsigned char* ch = sl + W::chunk(u << 4);
    const int i = (int)(u & 31);
    reinterpret_cast<uint2*>(ch)[i] = make_uint2(c0.lo, c1.lo);
    if constexpr (W::k7) {
        reinterpret_cast<u32*>(ch + W::kMid)[i] = (c0.hi & 0xffffu) | (c1.hi << 16);
        reinterpret_cast<u16*>(ch + W::kTop)[i] = (u16)(((c0.hi >> 16) & 0xffu) | ((c1.hi >> 8) & 0xff00u));
    }
    if (G == 16 || (u & 1) == 0) st_scale<W>(ch, G == 16 ? u : u >> 1, scale);
}
// Unit u's codes (threads 2u and 2u + 1) from its nibble words lo and, int7-h32 (k7), the u32 of its
// bits 4-5 (mid) and the u16 of its bit 6 (top), as st_codes16 stores them.
template <bool k7>
__device__ __forceinline__ void unit_codes(uint2 lo, u32 mid, u32 top, Codes8& c0, Codes8& c1) {
    c0 = Codes8{lo.x, 0u};
    c1 = Codes8{lo.y, 0u};
    if constexpr (k7) {
        c0.hi = (mid & 0xffffu) | ((top & 0xffu) << 16);
        c1.hi = (mid >> 16) | ((top >> 8) << 16);
    }
}
template <int G, int kCodec, bool kPeer>
__device__ __forceinline__ void ld_codes16(const unsigned char* sl, i64 u, Codes8& c0, Codes8& c1) {
    using W = Wire<G, kCodec>;
    const unsigned char* ch = sl + W::chunk(u << 4);
    const int i = (int)(u & 31);
    const uint2* p = reinterpret_cast<const uint2*>(ch) + i;
    const uint2 lo = kPeer ? __ldcg(p) : __ldg(p);
    if constexpr (W::k7)
        unit_codes<true>(lo, ld_wire_u32<kPeer>(ch + W::kMid + 4 * i), ld_wire_u16<kPeer>(ch + W::kTop + 2 * i), c0, c1);
    else
        unit_codes<false>(lo, 0u, 0u, c0, c1);
}

// A warp's wire for its 32 units u0 .. u0 + 31 of a 16-element loop (u0 a multiple of 32): one chunk
// of the slice (Wire). wire16_copy_async copies it into r by cp.async, one 16-byte piece a lane
// (wire16_piece); wire16_codes and wire16_scale_bits read a lane's unit back as ld_codes16 and
// ld_scale_bits read it from the slice.
template <int G, int kCodec>
struct WarpWire16 {
    using W = Wire<G, kCodec>;
    static constexpr int kScale = W::k7 ? 4 : W::kScaleBytes;   // bytes of scales per two units
    static constexpr int kBytes = W::kChunkBytes;
    static_assert(G <= 32 && kBytes % 32 == 0 && kBytes <= 512, "a warp's wire: at most one 16-byte piece a lane");
};
// This lane's 16-byte piece of its warp's run for units u0 ..: at base + u0 * per_unit (none: per_unit 0).
struct WirePiece {
    const unsigned char* base;
    int per_unit;
};
template <int G, int kCodec>
__device__ __forceinline__ WirePiece wire16_piece(const unsigned char* sl) {
    using WW = WarpWire16<G, kCodec>;
    const int i = (threadIdx.x & 31) * 16;
    if (i < WW::kBytes) return WirePiece{sl + i, WW::kBytes / 32};
    return WirePiece{sl, 0};
}
// The warp's run for units u0 .. u0 + 31 copied into r (cp.async; the caller commits).
__device__ __forceinline__ void wire16_copy_async(uint4* r, const WirePiece& p, i64 u0) {
    if (p.per_unit != 0) cp_async16(r + (threadIdx.x & 31), p.base + u0 * p.per_unit);
}
template <int G, int kCodec>
__device__ __forceinline__ void wire16_codes(const uint4* r, Codes8& c0, Codes8& c1) {
    using WW = WarpWire16<G, kCodec>;
    const int lane = threadIdx.x & 31;
    const unsigned char* b = reinterpret_cast<const unsigned char*>(r);
    const uint2 lo = reinterpret_cast<const uint2*>(b)[lane];
    if constexpr (WW::W::k7)
        unit_codes<true>(lo, reinterpret_cast<const u32*>(b + WW::W::kMid)[lane],
                         reinterpret_cast<const u16*>(b + WW::W::kTop)[lane], c0, c1);
    else
        unit_codes<false>(lo, 0u, 0u, c0, c1);
}
template <int G, int kCodec>
__device__ __forceinline__ u32 wire16_scale_bits(const uint4* r) {
    using WW = WarpWire16<G, kCodec>;
    const unsigned char* b = reinterpret_cast<const unsigned char*>(r) + WW::W::kScaleOff;
    const int k = (threadIdx.x & 31) >> 1;
    if constexpr (WW::kScale == 4) return reinterpret_cast<const u32*>(b)[k];
    else return reinterpret_cast<const u16*>(b)[k];
}

// From slice sl, for thread t (elements 8t ..) of group grp, the stored scale bits: int4's float32
// group scale; int4-h32's bfloat16 group scale (bits 0-15); int7-h32's two bfloat16 scales of the
// rotation block (t / 4) as one word, the lower group's in bits 0-15. Widened to float32 only by
// scale_of and unit_nan, at the use: a load ahead of its use (a prefetch) stays in flight.
template <int G, int kCodec, bool kPeer>
__device__ __forceinline__ u32 ld_scale_bits(const unsigned char* sl, i64 t, i64 grp) {
    using W = Wire<G, kCodec>;
    const unsigned char* ch = sl + W::chunk(t << 3);
    if constexpr (W::k7) return ld_wire_u32<kPeer>(ch + W::scale_in_chunk(grp & ~(i64)1));
    else if constexpr (W::kBf16Scale) return ld_wire_u16<kPeer>(ch + W::scale_in_chunk(grp));
    else return fbits(ld_wire_f32<kPeer>(ch + W::scale_in_chunk(grp)));
}
// The float32 bits of thread t's scale, from ld_scale_bits.
template <int G, int kCodec>
__device__ __forceinline__ u32 scale_bits_of(u32 bits, i64 t) {
    using W = Wire<G, kCodec>;
    if constexpr (W::k7) return (t & 2) ? (bits & 0xffff0000u) : (bits << 16);
    else if constexpr (W::kBf16Scale) return bits << 16;
    else return bits;
}
template <int G, int kCodec>
__device__ __forceinline__ float scale_of(u32 bits, i64 t) { return bitsf(scale_bits_of<G, kCodec>(bits, t)); }
// The NaN of thread t's NaN/Inf unit as float32 bits, or 0 when none of its scales is NaN:
// the group's scale (int4 codecs), the first NaN of the block's two (int7-h32).
template <int G, int kCodec>
__device__ __forceinline__ u32 unit_nan(u32 bits, i64 t) {
    if constexpr (Wire<G, kCodec>::k7) {
        const u32 lo = bits << 16, hi = bits & 0xffff0000u;
        return (lo & 0x7fffffffu) > 0x7f800000u ? lo : (hi & 0x7fffffffu) > 0x7f800000u ? hi : 0u;
    } else {
        const u32 b = scale_bits_of<G, kCodec>(bits, t);
        return (b & 0x7fffffffu) > 0x7f800000u ? b : 0u;
    }
}

}  // namespace echo

#endif  // ECHO_CODEC_WIRE_CUH
