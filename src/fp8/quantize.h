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
//
// The input is either `input`, row-major [rows, cols], or (strided.n > 0) the column blocks of
// strided 4-d tensors described by StridedParts below; rows and cols are the logical shape in
// both cases, and the outputs are the same bytes either way.
//
// StridedParts: n tensors p_0 .. p_{n-1} (1 <= n <= 4) of one shape [d0, d1, d2, d3] and one set
// of element strides [stride[0], stride[1], stride[2], 1], read as the matrix
//   x = cat([p.reshape(d0 * d1, d2 * d3) for p in parts], dim=1)    # rows = d0*d1, cols = n*d2*d3
// without materializing it: element (r, c) is ptr[c / (d2*d3)][i0*stride[0] + i1*stride[1] +
// i2*stride[2] + i3] with (i0, i1) = divmod(r, d1) and (i2, i3) = divmod(c % (d2*d3), d3). It
// exists for SDPA's dq, dk, dv: the QKV projection's backward casts them where they lie (each a
// [s, b, h, hd] view of a [b, h, s, hd] buffer) instead of autograd stacking them into one
// [tokens, 3 * hidden] tensor first, a copy as large as the cast's own read. d0 is implied by
// rows / d1. Only the CUDA kernel reads it, and only for the layouts that
// quantize_cuda_strided_supported() accepts; quantize_cpu refuses it (the tensor layer,
// quantize_parts in cast.h, materializes x instead).
struct StridedParts {
  int n = 0;  // 0: the input is `input`
  const void* ptr[4] = {nullptr, nullptr, nullptr, nullptr};
  int64_t d1 = 1, d2 = 1, d3 = 1;
  int64_t stride[3] = {0, 0, 0};  // elements; dim 3 is contiguous
};

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
  StridedParts strided;                 // n > 0: read the input from here instead of `input`
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
// Whether quantize_cuda reads p.strided in place: the tiled kernel's 16-byte loads must apply to
// every part (each pointer 16-byte aligned, d3 and the strides multiples of 16 bytes' worth of
// elements, so one load never leaves a row of d3 elements), rows within the tiled grid's limit,
// and out 16-byte aligned. quantize_cuda refuses (Error) a strided request this rejects; the
// caller materializes the input instead.
bool quantize_cuda_strided_supported(const QuantizeParams& p);
void dequantize_cuda(const DequantizeParams& p, void* stream);
// out [cols, rows] <- in [rows, cols], FP8 bytes (src/fp8/cuda/transpose.cu). Only for shapes and
// pointers that transpose_bytes_cuda_supported() accepts (rows and cols multiples of 16, 16-byte
// alignment); the caller copies other shapes another way.
bool transpose_bytes_cuda_supported(int64_t rows, int64_t cols, const void* in, const void* out);
void transpose_bytes_cuda(const uint8_t* in, uint8_t* out, int64_t rows, int64_t cols,
                          void* stream);
#endif

}  // namespace fp8dp
