// The autograd function of Linear / LayerNormLinear (linear_autograd.cpp) behind a plain call, so
// that only linear_autograd.cpp sees the autograd headers.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

#include "fp8/recipe.h"

namespace fp8dp {

class LinearCore;

// Runs core's forward through the autograd function and returns {y} or, with
// return_layernorm_output, {y, ln_out}. Takes the arguments LinearCore::forward has checked
// (undefined bias / ln_weight / ln_bias / residual = absent); ac is the autocast state at the call
// and need_wgrad whether a weight gradient will be wanted. residual: added to y in the GEMM's
// epilogue; its gradient is y's gradient itself.
std::vector<at::Tensor> apply_linear_function(const at::Tensor& x, const at::Tensor& weight,
                                              const at::Tensor& bias, const at::Tensor& ln_weight,
                                              const at::Tensor& ln_bias,
                                              std::shared_ptr<LinearCore> core,
                                              std::optional<bool> is_first_microbatch,
                                              const AutocastState& ac, bool need_wgrad,
                                              const at::Tensor& residual = at::Tensor());

// A residual [..., out_features] as the GEMM's 'residual' takes it: [tokens, out_features] with
// contiguous rows (a view when it has them, else a copy), detached.
at::Tensor residual_2d(const at::Tensor& residual, int64_t out_features);

// True while this thread runs a backward pass (a forward then is a recompute by activation
// checkpointing, C14).
bool in_backward_pass();

// True when t has tensor pre-hooks (t.register_hook) in autograd; one whose hooks were all removed
// may still count (the bindings ask Python to tell, WeightAttrs::tensor_hooks).
bool has_tensor_pre_hooks(const at::Tensor& t);

// Whether the running backward hands param's gradient back to the caller (torch.autograd.grad
// with param among its inputs) instead of accumulating it (C14).
bool gradient_captured(const at::Tensor& param);

}  // namespace fp8dp
