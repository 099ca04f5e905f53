// echonccl fused all-reduce through peer memory: ONE kernel per all-reduce.
//
// The two-shot schedule of echonccl/schedules/two_shot.py, done by thread blocks that
// store straight into the peers' registered buffers (CUDA IPC, echonccl/peer_memory.py)
// and signal with flags, with the codec steps of codec.cuh. Outputs and residuals are
// bitwise those of the three-kernel two_shot (and so of the numpy reference). The same for
// the quantized one-shot (schedules/one_shot_q.py, fused_one_shot_q_body), and the 16-bit
// one-shots for small sizes.
//
// Registered region of one rank (peer_memory.Region; every rank maps every other's):
//   ctl    : Ctl (epoch, ticket, done, error), local use only
//   flags  : u32 [(P - 1) recv slots + P gather slots][max_tiles]
//   recv   : (P - 1) wire slices, source s in slot s < rank ? s : s - 1   (two_shot's peers_in)
//   gather : P wire slices, owner s in slot s (two_shot's gather; a two-shot leaves its own slot)
//   push   : 2 parities x push_half bytes: what the one-shots push (one_shot, one_shot_q)
// The flag for tile j of a slot is the call's epoch once the tile's bytes are there.
// A rank can be at most one call ahead of another (every call needs the other's data of that
// call), and writes into a peer's region only what that peer is done reading: two_shot writes
// recv at once (the peer read the last call's recv before it sent what let this rank finish it)
// and gather only after the peer's contribution to this call; the one-shots, whose readers read
// until the end of their call, write at once into the push half of the call's epoch parity.
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
// The last block to finish resets the ticket and advances the epoch (stored on the device,
// so CUDA-graph replays count calls too). A wait that exceeds timeout_ns sets ctl->error
// and gives up (the host raises PeerTimeoutError; the output is then undefined).
// Each kernel runs one codec loop per phase: the general one (bounds tested per load and store),
// or, in the whole-slice kernels (the host's choice when x and out hold the same count, a multiple
// of 512, all 16-byte aligned, in round 1), the loop for slices whose valid elements lie whole in
// aligned buffers. Both loops in one phase made ptxas spill twice as much, and the kernel ran 5-25%
// slower on two H200s. The any-count kernels (kAny; kernel_table.Kernel.any_count: two-shots whose
// phases all run 16 elements a thread) are whole-slice kernels for a count that is not a multiple
// of 512: a slice's last 512-element block, one warp's step, holds fewer valid elements, and that
// warp reads it zero-filled and stores it up to the count (unit16_copy_async_n, unit16_store_n).
// Their own kernels, so that the whole-slice ones keep their code (the partial block's tests in
// them cost the MPS proxy 7% at 16 MiB). Every kernel leaves a slice's 512-element blocks past the
// count alone (their wire bytes stale, their residuals as a new state holds them), and so does every
// owner, which may read such stale blocks from a peer running a whole-slice kernel (slice_extent).
//
// Which kernels exist is echonccl/kernel_table.py's to say: it generates the source that uses
// the ECHO_*_KERNEL macros at the end of this file, one line a kernel.
#ifndef ECHO_FUSED_CUH
#define ECHO_FUSED_CUH

#include "codec.cuh"

#ifndef ECHO_FUSED_MIN_BLOCKS   // resident blocks per SM: a launch constant of echonccl/kernel_table.py
#error "ECHO_FUSED_MIN_BLOCKS is not defined: compile the sources echonccl/kernel_table.py generates"
#endif

