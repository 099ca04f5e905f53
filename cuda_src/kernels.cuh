// echonccl's standalone codec kernels (the NCCL path's three launches): one macro per family
// defines an extern "C" entry point over the templates of codec.cuh. Which entry points exist is
// echonccl/kernel_table.py's to say: it generates the source that uses these macros, one line a
// kernel, and the launch side's names from the same table.
//
// Parameters are 8-byte values (pointers or long long), as echonccl/kernels_cuda.py passes them:
//
//   ECHO_RQ_KERNEL: reduce_quantize (echonccl/kernels.py); GIN, INCODEC: the incoming slices' codec
//   (the owner of a mixed codec; else G, CODEC)
//       (const uint8 *incoming, i64 n_in, i64 own_pos, const In *own, i64 own_n,
//        Res *residual /* may be null */, uint8 *wire_out, i64 S, const Ref *base /* may be null */, i64 base_n)
//   ECHO_DQ_KERNEL: dequantize; grid.y = the slices to decode (ceil(count / S))
//       (const uint8 *wire, Out *out, i64 count, i64 S, i64 accumulate)
//   ECHO_DQS_KERNEL: dequantize of the sum of `terms` parts (dequantize_sum_loop)
//       (const uint8 *wire, Out *out, i64 count, i64 S, i64 accumulate, i64 terms, i64 term_bytes)
//
// <In>, <Out>: f16, bf16, f32; <Res>: f32, <In> or i8 (the 8-bit block residual format, a byte
// pointer); <Ref>: f32 or <In>; G and CODEC: the codec's group size and echo::kInt4 / kInt4H32 /
// kInt7H32.
#ifndef ECHO_KERNELS_CUH
#define ECHO_KERNELS_CUH

#include "codec.cuh"

namespace echo {

// Resident blocks per SM asked of ptxas for reduce_quantize (measured on H200): 4 (64 registers, no
// spills); 3 (80 registers) for int7-h32 (three code sections, two scales a block) and the rotated
// float32-input kernels that keep 8 elements a thread (two prefetched 32-byte chunks); 2 (128
// registers) for the kernels that run a 32-element block a thread (kBlock32Rq).
template <typename InT, typename ResT, typename RefT, int G, int kCodec>
constexpr int kRqMinBlocks = kBlock32Rq<InT, ResT, RefT, G, kCodec> ? 2
                             : kCodec == kInt7H32 || (kCodec == kInt4H32 && sizeof(InT) == 4) ? 3
                                                                                               : 4;
// dequantize: 8 blocks per SM (32 registers; a few spilled bytes in the accumulating and int7-h32
// kernels, yet 1-11% faster than ptxas's own choice on H200); 4 for the block-a-thread kernels
// (kBlock32Dequantize: 32 values a thread). Its sum of parts: 4 (64 registers).
template <typename OutT, int G, int kCodec>
constexpr int kDqMinBlocks = kBlock32Dequantize<OutT, G, kCodec> ? 4 : 8;
constexpr int kDqsMinBlocks = 4;

}  // namespace echo

#define ECHO_RQ_KERNEL(NAME, IN, RES, REF, G, CODEC, GIN, INCODEC)                                                  \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK,                                                          \
                                                 (echo::kRqMinBlocks<echo::IN, echo::RES, echo::REF, G, CODEC>))      \
        NAME(const unsigned char* __restrict__ incoming, long long n_in, long long own_pos,                           \
             const echo::IN* __restrict__ own, long long own_n, echo::RES* __restrict__ residual,                    \
             unsigned char* __restrict__ wire_out, long long S, const echo::REF* __restrict__ base,                   \
             long long base_n) {                                                                                      \
        echo::reduce_quantize_body<echo::IN, echo::RES, echo::REF, G, CODEC, false, false, echo::kInBatch, true, GIN, \
                                   INCODEC>(                                                                          \
            echo::RqArgs<echo::IN, echo::RES, echo::REF>{incoming, n_in, own_pos, own, own_n, residual, wire_out, S,  \
                                                        base, base_n},                                               \
            (long long)blockIdx.x * blockDim.x + threadIdx.x, S >> 3, (long long)gridDim.x * blockDim.x);             \
    }

#define ECHO_DQ_KERNEL(NAME, OUT, G, CODEC)                                                                           \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK, (echo::kDqMinBlocks<echo::OUT, G, CODEC>))              \
        NAME(const unsigned char* __restrict__ wire, echo::OUT* __restrict__ out, long long count, long long S,      \
             long long accumulate) {                                                                                  \
        const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x; \
        if (accumulate)                                                                                               \
            echo::dequantize_body<echo::OUT, G, true, CODEC>(wire, out, count, S, blockIdx.y, t, S >> 3, step);      \
        else                                                                                                          \
            echo::dequantize_body<echo::OUT, G, false, CODEC>(wire, out, count, S, blockIdx.y, t, S >> 3, step);     \
    }

#define ECHO_DQS_KERNEL(NAME, OUT, G, CODEC)                                                                          \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK, echo::kDqsMinBlocks)                                    \
        NAME(const unsigned char* __restrict__ wire, echo::OUT* __restrict__ out, long long count, long long S,      \
             long long accumulate, long long terms, long long term_bytes) {                                           \
        const echo::Terms parts{wire, term_bytes, (int)terms};                                                        \
        const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x; \
        if (accumulate)                                                                                               \
            echo::dequantize_sum_body<echo::OUT, G, true, CODEC>(parts, out, count, S, blockIdx.y, t, S >> 3, step); \
        else                                                                                                          \
            echo::dequantize_sum_body<echo::OUT, G, false, CODEC>(parts, out, count, S, blockIdx.y, t, S >> 3, step); \
    }

#endif  // ECHO_KERNELS_CUH
