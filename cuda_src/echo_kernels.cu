// echonccl CUDA kernels: extern "C" entry points over the templates of codec.cuh.
//
// Built two ways from this one file:
//   * nvcc -fatbin (tools/build_fatbin.sh) -> cuda_src/echo_kernels.fatbin
//   * NVRTC through cupy.RawModule(code=...) (echonccl/kernels_cuda.py, which
//     inlines codec.cuh and its parts into the source so CuPy's cache key covers them).
//
// Entry points (all parameters are 8-byte: pointers or long long, which is
// what CuPy passes for arrays / None / Python ints):
//
//   echo_reduce_quantize_<in>_res<res>_ref<ref>_g<G>(
//       const uint8 *incoming, i64 n_in, i64 own_pos, const In *own, i64 own_n,
//       Res *residual /* may be null */, uint8 *wire_out, i64 S,
//       const Ref *base /* may be null */, i64 base_n)
//   echo_dequantize_<out>_g<G>(const uint8 *wire, Out *out, i64 count, i64 S)
//   echo_dequantize_acc_<out>_g<G>(...same...)      out += decoded (see dequantize_body)
//       grid.y = number of slices to decode (ceil(count / S))
//   echo_dequantize_sum[_acc]_<out>_g<G>(const uint8 *wire, Out *out, i64 count, i64 S,
//       i64 terms, i64 term_bytes)    the sum of `terms` parts of wire (dequantize_sum_loop)
//   and the same five with the suffix _h32: the rotated codec int4-h32; and for G = 16
//   only, with the suffix _i7h32: the 8-bit codec int7-h32.
//
// with <in>, <out> in {f16, bf16, f32}; <res> in {f32, <in>, i8} (i8: the 8-bit block
// residual format, a byte pointer); <ref> in {f32, <in>}; G in
// {32, 64, 128} (16 for int7-h32). echonccl/kernels_cuda.py builds the same names
// (`entry_points()`), and tests/test_cuda_compile.py checks the two agree.
#include "codec.cuh"

// ---------------------------------------------------------------- the lists
// (in, res, ref) combinations for one group size G.
#define ECHO_RQ_COMBOS(X, G)                                                                                          \
    X(f16, f32, f32, G) X(f16, f32, f16, G) X(f16, f16, f32, G) X(f16, f16, f16, G)                                  \
    X(f16, i8, f32, G) X(f16, i8, f16, G)                                                                             \
    X(bf16, f32, f32, G) X(bf16, f32, bf16, G) X(bf16, bf16, f32, G) X(bf16, bf16, bf16, G)                          \
    X(bf16, i8, f32, G) X(bf16, i8, bf16, G)                                                                          \
    X(f32, f32, f32, G) X(f32, i8, f32, G)
#define ECHO_DQ_COMBOS(X, G) X(f16, G) X(bf16, G) X(f32, G)

#define ECHO_FOR_EACH_GROUP(LIST, X) LIST(X, 32) LIST(X, 64) LIST(X, 128)

// ---------------------------------------------------------- the entry points
// Minimum resident blocks per SM asked of ptxas for reduce_quantize: caps it at
// 64 registers (no spills), 4 x 256 threads per SM (measured best on H200).
#ifndef ECHO_RQ_MIN_BLOCKS
#define ECHO_RQ_MIN_BLOCKS 4
#endif

// The rotated float32-input kernels other than the block-a-thread ones (G = 64, 128; int8 residuals)
// need a few more registers (two prefetched 32-byte chunks): 3 blocks per SM, 80 registers, no spills.
#ifndef ECHO_RQ_MIN_BLOCKS_H32_F32
#define ECHO_RQ_MIN_BLOCKS_H32_F32 3
#endif
// int7-h32 (three code sections, two scales a block) needs up to 80 registers: 3 blocks per SM.
#ifndef ECHO_RQ_MIN_BLOCKS_I7
#define ECHO_RQ_MIN_BLOCKS_I7 3
#endif
// By codec (echo::kInt4, kInt4H32, kInt7H32 = 0, 1, 2) and input type.
#define ECHO_RQ_MINB_0_f16 ECHO_RQ_MIN_BLOCKS
#define ECHO_RQ_MINB_0_bf16 ECHO_RQ_MIN_BLOCKS
#define ECHO_RQ_MINB_0_f32 ECHO_RQ_MIN_BLOCKS
#define ECHO_RQ_MINB_1_f16 ECHO_RQ_MIN_BLOCKS
#define ECHO_RQ_MINB_1_bf16 ECHO_RQ_MIN_BLOCKS
#define ECHO_RQ_MINB_1_f32 ECHO_RQ_MIN_BLOCKS_H32_F32
#define ECHO_RQ_MINB_2_f16 ECHO_RQ_MIN_BLOCKS_I7
#define ECHO_RQ_MINB_2_bf16 ECHO_RQ_MIN_BLOCKS_I7
#define ECHO_RQ_MINB_2_f32 ECHO_RQ_MIN_BLOCKS_I7

