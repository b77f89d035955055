// LayerNormMLPCore: the checks of the fused forward (what LinearCore::forward checks for each of
// the two GEMMs, plus the activation's shapes), then the autograd function.
#include "modules/layernorm_mlp.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include "common/check.h"
#include "common/tensor_checks.h"
#include "fp8/activation.h"
#include "fp8/activation_kernel.h"
#include "fp8/scaling_registry.h"
#include "modules/capture_check.h"
#include "modules/graph_record.h"
#include "modules/linear_autograd.h"

namespace fp8dp {
namespace {

void check_param(const at::Tensor& p, const char* name, std::vector<int64_t> shape,
                 const at::Tensor& like, const std::string& mod) {
  FP8DP_CHECK_ARG(p.sizes() == at::IntArrayRef(shape), mod, ": parameter '", name,
                  "' must have shape ", at::IntArrayRef(shape), ", got ", p.sizes());
  FP8DP_CHECK_ARG(p.scalar_type() == like.scalar_type() && p.device() == like.device(), mod,
                  ": parameter '", name, "' must match 'fc1.weight' (", like.scalar_type(), " on ",
                  like.device(), "), got ", p.scalar_type(), " on ", p.device());
}

// The sink a LinearCore was bound to must still manage these very parameters: a weight
// re-assigned or unfrozen after wrapping would have its gradient delivered into another
// parameter's main_grad (the check of LinearCore::forward).
void check_bound(const LinearCore& core, const at::Tensor& weight, const at::Tensor& bias,
                 const std::string& mod, const char* which) {
  const auto sink = core.grad_sink();
  if (!sink) return;
  FP8DP_CHECK_ARG(
      core.sink_weight() >= 0 &&
          sink->param(core.sink_weight()).unsafeGetTensorImpl() == weight.unsafeGetTensorImpl(),
      mod, ": parameter '", which,
      ".weight' is not the one DistributedDataParallel manages for this module "
      "(re-assigned or unfrozen after wrapping?): tie, freeze and unfreeze parameters "
      "before wrapping the model");
  FP8DP_CHECK_ARG(
      !bias.defined() || !bias.requires_grad() ||
          (core.sink_bias() >= 0 &&
           sink->param(core.sink_bias()).unsafeGetTensorImpl() == bias.unsafeGetTensorImpl()),
      mod, ": parameter '", which,
      ".bias' is not the one DistributedDataParallel manages for this module "
      "(re-assigned or unfrozen after wrapping?)");
}

}  // namespace

LayerNormMLPCore::LayerNormMLPCore(MLPConfig cfg, std::shared_ptr<LinearCore> fc1,
                                   std::shared_ptr<LinearCore> fc2)
    : cfg_(std::move(cfg)), fc1_(std::move(fc1)), fc2_(std::move(fc2)) {
  const std::string& mod = cfg_.name;
  FP8DP_CHECK_ARG(fc1_ && fc2_, mod, ": needs the cores of fc1 and fc2, got None");
  FP8DP_CHECK_ARG(cfg_.ffn_hidden_size > 0, mod, ": ffn_hidden_size must be > 0, got ",
                  cfg_.ffn_hidden_size);
  const LinearConfig& c1 = fc1_->config();
  const LinearConfig& c2 = fc2_->config();
  FP8DP_CHECK_ARG(c1.layernorm && !c1.return_layernorm_output && !c1.return_layernorm_input &&
                      c1.qkv_heads == 0,
                  mod,
                  ": fc1 must be a LayerNormLinear core without return_layernorm_output, "
                  "return_layernorm_input or qkv_heads");
  FP8DP_CHECK_ARG(!c2.layernorm, mod, ": fc2 must be a Linear core, got a LayerNormLinear core");
  FP8DP_CHECK_ARG(c2.qkv_heads == 0, mod, ": fc2 must be a Linear core without qkv_heads");
  const int64_t fc1_out = activation_in_cols(cfg_.activation, cfg_.ffn_hidden_size);
  FP8DP_CHECK_ARG(c1.out_features == fc1_out, mod, ": fc1 must have out_features=", fc1_out, " (",
                  activation_name(cfg_.activation), " of ffn_hidden_size=", cfg_.ffn_hidden_size,
                  "), got ", c1.out_features);
  FP8DP_CHECK_ARG(c2.in_features == cfg_.ffn_hidden_size && c2.out_features == c1.in_features, mod,
                  ": fc2 must map ffn_hidden_size=", cfg_.ffn_hidden_size,
                  " to hidden_size=", c1.in_features, ", got ", c2.in_features, " -> ",
                  c2.out_features);
}

at::Tensor LayerNormMLPCore::forward(const at::Tensor& x, const at::Tensor& ln_weight,
                                     const at::Tensor& ln_bias, const at::Tensor& fc1_weight,
                                     const at::Tensor& fc1_bias, const at::Tensor& fc2_weight,
                                     const at::Tensor& fc2_bias,
                                     std::optional<bool> is_first_microbatch,
                                     const at::Tensor& residual) {
  const std::string& mod = cfg_.name;
  const int64_t hidden = fc1_->config().in_features;
  const int64_t fc1_out = fc1_->config().out_features, ffn = cfg_.ffn_hidden_size;
  FP8DP_CHECK_ARG(fc1_weight.defined() && fc2_weight.defined() && ln_weight.defined(), mod,
                  ": parameters 'fc1.weight', 'fc2.weight' and 'fc1.layer_norm_weight' must be "
                  "defined");
  to_high_precision_dtype(fc1_weight.scalar_type(), mod, "parameter 'fc1.weight'");
  check_param(fc1_weight, "fc1.weight", {fc1_out, hidden}, fc1_weight, mod);
  check_param(fc2_weight, "fc2.weight", {hidden, ffn}, fc1_weight, mod);
  check_param(ln_weight, "fc1.layer_norm_weight", {hidden}, fc1_weight, mod);
  if (ln_bias.defined()) check_param(ln_bias, "fc1.layer_norm_bias", {hidden}, fc1_weight, mod);
  if (fc1_bias.defined()) check_param(fc1_bias, "fc1.bias", {fc1_out}, fc1_weight, mod);
  if (fc2_bias.defined()) check_param(fc2_bias, "fc2.bias", {hidden}, fc1_weight, mod);
  FP8DP_CHECK_ARG(x.defined(), mod, ": input is undefined");
  FP8DP_CHECK_ARG(x.dim() >= 1 && x.size(-1) == hidden, mod,
                  ": input must have hidden_size=", hidden, " as its last dimension, got shape ",
                  x.sizes());
  FP8DP_CHECK_ARG(x.scalar_type() == fc1_weight.scalar_type(), mod, ": input has dtype ",
                  x.scalar_type(), " but the parameters have dtype ", fc1_weight.scalar_type(),
                  " (cast the input to params_dtype)");
  FP8DP_CHECK_ARG(x.device() == fc1_weight.device(), mod, ": input is on ", x.device(),
                  " but the parameters are on ", fc1_weight.device());
  if (residual.defined()) check_residual(residual, x, hidden, mod);

  // C14: a recompute by activation checkpointing repeats the forward's fp8_autocast state.
  const bool recompute = in_backward_pass();
  const AutocastState ac = recompute && forward_autocast_ ? *forward_autocast_ : autocast_current();
  if (!recompute && !c10::InferenceMode::is_enabled()) forward_autocast_ = ac;
  const bool grad = at::GradMode::is_enabled();
  const bool need_wgrad1 = grad && fc1_weight.requires_grad();
  const bool need_wgrad2 = grad && fc2_weight.requires_grad();
  check_graph_capture(x.device(), mod, ac, grad, need_wgrad1 || need_wgrad2,
                      (need_wgrad1 && fc1_->grad_sink() != nullptr) ||
                          (need_wgrad2 && fc2_->grad_sink() != nullptr),
                      (need_wgrad1 && fc1_->config().delay_wgrad_compute) ||
                          (need_wgrad2 && fc2_->config().delay_wgrad_compute),
                      is_first_microbatch);
  // C9: a training forward's recipe without state joins the next update_fp8_scales check.
  if (ac.enabled && (need_wgrad1 || need_wgrad2) && !recompute) {
    registry_note_recipe(ac.recipe);
    if (GraphRecord* rec = active_graph_record()) rec->note_recipe(ac.recipe);
  }
  if (need_wgrad1) check_bound(*fc1_, fc1_weight, fc1_bias, mod, "fc1");
  if (need_wgrad2) check_bound(*fc2_, fc2_weight, fc2_bias, mod, "fc2");
  if (ac.enabled) {
    FP8DP_CHECK_ARG(!(ac.recipe.fprop_high_precision || ac.recipe.dgrad_high_precision ||
                      ac.recipe.wgrad_high_precision),
                    mod,
                    ": override_linear_precision other than (False, False, False) (GEMMs in high "
                    "precision) is not supported by LayerNormMLP, whose fused activation keeps "
                    "only the FP8 input of fc2; use LayerNormLinear + Linear for it");
    // FP8 GEMMs need multiples of 16 in every inner dimension: hidden (fc1 fprop, fc2 dgrad),
    // fc1's outputs (fc1 dgrad), ffn (fc2 fprop), tokens (both wgrads).
    FP8DP_CHECK_ARG(hidden % 16 == 0, mod, ": FP8 needs hidden_size to be a multiple of 16, got ",
                    hidden);
    FP8DP_CHECK_ARG(ffn % 16 == 0, mod, ": FP8 needs ffn_hidden_size to be a multiple of 16, got ",
                    ffn);
    const int64_t tokens = x.numel() / hidden;
    FP8DP_CHECK_ARG(!(need_wgrad1 || need_wgrad2) || tokens % 16 == 0, mod,
                    ": FP8 training needs the number of tokens (the product of the input's leading "
                    "dimensions) to be a multiple of 16, got ",
                    tokens, " from input shape ", x.sizes());
  }
  return apply_layernorm_mlp_function(x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight,
                                      fc2_bias, residual, cfg_, fc1_, fc2_, is_first_microbatch, ac,
                                      need_wgrad1, need_wgrad2);
}

}  // namespace fp8dp
