// Tensor-level LayerNorm / RMSNorm: checks, allocation, kernel dispatch (CPU forward kernel, CUDA
// forward and backward kernels; CPU backward in FP32 ATen).
#include "norm/norm.h"

#include <ATen/ATen.h>

#include "common/check.h"
#include "common/dispatch.h"
#include "common/tensor_checks.h"
#include "fp8/cast.h"
#include "norm/norm_kernel.h"

#if defined(FP8DP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fp8dp {
namespace {

void check_device(const at::Tensor& t, const at::Tensor& x, const char* arg) {
  FP8DP_CHECK_ARG(t.device() == x.device(), "norm: ", arg, " must be on the input's device ",
                  x.device(), ", got ", t.device());
}

}  // namespace

NormForward norm_forward_aten(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                              const NormConfig& cfg, const at::Tensor& scale, Format format) {
  const at::Tensor xf = x.to(at::kFloat);
  NormForward r;
  r.mu = cfg.rms ? at::zeros({x.size(0)}, xf.options()) : xf.mean(1);
  const at::Tensor xc = xf - r.mu.unsqueeze(1);
  r.rsigma = at::rsqrt((xc * xc).mean(1) + cfg.eps);
  at::Tensor g = gamma.to(at::kFloat);
  if (cfg.zero_centered_gamma) g = g + 1.0f;
  at::Tensor z = xc * r.rsigma.unsqueeze(1) * g;
  if (beta.defined()) z = z + beta.to(at::kFloat);
  r.out = z.to(x.scalar_type());
  if (scale.defined()) {
    Quantized q = quantize(r.out, scale, format, QuantizeOptions{true, false, false});
    r.out_fp8 = q.data;
    r.scale_inv = q.scale_inv;
    r.amax = q.amax;
  } else {
    r.amax = fp8dp::amax(r.out);
  }
  return r;
}

