// echonccl wire codec on the GPU: the bit-exact CUDA twin of echonccl/codec.py.
//
// The spec is the docstring of echonccl/codec.py; the reference is
// echonccl/kernels_numpy.py. Everything here reproduces those bit for bit:
//
//  * All float32 arithmetic goes through inline PTX with an explicit rounding
//    modifier and WITHOUT .ftz (add.rn / sub.rn / mul.rn / div.rn / rcp.rn,
//    cvt.rni). Explicit-rounding PTX ops are never contracted into FMA, and
//    inline asm is immune to compiler flags. This matters because CuPy
//    appends `-ftz=true` to every NVRTC compile (after the caller's options,
//    and the last occurrence wins): the __fadd_rn/__fdiv_rn intrinsics and
//    fabsf/fmaxf would then flush subnormals and break bit-exactness for fp32
//    subnormal inputs. With asm the result is the same under nvcc
//    (-ftz=false --fmad=false) and under CuPy's NVRTC.
//  * q = rint(fl(v * fl(1/scale))) for a normal scale, as codec.py defines it: one multiply
//    an element, rounded with the 1.5*2^23 trick; clip(rint(fl(v / scale)), -L, L) (L = 7;
//    int7-h32: 63) by IEEE division for a subnormal one (quantize_values).
//    Codes are decoded to floats by bit tricks, not int->float conversions.
//  * |v|, max, isfinite and ==0 are integer operations on the IEEE bits
//    (again FTZ-immune; for non-negative floats the unsigned order of the
//    bits is the float order).
//  * float <-> half/bfloat16 conversions are the PTX cvt instructions that
//    __float2half_rn / __float2bfloat16_rn / __half2float compile to
//    (cvt.rn.f16.f32, cvt.rn.bf16.f32, cvt.f32.f16; round to nearest even,
//    subnormals kept). The 16-bit types are storage-only structs defined here,
//    so the code needs no CUDA header and compiles under NVRTC without an
//    include path.
//  * NaN bit patterns of dequantized outputs follow numpy on the host
//    (x86/Arm propagate the NaN operand of q*scale, quieted; numpy's
//    float->half keeps sign and top payload bits; ml_dtypes' float->bfloat16
//    gives 0x7fc0/0xffc0), so outputs are equal as bits, NaNs included.
//
// Thread mapping: one thread = 8 consecutive elements of a slice = one 32-bit
// word of packed codes (int7-h32: and a u16 and a byte of their high bits). A group of G elements = G/8 consecutive lanes of one
// warp; its amax / non-finite flag is reduced with __shfl_xor_sync among them.
// (reduce_quantize_block32 and dequantize_block32, int4-h32 at G = 32 in the standalone kernels:
// one thread = a 32-element block; a warp's blocks staged through shared memory, staging.cuh.)
// The host guarantees S % 512 == 0 (so the thread count is a multiple of 64
// and every warp is entirely inside or outside the grid-stride range: the
// full-mask shuffles are safe), and 4-byte aligned wire buffers (slices start
// 16-byte aligned inside them by construction).
#ifndef ECHO_CODEC_CUH
#define ECHO_CODEC_CUH

// The parts, each self-contained (it includes what it needs):
//   codec_base.cuh       launch constants, float32 ops, element types, 8-element loads / stores
//   staging.cuh          global memory through shared memory: staged warp runs, cp.async rings
//   residual.cuh         the residual formats (the input's type, float32, int8 blocks)
//   codec_wire.cuh       the wire format: codes, scales, the codecs' geometry
//   rotation.cuh         the rotated codecs' 32-point Hadamard transform
//   reduce_quantize.cuh  sum + quantize with error feedback (contribution and owner)
//   dequantize.cuh       decode into the output (or add to it)
#include "reduce_quantize.cuh"
#include "dequantize.cuh"

#endif  // ECHO_CODEC_CUH