namespace echo {

constexpr int kMaxRanks = 8;

struct Ctl {
    unsigned int epoch;
    unsigned int ticket;
    unsigned int done;
    unsigned int error;
};

// Device-resident table of every rank's mapped region parts (indexed by rank).
struct PeerTable {
    unsigned char* recv[kMaxRanks];
    unsigned char* gather[kMaxRanks];
    unsigned int* flags[kMaxRanks];
    uint2* ll[kMaxRanks];             // low-latency lines: [parity][P - 1 slots][ll_words]
    unsigned char* gather_peers[kMaxRanks];   // gather[(rank + 1 + k) % P] for k < P - 1
    unsigned char* push[kMaxRanks];           // push areas: [parity][push_half bytes]
    unsigned char* push_peers[kMaxRanks];     // push[(rank + 1 + k) % P] for k < P - 1
    long long push_half;
};

__device__ __forceinline__ unsigned int ld_acquire_sys(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Flags are published after a __syncthreads, by thread 0, or where an item publishes several, one
// a lane of warp 0 (a thread's system-scope releases complete one after another): a st.release.sys
// is cumulative over what the barrier made its thread observe, so no full fence is needed.
// one_shot_q's waits are one flag a lane too; the two-shot owner's stay with thread 0 (lane-parallel
// there, the kernel's loop control spilled 4x more and P = 2 ran 1-2% slower; docs/notes/fused.md).

// The calling thread spins until *flag has reached `epoch` (or the deadline passed: ctl->error).
// Returns false on timeout.
__device__ __forceinline__ bool wait_flag(const unsigned int* flag, unsigned int epoch, Ctl* ctl,
                                          u64 deadline) {
    unsigned int spins = 0;
    while ((int)(ld_acquire_sys(flag) - epoch) < 0) {
        if ((++spins & 1023u) == 0) {
            if (global_ns() > deadline || *((volatile unsigned int*)&ctl->error)) {
                atomicExch(&ctl->error, 1u);
                return false;
            }
        }
    }
    return true;
}

constexpr int kChunk = 256;   // threads per chunk (= ECHO_BLOCK): 2048 elements

// The start of a ticketed call, every thread: this call's epoch (the last finished call's + 1,
// the same on every rank, which makes the same calls) and wait deadline; *ok set to 1.
struct CallStart {
    unsigned int epoch;
    u64 deadline;
};
__device__ __forceinline__ CallStart begin_call(const Ctl* ctl, u64 timeout_ns, int* ok) {
    __shared__ unsigned int s_epoch;
    __shared__ u64 s_deadline;
    if (threadIdx.x == 0) {
        s_epoch = *((volatile const unsigned int*)&ctl->epoch) + 1u;
        s_deadline = global_ns() + timeout_ns;
        *ok = 1;
    }
    __syncthreads();
    return CallStart{s_epoch, s_deadline};
}

// The end of a ticketed call: the last block to finish resets the ticket and publishes the
// epoch, for the next launch on this stream, which sees them as a kernel sees its stream
// predecessor's stores: no fence (two fences here cost about 0.8 us a call). Every block had its
// last ticket's value before it counted itself done, so no ticket is taken after the reset.
__device__ __forceinline__ void end_call(Ctl* ctl, unsigned int epoch) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (atomicAdd(&ctl->done, 1u) == gridDim.x - 1) {
            ctl->ticket = 0;
            ctl->done = 0;
            ctl->epoch = epoch;
        }
    }
}

// One block takes the next work item (all threads get it). Warp 1 asks for the ticket before the
// barrier and stores it after: the atomic's round trip runs beside the block's arrival and the
// system-scope fences of the flags warp 0 releases for the item before.
__device__ __forceinline__ long long next_item(Ctl* ctl, long long* s_item) {
    static_assert(ECHO_BLOCK > 32, "next_item takes the ticket on warp 1");
    unsigned int ticket = 0;
    if (threadIdx.x == 32) ticket = atomicAdd(&ctl->ticket, 1u);
    __syncthreads();
    if (threadIdx.x == 32) *s_item = (long long)ticket;
    __syncthreads();
    return *s_item;
}

