// The C++ core of fp8dp.Linear and fp8dp.LayerNormLinear: FP8 state, weight cache, wgrad routing
// (C2), the delayed weight-gradient queue (C3) and backward_dw with the guarded bias backfill (C4).
// The Python modules own the nn.Parameters and call forward() / backward_dw() on this object.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fp8/activation_math.h"
#include "fp8/recipe.h"
#include "fp8/scaling_state.h"
#include "grad_buffer/grad_sink.h"
#include "modules/wgrad_store.h"
#include "norm/norm.h"

namespace fp8dp {

struct LinearConfig {
  std::string name;  // used in error messages, e.g. "Linear(in_features=32, out_features=64)"
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool fuse_wgrad_accumulation = false;
  bool delay_wgrad_compute = false;
  bool layernorm = false;  // LayerNormLinear: normalize the input first
  NormConfig norm;
  bool return_layernorm_output = false;
  // LayerNormLinear: forward also returns its input x (last), for the block's residual path
  // (`proj(attn, residual=x)` in a pre-norm block). The gradient that path sends back reaches this
  // layer's backward and is added to dx inside the norm's backward kernel (norm_backward's
  // dx_add), where autograd would otherwise add the two gradients of x in a kernel of its own.
  bool return_layernorm_input = false;
  // > 0: the output is a fused QKV projection, [q | k | v] along out_features, each [qkv_heads,
  // head_dim]; forward returns q, k, v as views ([..., qkv_heads, head_dim]) instead of y, so that
  // autograd hands backward their three gradients as attention produced them (an unbind after
  // the call would stack them into one tensor first: a copy the size of y, which the FP8 cast
  // of grad_output can read in place instead, cast_parts).
  int64_t qkv_heads = 0;
  // The layer's output goes through this activation (an MLP's fc1 among separate modules):
  // forward returns act(x Wᵀ + b), and backward casts grad_output's activation derivative for the
  // GEMMs in one pass (activation_cast) where a separate activation's backward would write it in
  // high precision and the cast read it again. SwiGLU halves the columns ([gate | up]).
  std::optional<Activation> activation;
  // The layer's input goes through this activation first (an MLP's fc2 among separate modules):
  // forward computes act(x) Wᵀ + b, the activation applied inside the FP8 cast of the GEMM's input
  // (activation_cast) where a separate activation would write act(x) in high precision for the
  // cast to read again; backward returns dgrad · act'(x). Linear only (not with a norm or with
  // `activation`). SwiGLU's input has 2 * in_features columns ([gate | up]).
  std::optional<Activation> input_activation;

  // The columns forward returns: out_features, or half of them after SwiGLU.
  int64_t output_features() const {
    return activation == Activation::kSwiglu ? out_features / 2 : out_features;
  }
  // The columns forward takes: in_features, or twice them before SwiGLU.
  int64_t input_features() const {
    return input_activation == Activation::kSwiglu ? 2 * in_features : in_features;
  }
};

// Attributes that live on the Python weight Parameter: the bindings fill these with callables so
// that the C++ core reads and writes them where C2 says (defaults: none of them is set).
struct WeightAttrs {
  std::function<at::Tensor()> main_grad;  // undefined tensor when the attribute is missing
  std::function<bool()> zero_out_wgrad;   // weight.zero_out_wgrad, default False
  std::function<void()> mark_grad_added_to_main_grad;  // weight.grad_added_to_main_grad = True
  // Whether a parameter that has autograd pre-hooks has a live tensor hook (p.register_hook):
  // Python keeps one pre-hook per tensor and empties its dict when the hooks are removed.
  // Default: every pre-hook counts.
  std::function<bool(const at::Tensor&)> tensor_hooks;
};

// The residual of a layer's forward (Linear, LayerNormMLP): y's shape (x's with out_features
// last), x's dtype (the output's) and device; ValueError naming 'residual' otherwise.
void check_residual(const at::Tensor& residual, const at::Tensor& x, int64_t out_features,
                    const std::string& mod);

class LinearCore : public std::enable_shared_from_this<LinearCore> {
 public:
  explicit LinearCore(LinearConfig cfg);

  const LinearConfig& config() const { return cfg_; }
  void set_weight_attrs(WeightAttrs attrs);

  // x: [..., input_features()] in the parameters' dtype and device. ln_weight / ln_bias only for
  // LayerNormLinear (ln_bias undefined for RMSNorm), bias optional. Returns {y} (q, k, v with
  // qkv_heads), then ln_out with return_layernorm_output, then x with return_layernorm_input.
  // Differentiable through a C++ autograd function.
  // is_first_microbatch: nullopt or true refresh the FP8 weight cache, false reuses it. It never
  // touches a gradient (C8): the fused wgrad always accumulates into main_grad.
  // residual: optional, y's shape, dtype and device; y = layer(x) + residual, added in the fprop
  // GEMM's epilogue and rounded once (not with qkv_heads). Its gradient is y's gradient itself.
  std::vector<at::Tensor> forward(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& bias, const at::Tensor& ln_weight,
                                  const at::Tensor& ln_bias,
                                  std::optional<bool> is_first_microbatch,
                                  const at::Tensor& residual = at::Tensor());

