// The C++ core of fp8dp.LayerNormMLP: norm (+ FP8 cast) -> fc1 -> activation fused with the FP8
// cast of fc2's input -> fc2, and in backward the activation's derivative fused with the FP8 cast
// of fc1's grad_output. The two GEMMs are two LinearCores (those of the module's fc1, a
// LayerNormLinear, and fc2, a Linear): each keeps its own FP8 scaling state, weight cache,
// delayed-wgrad queue (backward_dw), wgrad hooks and DistributedDataParallel binding, so C2-C5 and
// the ledger hold for both weights exactly as for the separate modules. This class only checks the
// arguments of the fused forward and runs it (layernorm_mlp_autograd.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>

#include "fp8/activation_math.h"
#include "fp8/recipe.h"
#include "modules/linear_core.h"

namespace fp8dp {

struct MLPConfig {
  std::string name;  // e.g. "LayerNormMLP(hidden_size=64, ffn_hidden_size=256, activation=gelu)"
  Activation activation = Activation::kGelu;
  int64_t ffn_hidden_size = 0;
};

class LayerNormMLPCore {
 public:
  // fc1: a LayerNormLinear core [hidden -> ffn (gelu) or 2 ffn (swiglu: gate | up)], without
  // return_layernorm_output; fc2: a Linear core [ffn -> hidden]. Checked here (ValueError).
  LayerNormMLPCore(MLPConfig cfg, std::shared_ptr<LinearCore> fc1, std::shared_ptr<LinearCore> fc2);

  const MLPConfig& config() const { return cfg_; }
  const std::shared_ptr<LinearCore>& fc1() const { return fc1_; }
  const std::shared_ptr<LinearCore>& fc2() const { return fc2_; }

  // x: [..., hidden] in the parameters' dtype and device; ln_bias, fc1_bias, fc2_bias optional
  // (undefined). Returns y [..., hidden]. Differentiable through a C++ autograd function.
  // is_first_microbatch as in LinearCore::forward, for both FP8 weight caches. residual:
  // optional, x's shape, dtype and device; y = mlp(x) + residual, added in fc2's GEMM epilogue
  // (as LinearCore::forward's residual).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& ln_weight, const at::Tensor& ln_bias,
                     const at::Tensor& fc1_weight, const at::Tensor& fc1_bias,
                     const at::Tensor& fc2_weight, const at::Tensor& fc2_bias,
                     std::optional<bool> is_first_microbatch,
                     const at::Tensor& residual = at::Tensor());

 private:
  MLPConfig cfg_;
  std::shared_ptr<LinearCore> fc1_, fc2_;
  // The fp8_autocast state of the latest forward outside backward, which a recompute by
  // activation checkpointing repeats (as LinearCore::forward does, C14).
  std::optional<AutocastState> forward_autocast_;
};

// The autograd function (layernorm_mlp_autograd.cpp) behind a plain call; the arguments are the
// ones forward() has checked (residual undefined = none). need_wgrad1 / need_wgrad2: whether fc1's
// / fc2's weight gradient will be wanted.
at::Tensor apply_layernorm_mlp_function(const at::Tensor& x, const at::Tensor& ln_weight,
                                        const at::Tensor& ln_bias, const at::Tensor& fc1_weight,
                                        const at::Tensor& fc1_bias, const at::Tensor& fc2_weight,
                                        const at::Tensor& fc2_bias, const at::Tensor& residual,
                                        const MLPConfig& cfg, std::shared_ptr<LinearCore> fc1,
                                        std::shared_ptr<LinearCore> fc2,
                                        std::optional<bool> is_first_microbatch,
                                        const AutocastState& ac, bool need_wgrad1,
                                        bool need_wgrad2);

}  // namespace fp8dp
