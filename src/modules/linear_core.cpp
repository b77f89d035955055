// LinearCore: argument checks of forward, FP8 casts per role, weight cache, fused-wgrad helpers,
// backward_dw (C2–C4). The autograd function itself is in linear_autograd.cpp.
#include "modules/linear_core.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include "common/check.h"
#include "common/tensor_checks.h"
#include "fp8/activation.h"
#include "fp8/scaling_registry.h"
#include "modules/block_dispatch.h"
#include "modules/capture_check.h"
#include "modules/graph_record.h"
#include "modules/linear_autograd.h"

namespace fp8dp {
namespace {

// Writes a gradient the way AccumulateGrad would: set when empty, else add in place. Used for the
// deferred results, each of which is the only copy of its micro-batch's gradient.
void accumulate_into_grad(const at::Tensor& param, const at::Tensor& g) {
  c10::NoGradGuard no_grad;
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) {
    grad = g;
  } else {
    grad.add_(g);
  }
}

void check_param(const at::Tensor& p, const char* name, std::vector<int64_t> shape,
                 const at::Tensor& weight, const std::string& mod) {
  FP8DP_CHECK_ARG(p.sizes() == at::IntArrayRef(shape), mod, ": parameter '", name,
                  "' must have shape ", at::IntArrayRef(shape), ", got ", p.sizes());
  FP8DP_CHECK_ARG(p.scalar_type() == weight.scalar_type() && p.device() == weight.device(), mod,
                  ": parameter '", name, "' must match 'weight' (", weight.scalar_type(), " on ",
                  weight.device(), "), got ", p.scalar_type(), " on ", p.device());
}

}  // namespace

void check_residual(const at::Tensor& residual, const at::Tensor& x, int64_t out_features,
                    const std::string& mod) {
  std::vector<int64_t> y_shape = x.sizes().vec();
  y_shape.back() = out_features;
  FP8DP_CHECK_ARG(residual.sizes() == at::IntArrayRef(y_shape), mod,
                  ": 'residual' must have the output's shape ", at::IntArrayRef(y_shape), ", got ",
                  residual.sizes());
  FP8DP_CHECK_ARG(residual.scalar_type() == x.scalar_type(), mod,
                  ": 'residual' must have the output's dtype ", x.scalar_type(), ", got ",
                  residual.scalar_type());
  FP8DP_CHECK_ARG(residual.device() == x.device(), mod,
                  ": 'residual' must be on the input's device ", x.device(), ", got ",
                  residual.device());
}

// The scaling state's default identity names the module's class and shape (C9); DDP renames it.
LinearCore::LinearCore(LinearConfig cfg) : cfg_(std::move(cfg)), scaling_(cfg_.name) {
  FP8DP_CHECK_ARG(cfg_.in_features > 0, cfg_.name, ": in_features must be > 0, got ",
                  cfg_.in_features);
  FP8DP_CHECK_ARG(cfg_.out_features > 0, cfg_.name, ": out_features must be > 0, got ",
                  cfg_.out_features);
  FP8DP_CHECK_ARG(cfg_.norm.eps > 0.0f, cfg_.name, ": eps must be > 0, got ", cfg_.norm.eps);
  FP8DP_CHECK_ARG(cfg_.qkv_heads >= 0, cfg_.name, ": qkv_heads must be >= 0, got ", cfg_.qkv_heads);
  FP8DP_CHECK_ARG(cfg_.qkv_heads == 0 || cfg_.out_features % (3 * cfg_.qkv_heads) == 0, cfg_.name,
                  ": qkv_heads=", cfg_.qkv_heads,
                  " needs out_features divisible by 3 * qkv_heads = ", 3 * cfg_.qkv_heads,
                  ", got out_features=", cfg_.out_features);
  FP8DP_CHECK_ARG(!cfg_.return_layernorm_input || cfg_.layernorm, cfg_.name,
                  ": return_layernorm_input needs a norm (LayerNormLinear)");
  if (cfg_.activation) {
    // q, k and v are views of the output, which an activation would replace.
    FP8DP_CHECK_ARG(cfg_.qkv_heads == 0, cfg_.name,
                    ": activation is not supported with qkv_heads (the output is q, k, v)");
    FP8DP_CHECK_ARG(*cfg_.activation != Activation::kSwiglu || cfg_.out_features % 2 == 0,
                    cfg_.name, ": activation 'swiglu' needs an even out_features ([gate | up]), ",
                    "got out_features=", cfg_.out_features);
  }
  if (cfg_.input_activation) {
    // The norm's output is cast in the norm's own pass, and an output activation would need two
    // saved pre-activations of different shapes: neither combination has a user yet.
    FP8DP_CHECK_ARG(!cfg_.layernorm, cfg_.name,
                    ": input_activation is not supported with a norm (LayerNormLinear)");
    FP8DP_CHECK_ARG(!cfg_.activation, cfg_.name,
                    ": input_activation and activation together are not supported");
  }
  set_weight_attrs({});
}