// With 16-bit data and residuals of the data's type or int8 the phases run 16 elements a thread
// (reduce_quantize_loop16, dequantize_loop16; the owner only with a float32 ref) where the slice
// lies whole in aligned buffers: one cross-lane rotation stage instead of two, one thread an
// int7-h32 group (one rank alone, P = 2, 1 GiB: 10% faster than 8 a thread; docs/notes/fused.md). The block's halves take
// the tile's chunks two at a time (unit_first: a thread's first unit of tile j). In the general
// kernels the 8-element loop takes what is left: a ragged slice's last warps of units, or every
// slice of an unaligned buffer (tail_first: a thread's first 8-element index >= t0 in tile j).
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
// the slice's valid count.
template <typename T, typename ResT, int G, int kCodec, bool kWhole, bool k16, bool kAny = false>
__device__ __forceinline__ void contribute_tile(const T* own, i64 own_n, ResT* res, unsigned char* wire, i64 S, i64 j,
                                                i64 ntiles, unsigned char* const* copies, int ncopies, i64 copy_off) {
    const i64 stride = ntiles * kChunk;
    i64 ue = 0;
    if constexpr (k16)
        ue = kWhole ? (kAny ? slice_extent(own_n, S) : own_n) >> 4
                    : (aligned16(own) && (res == nullptr || aligned16(res)) ? whole_units(own_n, S) : 0);
    split_tile<!(kWhole && k16), true>(
        ue, j, ntiles,
        [&](i64 u_first, i64 u_end) {
            if constexpr (k16)
                reduce_quantize_loop16<T, ResT, G, kCodec, false, G, kCodec, kWhole, kAny>(
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
template <typename T, typename ResT, int G, int kCodec, bool kWhole, bool kAny>
__device__ __noinline__ void phase_contribute(const T* own, i64 own_n, ResT* res, unsigned char* wire, i64 S, i64 j,
                                              i64 ntiles) {
    contribute_tile<T, ResT, G, kCodec, kWhole, kLoop16<T, ResT, G>, kAny>(own, own_n, res, wire, S, j, ntiles,
                                                                           nullptr, 0, 0);
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
template <typename T, typename ResT, typename RefT, int G, int kCodec, int GIn, int kInCodec, bool kWhole, bool kAny>
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
                    : (aligned16(own) && aligned16(out) && (res == nullptr || aligned16(res))
                           ? whole_units(own_n < out_n ? own_n : out_n, S) : 0);
    split_tile<!(kWhole && k16), true>(
        ue, j, ntiles,
        [&](i64 u_first, i64 u_end) {
            if constexpr (k16)
                reduce_quantize_loop16<T, ResT, G, kCodec, true, GIn, kInCodec, kWhole, kAny>(
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
        dequantize_loop<T, G, true, kCodec, true, kWhole>(wire, out, count, S, slice, t_first, t_end, stride);
    else
        dequantize_loop<T, G, false, kCodec, true, kWhole>(wire, out, count, S, slice, t_first, t_end, stride);
}
template <typename T, int G, int kCodec, bool kWhole, bool kAdd>
__device__ __noinline__ void decode8_call(const unsigned char* wire, T* out, i64 count, i64 S, i64 slice, i64 t_first,
                                          i64 t_end, i64 stride, int accumulate) {
    decode8_body<T, G, kCodec, kWhole, kAdd>(wire, out, count, S, slice, t_first, t_end, stride, accumulate);
}
template <typename T, int G, int kCodec, bool kWhole, bool kAdd, bool kAny>
__device__ __noinline__ void phase_decode(const unsigned char* wire, T* out, i64 count, i64 S, i64 slice,
                                          i64 j, i64 ntiles, int accumulate) {
    constexpr bool k16 = kLoop16<T, T, G>;
    const i64 stride = ntiles * kChunk;
    i64 ue = 0;
    if constexpr (k16)
        ue = kWhole ? (kAny ? slice_extent(slice_valid(count, slice, S), S) : slice_valid(count, slice, S)) >> 4
                    : (aligned16(out) ? whole_units(count - slice * S, S) : 0);
    split_tile<!(kWhole && k16), false>(   // (dequantize_loop: no ring)
        ue, j, ntiles,
        [&](i64 u_first, i64 u_end) {
            if constexpr (k16) {
                if (kAdd && accumulate) dequantize_loop16<T, G, true, kCodec>(wire, out, S, slice, u_first, u_end, stride);
                else dequantize_loop16<T, G, false, kCodec, kAny>(wire, out, S, slice, u_first, u_end, stride,
                                                                    kAny ? slice_valid(count, slice, S) : 0);
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
        dequantize_sum_loop<T, G, true, kCodec, true, kWhole>(terms, out, count, S, slice, j * kChunk + threadIdx.x,
                                                             t_end, ntiles * kChunk);
    else
        dequantize_sum_loop<T, G, false, kCodec, true, kWhole>(terms, out, count, S, slice, j * kChunk + threadIdx.x,
                                                              t_end, ntiles * kChunk);
}

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
template <typename T, typename ResT, int G, int kCodec, int GS, int kSumCodec, bool kWhole, bool kRef32, bool kAny>
__device__ __forceinline__ void fused_two_shot_body(const T* x, i64 x_n, T* out, i64 count,
                                                    ResT* __restrict__ res_in, ResT* __restrict__ res_out,
                                                    i64 S, int rank, int P, i64 ntiles, i64 max_tiles,
                                                    int accumulate, const PeerTable* __restrict__ table,
                                                    Ctl* ctl, u64 timeout_ns) {
    static_assert(!kAny || (kWhole && kRef32 && kLoop16<T, ResT, G> && kLoop16<T, ResT, GS>),
                  "any count: whole slices whose phases all run 16 elements a thread");
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
        if (item >= 2 * n1 + T_ || !s_ok) break;
        if (item < n1) {
            // 1. contribution to peer s's slice, tile j
            const i64 j = item / (P - 1);
            const int s = (rank + 1 + (int)(item % (P - 1))) % P;
            const int slot = rank < s ? rank : rank - 1;
            const i64 lo = s * S < x_n ? s * S : x_n;
            const i64 hi = lo + S < x_n ? lo + S : x_n;
            phase_contribute<T, ResT, G, kCodec, kWhole, kAny>(x + lo, hi - lo, res_in ? res_at(res_in, s * S) : nullptr,
                                         table->recv[s] + slot * slice_bytes, S, j, T_);
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
            phase_reduce<T, ResT, typename Pick<kRef32, float, T>::type, GS, kSumCodec, G, kCodec, kWhole, kAny>(
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
            phase_decode<T, GS, kSumCodec, kWhole, !kRef32, kAny>(my_gather, out, count, S, s, j, T_, accumulate);
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
        if (item >= 2 * n1 || !s_ok) break;
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

// 16-bit (or float32) one-shot all-reduce for small sizes: every rank pushes its whole
// input into slot (source) s < rank ? s : s - 1 of the push half of this call's parity of every
// peer, flags it per tile; then each rank sums the P inputs of a tile in rank order in float32
// and rounds once to T. Every rank computes the same bits. Flags use the recv flag slots; tiles
// of tile_t * 8 elements.
template <typename T>
__device__ __forceinline__ void one_shot_body(const T* x, T* out, i64 count, int rank, int P,
                                              i64 tile_t, i64 max_tiles, const PeerTable* __restrict__ table,
                                              Ctl* ctl, u64 timeout_ns) {
    __shared__ long long s_item;
    __shared__ int s_ok;
    const auto [epoch, s_deadline] = begin_call(ctl, timeout_ns, &s_ok);
    const i64 nthr = (count + 7) >> 3;
    const i64 T_ = (nthr + tile_t - 1) / tile_t;
    const i64 slot_bytes = ((count * Traits<T>::kBytes + 255) / 256) * 256;
    const i64 half = (i64)(epoch & 1u) * table->push_half;
    const bool vec = aligned16(x) && aligned16(out);
    unsigned int* my_flags = table->flags[rank];
    const i64 n1 = T_, n2 = T_;
    for (;;) {
        const long long item = next_item(ctl, &s_item);
        if (item >= n1 + n2 || !s_ok) break;
        if (item < n1) {
            // push tile j to every peer; a local flag says this rank has read x's tile j
            const i64 j = item;
            const i64 t1 = (j + 1) * tile_t < nthr ? (j + 1) * tile_t : nthr;
            for (i64 t = j * tile_t + threadIdx.x; t < t1; t += blockDim.x) {
                const Raw8<T> r = load_raw8<T, true>(x, t << 3, count, vec);
                T v[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = raw_elem<T>(r, i);
                for (int k = 1; k < P; ++k) {
                    const int s = (rank + k) % P;
                    const int slot = rank < s ? rank : rank - 1;
                    store8<T>(reinterpret_cast<T*>(table->push[s] + half + slot * slot_bytes), t << 3, count, vec, v);
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                for (int k = 1; k < P; ++k) {
                    const int s = (rank + k) % P;
                    const int slot = rank < s ? rank : rank - 1;
                    st_release_sys(table->flags[s] + slot * max_tiles + j, epoch);
                }
                st_release_sys(my_flags + (P - 1) * max_tiles + j, epoch);
            }
        } else {
            // sum tile j once every peer's copy is here and this rank's own push of it is done
            // (out may be x: the tile is overwritten only after it was sent)
            const i64 j = item - n1;
            if (threadIdx.x == 0) {
                bool ok = true;
                for (int i = 0; i < P && ok; ++i)
                    ok = wait_flag(my_flags + i * max_tiles + j, epoch, ctl, s_deadline);
                if (!ok) s_ok = 0;
            }
            __syncthreads();
            if (!s_ok) break;
            const unsigned char* my_recv = table->push[rank] + half;
            const i64 t1 = (j + 1) * tile_t < nthr ? (j + 1) * tile_t : nthr;
            for (i64 t = j * tile_t + threadIdx.x; t < t1; t += blockDim.x) {
                float acc[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] = -0.0f;
                for (int s = 0; s < P; ++s) {
                    float v[8];
                    if (s == rank) {
                        const Raw8<T> r = load_raw8<T, true>(x, t << 3, count, vec);
                        unpack8<T>(r.w, v);
                    } else {
                        const int slot = s < rank ? s : s - 1;
                        const T* src = reinterpret_cast<const T*>(my_recv + slot * slot_bytes);
                        Raw8<T> r;
                        if (vec && (t << 3) + 8 <= count) {
                            const uint4* q = reinterpret_cast<const uint4*>(src + (t << 3));
#pragma unroll
                            for (int k = 0; k < Raw8<T>::kVec; ++k) r.w[k] = __ldcg(q + k);
                        } else {
                            r = load_raw8<T, false>(src, t << 3, count, false);
                        }
                        unpack8<T>(r.w, v);
                    }
                    add_terms(acc, v);
                }
                store8f<T>(out, t << 3, count, vec, acc);
            }
        }
    }
    end_call(ctl, epoch);
}

// Low-latency one-shot for small inputs: the same sum as one_shot_body (float32, rank order,
// rounded once), with every 4 bytes of input sent as one 8-byte line {data, epoch}: a line is
// written by one store, so the reader needs no fence and no flag: it spins on the line until
// its epoch is this call's. Each block keeps its own epoch (block_epochs[blockIdx.x]): every rank
// launches the same grids in the same order, so block b's epochs agree across ranks. Lines
// alternate between two parities (a peer one call ahead writes the other one).
template <typename T>
__device__ __forceinline__ void one_shot_ll_body(const T* x, T* out, i64 count, int rank, int P, i64 ll_words,
                                                 const PeerTable* __restrict__ table, unsigned int* block_epochs,
                                                 Ctl* ctl, u64 timeout_ns) {
    __shared__ unsigned int s_epoch;
    __shared__ u64 s_deadline;
    if (threadIdx.x == 0) {
        s_epoch = block_epochs[blockIdx.x] + 1u;
        s_deadline = global_ns() + timeout_ns;
    }
    __syncthreads();
    const unsigned int epoch = s_epoch;
    const i64 parity = epoch & 1u;
    const i64 nbytes = count * Traits<T>::kBytes;
    const i64 words = (nbytes + 3) >> 2;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < words) {
        u32 mine;
        if ((i + 1) * 4 <= nbytes) {
            mine = reinterpret_cast<const u32*>(x)[i];
        } else {  // a float16/bfloat16 tail: one element in the low half
            mine = (u32) reinterpret_cast<const u16*>(x)[2 * i];
        }
        for (int k = 1; k < P; ++k) {
            const int s = (rank + k) % P;
            const int slot = rank < s ? rank : rank - 1;
            uint2* line = table->ll[s] + (parity * (P - 1) + slot) * ll_words + i;
            asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(line), "r"(mine), "r"(epoch) : "memory");
        }
        float acc[2] = {-0.0f, -0.0f};
        bool ok = true;
        for (int s = 0; s < P; ++s) {
            u32 w = mine;
            if (s != rank) {
                const int slot = s < rank ? s : s - 1;
                const uint2* line = table->ll[rank] + (parity * (P - 1) + slot) * ll_words + i;
                u32 d, e;
                unsigned int spins = 0;
                for (;;) {
                    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(d), "=r"(e) : "l"(line) : "memory");
                    if (e == epoch) break;
                    if ((++spins & 1023u) == 0 && (global_ns() > s_deadline || *((volatile unsigned int*)&ctl->error))) {
                        atomicExch(&ctl->error, 1u);
                        ok = false;
                        break;
                    }
                }
                if (!ok) break;
                w = d;
            }
            if constexpr (Traits<T>::kBytes == 4) {
                acc[0] = add_rn(acc[0], bitsf(w));
            } else {
                acc[0] = add_rn(acc[0], Traits<T>::lo_f32(w));
                acc[1] = add_rn(acc[1], Traits<T>::hi_f32(w));
            }
        }
        if (ok) {
            if constexpr (Traits<T>::kBytes == 4) {
                reinterpret_cast<float*>(out)[i] = acc[0];
            } else if ((i + 1) * 4 <= nbytes) {
                reinterpret_cast<u32*>(out)[i] = Traits<T>::pack2(acc[0], acc[1]);
            } else {
                out[2 * i] = Traits<T>::from_f32(acc[0]);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) block_epochs[blockIdx.x] = epoch;
}

}  // namespace echo

// The entry points (ECHO_FUSED_MIN_BLOCKS resident blocks per SM, 80 registers: what
// echonccl/fused.py launches; at 4 a SM the phases spilled 3-4x more and ran 8-17% slower).
// Parameters are 8-byte values, as echonccl/fused.py passes them. WHOLE: the kernel for slices
// that lie whole in aligned buffers (see the top of this file); a kernel holding both loops,
// picked at run time, spilled more in every phase.
//
// ECHO_TWO_SHOT_KERNEL(NAME, T, R, G, CODEC, GS, SUMCODEC, WHOLE, REF32, ANY)
//     (const T* x, i64 x_n, T* out, i64 count, R* res_in, R* res_out, i64 S, i64 rank, i64 P,
//      i64 ntiles, i64 max_tiles, i64 accumulate, const PeerTable* table, Ctl* ctl, i64 timeout_ns)
//     GS, SUMCODEC (the sums' codec), REF32, ANY: see fused_two_shot_body
#define ECHO_TWO_SHOT_KERNEL(NAME, T, R, G, CODEC, GS, SUMCODEC, WHOLE, REF32, ANY)                                  \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK, ECHO_FUSED_MIN_BLOCKS)                                   \
        NAME(const echo::T* x, long long x_n, echo::T* out, long long count, echo::R* res_in, echo::R* res_out,      \
             long long S, long long rank, long long P, long long ntiles, long long max_tiles, long long accumulate,   \
             const echo::PeerTable* table, echo::Ctl* ctl, long long timeout_ns) {                                    \
        echo::fused_two_shot_body<echo::T, echo::R, G, CODEC, GS, SUMCODEC, WHOLE, REF32, ANY>(                       \
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

// ECHO_ONE_SHOT_KERNEL(NAME, T)
//     (const T* x, T* out, i64 count, i64 rank, i64 P, i64 tile_t, i64 max_tiles,
//      const PeerTable* table, Ctl* ctl, i64 timeout_ns)
#define ECHO_ONE_SHOT_KERNEL(NAME, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK)                                                          \
        NAME(const echo::T* x, echo::T* out, long long count, long long rank, long long P, long long tile_t,          \
             long long max_tiles, const echo::PeerTable* table, echo::Ctl* ctl, long long timeout_ns) {               \
        echo::one_shot_body<echo::T>(x, out, count, (int)rank, (int)P, tile_t, max_tiles, table, ctl,                 \
                                     (echo::u64)timeout_ns);                                                          \
    }

// ECHO_ONE_SHOT_LL_KERNEL(NAME, T)
//     (const T* x, T* out, i64 count, i64 rank, i64 P, i64 ll_words, const PeerTable* table,
//      unsigned* block_epochs, Ctl* ctl, i64 timeout_ns)
#define ECHO_ONE_SHOT_LL_KERNEL(NAME, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK)                                                          \
        NAME(const echo::T* x, echo::T* out, long long count, long long rank, long long P, long long ll_words,        \
             const echo::PeerTable* table, unsigned int* block_epochs, echo::Ctl* ctl, long long timeout_ns) {        \
        echo::one_shot_ll_body<echo::T>(x, out, count, (int)rank, (int)P, ll_words, table, block_epochs, ctl,         \
                                        (echo::u64)timeout_ns);                                                       \
    }

#endif  // ECHO_FUSED_CUH
