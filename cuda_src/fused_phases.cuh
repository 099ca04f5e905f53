// echonccl fused two-shot and one_shot_q: a phase's codec work on one tile of a slice, each phase
// a function of its own (fused.cuh takes the work items and runs these).
#ifndef ECHO_FUSED_PHASES_CUH
#define ECHO_FUSED_PHASES_CUH

#include "codec.cuh"

namespace echo {

constexpr int kChunk = 256;   // threads per chunk (= ECHO_BLOCK): 2048 elements

// With 16-bit data and residuals of the data's type or int8 the phases run 16 elements a thread
// (reduce_quantize_loop16, dequantize_loop16; the owner only with a float32 ref) where the slice
// lies whole in aligned buffers: one cross-lane rotation stage instead of two, one thread an
// int7-h32 group (one rank alone, P = 2, 1 GiB: 10% faster than 8 a thread; docs/notes/fused.md). The block's halves take
// the tile's chunks two at a time (unit_first: a thread's first unit of tile j). In the general
// kernels the 8-element loop takes what is left: a ragged slice's last warps of units (tail_first:
// a thread's first 8-element index >= t0 in tile j), and every slice of an input or output off
// 16-byte alignment, except in the shifted kernels (kShift; kernel_table.Kernel.shifted), whose
// 16-element loops read and write such buffers at their shift (residuals are always aligned): their
// own kernels, since the shifted loops beside the aligned ones made the general kernels spill three
// times as much (docs/notes/fused.md).
template <typename T, typename ResT, int G>
constexpr bool kLoop16 = Traits<T>::kBytes == 2 && (IsSame<ResT, T>::v || IsI8<ResT>::v) && G <= 32;
__device__ __forceinline__ i64 unit_first(i64 j, i64 ntiles) {
    return (j + (threadIdx.x >> 7) * ntiles) * (kChunk / 2) + (threadIdx.x & (kChunk / 2 - 1));
}
// The units of a slice of S elements that lie whole in n valid ones, in whole warps (32 units).
__device__ __forceinline__ i64 whole_units(i64 n, i64 S) { return ((n < S ? n : S) >> 9) << 5; }
// The valid elements of slice s of `count`, and the elements a slice with n valid ones is worked
// on up to: n rounded up to 512 (no group spans two such blocks), at most S. The reference makes
// zero codes and zero residuals (codec.clear_residuals' bytes) of the blocks past it.
__device__ __forceinline__ i64 slice_valid(i64 count, i64 s, i64 S) {
    const i64 n = count - s * S;
    return n <= 0 ? 0 : (n < S ? n : S);
}
__device__ __forceinline__ i64 slice_extent(i64 n, i64 S) {
    const i64 e = ((n + 511) >> 9) << 9;
    return e < S ? e : S;
}
__device__ __forceinline__ i64 tail_first(i64 j, i64 ntiles, i64 t0) {
    const i64 t = j * kChunk + threadIdx.x, step = ntiles * kChunk;
    return t >= t0 ? t : t + (t0 - t + step - 1) / step * step;
}
// Whether tile j holds any of the 8-element threads [t0, t_end) (t0 < t_end): a chunk from t0's on.
__device__ __forceinline__ bool tile_has_tail(i64 j, i64 ntiles, i64 t0, i64 t_end) {
    const i64 c0 = t0 / kChunk, c = j >= c0 ? j : j + (c0 - j + ntiles - 1) / ntiles * ntiles;
    return c * kChunk < t_end;
}

// The 8-element loop of a contribution (kOut false) or an owner (kOut, its incoming slices peer memory) over
// threads [t_first, t_end), kFull as reduce_quantize_loop's: inlined where it is the phase's only loop, a
// call after the 16-element one (inlined beside it, it made the general owner spill 240 bytes).
template <bool kOut, int G, int kCodec, int GIn, int kInCodec, bool kFull, typename T, typename ResT, typename RefT,
          typename OutT>
__device__ __forceinline__ void loop8_body(const RqArgs<T, ResT, RefT, OutT>& a, i64 t_first, i64 t_end, i64 stride) {
    reduce_quantize_loop<T, ResT, RefT, G, kCodec, kOut, kOut, 1, kFull, OutT, GIn, kInCodec, true>(a, t_first,
                                                                                             t_end, stride);
}
template <bool kOut, int G, int kCodec, int GIn, int kInCodec, bool kFull, typename T, typename ResT, typename RefT,
          typename OutT>
__device__ __noinline__ void loop8_call(const RqArgs<T, ResT, RefT, OutT> a, i64 t_first, i64 t_end, i64 stride) {
    loop8_body<kOut, G, kCodec, GIn, kInCodec, kFull>(a, t_first, t_end, stride);
}
template <bool kCall, bool kOut, int G, int kCodec, int GIn, int kInCodec, bool kFull, typename T, typename ResT,
          typename RefT, typename OutT>
__device__ __forceinline__ void loop8(const RqArgs<T, ResT, RefT, OutT>& a, i64 t_first, i64 t_end, i64 stride) {
    if constexpr (kCall) loop8_call<kOut, G, kCodec, GIn, kInCodec, kFull>(a, t_first, t_end, stride);
    else loop8_body<kOut, G, kCodec, GIn, kInCodec, kFull>(a, t_first, t_end, stride);
}

// Tile j of a phase: f16(u_first, ue) on its units below ue (the 16-element loop; none if ue is 0),
// then, where the phase has the 8-element loop too (kTail), f8(t_first) on its 8-element threads
// from 2 ue to t_end() (found after f16: no value held across it), if the tile holds any (after a
// barrier where both loops ran: they use the ring differently, kSync); f8(t_first, t_end).
template <bool kTail, bool kSync, typename F16, typename TEnd, typename F8>
__device__ __forceinline__ void split_tile(i64 ue, i64 j, i64 ntiles, const F16& f16, const TEnd& t_end_of,
                                           const F8& f8) {
    if (ue > 0) f16(unit_first(j, ntiles), ue);
    if constexpr (kTail) {
        const i64 t0 = 2 * ue, t_end = t_end_of();
        if (t0 < t_end && tile_has_tail(j, ntiles, t0, t_end)) {
            if (kSync && t0 > 0) __syncthreads();
            f8(tail_first(j, ntiles, t0), t_end);
        }
    }
}

// The phases' codec work as separate (not inlined) functions: each then gets the registers of
// its own standalone kernel instead of the union of all three in one loop. The owner writes its
// own slice of the output as it makes the codes, and reduces its incoming slices one at a time
// (the standalone kernels: kInBatch at once): fewer registers and spills, faster with two ranks.
// Each works on tile j of T: 8-element threads j * 256 + threadIdx.x, stepping by T * 256 (the
// 16-element loops: unit_first). kWhole: the slice's valid elements lie whole in 16-byte aligned
// buffers (reduce_quantize_loop's and dequantize_loop's kFull), a multiple of 512 of them unless
// kAny (the 16-element loops only: the last 512-element block in part), and only the blocks that
// hold them are worked on. contribute_tile: a contribution's tile, phase_contribute's and
// phase_push's body (k16: the 16-element loop where it applies); in a whole-slice kernel own_n is
// the slice's valid count; kShift: `own` may lie off 16-byte alignment in the 16-element loop.
template <typename T, typename ResT, int G, int kCodec, bool kWhole, bool k16, bool kAny = false, bool kShift = false>
__device__ __forceinline__ void contribute_tile(const T* own, i64 own_n, ResT* res, unsigned char* wire, i64 S, i64 j,
                                                i64 ntiles, unsigned char* const* copies, int ncopies, i64 copy_off) {
    const i64 stride = ntiles * kChunk;
    i64 ue = 0;
    if constexpr (k16)
        ue = kWhole ? (kAny ? slice_extent(own_n, S) : own_n) >> 4
                    : ((kShift || aligned16(own)) && (res == nullptr || aligned16(res)) ? whole_units(own_n, S) : 0);
    split_tile<!(kWhole && k16), true>(
        ue, j, ntiles,
        [&](i64 u_first, i64 u_end) {
            if constexpr (k16)
                reduce_quantize_loop16<T, ResT, G, kCodec, false, G, kCodec, kWhole, kAny, kShift>(
                    RqArgs<T, ResT, float, T>{nullptr, 0, 0, own, own_n, res, wire, S, nullptr, 0, copies, ncopies,
                                           copy_off},
                    u_first, u_end, stride);
        },
        [&] { return (kWhole ? own_n : S) >> 3; },
        [&](i64 t_first, i64 t_end) {
            loop8<k16, false, G, kCodec, G, kCodec, kWhole>(
                RqArgs<T, ResT, float>{nullptr, 0, 0, own, own_n, res, wire, S, nullptr, 0, copies, ncopies, copy_off},
                t_first, t_end, stride);
        });
}
template <typename T, typename ResT, int G, int kCodec, bool kWhole, bool kAny, bool kShift>
__device__ __noinline__ void phase_contribute(const T* own, i64 own_n, ResT* res, unsigned char* wire, i64 S, i64 j,
                                              i64 ntiles) {
    contribute_tile<T, ResT, G, kCodec, kWhole, kLoop16<T, ResT, G>, kAny, kShift>(own, own_n, res, wire, S, j,
                                                                                   ntiles, nullptr, 0, 0);
}
// phase_contribute with the codes also stored to copies[c] + copy_off (one_shot_q's push), 8 elements
// a thread (at 16 it spilled 100 bytes and one_shot_q ran 2-4% slower one rank alone).
template <typename T, typename ResT, int G, int kCodec, bool kWhole>
__device__ __noinline__ void phase_push(const T* own, i64 own_n, ResT* res, unsigned char* wire, i64 S, i64 j,
                                        i64 ntiles, unsigned char* const* copies, int ncopies, i64 copy_off) {
    contribute_tile<T, ResT, G, kCodec, kWhole, false>(own, own_n, res, wire, S, j, ntiles, copies, ncopies, copy_off);
}
// The owner's reduce: the P - 1 incoming contributions (codec GIn, kInCodec) and its own slice
// summed, quantized in the sums' codec (G, kCodec) into `wire` and the peers' copies, its output
// slice written. RefT: T (the residual holds the output's rounding to T; `base`: a refinement
// round's) or float (echonccl Feedback(rounding=False): the sum's quantization error alone, two
// rotations an element instead of three; no base).
template <typename T, typename ResT, typename RefT, int G, int kCodec, int GIn, int kInCodec, bool kWhole, bool kAny,
          bool kShift>
__device__ __noinline__ void phase_reduce(const unsigned char* incoming, int n_in, int own_pos, const T* own,
                                          i64 own_n, ResT* res, unsigned char* wire, i64 S, const T* base,
                                          i64 base_n, i64 j, i64 ntiles, unsigned char* const* copies,
                                          int ncopies, i64 copy_off, T* out, i64 out_n) {
    constexpr bool kRef32 = !IsSame<RefT, T>::v;      // a float32 ref of 16-bit data: never a base
    constexpr bool k16 = kRef32 && kLoop16<T, ResT, G> && GIn <= 32;
    const i64 stride = ntiles * kChunk;
    i64 ue = 0;
    if constexpr (k16)
        ue = kWhole ? (kAny ? slice_extent(out_n, S) : out_n) >> 4
                    : ((kShift || (aligned16(own) && aligned16(out))) && (res == nullptr || aligned16(res))
                           ? whole_units(own_n < out_n ? own_n : out_n, S) : 0);
    split_tile<!(kWhole && k16), true>(
        ue, j, ntiles,
        [&](i64 u_first, i64 u_end) {
            if constexpr (k16)
                reduce_quantize_loop16<T, ResT, G, kCodec, true, GIn, kInCodec, kWhole, kAny, kShift>(
                    RqArgs<T, ResT, float, T>{incoming, n_in, own_pos, own, own_n, res, wire, S, nullptr, 0, copies,
                                           ncopies, copy_off, out, out_n},
                    u_first, u_end, stride);
        },
        [&] { return slice_extent(out_n, S) >> 3; },   // a peer's whole-slice kernel wrote no further
        [&](i64 t_first, i64 t_end) {
            loop8<k16, true, G, kCodec, GIn, kInCodec, kWhole>(
                RqArgs<T, ResT, RefT, T>{incoming, n_in, own_pos, own, own_n, res, wire, S, kRef32 ? nullptr : base,
                                         kRef32 ? 0 : base_n, copies, ncopies, copy_off, out, out_n},
                t_first, t_end, stride);
        });
}
// The 8-element decode over threads [t_first, t_end): inlined where it is the phase's only loop, a call
// after the 16-element one. kAdd: `accumulate` may be set (a refinement round's kernel; not with a
// float32 ref): without it the adding loops are not compiled in.
template <typename T, int G, int kCodec, bool kWhole, bool kAdd>
__device__ __forceinline__ void decode8_body(const unsigned char* wire, T* out, i64 count, i64 S, i64 slice,
                                             i64 t_first, i64 t_end, i64 stride, int accumulate) {
    if (kAdd && accumulate)
        dequantize_loop<T, G, true, kCodec, true, kWhole, true>(wire, out, count, S, slice, t_first, t_end, stride);
    else
        dequantize_loop<T, G, false, kCodec, true, kWhole, true>(wire, out, count, S, slice, t_first, t_end, stride);
}
template <typename T, int G, int kCodec, bool kWhole, bool kAdd>
__device__ __noinline__ void decode8_call(const unsigned char* wire, T* out, i64 count, i64 S, i64 slice, i64 t_first,
                                          i64 t_end, i64 stride, int accumulate) {
    decode8_body<T, G, kCodec, kWhole, kAdd>(wire, out, count, S, slice, t_first, t_end, stride, accumulate);
}
template <typename T, int G, int kCodec, bool kWhole, bool kAdd, bool kAny, bool kShift>
__device__ __noinline__ void phase_decode(const unsigned char* wire, T* out, i64 count, i64 S, i64 slice,
                                          i64 j, i64 ntiles, int accumulate) {
    constexpr bool k16 = kLoop16<T, T, G>;
    const i64 stride = ntiles * kChunk;
    i64 ue = 0;
    if constexpr (k16)
        ue = kWhole ? (kAny ? slice_extent(slice_valid(count, slice, S), S) : slice_valid(count, slice, S)) >> 4
                    : (aligned16(out) || (kShift && !(kAdd && accumulate)) ? whole_units(count - slice * S, S) : 0);
    split_tile<!(kWhole && k16), false>(   // (dequantize_loop: no ring)
        ue, j, ntiles,
        [&](i64 u_first, i64 u_end) {
            if constexpr (k16) {
                if (kAdd && accumulate) dequantize_loop16<T, G, true, kCodec>(wire, out, S, slice, u_first, u_end, stride);
                else dequantize_loop16<T, G, false, kCodec, kAny, kShift>(
                    wire, out, S, slice, u_first, u_end, stride, kAny ? slice_valid(count, slice, S) : 0);
            }
        },
        [&] { return (kWhole ? slice_valid(count, slice, S) : S) >> 3; },
        [&](i64 t_first, i64 t_end) {
            if constexpr (k16)
                decode8_call<T, G, kCodec, kWhole, kAdd>(wire, out, count, S, slice, t_first, t_end, stride, accumulate);
            else
                decode8_body<T, G, kCodec, kWhole, kAdd>(wire, out, count, S, slice, t_first, t_end, stride,
                                                         accumulate);
        });
}

template <typename T, int G, int kCodec, bool kWhole>
__device__ __noinline__ void phase_decode_sum(const Terms& terms, T* out, i64 count, i64 S, i64 slice, i64 j,
                                              i64 ntiles, int accumulate) {
    const i64 t_end = (kWhole ? slice_valid(count, slice, S) : S) >> 3;
    if (accumulate)
        dequantize_sum_loop<T, G, true, kCodec, true, kWhole, true>(terms, out, count, S, slice, j * kChunk + threadIdx.x,
                                                             t_end, ntiles * kChunk);
    else
        dequantize_sum_loop<T, G, false, kCodec, true, kWhole, true>(terms, out, count, S, slice, j * kChunk + threadIdx.x,
                                                              t_end, ntiles * kChunk);
}

}  // namespace echo

#endif  // ECHO_FUSED_PHASES_CUH