void LinearCore::set_weight_attrs(WeightAttrs attrs) {
  if (!attrs.main_grad) attrs.main_grad = [] { return at::Tensor(); };
  if (!attrs.zero_out_wgrad) attrs.zero_out_wgrad = [] { return false; };
  if (!attrs.mark_grad_added_to_main_grad) attrs.mark_grad_added_to_main_grad = [] {};
  if (!attrs.tensor_hooks) attrs.tensor_hooks = [](const at::Tensor&) { return true; };
  attrs_ = std::move(attrs);
}

Quantized LinearCore::cast(const at::Tensor& x, Role role, const AutocastState& ac,
                           QuantizeOptions opts) {
  const Format f = role == Role::kGradOutput ? ac.recipe.bwd_format : ac.recipe.fwd_format;
  if (ac.recipe.kind == RecipeKind::kCurrent) return cast_current(x, f, ac.recipe.margin, opts);
  if (ac.recipe.kind == RecipeKind::kBlock) return cast_block(x, role, ac.recipe, opts);
  return scaling_.cast(x, role, ac.recipe, opts);
}

Quantized LinearCore::cast_parts(at::TensorList parts, Role role, const AutocastState& ac,
                                 QuantizeOptions opts) {
  if (ac.recipe.kind == RecipeKind::kDelayed)
    return scaling_.cast_parts(parts, role, ac.recipe, opts);
  return cast(join_parts(parts), role, ac, opts);
}

// Delayed scaling casts in one pass with the known scale and records the amax in the role's
// history row; current scaling needs the amax first (one pass that writes nothing). Block scaling
// has no fused kernel: the activation (or its derivative) in the activation dtype, then the role's
// block cast (1x128 tiles, both orientations), as the unfused layers cast it: the same bytes.
Quantized LinearCore::cast_activation(const at::Tensor& da, const at::Tensor& h, Activation act,
                                      Role role, const AutocastState& ac, QuantizeOptions opts) {
  if (ac.recipe.kind == RecipeKind::kBlock) {
    const at::Tensor hp =
        da.defined() ? activation_backward(da, h, act) : activation_forward(h, act);
    return cast(hp, role, ac, opts);
  }
  const Format fmt = role == Role::kGradOutput ? ac.recipe.bwd_format : ac.recipe.fwd_format;
  if (ac.recipe.kind == RecipeKind::kCurrent) {
    const at::Tensor s = current_scale(activation_amax(da, h, act), fmt, ac.recipe.margin);
    return activation_cast(da, h, act, s, fmt, opts);
  }
  // Elements cast: act(h) forward (half of h's after SwiGLU), dh (h's shape) backward.
  const int64_t numel =
      da.defined() ? h.numel() : (act == Activation::kSwiglu ? h.numel() / 2 : h.numel());
  const at::Tensor s =
      scaling_.prepare_scale(role, ac.recipe, h, [&] { return activation_amax(da, h, act); });
  return activation_cast(da, h, act, s, fmt, opts, scaling_.amax_slot(role, numel));
}

