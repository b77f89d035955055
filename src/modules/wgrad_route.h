// The route of one use's weight gradient out of a backward, shared by the autograd functions of
// Linear / LayerNormLinear (linear_autograd.cpp) and of LayerNormMLP's two GEMMs
// (layernorm_mlp_autograd.cpp): returned to autograd (C2 a), accumulated into main_grad by the
// GEMM (C2 b), queued for backward_dw() (C3), delivered to DistributedDataParallel's sink (C8),
// or handed back to torch.autograd.grad (C14).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "modules/linear_core.h"
#include "modules/sink_use.h"
#include "modules/wgrad_store.h"

namespace fp8dp {

// What a use of the weight will deliver to the sink itself, announced to the ledger (C8): the
// weight's gradient when fused or delayed; the bias's when the deferred GEMM makes it (delayed,
// FP8 off). By the forward, or by the backward of a reentrant checkpoint's recompute.
void announce_use(SinkUse& use, const LinearConfig& cfg, bool fp8, const at::Tensor& bias);

// Decided once at the start of the backward.
struct WgradRoute {
  bool need_w = false;    // autograd wants the weight's gradient
  bool captured = false;  // ...handed back to the caller (autograd.grad), nothing accumulated
  bool fused = false;     // ...accumulated into main_grad by the GEMM
  bool delayed = false;   // ...computed by backward_dw()
  bool bound = false;     // ...delivered to DistributedDataParallel's sink
};

WgradRoute plan_wgrad(const LinearConfig& cfg, const SinkUse& use, const at::Tensor& weight,
                      bool need_w);

// Before the backward reads or writes anything (a refusal then changes nothing):
// - what the forward announced to the ledger is withdrawn when the gradient is captured or not
//   wanted at all;
// - a tensor hook that the route would bypass is refused (fused or delayed weight; the bias
//   when its gradient is deferred with the weight's, FP8 off). `module` names the module in the
//   error, `param` the weight's name in it ("weight", "fc1.weight");
// - the sink is asked whether it still accepts the gradient (C11: not for a launched bucket).
void prepare_wgrad(LinearCore& core, SinkUse& use, const WgradRoute& r, const at::Tensor& weight,
                   const at::Tensor& bias, bool need_b, bool fp8, const std::string& module,
                   const std::string& param);

// Runs or queues the weight-gradient GEMM of `task` (its operands filled in) by route r and
// returns what autograd gets for the weight; sets dbias when the GEMM made the bias gradient.
at::Tensor route_wgrad(LinearCore& core, SinkUse& use, const WgradRoute& r,
                       const at::Tensor& weight, const at::Tensor& bias, bool fp8, WgradTask task,
                       at::Tensor& dbias);

}  // namespace fp8dp
