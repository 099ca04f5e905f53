// echonccl fused kernels: the registered region's control words and peer table, and the flags,
// tickets and epochs through which the ranks' blocks meet (fused.cuh, fused_one_shot.cuh).
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
// The last block of a ticketed call to finish resets the ticket and advances the epoch (stored on
// the device, so CUDA-graph replays count calls too). A wait that exceeds timeout_ns sets ctl->error
// and gives up (the host raises PeerTimeoutError; the output is then undefined).
#ifndef ECHO_FUSED_SYNC_CUH
#define ECHO_FUSED_SYNC_CUH

#include "codec_base.cuh"

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

// The start of a ticketed call, every thread: this call's epoch (the last finished call's + 1,
// the same on every rank, which makes the same calls) and wait deadline; *ok set to 1. A failed
// wait clears *ok, and the block reads it only after the barrier that follows the wait, then
// leaves its item loop: read at an item's start too, a thread late to read it could see the
// clearing of that item's wait and leave at another barrier than its block (which then hangs).
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

}  // namespace echo

#endif  // ECHO_FUSED_SYNC_CUH