Quantized LinearCore::weight_fp8(const at::Tensor& weight, const AutocastState& ac,
                                 std::optional<bool> is_first_microbatch) {
  // Reuse only when asked (is_first_microbatch=False) and the cache was made from this very weight
  // as it is now (C8: a reused FP8 weight is never stale): same storage and shape, same format,
  // and no write since (the version counter: optimizer steps write in place; the distributed
  // optimizer's all-gather writes through the buffer and bumps it too, see GradSync).
  // True or None always refresh it.
  const bool reuse =
      is_first_microbatch.has_value() && !*is_first_microbatch && weight_cache_.data.defined() &&
      weight_cache_format_ == ac.recipe.fwd_format && weight_cache_kind_ == ac.recipe.kind &&
      weight_cache_.data.sizes() == weight.sizes() &&
      weight_cache_.data.device() == weight.device() && weight_cache_ptr_ == weight.data_ptr() &&
      weight_cache_version_ == static_cast<uint32_t>(weight._version());
  if (!reuse && c10::InferenceMode::is_enabled()) {
    // Inference leaves training state alone (ScalingState::prepare_scale), the cache included:
    // it would hold inference tensors, cast with a scale that training may not have chosen (the
    // weight's own amax when no step set one yet). No transpose: nothing runs backward.
    return cast(weight.detach(), Role::kWeight, ac, QuantizeOptions{true, false, false});
  }
  if (!reuse) {
    weight_cache_ = cast(weight.detach(), Role::kWeight, ac, QuantizeOptions{true, true, false});
    weight_cache_format_ = ac.recipe.fwd_format;
    weight_cache_kind_ = ac.recipe.kind;  // per-tensor and block scales do not mix in one GEMM
    weight_cache_ptr_ = weight.data_ptr();
    weight_cache_version_ = static_cast<uint32_t>(weight._version());
  }
  return weight_cache_;
}

at::Tensor LinearCore::main_grad_for(const at::Tensor& weight) {
  at::Tensor mg = attrs_.main_grad();
  FP8DP_CHECK(mg.defined(), cfg_.name,
              ": fuse_wgrad_accumulation=True needs 'main_grad' on parameter 'weight' (set by "
              "fp8dp.DistributedDataParallel, or by hand), but parameter 'weight' has none");
  FP8DP_CHECK(mg.sizes() == weight.sizes() && mg.device() == weight.device(), cfg_.name,
              ": parameter 'weight' has main_grad of shape ", mg.sizes(), " on ", mg.device(),
              ", expected ", weight.sizes(), " on ", weight.device());
  return mg;
}

at::Tensor LinearCore::dummy_wgrad(const at::Tensor& weight) {
  // Autograd needs a gradient for the weight so that its AccumulateGrad hooks fire (C2 b); its
  // values are never used (grad_added_to_main_grad says so). A fresh tensor each backward, which
  // nothing else references, so AccumulateGrad takes it as `.grad` as it is: a cached one would be
  // copied, a full pass over the weight's bytes per micro-batch (new_empty_strided + copy_ of the
  // weight's shape among the backward's ops, test_fused_wgrad_stand_in.py; TE hands out a fresh
  // one too). The allocation comes from the caching allocator, and empty writes nothing;
  // zero_out_wgrad asks for zeros.
  return attrs_.zero_out_wgrad() ? at::zeros(weight.sizes(), weight.options())
                                 : at::empty(weight.sizes(), weight.options());
}

void LinearCore::mark_grad_added_to_main_grad() { attrs_.mark_grad_added_to_main_grad(); }

bool LinearCore::has_tensor_hooks(const at::Tensor& param) {
  // Autograd's own list first: almost always empty, and then no call into Python.
  return has_tensor_pre_hooks(param) && attrs_.tensor_hooks(param);
}

bool LinearCore::need_backward_dw() {
  drop_stale_wgrads();
  return cfg_.delay_wgrad_compute && !store_.empty();
}

void LinearCore::drop_stale_wgrads() {
  while (!store_.empty() && store_.front().sink &&
         store_.front().weight_token.iteration != store_.front().sink->iteration())
    store_.pop();
}

std::shared_ptr<GradSink> LinearCore::grad_sink() const {
  std::shared_ptr<GradSink> sink = sink_.lock();
  if (sink)
    if (GraphRecord* rec = active_graph_record()) return rec->sink_for(sink);
  return sink;
}

void LinearCore::warm_queued_wgrads() {
  while (!store_.empty()) run_wgrad(store_.pop());
}

void LinearCore::bind_grad_sink(const std::shared_ptr<GradSink>& sink, int64_t weight, int64_t bias,
                                std::string name) {
  FP8DP_CHECK_ARG(sink, cfg_.name, ": bind_grad_sink needs a sink, got None");
  FP8DP_CHECK_ARG(store_.empty(), cfg_.name, ": ", store_.size(),
                  " weight gradient(s) are still queued for backward_dw(); run them before "
                  "wrapping the module in DistributedDataParallel");
  sink_ = sink;
  sink_weight_ = weight;
  sink_bias_ = bias;
  sink_name_ = std::move(name);
}

