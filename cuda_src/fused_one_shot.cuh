// echonccl 16-bit (or float32) one-shot all-reduces for small sizes, through peer memory: the
// tiled one (one_shot_body) and the low-latency one (one_shot_ll_body). Every rank sums every
// rank's input in float32 in rank order and rounds once, so every rank computes the same bits.
// Flags, tickets and epochs: fused_sync.cuh.
#ifndef ECHO_FUSED_ONE_SHOT_CUH
#define ECHO_FUSED_ONE_SHOT_CUH

#include "codec_wire.cuh"
#include "fused_sync.cuh"

namespace echo {

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
        if (item >= n1 + n2) break;
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

// The entry points; parameters are 8-byte values, as echonccl/fused.py passes them.
//
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

#endif  // ECHO_FUSED_ONE_SHOT_CUH
