// Tensor-level block-scaled FP8 casts: argument checks, output allocation, CPU / CUDA dispatch.
#include "fp8/block_cast.h"

#include <ATen/ATen.h>

#include <cfloat>
#include <vector>

#include "common/check.h"
#include "common/dispatch.h"
#include "common/tensor_checks.h"

namespace fp8dp {

Quantized block_quantize(const at::Tensor& x_in, Format format, BlockShape shape, BlockQParams q,
                         QuantizeOptions opts) {
  constexpr const char* fn = "fp8dp.block_quantize";
  FP8DP_CHECK_ARG(x_in.defined(), fn, ": argument 'x' is undefined");
  check_device_supported(x_in, fn, "argument 'x'");
  const DType dt = to_high_precision_dtype(x_in.scalar_type(), fn, "argument 'x'");
  FP8DP_CHECK_ARG(q.amax_epsilon >= 0.0f && q.amax_epsilon <= FLT_MAX, fn,
                  ": amax_epsilon must be finite and >= 0, got ", q.amax_epsilon);
  const at::Tensor x = x_in.contiguous();
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const int64_t kb = ceil_blocks(cols), kbt = ceil_blocks(rows);
  auto f32 = x.options().dtype(at::kFloat);
  auto f8 = x.options().dtype(fp8_dtype(format));

  Quantized out;
  BlockQuantizeParams p;
  p.input = x.data_ptr();
  p.input_dtype = dt;
  p.rows = rows;
  p.cols = cols;
  p.format = format;
  p.shape = shape;
  p.power_2_scale = q.power_2_scale;
  p.amax_epsilon = q.amax_epsilon;
  const bool tile = shape == BlockShape::k1x128;
  if (opts.data) {
    out.data = at::empty(x.sizes(), f8);
    out.scale_inv =
        at::empty(tile ? std::vector<int64_t>{rows, kb} : std::vector<int64_t>{kbt, kb}, f32);
    p.out = static_cast<uint8_t*>(out.data.data_ptr());
    p.scale_inv = out.scale_inv.data_ptr<float>();
  }
  if (opts.transpose) {
    out.data_t = at::empty({cols, rows}, f8);
    out.scale_inv_t =
        at::empty(tile ? std::vector<int64_t>{cols, kbt} : std::vector<int64_t>{kb, kbt}, f32);
    p.out_t = static_cast<uint8_t*>(out.data_t.data_ptr());
    p.scale_inv_t = out.scale_inv_t.data_ptr<float>();
  }
  // FP32 column sums rounded once, as quantize's dbias (C4: the eager bias gradient). On CUDA with
  // the transpose (the grad_output's cast) the cast kernel sums the columns it already holds.
  at::Tensor dbias32;
  if (opts.dbias) {
    to_high_precision_dtype(opts.dbias_dtype, fn, "dbias_dtype");
    if (x.is_cuda() && p.out_t != nullptr && rows > 0) {
      dbias32 = at::empty({cols}, f32);
      p.dbias = dbias32.data_ptr<float>();
    } else {
      dbias32 = at::sum(x.reshape({rows, cols}), {0}, false, at::kFloat);
    }
  }
  if (rows > 0 && (p.out != nullptr || p.out_t != nullptr))
    dispatch_kernel(x.device(), block_quantize_cpu, FP8DP_CUDA_KERNEL(block_quantize_cuda), p);
  if (opts.dbias) out.dbias = dbias32.to(opts.dbias_dtype);
  return out;
}

ScaleGranularity scale_granularity(const at::Tensor& data, const at::Tensor& s, const char* fn,
                                   const char* arg) {
  FP8DP_CHECK_ARG(s.defined(), fn, ": '", arg, "' is undefined (an FP8 operand needs its scales)");
  FP8DP_CHECK_ARG(s.scalar_type() == at::kFloat, fn, ": '", arg, "' must be float32, got ",
                  s.scalar_type());
  FP8DP_CHECK_ARG(s.device() == data.device(), fn, ": '", arg, "' is on ", s.device(),
                  " but its operand is on ", data.device());
  if (s.dim() <= 1 && s.numel() == 1) return ScaleGranularity::kTensor;
  FP8DP_CHECK_ARG(data.dim() == 2, fn, ": an operand with block scales '", arg,
                  "' must be 2-D, got shape ", data.sizes());
  const int64_t rows = data.size(0), cols = data.size(1);
  const int64_t kb = ceil_blocks(cols), kbt = ceil_blocks(rows);
  FP8DP_CHECK_ARG(s.dim() == 2 && s.is_contiguous(), fn, ": '", arg,
                  "' must be float32 with one element (per-tensor scaling) or a contiguous 2-D "
                  "block layout, got shape ",
                  s.sizes());
  if (s.size(0) == rows && s.size(1) == kb) return ScaleGranularity::k1x128;
  if (s.size(0) == kbt && s.size(1) == kb) return ScaleGranularity::k128x128;
  FP8DP_CHECK_ARG(false, fn, ": '", arg, "' has shape ", s.sizes(),
                  ", which fits no scaling of a [", rows, ", ", cols,
                  "] operand: expected [1] (per tensor), [", rows, ", ", kb, "] (1x128 tiles) or [",
                  kbt, ", ", kb, "] (128x128 blocks)");
}

at::Tensor block_dequantize(const at::Tensor& data_in, const at::Tensor& scale_inv,
                            at::ScalarType dtype) {
  constexpr const char* fn = "fp8dp.block_dequantize";
  FP8DP_CHECK_ARG(data_in.defined() && is_fp8(data_in.scalar_type()), fn,
                  ": argument 'data' must be an FP8 tensor");
  check_device_supported(data_in, fn, "argument 'data'");
  const ScaleGranularity g = scale_granularity(data_in, scale_inv, fn, "scale_inv");
  FP8DP_CHECK_ARG(g != ScaleGranularity::kTensor, fn,
                  ": 'scale_inv' is a per-tensor scale; use fp8dp.dequantize for it");
  const DType out_dtype = to_high_precision_dtype(dtype, fn, "argument 'dtype'");
  const at::Tensor data = data_in.contiguous();
  at::Tensor out = at::empty(data.sizes(), data.options().dtype(dtype));
  BlockDequantizeParams p;
  p.input = static_cast<const uint8_t*>(data.data_ptr());
  p.rows = data.size(0);
  p.cols = data.size(1);
  p.format = data.scalar_type() == at::kFloat8_e4m3fn ? Format::kE4M3 : Format::kE5M2;
  p.shape = g == ScaleGranularity::k1x128 ? BlockShape::k1x128 : BlockShape::k128x128;
  p.scale_inv = scale_inv.data_ptr<float>();
  p.out = out.data_ptr();
  p.out_dtype = out_dtype;
  if (data.numel() > 0)
    dispatch_kernel(data.device(), block_dequantize_cpu, FP8DP_CUDA_KERNEL(block_dequantize_cuda),
                    p);
  return out;
}

}  // namespace fp8dp