void LinearCore::register_wgrad_hook(std::function<void()> hook) {
  FP8DP_CHECK_ARG(static_cast<bool>(hook), cfg_.name,
                  ": register_wgrad_accumulation_and_reduce_hooks needs a callable");
  hooks_.push_back(std::move(hook));
}

void LinearCore::backward_dw() {
  FP8DP_CHECK(cfg_.delay_wgrad_compute, cfg_.name,
              ".backward_dw(): the module was built with delay_wgrad_compute=False, so its "
              "weight gradient is computed in backward and nothing is ever queued");
  drop_stale_wgrads();
  FP8DP_CHECK(!store_.empty(), cfg_.name,
              ".backward_dw(): no weight-gradient computation is queued (call it once after each "
              "backward that reached this module)");
  // Bound to DistributedDataParallel: ask the sink before the task leaves the queue and before a
  // fused GEMM writes into main_grad, so that a refusal (C11: its bucket already launched or
  // reduced) leaves the queue and main_grad as they were, and the call can be repeated.
  if (const WgradTask& next = store_.front(); next.sink) {
    next.sink->check_accepting(next.sink_weight, Route::kDelayed, next.weight_token.counted);
    if (next.dy.defined() && next.bias.defined() && next.sink_bias >= 0)
      next.sink->check_accepting(next.sink_bias, Route::kDelayed, next.bias_token.counted);
  }
  const WgradTask task = store_.pop();
  const WgradResult r = run_wgrad(task);
  if (task.sink) {
    // Bound to DistributedDataParallel: straight into main_grad (fused: already there), counted
    // against the micro-batch whose forward announced it.
    task.sink->deliver(task.sink_weight, r.dweight, Route::kDelayed, task.weight_token);
    if (r.dbias.defined() && task.sink_bias >= 0)
      task.sink->deliver(task.sink_bias, r.dbias, Route::kDelayed, task.bias_token);
    for (const auto& hook : hooks_) hook();
    return;
  }
  if (r.dweight.defined()) accumulate_into_grad(task.weight, r.dweight);
  // C4, the guarded backfill: only a bias gradient that the deferred GEMM itself produced is
  // written (the high-precision route). In FP8 mode the bias gradient already went to autograd in
  // backward, and an external consumer may have moved it into main_grad and cleared bias.grad:
  // touching bias.grad here would either read a missing tensor or count the gradient twice.
  // The deferred high-precision bias gradient is that micro-batch's only copy, so like the weight
  // gradient it accumulates into a bias.grad left by an earlier micro-batch instead of being lost.
  if (r.dbias.defined() && task.bias.defined()) accumulate_into_grad(task.bias, r.dbias);
  for (const auto& hook : hooks_) hook();
}

