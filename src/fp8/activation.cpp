// Tensor-level activation (+ FP8 cast): argument checks, output allocation, CPU / CUDA dispatch.
#include "fp8/activation.h"

#include <ATen/ATen.h>

#include <atomic>
#include <cfloat>
#include <cmath>

#include "common/check.h"
#include "common/dispatch.h"
#include "common/tensor_checks.h"
#include "fp8/activation_kernel.h"

namespace fp8dp {

Activation parse_activation(const std::string& name, std::string_view where) {
  if (name == "gelu") return Activation::kGelu;
  if (name == "swiglu") return Activation::kSwiglu;
  FP8DP_CHECK_ARG(false, where, ": activation must be 'gelu' or 'swiglu', got '", name, "'");
}

const char* activation_name(Activation act) {
  return act == Activation::kSwiglu ? "swiglu" : "gelu";
}

namespace {
std::atomic<bool> g_lut_enabled{true};

// Checks h (and da) and fills the shape and input fields of p. Returns the contiguous inputs.
struct Inputs {
  at::Tensor h, da;
};

Inputs prepare(ActParams& p, const at::Tensor& da_in, const at::Tensor& h_in, Activation act,
               const char* fn) {
  FP8DP_CHECK_ARG(h_in.defined() && h_in.dim() == 2, fn, ": argument 'h' must be 2-D, got ",
                  h_in.defined() ? h_in.sizes() : at::IntArrayRef{});
  check_device_supported(h_in, fn, "argument 'h'");
  p.dtype = to_high_precision_dtype(h_in.scalar_type(), fn, "argument 'h'");
  p.act = act;
  p.lut = g_lut_enabled.load();
  p.rows = h_in.size(0);
  const int64_t in_cols = h_in.size(1);
  if (act == Activation::kSwiglu) {
    FP8DP_CHECK_ARG(in_cols % 2 == 0, fn,
                    ": swiglu needs an even number of input columns ([gate | up]), got h of shape ",
                    h_in.sizes());
  }
  p.cols = act == Activation::kSwiglu ? in_cols / 2 : in_cols;
  Inputs in{h_in.contiguous(), at::Tensor()};
  p.input = in.h.data_ptr();
  p.backward = da_in.defined();
  if (p.backward) {
    FP8DP_CHECK_ARG(da_in.dim() == 2 && da_in.size(0) == p.rows && da_in.size(1) == p.cols, fn,
                    ": argument 'da' must have shape [", p.rows, ", ", p.cols, "] for h of shape ",
                    h_in.sizes(), " (", activation_name(act), "), got ", da_in.sizes());
    FP8DP_CHECK_ARG(da_in.scalar_type() == h_in.scalar_type() && da_in.device() == h_in.device(),
                    fn, ": argument 'da' must match 'h' (", h_in.scalar_type(), " on ",
                    h_in.device(), "), got ", da_in.scalar_type(), " on ", da_in.device());
    in.da = da_in.contiguous();
    p.grad = in.da.data_ptr();
  }
  return in;
}

void run(const ActParams& p, const at::Tensor& like) {
  if (p.rows == 0 || p.cols == 0) {
    // Nothing to compute; an amax over nothing is 0 (quantize's rule), merged or written.
    return;
  }
  dispatch_kernel(like.device(), activation_cpu, FP8DP_CUDA_KERNEL(activation_cuda), p);
}

}  // namespace

bool set_activation_lut(bool enabled) { return g_lut_enabled.exchange(enabled); }

at::Tensor activation_forward(const at::Tensor& h, Activation act) {
  return activation_backward(at::Tensor(), h, act);
}

at::Tensor activation_backward(const at::Tensor& da, const at::Tensor& h, Activation act) {
  constexpr const char* fn = "fp8dp.activation";
  ActParams p;
  const Inputs in = prepare(p, da, h, act, fn);
  at::Tensor out = at::empty({p.rows, p.out_cols()}, in.h.options());
  p.out_hp = out.data_ptr();
  run(p, in.h);
  return out;
}

Quantized activation_cast(const at::Tensor& da, const at::Tensor& h, Activation act,
                          const at::Tensor& scale, Format format, QuantizeOptions opts,
                          const at::Tensor& amax_into) {
  constexpr const char* fn = "fp8dp.activation_cast";
  ActParams p;
  const Inputs in = prepare(p, da, h, act, fn);
  FP8DP_CHECK_ARG(scale.defined() && scale.scalar_type() == at::kFloat && scale.numel() == 1 &&
                      scale.device() == h.device(),
                  fn, ": argument 'scale' must be a float32 tensor with one element on ",
                  h.device());
  check_scale_value(scale, fn);
  FP8DP_CHECK_ARG(!opts.dbias || p.backward, fn,
                  ": a bias gradient (dbias) is a backward output; pass 'da'");
  const at::Tensor sc = scale.contiguous();
  const int64_t rows = p.rows, cols = p.out_cols();
  auto f32 = in.h.options().dtype(at::kFloat);
  auto f8 = in.h.options().dtype(fp8_dtype(format));
  Quantized q;
  if (amax_into.defined()) check_amax_into(amax_into, h, fn);
  q.amax = amax_into.defined() ? amax_into : at::zeros({1}, f32);
  q.scale_inv = at::empty({1}, f32);
  if (opts.data) q.data = at::empty({rows, cols}, f8);
  if (opts.transpose) q.data_t = at::empty({cols, rows}, f8);
  if (opts.dbias) {
    to_high_precision_dtype(opts.dbias_dtype, fn, "dbias_dtype");
    q.dbias = at::zeros({cols}, in.h.options().dtype(opts.dbias_dtype));
  }
  p.scale = sc.data_ptr<float>();
  p.format = format;
  p.out = opts.data ? static_cast<uint8_t*>(q.data.data_ptr()) : nullptr;
  p.out_t = opts.transpose ? static_cast<uint8_t*>(q.data_t.data_ptr()) : nullptr;
  p.amax = q.amax.data_ptr<float>();
  p.amax_accumulate = amax_into.defined();
  p.scale_inv = q.scale_inv.data_ptr<float>();
  p.dbias = opts.dbias ? q.dbias.data_ptr() : nullptr;
  p.dbias_dtype =
      opts.dbias ? to_high_precision_dtype(opts.dbias_dtype, fn, "dbias_dtype") : DType::kFloat32;
  if (rows == 0 || cols == 0) {
    // scale_inverse's rule (NaN for an invalid scale) without a kernel launch of its own.
    q.scale_inv.copy_(at::where(sc.gt(0.0) & sc.le(FLT_MAX), sc.reciprocal(), NAN));
    return q;
  }
  run(p, in.h);
  return q;
}

at::Tensor activation_amax(const at::Tensor& da, const at::Tensor& h, Activation act) {
  constexpr const char* fn = "fp8dp.activation_amax";
  ActParams p;
  const Inputs in = prepare(p, da, h, act, fn);
  at::Tensor a = at::zeros({1}, in.h.options().dtype(at::kFloat));
  p.amax = a.data_ptr<float>();
  run(p, in.h);
  return a;
}

}  // namespace fp8dp
