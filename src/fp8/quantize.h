// Raw-pointer FP8 cast kernels (C7), one signature for the CPU and CUDA versions.
// Nothing here depends on LibTorch tensors: src/fp8/cast.h checks tensors and passes pointers down.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "fp8/format.h"

namespace fp8dp {

// One pass over a row-major [rows, cols] input. Every output pointer is optional (nullptr = skip):
//   out       [rows, cols]  saturate(rne(x * scale)) as FP8 bytes
//   out_t     [cols, rows]  the same bytes transposed (the layout Hopper's FP8 GEMM needs)
//   amax      [1]           max |x| over the input, NaN if any NaN, +Inf if any Inf (and no NaN);
//                           0 for an empty input; written, or with amax_accumulate max-merged
//                           into the running amax already there (a delayed-scaling history's
//                           row 0: no separate launches to zero it and merge it afterwards)
//   scale_inv [1]           1 / scale
//   dbias     [cols]        column sums of x in FP32 (the bias gradient of a grad_output), summed
//                           in a fixed order (within each 64-row chunk in row order, then the
//                           chunks in order), so the result does not depend on the thread count;
//                           stored as dbias_dtype (rounded once, to nearest even: a bf16 bias's
//                           gradient needs no conversion launch of its own)
// scale points to one float (host memory for the CPU version, device memory for CUDA).
struct QuantizeParams {
  const void* input = nullptr;
  DType input_dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  const float* scale = nullptr;
  Format format = Format::kE4M3;
  uint8_t* out = nullptr;
  uint8_t* out_t = nullptr;
  float* amax = nullptr;
  bool amax_accumulate = false;  // *amax holds an amax (>= 0, or NaN): merge with max
  float* scale_inv = nullptr;
  void* dbias = nullptr;
  DType dbias_dtype = DType::kFloat32;  // float32, bfloat16 or float16
};

void quantize_cpu(const QuantizeParams& p);

// out[i] = decode(in[i]) * scale_inv[0], written as out_dtype.
struct DequantizeParams {
  const uint8_t* input = nullptr;
  int64_t numel = 0;
  Format format = Format::kE4M3;
  const float* scale_inv = nullptr;
  void* out = nullptr;
  DType out_dtype = DType::kFloat32;
};

void dequantize_cpu(const DequantizeParams& p);

#if defined(FP8DP_WITH_CUDA)
// stream is a cudaStream_t; kept as void* so this header stays free of CUDA headers.
void quantize_cuda(const QuantizeParams& p, void* stream);
void dequantize_cuda(const DequantizeParams& p, void* stream);
// out [cols, rows] <- in [rows, cols], FP8 bytes (src/fp8/cuda/transpose.cu). Only for shapes and
// pointers that transpose_bytes_cuda_supported() accepts (rows and cols multiples of 16, 16-byte
// alignment); the caller copies other shapes another way.
bool transpose_bytes_cuda_supported(int64_t rows, int64_t cols, const void* in, const void* out);
void transpose_bytes_cuda(const uint8_t* in, uint8_t* out, int64_t rows, int64_t cols,
                          void* stream);
#endif

}  // namespace fp8dp