std::vector<at::Tensor> LinearCore::forward(const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& bias, const at::Tensor& ln_weight,
                                            const at::Tensor& ln_bias,
                                            std::optional<bool> is_first_microbatch,
                                            const at::Tensor& residual) {
  const std::string& mod = cfg_.name;
  const int64_t in = cfg_.in_features, out = cfg_.out_features;
  FP8DP_CHECK_ARG(weight.defined(), mod, ": parameter 'weight' is undefined");
  const at::ScalarType dt = weight.scalar_type();
  to_high_precision_dtype(dt, mod, "parameter 'weight'");
  check_param(weight, "weight", {out, in}, weight, mod);
  if (bias.defined()) check_param(bias, "bias", {out}, weight, mod);
  if (cfg_.layernorm) {
    FP8DP_CHECK_ARG(ln_weight.defined(), mod, ": parameter 'layer_norm_weight' is undefined");
    check_param(ln_weight, "layer_norm_weight", {in}, weight, mod);
    if (ln_bias.defined()) check_param(ln_bias, "layer_norm_bias", {in}, weight, mod);
  }
  FP8DP_CHECK_ARG(x.defined(), mod, ": input is undefined");
  const bool gate_up = cfg_.input_activation == Activation::kSwiglu;  // [gate | up] input
  FP8DP_CHECK_ARG(x.dim() >= 1 && x.size(-1) == cfg_.input_features(), mod, ": input must have ",
                  gate_up ? "2 * in_features=" : "in_features=", cfg_.input_features(),
                  " as its last dimension",
                  gate_up ? " (input_activation='swiglu': [gate | up])" : "", ", got shape ",
                  x.sizes());
  FP8DP_CHECK_ARG(x.scalar_type() == dt, mod, ": input has dtype ", x.scalar_type(),
                  " but the parameters have dtype ", dt, " (cast the input to params_dtype)");
  FP8DP_CHECK_ARG(x.device() == weight.device(), mod, ": input is on ", x.device(),
                  " but the parameters are on ", weight.device());
  if (residual.defined()) {
    // q, k and v are three outputs, each with its own gradient: no one tensor to add to.
    FP8DP_CHECK_ARG(cfg_.qkv_heads == 0, mod,
                    ": 'residual' is not supported with qkv_heads (the output is q, k, v)");
    // The epilogue adds the residual to the GEMM's result, before an activation would see it.
    FP8DP_CHECK_ARG(!cfg_.activation, mod, ": 'residual' is not supported with activation='",
                    activation_name(*cfg_.activation), "'");
    check_residual(residual, x, out, mod);
  }

  // C14: activation checkpointing runs this forward again inside backward, where the
  // fp8_autocast that was open at the original forward usually is not (backward runs outside it,
  // and torch's checkpoint restores only torch's own autocast). The recompute must repeat the
  // forward as it ran, or it saves other tensors (high precision instead of FP8) and backward
  // computes other gradients: it takes the state of this layer's latest forward outside backward,
  // which within one iteration is the one it repeats.
  const bool recompute = in_backward_pass();
  const AutocastState ac = recompute && forward_autocast_ ? *forward_autocast_ : autocast_current();
  if (!recompute && !c10::InferenceMode::is_enabled()) forward_autocast_ = ac;
  const bool need_wgrad = at::GradMode::is_enabled() && weight.requires_grad();
  check_graph_capture(x.device(), mod, ac, at::GradMode::is_enabled(), need_wgrad,
                      grad_sink() != nullptr, cfg_.delay_wgrad_compute, is_first_microbatch);
  // C9: a training forward's recipe without state joins the next update_fp8_scales check.
  if (ac.enabled && need_wgrad && !recompute) {
    registry_note_recipe(ac.recipe);
    if (GraphRecord* rec = active_graph_record()) rec->note_recipe(ac.recipe);
  }
  if (need_wgrad) {
    if (const auto sink = grad_sink()) {
      // The sink knows the parameter it was bound to; a weight re-assigned (or unfrozen) after
      // wrapping would have its gradient delivered into another parameter's main_grad.
      FP8DP_CHECK_ARG(sink_weight_ >= 0 && sink->param(sink_weight_).unsafeGetTensorImpl() ==
                                               weight.unsafeGetTensorImpl(),
                      mod,
                      ": parameter 'weight' is not the one DistributedDataParallel manages for "
                      "this module (re-assigned or unfrozen after wrapping?): tie, freeze and "
                      "unfreeze parameters before wrapping the model");
      FP8DP_CHECK_ARG(!bias.defined() || !bias.requires_grad() ||
                          (sink_bias_ >= 0 && sink->param(sink_bias_).unsafeGetTensorImpl() ==
                                                  bias.unsafeGetTensorImpl()),
                      mod,
                      ": parameter 'bias' is not the one DistributedDataParallel manages for "
                      "this module (re-assigned or unfrozen after wrapping?)");
    }
  }
  if (ac.enabled) {
    // FP8 GEMMs need multiples of 16 in every inner dimension (fprop: in, dgrad: out, wgrad:
    // tokens); the same rule on every device, checked before any work is done.
    FP8DP_CHECK_ARG(in % 16 == 0, mod, ": FP8 needs in_features to be a multiple of 16, got ", in);
    FP8DP_CHECK_ARG(out % 16 == 0, mod, ": FP8 needs out_features to be a multiple of 16, got ",
                    out);
    const int64_t tokens = x.numel() / cfg_.input_features();
    FP8DP_CHECK_ARG(!need_wgrad || tokens % 16 == 0, mod,
                    ": FP8 training needs the number of tokens (the product of the input's leading "
                    "dimensions) to be a multiple of 16, got ",
                    tokens, " from input shape ", x.sizes());
  }
  return apply_linear_function(x, weight, bias, ln_weight, ln_bias, shared_from_this(),
                               is_first_microbatch, ac, need_wgrad, residual);
}

}  // namespace fp8dp
