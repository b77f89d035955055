// Tensor-level FP8 casts: argument checks, output allocation, CPU / CUDA dispatch.
#include "fp8/cast.h"

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "common/check.h"
#include "common/dispatch.h"
#include "common/tensor_checks.h"
#include "fp8/quantize.h"

namespace fp8dp {
namespace {

Format format_of(at::ScalarType t, const char* fn, const char* arg) {
  if (t == at::kFloat8_e4m3fn) return Format::kE4M3;
  if (t == at::kFloat8_e5m2) return Format::kE5M2;
  FP8DP_CHECK_ARG(false, fn, ": argument '", arg, "' must be float8_e4m3fn or float8_e5m2, got ",
                  t);
}

void check_scalar_float(const at::Tensor& s, const at::Tensor& x, const char* fn, const char* arg) {
  FP8DP_CHECK_ARG(s.defined(), fn, ": argument '", arg, "' is undefined");
  FP8DP_CHECK_ARG(s.scalar_type() == at::kFloat, fn, ": argument '", arg, "' must be float32, got ",
                  s.scalar_type());
  FP8DP_CHECK_ARG(s.numel() == 1, fn, ": argument '", arg, "' must have one element, got ",
                  s.numel());
  FP8DP_CHECK_ARG(s.device() == x.device(), fn, ": argument '", arg, "' is on ", s.device(),
                  " but the input is on ", x.device());
}

}  // namespace

void check_scale_value(const at::Tensor& scale, const char* fn, const char* arg) {
  if (!scale.is_cpu()) return;
  const float s = scale.item<float>();
  FP8DP_CHECK_ARG(std::isfinite(s) && s > 0.0f, fn, ": argument '", arg,
                  "' must be finite and > 0, got ", s);
}

at::ScalarType fp8_dtype(Format f) {
  return f == Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

namespace {

// The outputs of a cast of a [p.rows, p.cols] input on like's device (data shaped data_shape),
// allocated, with p's output fields pointing at them.
Quantized alloc_outputs(const at::Tensor& like, at::IntArrayRef data_shape, QuantizeOptions opts,
                        const at::Tensor& amax_into, const char* fn, QuantizeParams& p) {
  auto f32 = like.options().dtype(at::kFloat);
  auto f8 = like.options().dtype(fp8_dtype(p.format));
  Quantized q;
  if (amax_into.defined()) check_amax_into(amax_into, like, fn);
  q.amax = amax_into.defined() ? amax_into : at::empty({1}, f32);
  q.scale_inv = at::empty({1}, f32);
  if (opts.data) q.data = at::empty(data_shape, f8);
  if (opts.transpose) q.data_t = at::empty({p.cols, p.rows}, f8);
  const DType dbias_dt =
      opts.dbias ? to_high_precision_dtype(opts.dbias_dtype, fn, "dbias_dtype") : DType::kFloat32;
  if (opts.dbias) q.dbias = at::empty({p.cols}, like.options().dtype(opts.dbias_dtype));

  p.out = opts.data ? static_cast<uint8_t*>(q.data.data_ptr()) : nullptr;
  p.out_t = opts.transpose ? static_cast<uint8_t*>(q.data_t.data_ptr()) : nullptr;
  p.amax = q.amax.data_ptr<float>();
  p.amax_accumulate = amax_into.defined();
  p.scale_inv = q.scale_inv.data_ptr<float>();
  p.dbias = opts.dbias ? q.dbias.data_ptr() : nullptr;
  p.dbias_dtype = dbias_dt;
  return q;
}

// quantize() and amax() share the checks and the kernel; fn names the public entry point in errors.
Quantized quantize_impl(const at::Tensor& x_in, const at::Tensor& scale, Format format,
                        QuantizeOptions opts, const at::Tensor& amax_into, const char* fn) {
  FP8DP_CHECK_ARG(x_in.defined(), fn, ": argument 'x' is undefined");
  check_device_supported(x_in, fn, "argument 'x'");
  const DType dt = to_high_precision_dtype(x_in.scalar_type(), fn, "argument 'x'");
  check_scalar_float(scale, x_in, fn, "scale");
  check_scale_value(scale, fn);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor sc = scale.contiguous();
  // x is viewed as [rows, cols] = [numel / last_dim, last_dim]; a 0-d tensor is [1, 1].
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);

  QuantizeParams p;
  p.input = x.data_ptr();
  p.input_dtype = dt;
  p.rows = rows;
  p.cols = cols;
  p.scale = sc.data_ptr<float>();
  p.format = format;
  Quantized q = alloc_outputs(x, x.sizes(), opts, amax_into, fn, p);
  dispatch_kernel(x.device(), quantize_cpu, FP8DP_CUDA_KERNEL(quantize_cuda), p);
  return q;
}

// ---------------------------------------------------------------- column blocks of 4-d parts

constexpr size_t kMaxParts = 4;  // StridedParts::ptr

// The checks of a `parts` argument (quantize_parts): 1 to 4 defined 4-d tensors of one shape,
// dtype and device, a high-precision dtype on a supported device. Returns that dtype.
DType check_parts(at::TensorList parts, const char* fn) {
  FP8DP_CHECK_ARG(!parts.empty() && parts.size() <= kMaxParts, fn,
                  ": argument 'parts' must hold 1 to ", kMaxParts, " tensors, got ", parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    FP8DP_CHECK_ARG(parts[i].defined(), fn, ": argument 'parts[", i, "]' is undefined");
  }
  const at::Tensor& p0 = parts[0];
  FP8DP_CHECK_ARG(p0.dim() == 4, fn, ": argument 'parts[0]' must be 4-D [d0, d1, d2, d3], got ",
                  p0.dim(), "-D of shape ", p0.sizes());
  check_device_supported(p0, fn, "argument 'parts[0]'");
  const DType dt = to_high_precision_dtype(p0.scalar_type(), fn, "argument 'parts[0]'");
  for (size_t i = 1; i < parts.size(); ++i) {
    const at::Tensor& t = parts[i];
    FP8DP_CHECK_ARG(t.sizes() == p0.sizes(), fn, ": argument 'parts[", i,
                    "]' must have the shape of parts[0], ", p0.sizes(), ", got ", t.sizes());
    FP8DP_CHECK_ARG(t.scalar_type() == p0.scalar_type(), fn, ": argument 'parts[", i,
                    "]' must have the dtype of parts[0], ", p0.scalar_type(), ", got ",
                    t.scalar_type());
    FP8DP_CHECK_ARG(t.device() == p0.device(), fn, ": argument 'parts[", i,
                    "]' must be on the device of parts[0], ", p0.device(), ", got ", t.device());
  }
  return dt;
}

// x = cat([p.reshape(d0 * d1, d2 * d3) for p in parts], dim=1): the definition of what
// quantize_parts casts, and its path wherever the strided kernel does not apply.
at::Tensor materialize_parts(at::TensorList parts) {
  std::vector<at::Tensor> blocks;
  blocks.reserve(parts.size());
  for (const at::Tensor& t : parts) {
    blocks.push_back(t.reshape({t.size(0) * t.size(1), t.size(2) * t.size(3)}));
  }
  return at::cat(blocks, 1);
}

// Fills p's input fields (strided, input_dtype, rows, cols) from checked parts and says whether
// the strided CUDA kernel reads them: CUDA tensors, one set of strides with dim 3 contiguous, a
// layout quantize_cuda_strided_supported accepts (asked with out unset: the outputs are fresh
// allocations, aligned as it needs), and something to read (an empty x goes the materializing
// way, which costs nothing).
bool strided_input(at::TensorList parts, DType dt, QuantizeParams& p) {
  const at::Tensor& p0 = parts[0];
  p.input_dtype = dt;
  p.rows = p0.size(0) * p0.size(1);
  p.cols = static_cast<int64_t>(parts.size()) * p0.size(2) * p0.size(3);
#if defined(FP8DP_WITH_CUDA)
  if (!p0.is_cuda() || p.rows * p.cols == 0 || p0.stride(3) != 1) return false;
  for (const at::Tensor& t : parts) {
    if (t.strides() != p0.strides()) return false;
  }
  StridedParts& s = p.strided;
  s.n = static_cast<int>(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) s.ptr[i] = parts[i].const_data_ptr();
  s.d1 = p0.size(1);
  s.d2 = p0.size(2);
  s.d3 = p0.size(3);
  for (int d = 0; d < 3; ++d) s.stride[d] = p0.stride(d);
  if (quantize_cuda_strided_supported(p)) return true;
  p.strided = StridedParts{};
#endif
  return false;
}

Quantized quantize_parts_impl(at::TensorList parts, const at::Tensor& scale, Format format,
                              QuantizeOptions opts, const at::Tensor& amax_into, const char* fn) {
  const DType dt = check_parts(parts, fn);
  check_scalar_float(scale, parts[0], fn, "scale");
  check_scale_value(scale, fn);
  QuantizeParams p;
  if (!strided_input(parts, dt, p)) {
    return quantize_impl(materialize_parts(parts), scale, format, opts, amax_into, fn);
  }
  const at::Tensor sc = scale.contiguous();
  p.scale = sc.data_ptr<float>();
  p.format = format;
  Quantized q = alloc_outputs(parts[0], {p.rows, p.cols}, opts, amax_into, fn, p);
  dispatch_kernel(parts[0].device(), quantize_cpu, FP8DP_CUDA_KERNEL(quantize_cuda), p);
  return q;
}

}  // namespace

Quantized quantize(const at::Tensor& x, const at::Tensor& scale, Format format,
                   QuantizeOptions opts, const at::Tensor& amax_into) {
  return quantize_impl(x, scale, format, opts, amax_into, "fp8dp.quantize");
}

Quantized quantize_parts(at::TensorList parts, const at::Tensor& scale, Format format,
                         QuantizeOptions opts, const at::Tensor& amax_into) {
  return quantize_parts_impl(parts, scale, format, opts, amax_into, "fp8dp.quantize_parts");
}

at::Tensor join_parts(at::TensorList parts) {
  check_parts(parts, "fp8dp.join_parts");
  return materialize_parts(parts);
}

bool quantize_parts_strided(at::TensorList parts) {
  QuantizeParams p;
  return strided_input(parts, check_parts(parts, "fp8dp.quantize_parts_strided"), p);
}

at::Tensor amax_parts(at::TensorList parts) {
  constexpr const char* fn = "fp8dp.amax_parts";
  FP8DP_CHECK_ARG(!parts.empty(), fn, ": argument 'parts' must hold 1 to ", kMaxParts,
                  " tensors, got 0");
  FP8DP_CHECK_ARG(parts[0].defined(), fn, ": argument 'parts[0]' is undefined");
  // As amax(): the cast's kernel with no output but the amax.
  auto one = at::ones({1}, parts[0].options().dtype(at::kFloat));
  return quantize_parts_impl(parts, one, Format::kE4M3, QuantizeOptions{false, false, false}, {},
                             fn)
      .amax;
}

void check_amax_into(const at::Tensor& a, const at::Tensor& like, const char* fn) {
  FP8DP_CHECK_ARG(a.scalar_type() == at::kFloat && a.numel() == 1 && a.is_contiguous(), fn,
                  ": 'amax_into' must be a contiguous float32 tensor with one element, got ",
                  a.scalar_type(), " of shape ", a.sizes());
  FP8DP_CHECK_ARG(a.device() == like.device(), fn, ": 'amax_into' is on ", a.device(),
                  " but the input is on ", like.device());
}

at::Tensor amax(const at::Tensor& x) {
  constexpr const char* fn = "fp8dp.amax";
  FP8DP_CHECK_ARG(x.defined(), fn, ": argument 'x' is undefined");
  // Same one-pass kernel without writing bytes; the scale is never applied to anything.
  auto one = at::ones({1}, x.options().dtype(at::kFloat));
  return quantize_impl(x, one, Format::kE4M3, QuantizeOptions{false, false, false}, {}, fn).amax;
}

at::Tensor transpose_fp8(const at::Tensor& data) {
  constexpr const char* fn = "fp8dp.transpose_fp8";
  FP8DP_CHECK_ARG(data.defined() && data.dim() == 2, fn, ": argument 'data' must be 2-D, got ",
                  data.defined() ? data.sizes() : at::IntArrayRef{});
  format_of(data.scalar_type(), fn, "data");
#if defined(FP8DP_WITH_CUDA)
  if (data.is_cuda() && data.is_contiguous()) {
    const int64_t rows = data.size(0), cols = data.size(1);
    at::Tensor out = at::empty({cols, rows}, data.options());
    if (transpose_bytes_cuda_supported(rows, cols, data.data_ptr(), out.data_ptr())) {
      c10::cuda::CUDAGuard guard(data.device());
      transpose_bytes_cuda(static_cast<const uint8_t*>(data.data_ptr()),
                           static_cast<uint8_t*>(out.data_ptr()), rows, cols,
                           c10::cuda::getCurrentCUDAStream().stream());
      return out;
    }
  }
#endif
  return data.t().contiguous();
}

at::Tensor dequantize(const at::Tensor& data_in, const at::Tensor& scale_inv,
                      at::ScalarType dtype) {
  constexpr const char* fn = "fp8dp.dequantize";
  FP8DP_CHECK_ARG(data_in.defined(), fn, ": argument 'data' is undefined");
  check_device_supported(data_in, fn, "argument 'data'");
  const Format format = format_of(data_in.scalar_type(), fn, "data");
  check_scalar_float(scale_inv, data_in, fn, "scale_inv");
  const DType out_dtype = to_high_precision_dtype(dtype, fn, "argument 'dtype'");
  const at::Tensor data = data_in.contiguous();
  const at::Tensor si = scale_inv.contiguous();
  at::Tensor out = at::empty(data.sizes(), data.options().dtype(dtype));
  DequantizeParams p;
  p.input = static_cast<const uint8_t*>(data.data_ptr());
  p.numel = data.numel();
  p.format = format;
  p.scale_inv = si.data_ptr<float>();
  p.out = out.data_ptr();
  p.out_dtype = out_dtype;
  dispatch_kernel(data.device(), dequantize_cpu, FP8DP_CUDA_KERNEL(dequantize_cuda), p);
  return out;
}

}  // namespace fp8dp
