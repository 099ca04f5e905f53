// echonccl fused all-reduce through peer memory: ONE kernel per all-reduce.
//
// The two-shot schedule of echonccl/schedules/two_shot.py, done by thread blocks that
// store straight into the peers' registered buffers (CUDA IPC, echonccl/peer_memory.py)
// and signal with flags, with the codec steps of codec.cuh. Outputs and residuals are
// bitwise those of the three-kernel two_shot (and so of the numpy reference). The same for
// the quantized one-shot (schedules/one_shot_q.py, fused_one_shot_q_body), and the 16-bit
// one-shots for small sizes.
//
// The registered region, its flags and epochs, and the rule by which a rank writes into a peer's
// region: fused_sync.cuh. The phases' codec work: fused_phases.cuh. The 16-bit one-shots:
// fused_one_shot.cuh.
//
// A slice is cut into chunks of 2048 elements (256 threads of 8, one block-wide step of the
// codec bodies; with 16-bit data and residuals 16 elements a thread, two chunks a step, where
// the slice lies whole in aligned buffers: kLoop16); tile j of T is the chunks j, j + T, j + 2T, ...: the blocks
// working on tiles j, j + 1, ... at one time stream through neighbouring memory, as a
// grid-stride kernel does. Work items, taken in order from one atomic ticket, phase after phase:
//   1. (P - 1) per tile j: quantize this rank's contribution to tile j of peer s's slice
//      (input + input residual) straight into s's recv slot, then flag it on s;
//   2. one per tile j of the own slice: wait for the P - 1 contributions, sum in rank order
//      with the own input taken exactly, add the output residual, quantize into the own gather
//      slot of every peer, flag it there, and write the own slice of `out`; the new output
//      residual holds the output's rounding to T too, or (the ref32 kernels, echonccl
//      Feedback(rounding=False)) the quantization error alone;
//   3. P - 1 per tile j: wait for tile j of owner s != rank's codes, decode into `out` (or add).
// Every item waits only for items taken before it (in the same order on every rank) by
// blocks that are running: no deadlock, whatever the grid size or residency.
// Each kernel runs one codec loop per phase: the general one (bounds tested per load and store),
// or, in the whole-slice kernels (the host's choice when x and out hold the same count, a multiple
// of 512, all 16-byte aligned, in round 1), the loop for slices whose valid elements lie whole in
// aligned buffers. Both loops in one phase made ptxas spill twice as much, and the kernel ran 5-25%
// slower on two H200s. The any-count kernels (kAny; kernel_table.Kernel.any_count: two-shots whose
// phases all run 16 elements a thread) are whole-slice kernels for a count that is not a multiple
// of 512: a slice's last 512-element block, one warp's step, holds fewer valid elements, and that
// warp reads it zero-filled and stores it up to the count (unit16_copy_async_n, unit16_store_n).
// Their own kernels, so that the whole-slice ones keep their code (the partial block's tests in
// them cost the MPS proxy 7% at 16 MiB). So too the shifted kernels (kShift; Kernel.shifted, the
// same two-shots' general kernels for an input or output off 16-byte alignment): their 16-element
// loops read and write at the buffer's shift (unit16_copy_async_at, unit16_store_at). Every
// kernel leaves a slice's 512-element blocks past the count alone (their wire bytes stale, their
// residuals as a new state holds them), and so does every owner, which may read such stale blocks
// from a peer running a whole-slice kernel (slice_extent).
//
// Which kernels exist is echonccl/kernel_table.py's to say: it generates the source that uses
// the ECHO_*_KERNEL macros at the end of this file and of fused_one_shot.cuh, one line a kernel.
#ifndef ECHO_FUSED_CUH
#define ECHO_FUSED_CUH

#include "fused_one_shot.cuh"
#include "fused_phases.cuh"
#include "fused_sync.cuh"

#ifndef ECHO_FUSED_MIN_BLOCKS   // resident blocks per SM: a launch constant of echonccl/kernel_table.py
#error "ECHO_FUSED_MIN_BLOCKS is not defined: compile the sources echonccl/kernel_table.py generates"
#endif