// The kernels that run one thread per 32-element block (int4-h32, G = 32, the reference in the
// input's dtype: reduce_quantize.cuh's kBlock32Rq) hold 32 values a thread: 128 registers, 2 blocks
// per SM (float32 input: a few bytes spilled).
#ifndef ECHO_RQ_MIN_BLOCKS_B32
#define ECHO_RQ_MIN_BLOCKS_B32 2
#endif
#define ECHO_RQ_MINB(CODEC, IN, RES, REF, G)                                                                         \
    ((echo::kBlock32Rq<echo::IN, echo::RES, echo::REF, G, CODEC>) ? ECHO_RQ_MIN_BLOCKS_B32                           \
                                                                  : ECHO_RQ_MINB_##CODEC##_##IN)

#define ECHO_DEFINE_REDUCE_QUANTIZE_AS(NAME, IN, RES, REF, G, CODEC)                                                 \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK, ECHO_RQ_MINB(CODEC, IN, RES, REF, G))                    \
        NAME(const unsigned char* __restrict__ incoming, long long n_in, long long own_pos,                           \
             const echo::IN* __restrict__ own, long long own_n, echo::RES* __restrict__ residual,                    \
             unsigned char* __restrict__ wire_out, long long S, const echo::REF* __restrict__ base,                   \
             long long base_n) {                                                                                      \
        echo::reduce_quantize_body<echo::IN, echo::RES, echo::REF, G, CODEC, false, false, echo::kInBatch, true>(    \
            echo::RqArgs<echo::IN, echo::RES, echo::REF>{incoming, n_in, own_pos, own, own_n, residual, wire_out, S,  \
                                                        base, base_n},                                               \
            (long long)blockIdx.x * blockDim.x + threadIdx.x, S >> 3, (long long)gridDim.x * blockDim.x);             \
    }
#define ECHO_DEFINE_REDUCE_QUANTIZE(IN, RES, REF, G)                                                                 \
    ECHO_DEFINE_REDUCE_QUANTIZE_AS(echo_reduce_quantize_##IN##_res##RES##_ref##REF##_g##G, IN, RES, REF, G, 0)        \
    ECHO_DEFINE_REDUCE_QUANTIZE_AS(echo_reduce_quantize_##IN##_res##RES##_ref##REF##_g##G##_h32, IN, RES, REF, G, 1)
#define ECHO_DEFINE_REDUCE_QUANTIZE_I7(IN, RES, REF, G)                                                              \
    ECHO_DEFINE_REDUCE_QUANTIZE_AS(echo_reduce_quantize_##IN##_res##RES##_ref##REF##_g##G##_i7h32, IN, RES, REF, G, 2)

// dequantize: at least this many blocks per SM (8: 32 registers; a few spilled bytes in the
// accumulating and int7-h32 kernels, yet 1-11% faster than ptxas's own choice on H200, BENCHMARKS.md seventh
// pass), or 0: ptxas's own choice.
#ifndef ECHO_DQ_MIN_BLOCKS
#define ECHO_DQ_MIN_BLOCKS 8
#endif
// The dequantize kernels that run a block a thread (int4-h32 at G = 32 into 16 bits: dequantize.cuh's
// dequantize_block32) hold 32 values a thread: this many blocks per SM.
#ifndef ECHO_DQ_MIN_BLOCKS_B32
#define ECHO_DQ_MIN_BLOCKS_B32 4
#endif
#if ECHO_DQ_MIN_BLOCKS
#define ECHO_DQ_BOUNDS(OUT, G, CODEC)                                                                                 \
    __launch_bounds__(ECHO_BLOCK, (echo::kBlock32Dequantize<echo::OUT, G, CODEC>) ? ECHO_DQ_MIN_BLOCKS_B32           \
                                                                                 : ECHO_DQ_MIN_BLOCKS)
#else
#define ECHO_DQ_BOUNDS(OUT, G, CODEC) __launch_bounds__(ECHO_BLOCK)
#endif
#define ECHO_DEFINE_DEQUANTIZE_AS(NAME, OUT, G, ACC, CODEC)                                                           \
    extern "C" __global__ void ECHO_DQ_BOUNDS(OUT, G, CODEC)                                                          \
        NAME(const unsigned char* __restrict__ wire, echo::OUT* __restrict__ out, long long count, long long S) {    \
        echo::dequantize_body<echo::OUT, G, ACC, CODEC>(wire, out, count, S, blockIdx.y,                              \
                                                      (long long)blockIdx.x * blockDim.x + threadIdx.x, S >> 3,       \
                                                      (long long)gridDim.x * blockDim.x);                             \
    }
#define ECHO_DEFINE_DEQUANTIZE(OUT, G)                                                                                \
    ECHO_DEFINE_DEQUANTIZE_AS(echo_dequantize_##OUT##_g##G, OUT, G, false, 0)                                        \
    ECHO_DEFINE_DEQUANTIZE_AS(echo_dequantize_acc_##OUT##_g##G, OUT, G, true, 0)                                     \
    ECHO_DEFINE_DEQUANTIZE_AS(echo_dequantize_##OUT##_g##G##_h32, OUT, G, false, 1)                                  \
    ECHO_DEFINE_DEQUANTIZE_AS(echo_dequantize_acc_##OUT##_g##G##_h32, OUT, G, true, 1)
#define ECHO_DEFINE_DEQUANTIZE_I7(OUT, G)                                                                             \
    ECHO_DEFINE_DEQUANTIZE_AS(echo_dequantize_##OUT##_g##G##_i7h32, OUT, G, false, 2)                                \
    ECHO_DEFINE_DEQUANTIZE_AS(echo_dequantize_acc_##OUT##_g##G##_i7h32, OUT, G, true, 2)

// dequantize_sum (the one-shot quantized all-reduce's decode): 64 registers.
#ifndef ECHO_DQS_MIN_BLOCKS
#define ECHO_DQS_MIN_BLOCKS 4
#endif
#define ECHO_DEFINE_DEQUANTIZE_SUM_AS(NAME, OUT, G, ACC, CODEC)                                                       \
    extern "C" __global__ void __launch_bounds__(ECHO_BLOCK, ECHO_DQS_MIN_BLOCKS)                                    \
        NAME(const unsigned char* __restrict__ wire, echo::OUT* __restrict__ out, long long count, long long S,      \
             long long terms, long long term_bytes) {                                                                 \
        echo::dequantize_sum_body<echo::OUT, G, ACC, CODEC>(echo::Terms{wire, term_bytes, (int)terms}, out, count, S, \
                                                          blockIdx.y, (long long)blockIdx.x * blockDim.x + threadIdx.x, \
                                                          S >> 3, (long long)gridDim.x * blockDim.x);                 \
    }
#define ECHO_DEFINE_DEQUANTIZE_SUM(OUT, G)                                                                            \
    ECHO_DEFINE_DEQUANTIZE_SUM_AS(echo_dequantize_sum_##OUT##_g##G, OUT, G, false, 0)                                \
    ECHO_DEFINE_DEQUANTIZE_SUM_AS(echo_dequantize_sum_acc_##OUT##_g##G, OUT, G, true, 0)                             \
    ECHO_DEFINE_DEQUANTIZE_SUM_AS(echo_dequantize_sum_##OUT##_g##G##_h32, OUT, G, false, 1)                          \
    ECHO_DEFINE_DEQUANTIZE_SUM_AS(echo_dequantize_sum_acc_##OUT##_g##G##_h32, OUT, G, true, 1)
#define ECHO_DEFINE_DEQUANTIZE_SUM_I7(OUT, G)                                                                         \
    ECHO_DEFINE_DEQUANTIZE_SUM_AS(echo_dequantize_sum_##OUT##_g##G##_i7h32, OUT, G, false, 2)                        \
    ECHO_DEFINE_DEQUANTIZE_SUM_AS(echo_dequantize_sum_acc_##OUT##_g##G##_i7h32, OUT, G, true, 2)

ECHO_FOR_EACH_GROUP(ECHO_RQ_COMBOS, ECHO_DEFINE_REDUCE_QUANTIZE)
ECHO_FOR_EACH_GROUP(ECHO_DQ_COMBOS, ECHO_DEFINE_DEQUANTIZE)
ECHO_RQ_COMBOS(ECHO_DEFINE_REDUCE_QUANTIZE_I7, 16)
ECHO_DQ_COMBOS(ECHO_DEFINE_DEQUANTIZE_I7, 16)
ECHO_FOR_EACH_GROUP(ECHO_DQ_COMBOS, ECHO_DEFINE_DEQUANTIZE_SUM)
ECHO_DQ_COMBOS(ECHO_DEFINE_DEQUANTIZE_SUM_I7, 16)
