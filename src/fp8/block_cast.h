// Tensor-level block-scaled FP8 casts (fp8dp.Float8BlockScaling): argument checks, output
// allocation, CPU / CUDA dispatch to block_quantize.h, and the dequantize the CPU GEMM uses.
#pragma once

#include <ATen/core/Tensor.h>

#include "fp8/block_quantize.h"
#include "fp8/cast.h"
#include "fp8/recipe.h"

namespace fp8dp {

// x: float32 / bfloat16 / float16 of any shape, viewed as [rows, cols] = [numel / last_dim,
// last_dim] (a non-contiguous x is copied first). Returns (what opts asks for):
//   data, scale_inv      opts.data: x's shape in FP8, scales laid out as block_quantize.h says
//   data_t, scale_inv_t  opts.transpose: [cols, rows], cast for a GEMM that reduces over rows (for
//                        1x128 tiles re-cast from x along the other dimension, not a transpose of
//                        data's bytes; for 128x128 blocks data's bytes transposed)
//   dbias                opts.dbias: column sums of x in FP32, rounded once to opts.dbias_dtype
// amax is left undefined: block scaling keeps no history and reports none (C9: no observation).
// No shape restriction here: a last tile shorter than 128 gets the scale of its elements (see
// block_quantize.h); the GEMMs decide what they take (gemm.h).
Quantized block_quantize(const at::Tensor& x, Format format, BlockShape shape, BlockQParams q,
                         QuantizeOptions opts = {});

// How an FP8 GEMM operand `data` [rows, cols] is scaled, read from its scale_inv's shape:
//   kTensor   one element, at most 1-D (the per-tensor recipes)
//   k1x128    2-D [rows, ceil(cols/128)]
//   k128x128  2-D [ceil(rows/128), ceil(cols/128)]
// (For rows == 1 both 2-D layouts coincide, and so do their numerics: the one-row block is the
// tile; it reads as k1x128.) Anything else throws a ValueError naming fn and arg.
enum class ScaleGranularity : int { kTensor = 0, k1x128 = 1, k128x128 = 2 };
ScaleGranularity scale_granularity(const at::Tensor& data, const at::Tensor& scale_inv,
                                   const char* fn, const char* arg);

// data: 2-D FP8 [rows, cols]; scale_inv float32 in a block layout (scale_granularity k1x128 or
// k128x128) on data's device. Returns decode(data) * scale_inv[tile] as dtype.
at::Tensor block_dequantize(const at::Tensor& data, const at::Tensor& scale_inv,
                            at::ScalarType dtype);

}  // namespace fp8dp
