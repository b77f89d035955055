// The weight-gradient GEMM shared by the immediate and the deferred (backward_dw) routes.
#include "modules/wgrad_store.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "gemm/gemm.h"

namespace fp8dp {

at::Tensor bias_grad_hp(const at::Tensor& dy, at::ScalarType dtype) {
  // Summed in FP32 without an FP32 copy of dy (a pass over it that the sum does not need).
  return at::sum(dy, {0}, false, at::kFloat).to(dtype);
}

WgradResult run_wgrad(const WgradTask& t) {
  if (t.replay) return t.replay();
  c10::NoGradGuard no_grad;
  GemmArgs g;
  g.a = t.a;
  g.a_scale_inv = t.a_scale_inv;
  g.b = t.b;
  g.b_scale_inv = t.b_scale_inv;
  g.use_split_accumulator = t.use_split_accumulator;
  WgradResult r;
  if (t.main_grad.defined()) {
    g.out = t.main_grad;
    g.accumulate = true;
    gemm(g);
  } else {
    g.out_dtype = t.weight.scalar_type();
    r.dweight = gemm(g);
  }
  if (t.dy.defined() && t.bias.defined()) r.dbias = bias_grad_hp(t.dy, t.bias.scalar_type());
  return r;
}

}  // namespace fp8dp