namespace echo {

// The fused two-shot all-reduce. x: this rank's input, x_n elements (0 in a refinement
// round); out: count elements (x itself for in place); res_in: P * S input residuals,
// res_out: S output residuals (both null without feedback); S: slice elements; ntiles: T,
// at most the slice's chunks and max_tiles (flags per slot). kWhole: x_n == count, a multiple of
// 512 unless kAny, and x, out and the residuals 16-byte aligned (the host's choice; see
// contribute_tile and this file's head). kRef32: the
// owner's ref in float32 (phase_reduce; echonccl Feedback(rounding=False)), never with
// accumulate (a refinement round runs the kernel without it). One owner phase per kernel: both
// in one, picked at run time, made the kernel 7-35% slower on one H200 (more spills).
// Contributions travel in codec (G, kCodec), the owners' sums in (GS, kSumCodec): the same, or
// int7-h32 sums of int4-h32 contributions (echonccl codec int4-h32/int7-h32).
template <typename T, typename ResT, int G, int kCodec, int GS, int kSumCodec, bool kWhole, bool kRef32, bool kAny,
          bool kShift>
__device__ __forceinline__ void fused_two_shot_body(const T* x, i64 x_n, T* out, i64 count,
                                                    ResT* __restrict__ res_in, ResT* __restrict__ res_out,
                                                    i64 S, int rank, int P, i64 ntiles, i64 max_tiles,
                                                    int accumulate, const PeerTable* __restrict__ table,
                                                    Ctl* ctl, u64 timeout_ns) {
    static_assert(!kAny || (kWhole && kRef32 && kLoop16<T, ResT, G> && kLoop16<T, ResT, GS>),
                  "any count: whole slices whose phases all run 16 elements a thread");
    static_assert(!kShift || (!kWhole && kRef32 && kLoop16<T, ResT, G> && kLoop16<T, ResT, GS>),
                  "shifted: general slices whose phases all run 16 elements a thread");
    __shared__ long long s_item;
    __shared__ int s_ok;
    const auto [epoch, s_deadline] = begin_call(ctl, timeout_ns, &s_ok);
    const i64 slice_bytes = Wire<G, kCodec>::slice_bytes(S);       // a contribution's
    const i64 sum_bytes = Wire<GS, kSumCodec>::slice_bytes(S);     // an owner's sum's
    const i64 T_ = ntiles;
    const i64 n1 = (i64)(P - 1) * T_;
    unsigned char* my_recv = table->recv[rank];
    unsigned char* my_gather = table->gather[rank];
    unsigned int* my_flags = table->flags[rank];

    for (;;) {
        const long long item = next_item(ctl, &s_item);
        if (item >= 2 * n1 + T_) break;
        if (item < n1) {
            // 1. contribution to peer s's slice, tile j
            const i64 j = item / (P - 1);
            const int s = (rank + 1 + (int)(item % (P - 1))) % P;
            const int slot = rank < s ? rank : rank - 1;
            const i64 lo = s * S < x_n ? s * S : x_n;
            const i64 hi = lo + S < x_n ? lo + S : x_n;
            phase_contribute<T, ResT, G, kCodec, kWhole, kAny, kShift>(
                x + lo, hi - lo, res_in ? res_at(res_in, s * S) : nullptr, table->recv[s] + slot * slice_bytes, S, j,
                T_);
            __syncthreads();
            if (threadIdx.x == 0) st_release_sys(table->flags[s] + slot * max_tiles + j, epoch);
        } else if (item < n1 + T_) {
            // 2. own slice, tile j: reduce the contributions, quantize, send to every peer
            const i64 j = item - n1;
            if (threadIdx.x == 0) {
                bool ok = true;
                for (int i = 0; i < P - 1 && ok; ++i)
                    ok = wait_flag(my_flags + i * max_tiles + j, epoch, ctl, s_deadline);
                if (!ok) s_ok = 0;
            }
            __syncthreads();
            if (!s_ok) break;
            const i64 lo = rank * S < x_n ? rank * S : x_n;
            const i64 hi = lo + S < x_n ? lo + S : x_n;
            const i64 blo = rank * S < count ? rank * S : count;
            const i64 bhi = blo + S < count ? blo + S : count;
            phase_reduce<T, ResT, typename Pick<kRef32, float, T>::type, GS, kSumCodec, G, kCodec, kWhole, kAny,
                         kShift>(
                my_recv, P - 1, rank, x + lo, hi - lo, res_out, table->gather_peers[0] + rank * sum_bytes, S,
                (!kRef32 && accumulate) ? out + blo : nullptr, bhi - blo, j, T_, table->gather_peers + 1, P - 2,
                rank * sum_bytes, out + blo, bhi - blo);
            __syncthreads();
            if (threadIdx.x < P && threadIdx.x != rank)
                st_release_sys(table->flags[threadIdx.x] + (P - 1 + rank) * max_tiles + j, epoch);
        } else {
            // 3. decode tile j of owner s's slice, s != rank
            const i64 i3 = item - n1 - T_;
            const i64 j = i3 / (P - 1);
            const int s = (rank + 1 + (int)(i3 % (P - 1))) % P;
            if (s * S >= count) continue;
            if (threadIdx.x == 0 &&
                !wait_flag(my_flags + (P - 1 + s) * max_tiles + j, epoch, ctl, s_deadline))
                s_ok = 0;
            __syncthreads();
            if (!s_ok) break;
            phase_decode<T, GS, kSumCodec, kWhole, !kRef32, kAny, kShift>(my_gather, out, count, S, s, j, T_,
                                                                          accumulate);
        }
    }
    end_call(ctl, epoch);
}

// The one-shot quantized all-reduce (echonccl/schedules/one_shot_q.py): every rank quantizes its
// whole input (slice v of P, tile j: item j * P + v), each slice with its input residual, into part
// `rank` of the push half of this call's parity on every rank (own included), flagging tile v * T + j
// of gather flag slot P - 1 + rank there; then decodes tile (v, j) of the P parts summed
// (dequantize_sum_loop) into out's slice v. Part s: P wire slices at push + parity * push_half +
// s * P * slice_bytes. x, out, res_in, kWhole and accumulate as in fused_two_shot_body (no
// output residual); P * T <= max_tiles.
template <typename T, typename ResT, int G, int kCodec, bool kWhole>
__device__ __forceinline__ void fused_one_shot_q_body(const T* x, i64 x_n, T* out, i64 count,
                                                      ResT* __restrict__ res_in, i64 S, int rank, int P, i64 ntiles,
                                                      i64 max_tiles, int accumulate,
                                                      const PeerTable* __restrict__ table, Ctl* ctl, u64 timeout_ns) {
    __shared__ long long s_item;
    __shared__ int s_ok;
    const auto [epoch, s_deadline] = begin_call(ctl, timeout_ns, &s_ok);
    const i64 slice_bytes = Wire<G, kCodec>::slice_bytes(S);
    const i64 part = P * slice_bytes;
    const i64 half = (i64)(epoch & 1u) * table->push_half;
    const i64 T_ = ntiles;
    const i64 n1 = (i64)P * T_;
    unsigned char* my_push = table->push[rank] + half;
    unsigned int* my_flags = table->flags[rank];

    for (;;) {
        const long long item = next_item(ctl, &s_item);
        if (item >= 2 * n1) break;
        const i64 k = item < n1 ? item : item - n1;
        const i64 j = k / P;
        const int v = (int)(k % P);
        const i64 tile = v * T_ + j;
        if (item < n1) {
            // 1. quantize tile j of slice v, into every rank's part `rank`
            const i64 lo = v * S < x_n ? v * S : x_n;
            const i64 hi = lo + S < x_n ? lo + S : x_n;
            const i64 off = half + rank * part + v * slice_bytes;
            phase_push<T, ResT, G, kCodec, kWhole>(x + lo, hi - lo, res_in ? res_at(res_in, v * S) : nullptr,
                                                  table->push[rank] + off, S, j, T_, table->push_peers, P - 1, off);
            __syncthreads();
            if (threadIdx.x < P) st_release_sys(table->flags[threadIdx.x] + (P - 1 + rank) * max_tiles + tile, epoch);
        } else {
            // 2. tile j of out's slice v: the P parts' codes summed
            if (v * S >= count) continue;
            if (threadIdx.x < P && !wait_flag(my_flags + (P - 1 + threadIdx.x) * max_tiles + tile, epoch, ctl, s_deadline))
                s_ok = 0;
            __syncthreads();
            if (!s_ok) break;
            phase_decode_sum<T, G, kCodec, kWhole>(Terms{my_push, part, P}, out, count, S, v, j, T_, accumulate);
        }
    }
    end_call(ctl, epoch);
}

}  // namespace echo

