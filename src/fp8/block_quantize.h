// Raw-pointer block-scaled FP8 cast kernels (DeepSeek-style, fp8dp.Float8BlockScaling), one
// signature for the CPU and CUDA versions. src/fp8/block_cast.h checks tensors and passes pointers
// down. Scale rule, per tile: amax = max |x| over the tile's elements (NaN if any NaN); scale = 1
// when amax is not finite (the tile holds Inf or NaN: finite values cast unscaled, NaN stays NaN
// in the bytes); else a = max(amax, amax_epsilon), scale = 1 when a is 0 (an all-zero tile), else
// fp8_max / a (FLT_MAX when that overflows), rounded down to a power of two (its exponent kept,
// mantissa cleared) with power_2_scale; scale_inv = 1 / scale. Bytes are saturate(rne(x * scale))
// as in quantize.h (C7).
#pragma once

#include <cfloat>
#include <cstdint>

#include "common/dtype.h"
#include "fp8/format.h"

namespace fp8dp {

// Elements per tile edge: DeepSeek-V3's and cuBLASLt's (VEC128 / BLK128x128) granularity.
inline constexpr int64_t kBlockLen = 128;

// k1x128: one scale per 1 x 128 tile of a row (activations, gradients: the tiles run along the
// GEMM's reduction dimension, which is the row). k128x128: one scale per 128 x 128 block (weights).
enum class BlockShape : int { k1x128 = 0, k128x128 = 1 };

FP8DP_HD constexpr int64_t ceil_blocks(int64_t n) { return (n + kBlockLen - 1) / kBlockLen; }

FP8DP_HD float block_scale(float amax, float fp8_max_v, bool power_2_scale, float amax_epsilon) {
  if (!(amax <= FLT_MAX)) return 1.0f;  // NaN or +Inf in the tile
  const float a = amax > amax_epsilon ? amax : amax_epsilon;
  if (!(a > 0.0f)) return 1.0f;  // an all-zero tile (and no epsilon)
  float s = fp8_max_v / a;
  if (!(s <= FLT_MAX)) s = FLT_MAX;
  if (power_2_scale) s = bits_float(float_bits(s) & 0x7F800000u);  // s is a positive normal here
  return s;
}

// One pass over a row-major [rows, cols] input of input_dtype. Outputs (nullptr = skip):
//   out        [rows, cols]  FP8 bytes, tiles along each row (k1x128) or 128 x 128 blocks
//   scale_inv  k1x128: [rows, ceil(cols/128)]; k128x128: [ceil(rows/128), ceil(cols/128)]
//   out_t      [cols, rows]  the transpose's cast, for a GEMM that reduces over rows (wgrad).
//              k1x128: tiles along each row of the transpose (128 rows of the input), so these
//              are NOT the bytes of out transposed: every element is re-cast from the input with
//              its column tile's scale. k128x128: a block of the transpose is the transpose of a
//              block, so out_t holds out's bytes transposed.
//   scale_inv_t k1x128: [cols, ceil(rows/128)]; k128x128: [ceil(cols/128), ceil(rows/128)]
//              (scale_inv transposed).
// A last tile shorter than 128 (cols or rows not a multiple of 128) takes its scale from the
// elements it has: the scale a zero-padded tile would get, since zeros do not change an amax.
// All scales are row-major FP32.
//   dbias      [cols] FP32 column sums of the input (CUDA only, with out_t): each 128-row region's
//              sums go to stream-ordered scratch and are added in region order, so the bits depend
//              on the shape alone. The CPU path (block_cast.cpp) sums with ATen.
struct BlockQuantizeParams {
  const void* input = nullptr;
  DType input_dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  Format format = Format::kE4M3;
  BlockShape shape = BlockShape::k1x128;
  bool power_2_scale = true;
  float amax_epsilon = 0.0f;
  uint8_t* out = nullptr;
  float* scale_inv = nullptr;
  uint8_t* out_t = nullptr;
  float* scale_inv_t = nullptr;
  float* dbias = nullptr;  // CUDA with out_t only
};

void block_quantize_cpu(const BlockQuantizeParams& p);

// out[r, c] = decode(in[r, c]) * scale_inv[tile of (r, c)] as out_dtype, in [rows, cols] row-major
// with scale_inv laid out as above for `shape`.
struct BlockDequantizeParams {
  const uint8_t* input = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  Format format = Format::kE4M3;
  BlockShape shape = BlockShape::k1x128;
  const float* scale_inv = nullptr;
  void* out = nullptr;
  DType out_dtype = DType::kFloat32;
};

void block_dequantize_cpu(const BlockDequantizeParams& p);

#if defined(FP8DP_WITH_CUDA)
// stream is a cudaStream_t (void* keeps this header free of CUDA headers). Same bytes and scales
// as the CPU version (src/fp8/cuda/block_quantize.cu).
void block_quantize_cuda(const BlockQuantizeParams& p, void* stream);
void block_dequantize_cuda(const BlockDequantizeParams& p, void* stream);
#endif

}  // namespace fp8dp