  // C3/C4: pops the oldest queued wgrad, runs it, writes weight.grad (or main_grad when fused),
  // backfills the bias gradient only when the deferred GEMM produced one, then runs every hook.
  void backward_dw();
  bool need_backward_dw();  // delay_wgrad_compute and at least one (not stale) wgrad queued
  int64_t queued_wgrads() {
    drop_stale_wgrads();
    return store_.size();
  }
  void register_wgrad_hook(std::function<void()> hook);

  // DistributedDataParallel hands its gradients over here (weight and bias: their indices in the
  // sink, -1 when it does not manage them). From then on no gradient of this module takes a detour
  // through autograd: the fused GEMM and backward_dw() deliver to the sink directly, no dummy
  // gradient is returned (so a plain-torch use of the same weight reaches the DDP hook with its
  // own gradient only, C8) and grad_added_to_main_grad is not set (p.grad never holds a stand-in).
  // The sink is held weakly: a dropped DDP leaves the module unbound.
  // name: the module's name in the wrapped model (for errors that name it).
  void bind_grad_sink(const std::shared_ptr<GradSink>& sink, int64_t weight, int64_t bias,
                      std::string name);
  const std::string& sink_name() const { return sink_name_; }
  // While make_graphed_callables warms up or captures (a GraphRecord is active), the record's
  // RecordingSink in front of the real one (modules/graph_sink.h).
  std::shared_ptr<GradSink> grad_sink() const;
  int64_t sink_weight() const { return sink_weight_; }
  int64_t sink_bias() const { return sink_bias_; }

  ScalingState& scaling() { return scaling_; }

  // Used by the autograd function (linear_autograd.cpp).
  Quantized cast(const at::Tensor& x, Role role, const AutocastState& ac, QuantizeOptions opts);
  // The same cast of x given as column blocks (quantize_parts, fp8/cast.h: x = the parts' 2-D
  // views side by side): delayed scaling reads them where they lie; current and block scaling
  // cast the joined matrix (their amax pass and tiles read a plain one).
  Quantized cast_parts(at::TensorList parts, Role role, const AutocastState& ac,
                       QuantizeOptions opts);
  // The FP8 cast of act(h) (forward, da undefined) or of its derivative da · act'(h) (backward) for
  // `role`, in one pass that writes no high-precision result (bytes equal to cast() of the
  // unfused result, activation.h).
  Quantized cast_activation(const at::Tensor& da, const at::Tensor& h, Activation act, Role role,
                            const AutocastState& ac, QuantizeOptions opts);
  Quantized weight_fp8(const at::Tensor& weight, const AutocastState& ac,
                       std::optional<bool> is_first_microbatch);
  at::Tensor main_grad_for(const at::Tensor& weight);
  at::Tensor dummy_wgrad(const at::Tensor& weight);
  void mark_grad_added_to_main_grad();
  // A live tensor hook (param.register_hook) on the weight or the bias (WeightAttrs::tensor_hooks).
  bool has_tensor_hooks(const at::Tensor& param);
  void enqueue(WgradTask task) { store_.push(std::move(task)); }
  // make_graphed_callables' warm-up: runs every queued weight-gradient GEMM (which builds its
  // GEMM plan on the capture stream) and drops it, delivering nothing and running no hook (the
  // caller restores main_grad, which a fused GEMM writes).
  void warm_queued_wgrads();
  // Forgets the cached FP8 weight: after a CUDA graph capture it lives in the graph's memory pool,
  // which replays overwrite, so no eager forward may reuse it.
  void drop_weight_cache() {
    weight_cache_ = Quantized();
    weight_cache_ptr_ = nullptr;
  }

 private:
  LinearConfig cfg_;
  WeightAttrs attrs_;
  ScalingState scaling_;
  Quantized weight_cache_;  // FP8 weight and its transpose, kept across micro-batches
  Format weight_cache_format_ = Format::kE4M3;
  RecipeKind weight_cache_kind_ = RecipeKind::kDelayed;
  const void* weight_cache_ptr_ = nullptr;  // the weight the cache was made from, and its version
  uint32_t weight_cache_version_ = 0;
  WeightGradStore store_;
  // The fp8_autocast state of the latest forward outside backward, which a recompute by activation
  // checkpointing repeats (forward()).
  std::optional<AutocastState> forward_autocast_;
  std::vector<std::function<void()>> hooks_;
  std::weak_ptr<GradSink> sink_;
  int64_t sink_weight_ = -1, sink_bias_ = -1;
  std::string sink_name_;

  // Drops queued wgrads of an iteration the sink has abandoned (zero_grad_buffer() or a failed
  // finish_grad_sync() after a forgotten backward_dw()): delivering them would add a stale
  // micro-batch to the new iteration. The sink already raised for them.
  void drop_stale_wgrads();
};

}  // namespace fp8dp