// The entry points (ECHO_FUSED_MIN_BLOCKS resident blocks per SM, 80 registers: what
// echonccl/fused.py launches; at 4 a SM the phases spilled 3-4x more and ran 8-17% slower).
// Parameters are 8-byte values, as echonccl/fused.py passes them. WHOLE: the kernel for slices
// that lie whole in aligned buffers (see the top of this file); a kernel holding both loops,
// picked at run time, spilled more in every phase.
//
// ECHO_TWO_SHOT_KERNEL(NAME, T, R, G, CODEC, GS, SUMCODEC, WHOLE, REF32, ANY, SHIFT)
//     (const T* x, i64 x_n, T* out, i64 count, R* res_in, R* res_out, i64 S, i64 rank, i64 P,
//      i64 ntiles, i64 max_tiles, i64 accumulate, const PeerTable* table, Ctl* ctl, i64 timeout_ns)
//     GS, SUMCODEC (the sums' codec), REF32, ANY, SHIFT: see fused_two_shot_body
#define ECHO_TWO_SHOT_KERNEL(NAME, T, R, G, CODEC, GS, SUMCODEC, WHOLE, REF32, ANY, SHIFT)                             \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK, ECHO_FUSED_MIN_BLOCKS)                                   \
        NAME(const echo::T* x, long long x_n, echo::T* out, long long count, echo::R* res_in, echo::R* res_out,      \
             long long S, long long rank, long long P, long long ntiles, long long max_tiles, long long accumulate,   \
             const echo::PeerTable* table, echo::Ctl* ctl, long long timeout_ns) {                                    \
        echo::fused_two_shot_body<echo::T, echo::R, G, CODEC, GS, SUMCODEC, WHOLE, REF32, ANY, SHIFT>(                 \
                                                                          x, x_n, out, count, res_in, res_out, S,     \
                                                                          (int)rank, (int)P, ntiles, max_tiles,       \
                                                                          (int)accumulate, table, ctl,                \
                                                                          (echo::u64)timeout_ns);                     \
    }

// ECHO_ONE_SHOT_Q_KERNEL(NAME, T, R, G, CODEC, WHOLE)
//     (const T* x, i64 x_n, T* out, i64 count, R* res_in, i64 S, i64 rank, i64 P, i64 ntiles,
//      i64 max_tiles, i64 accumulate, const PeerTable* table, Ctl* ctl, i64 timeout_ns)
#define ECHO_ONE_SHOT_Q_KERNEL(NAME, T, R, G, CODEC, WHOLE)                                                          \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK, ECHO_FUSED_MIN_BLOCKS)                                   \
        NAME(const echo::T* x, long long x_n, echo::T* out, long long count, echo::R* res_in, long long S,           \
             long long rank, long long P, long long ntiles, long long max_tiles, long long accumulate,                \
             const echo::PeerTable* table, echo::Ctl* ctl, long long timeout_ns) {                                    \
        echo::fused_one_shot_q_body<echo::T, echo::R, G, CODEC, WHOLE>(x, x_n, out, count, res_in, S, (int)rank,    \
                                                                      (int)P, ntiles, max_tiles, (int)accumulate,     \
                                                                      table, ctl, (echo::u64)timeout_ns);             \
    }

#endif  // ECHO_FUSED_CUH
