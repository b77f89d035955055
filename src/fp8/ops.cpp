// Tensor-level FP8 casts: argument checks, output allocation, CPU / CUDA dispatch.
#include "fp8/ops.h"

#include <ATen/ATen.h>

#include <cmath>
#include <utility>

#include "common/check.h"
#include "fp8/quantize.h"

#if defined(FP8DP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fp8dp {
namespace {

DType to_dtype(const at::Tensor& t, const char* fn, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      FP8DP_CHECK_ARG(false, fn, ": argument '", arg,
                      "' must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

Format format_of(at::ScalarType t, const char* fn, const char* arg) {
  if (t == at::kFloat8_e4m3fn) return Format::kE4M3;
  if (t == at::kFloat8_e5m2) return Format::kE5M2;
  FP8DP_CHECK_ARG(false, fn, ": argument '", arg, "' must be float8_e4m3fn or float8_e5m2, got ",
                  t);
}

void check_device_supported(const at::Tensor& t, const char* fn, const char* arg) {
#if defined(FP8DP_WITH_CUDA)
  FP8DP_CHECK_ARG(t.is_cpu() || t.is_cuda(), fn, ": argument '", arg,
                  "' must be on the CPU or a CUDA device, got ", t.device());
#else
  FP8DP_CHECK_ARG(t.is_cpu(), fn, ": argument '", arg,
                  "' must be on the CPU (this build of fp8dp has no CUDA), got ", t.device());
#endif
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

at::ScalarType fp8_dtype(Format f) {
  return f == Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

namespace {

// quantize() and amax() share the checks and the kernel; fn names the public entry point in errors.
Quantized quantize_impl(const at::Tensor& x_in, const at::Tensor& scale, Format format,
                        QuantizeOptions opts, const char* fn) {
  FP8DP_CHECK_ARG(x_in.defined(), fn, ": argument 'x' is undefined");
  check_device_supported(x_in, fn, "x");
  const DType dt = to_dtype(x_in, fn, "x");
  check_scalar_float(scale, x_in, fn, "scale");
  if (scale.is_cpu()) {
    const float s = scale.item<float>();
    FP8DP_CHECK_ARG(std::isfinite(s) && s > 0.0f, fn,
                    ": argument 'scale' must be finite and > 0, got ", s);
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor sc = scale.contiguous();
  // x is viewed as [rows, cols] = [numel / last_dim, last_dim]; a 0-d tensor is [1, 1].
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  auto f32 = x.options().dtype(at::kFloat);
  auto f8 = x.options().dtype(fp8_dtype(format));

  Quantized q;
  q.amax = at::empty({1}, f32);
  q.scale_inv = at::empty({1}, f32);
  if (opts.data) q.data = at::empty(x.sizes(), f8);
  if (opts.transpose) q.data_t = at::empty({cols, rows}, f8);
  if (opts.dbias) q.dbias = at::empty({cols}, f32);

  QuantizeParams p;
  p.input = x.data_ptr();
  p.input_dtype = dt;
  p.rows = rows;
  p.cols = cols;
  p.scale = sc.data_ptr<float>();
  p.format = format;
  p.out = opts.data ? static_cast<uint8_t*>(q.data.data_ptr()) : nullptr;
  p.out_t = opts.transpose ? static_cast<uint8_t*>(q.data_t.data_ptr()) : nullptr;
  p.amax = q.amax.data_ptr<float>();
  p.scale_inv = q.scale_inv.data_ptr<float>();
  p.dbias = opts.dbias ? q.dbias.data_ptr<float>() : nullptr;
#if defined(FP8DP_WITH_CUDA)
  if (x.is_cuda()) {
    c10::cuda::CUDAGuard guard(x.device());
    quantize_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
    return q;
  }
#endif
  quantize_cpu(p);
  return q;
}

}  // namespace

Quantized quantize(const at::Tensor& x, const at::Tensor& scale, Format format,
                   QuantizeOptions opts) {
  return quantize_impl(x, scale, format, opts, "fp8dp.quantize");
}

at::Tensor amax(const at::Tensor& x) {
  constexpr const char* fn = "fp8dp.amax";
  FP8DP_CHECK_ARG(x.defined(), fn, ": argument 'x' is undefined");
  // Same one-pass kernel without writing bytes; the scale is never applied to anything.
  auto one = at::ones({1}, x.options().dtype(at::kFloat));
  return quantize_impl(x, one, Format::kE4M3, QuantizeOptions{false, false, false}, fn).amax;
}

at::Tensor dequantize(const at::Tensor& data_in, const at::Tensor& scale_inv,
                      at::ScalarType dtype) {
  constexpr const char* fn = "fp8dp.dequantize";
  FP8DP_CHECK_ARG(data_in.defined(), fn, ": argument 'data' is undefined");
  check_device_supported(data_in, fn, "data");
  const Format format = format_of(data_in.scalar_type(), fn, "data");
  check_scalar_float(scale_inv, data_in, fn, "scale_inv");
  FP8DP_CHECK_ARG(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, fn,
                  ": argument 'dtype' must be float32, bfloat16 or float16, got ", dtype);
  const at::Tensor data = data_in.contiguous();
  const at::Tensor si = scale_inv.contiguous();
  at::Tensor out = at::empty(data.sizes(), data.options().dtype(dtype));
  DequantizeParams p;
  p.input = static_cast<const uint8_t*>(data.data_ptr());
  p.numel = data.numel();
  p.format = format;
  p.scale_inv = si.data_ptr<float>();
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out, fn, "dtype");
#if defined(FP8DP_WITH_CUDA)
  if (data.is_cuda()) {
    c10::cuda::CUDAGuard guard(data.device());
    dequantize_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
    return out;
  }
#endif
  dequantize_cpu(p);
  return out;
}

void update_scaling(at::Tensor& amax_history, at::Tensor& scale, at::Tensor& scale_inv,
                    const at::Tensor& fp8_max, AmaxAlgo algo, float margin) {
  constexpr const char* fn = "fp8dp.update_scaling";
  const std::pair<const at::Tensor*, const char*> args[] = {{&amax_history, "amax_history"},
                                                            {&scale, "scale"},
                                                            {&scale_inv, "scale_inv"},
                                                            {&fp8_max, "fp8_max"}};
  for (const auto& [t, name] : args) {
    FP8DP_CHECK_ARG(t->defined(), fn, ": argument '", name, "' is undefined");
    check_device_supported(*t, fn, name);
    FP8DP_CHECK_ARG(t->scalar_type() == at::kFloat, fn, ": argument '", name,
                    "' must be float32, got ", t->scalar_type());
    FP8DP_CHECK_ARG(t->is_contiguous(), fn, ": argument '", name, "' must be contiguous");
    FP8DP_CHECK_ARG(t->device() == amax_history.device(), fn, ": argument '", name, "' is on ",
                    t->device(), " but 'amax_history' is on ", amax_history.device());
  }
  FP8DP_CHECK_ARG(amax_history.dim() == 2 && amax_history.size(0) >= 1, fn,
                  ": argument 'amax_history' must be [L, n] with L >= 1, got ",
                  amax_history.sizes());
  const int64_t n = amax_history.size(1);
  FP8DP_CHECK_ARG(scale.numel() == n, fn, ": argument 'scale' needs ", n, " elements, got ",
                  scale.numel());
  FP8DP_CHECK_ARG(scale_inv.numel() == n, fn, ": argument 'scale_inv' needs ", n, " elements, got ",
                  scale_inv.numel());
  FP8DP_CHECK_ARG(fp8_max.numel() == n, fn, ": argument 'fp8_max' needs ", n, " elements, got ",
                  fp8_max.numel());
  FP8DP_CHECK_ARG(std::isfinite(margin) && margin >= 0.0f, fn,
                  ": argument 'margin' must be finite and >= 0, got ", margin);
  ScalingUpdateParams p;
  p.amax_history = amax_history.data_ptr<float>();
  p.scale = scale.data_ptr<float>();
  p.scale_inv = scale_inv.data_ptr<float>();
  p.fp8_max = fp8_max.data_ptr<float>();
  p.n = n;
  p.history_len = amax_history.size(0);
  p.algo = algo;
  p.margin = margin;
#if defined(FP8DP_WITH_CUDA)
  if (amax_history.is_cuda()) {
    c10::cuda::CUDAGuard guard(amax_history.device());
    update_scaling_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
    return;
  }
#endif
  update_scaling_cpu(p);
}

void update_scaling_batched(const std::vector<ScalingSlot>& slots, const at::Device& device) {
  if (slots.empty()) return;
#if defined(FP8DP_WITH_CUDA)
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    update_scaling_batched_cuda(slots.data(), static_cast<int64_t>(slots.size()),
                                c10::cuda::getCurrentCUDAStream().stream());
    return;
  }
#endif
  FP8DP_CHECK(device.is_cpu(), "update_scaling_batched: buffers on ", device,
              " but fp8dp was built without CUDA");
  update_scaling_batched_cpu(slots.data(), static_cast<int64_t>(slots.size()));
}

}  // namespace fp8dp