NormForward norm_forward(const at::Tensor& x_in, const at::Tensor& gamma_in,
                         const at::Tensor& beta_in, const NormConfig& cfg, bool want_out,
                         const at::Tensor& scale, Format format, const at::Tensor& amax_into) {
  FP8DP_CHECK_ARG(x_in.dim() == 2, "norm: input must be [rows, cols], got ", x_in.sizes());
  const int64_t rows = x_in.size(0), cols = x_in.size(1);
  FP8DP_CHECK_ARG(cols > 0, "norm: input must have at least one column, got ", x_in.sizes());
  check_device_supported(x_in, "norm", "input");
  const DType dt = to_high_precision_dtype(x_in.scalar_type(), "norm", "input");
  check_device(gamma_in, x_in, "gamma");
  if (beta_in.defined()) check_device(beta_in, x_in, "beta");
  if (scale.defined()) {
    check_device(scale, x_in, "scale");
    FP8DP_CHECK_ARG(scale.numel() == 1, "norm: scale must have one element, got ", scale.sizes());
    check_scale_value(scale, "norm");
  }
  FP8DP_CHECK_ARG(gamma_in.numel() == cols && gamma_in.scalar_type() == x_in.scalar_type(),
                  "norm: gamma must be [", cols, "] of ", x_in.scalar_type(), ", got ",
                  gamma_in.sizes(), " of ", gamma_in.scalar_type());
  FP8DP_CHECK_ARG(!beta_in.defined() ||
                      (beta_in.numel() == cols && beta_in.scalar_type() == x_in.scalar_type()),
                  "norm: beta must be [", cols, "] of ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), gamma = gamma_in.contiguous();
  const at::Tensor beta = beta_in.defined() ? beta_in.contiguous() : beta_in;
  auto f32 = x.options().dtype(at::kFloat);
  NormForward r;
  r.mu = at::empty({rows}, f32);
  r.rsigma = at::empty({rows}, f32);
  if (amax_into.defined()) check_amax_into(amax_into, x, "norm");
  r.amax = amax_into.defined() ? amax_into : at::empty({1}, f32);
  if (want_out) r.out = at::empty({rows, cols}, x.options());
  at::Tensor sc;
  if (scale.defined()) {
    r.out_fp8 = at::empty({rows, cols}, x.options().dtype(fp8_dtype(format)));
    r.scale_inv = at::empty({1}, f32);
    sc = scale.to(f32).contiguous();
  }
  NormFwdParams p;
  p.input = x.data_ptr();
  p.dtype = dt;
  p.rows = rows;
  p.cols = cols;
  p.gamma = gamma.data_ptr();
  p.beta = beta.defined() ? beta.data_ptr() : nullptr;
  p.eps = cfg.eps;
  p.rms = cfg.rms;
  p.zero_centered_gamma = cfg.zero_centered_gamma;
  p.out = want_out ? r.out.data_ptr() : nullptr;
  p.out_fp8 = scale.defined() ? static_cast<uint8_t*>(r.out_fp8.data_ptr()) : nullptr;
  p.scale = scale.defined() ? sc.data_ptr<float>() : nullptr;
  p.scale_inv = scale.defined() ? r.scale_inv.data_ptr<float>() : nullptr;
  p.format = format;
  p.amax = r.amax.data_ptr<float>();
  p.amax_accumulate = amax_into.defined();
  p.mu = r.mu.data_ptr<float>();
  p.rsigma = r.rsigma.data_ptr<float>();
  dispatch_kernel(x.device(), norm_fwd_cpu, FP8DP_CUDA_KERNEL(norm_fwd_cuda), p);
  return r;
}

NormGrads norm_backward(const at::Tensor& dz_in, const at::Tensor& x_in, const at::Tensor& mu,
                        const at::Tensor& rsigma, const at::Tensor& gamma, bool has_beta,
                        const NormConfig& cfg, const at::Tensor& dx_add_in) {
  FP8DP_CHECK_ARG(x_in.dim() == 2 && x_in.size(1) > 0,
                  "norm_backward: x must be [rows, cols] with cols > 0, got ", x_in.sizes());
  const int64_t rows = x_in.size(0), cols = x_in.size(1);
  FP8DP_CHECK_ARG(dz_in.sizes() == x_in.sizes(), "norm_backward: dz must have x's shape ",
                  x_in.sizes(), ", got ", dz_in.sizes());
  FP8DP_CHECK_ARG(gamma.numel() == cols, "norm_backward: gamma must have ", cols, " elements, got ",
                  gamma.sizes());
  for (const at::Tensor* s : {&mu, &rsigma}) {
    FP8DP_CHECK_ARG(s->numel() == rows && s->scalar_type() == at::kFloat,
                    "norm_backward: mu and rsigma must be float32 [", rows, "], got ", s->sizes(),
                    " of ", s->scalar_type());
  }
  check_device_supported(x_in, "norm", "input");
  check_device(dz_in, x_in, "dz");
  check_device(gamma, x_in, "gamma");
  check_device(mu, x_in, "mu");
  check_device(rsigma, x_in, "rsigma");
  if (dx_add_in.defined()) {
    FP8DP_CHECK_ARG(dx_add_in.sizes() == x_in.sizes(), "norm_backward: dx_add must have x's shape ",
                    x_in.sizes(), ", got ", dx_add_in.sizes());
    // x's dtype, as autograd hands it (a gradient has its tensor's dtype): the CUDA kernel reads
    // dx_add as x's type, so another dtype would be rounded to it there and not on the CPU.
    FP8DP_CHECK_ARG(dx_add_in.scalar_type() == x_in.scalar_type(),
                    "norm_backward: dx_add must have x's dtype ", x_in.scalar_type(), ", got ",
                    dx_add_in.scalar_type());
    check_device(dx_add_in, x_in, "dx_add");
  }
#if defined(FP8DP_WITH_CUDA)
  // The kernel takes one dtype for dz, x and gamma (what LayerNormLinear passes); another mix
  // takes the ATen formulation below.
  if (x_in.is_cuda() && dz_in.scalar_type() == x_in.scalar_type() &&
      gamma.scalar_type() == x_in.scalar_type()) {
    const at::Tensor dz = dz_in.contiguous(), x = x_in.contiguous(), g = gamma.contiguous();
    const at::Tensor m = mu.contiguous(), rs = rsigma.contiguous();
    NormGrads gr;
    gr.dx = at::empty_like(x);
    gr.dgamma = at::empty({cols}, g.options());
    if (has_beta) gr.dbeta = at::empty({cols}, g.options());
    NormBwdParams p;
    p.dz = dz.data_ptr();
    p.x = x.data_ptr();
    p.dtype = to_high_precision_dtype(x.scalar_type(), "norm", "input");
    p.rows = rows;
    p.cols = cols;
    p.mu = m.data_ptr<float>();
    p.rsigma = rs.data_ptr<float>();
    p.gamma = g.data_ptr();
    p.rms = cfg.rms;
    p.zero_centered_gamma = cfg.zero_centered_gamma;
    p.dx = gr.dx.data_ptr();
    // Autograd may hand an expanded or strided gradient; the kernel reads dz's layout.
    const at::Tensor dx_add = dx_add_in.defined() ? dx_add_in.contiguous() : at::Tensor();
    p.dx_add = dx_add.defined() ? dx_add.data_ptr() : nullptr;
    p.dgamma = gr.dgamma.data_ptr();
    p.dbeta = has_beta ? gr.dbeta.data_ptr() : nullptr;
    c10::cuda::CUDAGuard guard(x.device());
    norm_bwd_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
    gr.dgamma = gr.dgamma.view(gamma.sizes());
    if (has_beta) gr.dbeta = gr.dbeta.view(gamma.sizes());
    return gr;
  }
#endif
  // xhat = (x - mu) * rsigma, z = xhat * g + beta. With dxhat = dz * g:
  //   LayerNorm: dx = rsigma * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
  //   RMSNorm:   dx = rsigma * (dxhat - xhat * mean(dxhat * xhat))
  //   dgamma = sum_rows(dz * xhat), dbeta = sum_rows(dz)
  const at::Tensor dz = dz_in.to(at::kFloat);
  // RMSNorm: mu is ignored (taken as 0), as in the kernel.
  const at::Tensor xf = x_in.to(at::kFloat);
  const at::Tensor xhat = (cfg.rms ? xf : xf - mu.unsqueeze(1)) * rsigma.unsqueeze(1);
  at::Tensor g = gamma.to(at::kFloat);
  if (cfg.zero_centered_gamma) g = g + 1.0f;
  const at::Tensor dxhat = dz * g;
  at::Tensor inner = dxhat - xhat * (dxhat * xhat).mean(1, /*keepdim=*/true);
  if (!cfg.rms) inner = inner - dxhat.mean(1, /*keepdim=*/true);
  NormGrads gr;
  at::Tensor dx = inner * rsigma.unsqueeze(1);
  if (dx_add_in.defined()) dx = dx + dx_add_in.to(at::kFloat);
  gr.dx = dx.to(x_in.scalar_type());
  gr.dgamma = (dz * xhat).sum(0).to(gamma.scalar_type());
  if (has_beta) gr.dbeta = dz.sum(0).to(gamma.scalar_type());
  return gr;
}

}  // namespace fp8dp
