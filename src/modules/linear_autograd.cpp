// The autograd function of Linear / LayerNormLinear: forward (norm + FP8 casts + fprop GEMM, an
// optional activation) and backward (grad_output cast with the activation's derivative and the
// eager bias gradient, dgrad GEMM, norm backward, and the weight gradient computed now or queued
// for backward_dw). Only this file sees autograd headers.
//
// C14: every activation backward needs goes through ctx->save_for_backward, so saved-tensor hooks
// see it: activation checkpointing drops it after forward and recomputes it in backward, and
// save_on_cpu offloads it. The context's capsule keeps only what is no activation: settings, the
// parameters themselves (whose .grad backward_dw writes, so they must stay the very objects) and
// main_grad (the fused GEMM's destination: packing it would accumulate into a copy).
#include "modules/linear_autograd.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <array>

#include "common/check.h"
#include "fp8/activation.h"
#include "gemm/gemm.h"
#include "modules/linear_core.h"
#include "modules/sink_use.h"
#include "modules/wgrad_route.h"

namespace fp8dp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The slots of ctx->save_for_backward, always all of them (undefined where absent), so that a
// recompute saves the same list as the forward it repeats.
enum Saved : size_t {
  // wgrad operand b: FP8 xᵀ [in, tokens] + scale_inv, or the high-precision GEMM input [tokens, in]
  kInT,
  kInScaleInv,
  kInHp,
  // dgrad operand b: FP8 Wᵀ [in, out] + scale_inv, or the high-precision weight [out, in]
  kWT,
  kWScaleInv,
  kWHp,
  // LayerNormLinear: the norm's input and statistics, and its weight
  kX2d,
  kMu,
  kRsigma,
  kLnWeight,
  // With an activation: its input, the GEMM's output [tokens, out] (the derivative reads it)
  kPreAct,
  // With an input activation: its input, x [tokens, input_features] (the derivative reads it)
  kInPreAct,
  kNumSaved
};

// What backward needs besides the saved activations (held in the autograd context as a capsule).
struct LinearCtx : torch::CustomClassHolder, SinkUse {
  std::shared_ptr<LinearCore> core;
  AutocastState ac;
  std::vector<int64_t> x_shape;
  at::ScalarType act_dtype = at::kFloat;
  at::Tensor weight, bias, main_grad;  // parameters (identity, not activations) and main_grad
  // (SinkUse: DistributedDataParallel's gradient sink when the module is bound to one, and what
  // this use announced to its ledger.)
  bool has_ln_bias = false;
  bool released = false;
  // Autograd numbers only the inputs that are defined: edge[i] of input i (x, weight, bias,
  // ln_weight, ln_bias, residual), or -1 when that input was absent.
  std::array<int, 6> edge{};

  bool needs_grad(AutogradContext* ctx, int input) const {
    return edge[input] >= 0 && ctx->needs_input_grad(static_cast<size_t>(edge[input]));
  }

  // The ledger learns what this use will deliver to the sink itself (the rest, through autograd,
  // DDP's forward announces from the graph): the weight gradient when fused or delayed, the bias
  // gradient when the deferred GEMM makes it (delayed, not FP8).
  void announce(const LinearConfig& cfg) { announce_use(*this, cfg, ac.enabled, bias); }

  void release() {
    for (at::Tensor* t : {&weight, &bias, &main_grad}) *t = at::Tensor();
    core.reset();
    sink.reset();
    released = true;
  }
};

// ---- forward, step by step ----

// The forward's tensor inputs (undefined = absent). residual: [..., out], y's shape and dtype,
// added in the fprop GEMM's epilogue.
struct ForwardInputs {
  at::Tensor x, weight, bias, ln_weight, ln_bias, residual;
};

// The fprop GEMM's input operand: FP8 (q) or high precision (hp), the norm's output for
// return_layernorm_output, and under FP8 the unquantized input of the GEMMs that the recipe runs
// in high precision (fprop, wgrad: recipe.h's *_high_precision).
struct GemmInput {
  Quantized q;
  at::Tensor hp;
  at::Tensor ln_out;
  at::Tensor hp_under_fp8;
};

// Which GEMMs of an FP8 layer run in high precision (override_linear_precision, recipe.h). An FP8
// cast whose result no GEMM reads still runs: it records the amax.
struct HighPrecision {
  bool fprop = false, dgrad = false, wgrad = false;
  bool input() const { return fprop || wgrad; }  // a GEMM needs x (or norm(x)) unquantized
};

HighPrecision high_precision(const AutocastState& ac, bool need_wgrad) {
  if (!ac.enabled) return {};
  return {ac.recipe.fprop_high_precision, ac.recipe.dgrad_high_precision,
          need_wgrad && ac.recipe.wgrad_high_precision};
}

// What backward needs besides the saved activations: settings, the parameters and the numbering
// of autograd's edges.
c10::intrusive_ptr<LinearCtx> make_context(const ForwardInputs& in,
                                           std::shared_ptr<LinearCore> core,
                                           const AutocastState& ac) {
  auto c = c10::make_intrusive<LinearCtx>();
  int next = 0;
  const at::Tensor* t[] = {&in.x, &in.weight, &in.bias, &in.ln_weight, &in.ln_bias, &in.residual};
  for (int i = 0; i < 6; ++i) c->edge[i] = t[i]->defined() ? next++ : -1;
  c->core = std::move(core);
  c->ac = ac;
  c->x_shape = in.x.sizes().vec();
  c->act_dtype = in.x.scalar_type();
  c->weight = in.weight;
  c->bias = in.bias;
  return c;
}

// LayerNormLinear: normalize x2d and, with FP8, cast the result; saves what the norm's backward
// needs.
GemmInput norm_and_cast_input(LinearCtx& c, const ForwardInputs& in, const at::Tensor& x2d,
                              bool need_wgrad, variable_list& saved) {
  LinearCore& core = *c.core;
  const LinearConfig& cfg = core.config();
  const AutocastState& ac = c.ac;
  const Format fmt = ac.recipe.fwd_format;
  const HighPrecision hp = high_precision(ac, need_wgrad);
  GemmInput gin;
  NormForward nf;
  if (ac.enabled && ac.recipe.kind == RecipeKind::kDelayed) {
    // The scale is known before the pass, so the norm writes FP8 directly.
    at::Tensor s = core.scaling().prepare_scale(Role::kInput, ac.recipe, x2d, [&] {
      return norm_forward(x2d, in.ln_weight, in.ln_bias, cfg.norm, false, {}, fmt).amax;
    });
    nf = norm_forward(x2d, in.ln_weight, in.ln_bias, cfg.norm,
                      cfg.return_layernorm_output || hp.input(), s, fmt,
                      core.scaling().amax_slot(Role::kInput, x2d.numel()));
    gin.q.data = nf.out_fp8;
    gin.q.scale_inv = nf.scale_inv;
    if (need_wgrad && !hp.wgrad) gin.q.data_t = transpose_fp8(nf.out_fp8);
  } else {
    // Current scaling needs the output's amax before the cast: norm, then one cast pass.
    nf = norm_forward(x2d, in.ln_weight, in.ln_bias, cfg.norm, true, {}, fmt);
    if (ac.enabled) {
      gin.q = core.cast(nf.out, Role::kInput, ac,
                        QuantizeOptions{true, need_wgrad && !hp.wgrad, false});
    } else {
      gin.hp = nf.out;
    }
  }
  gin.ln_out = nf.out;
  if (hp.input()) gin.hp_under_fp8 = nf.out;
  saved[kX2d] = x2d;
  saved[kMu] = nf.mu;
  saved[kRsigma] = nf.rsigma;
  saved[kLnWeight] = in.ln_weight.detach();
  c.has_ln_bias = in.ln_bias.defined();
  return gin;
}

// The fprop GEMM's input: the (normalized or activated) input, cast to FP8 under fp8_autocast
// (with its transpose when a weight gradient will be wanted). With an input activation the cast
// applies it in its pass, and x is saved for the derivative when x wants a gradient.
GemmInput prepare_gemm_input(LinearCtx& c, const ForwardInputs& in, const at::Tensor& x2d,
                             bool need_wgrad, variable_list& saved) {
  LinearCore& core = *c.core;
  if (core.config().layernorm) return norm_and_cast_input(c, in, x2d, need_wgrad, saved);
  const std::optional<Activation>& act = core.config().input_activation;
  if (act && in.x.requires_grad()) saved[kInPreAct] = x2d;  // (grad mode is off in here)
  GemmInput gin;
  if (c.ac.enabled) {
    const HighPrecision hp = high_precision(c.ac, need_wgrad);
    const QuantizeOptions opts{true, need_wgrad && !hp.wgrad, false};
    gin.q = act ? core.cast_activation(at::Tensor(), x2d, *act, Role::kInput, c.ac, opts)
                : core.cast(x2d, Role::kInput, c.ac, opts);
    if (hp.input()) gin.hp_under_fp8 = act ? activation_forward(x2d, *act) : x2d;
  } else {
    gin.hp = act ? activation_forward(x2d, *act) : x2d;
  }
  return gin;
}

// y = gemm_in · Wᵀ (+ bias) (+ residual), the weight cast to FP8 (or taken from the cache) under
// fp8_autocast; saves the operands of dgrad (W) and wgrad (x) in the form backward's GEMMs take
// them. The residual is the GEMM epilogue's C (gemm.h): one pass over y instead of a separate add
// kernel, and nothing saved, since y + residual passes its gradient to the residual unchanged.
at::Tensor fprop_gemm(const LinearCtx& c, const ForwardInputs& in, const GemmInput& gin,
                      std::optional<bool> first, bool need_wgrad, variable_list& saved) {
  LinearCore& core = *c.core;
  GemmArgs g;
  g.bias = in.bias.defined() ? in.bias.detach() : in.bias;
  if (in.residual.defined()) g.residual = residual_2d(in.residual, core.config().out_features);
  g.out_dtype = in.x.scalar_type();
  g.use_split_accumulator = c.ac.recipe.split_accumulator_fprop;  // default fast (recipe.h)
  if (c.ac.enabled) {
    const HighPrecision hp = high_precision(c.ac, need_wgrad);
    const Quantized qw = core.weight_fp8(in.weight, c.ac, first);
    if (hp.fprop) {
      g.a = gin.hp_under_fp8.contiguous();
      g.b = in.weight.detach().contiguous();
    } else {
      g.a = gin.q.data;
      g.a_scale_inv = gin.q.scale_inv;
      g.b = qw.data;
      g.b_scale_inv = qw.scale_inv;
    }
    if (hp.wgrad) {
      saved[kInHp] = gin.hp_under_fp8.contiguous();
    } else {
      saved[kInT] = gin.q.data_t;
      saved[kInScaleInv] = gin.q.scale_inv_for_t();
    }
    if (hp.dgrad) {
      saved[kWHp] = in.weight.detach().contiguous();
    } else {
      // The FP8 weight cache, shared by the micro-batches that reuse it: saving it adds a
      // reference (no copy), and a checkpoint's recompute gets the same cache back.
      saved[kWT] = qw.data_t;
      saved[kWScaleInv] = qw.scale_inv_for_t();
    }
  } else {
    g.a = gin.hp.contiguous();
    g.b = in.weight.detach().contiguous();
    if (need_wgrad) saved[kInHp] = g.a;
    saved[kWHp] = g.b;
  }
  std::vector<int64_t> y_shape = c.x_shape;
  y_shape.back() = core.config().out_features;
  return gemm(g).view(y_shape);
}

// act(y) for a layer with an activation: saves y, the pre-activation that the derivative reads
// (what a separate activation module would save), and returns [..., output_features].
at::Tensor activate_output(const at::Tensor& y, const LinearConfig& cfg, variable_list& saved) {
  const at::Tensor pre = y.view({-1, cfg.out_features});
  saved[kPreAct] = pre;
  std::vector<int64_t> shape = y.sizes().vec();
  shape.back() = cfg.output_features();
  return activation_forward(pre, *cfg.activation).view(shape);
}

// With a weight gradient wanted: remembers DistributedDataParallel's sink (when bound) and the
// micro-batch this use belongs to, announces to the ledger, and picks the fused GEMM's main_grad.
void bind_weight_gradient(LinearCtx& c, const at::Tensor& weight) {
  LinearCore& core = *c.core;
  const LinearConfig& cfg = core.config();
  if ((c.sink = core.grad_sink())) {
    c.sink_weight = core.sink_weight();
    c.sink_bias = core.sink_bias();
    c.microbatch = c.sink->microbatch();
    // A forward inside a backward is a recompute (activation checkpointing). Non-reentrant:
    // its backward never runs (only its saved tensors are used, by the node of the forward
    // that announced already). Reentrant: the original forward ran without grad and announced
    // nothing, and this node's backward announces when it delivers. Either way: once per use.
    if (!in_backward_pass()) c.announce(cfg);
  }
  if (cfg.fuse_wgrad_accumulation)
    c.main_grad = c.sink ? c.sink->main_grad(c.sink_weight) : core.main_grad_for(weight);
}

// ---- backward, step by step ----

// Which gradients this backward computes, and by which route the weight's goes (wgrad_route.h).
struct BackwardPlan {
  bool need_x = false, need_w = false, need_b = false, need_ln = false, need_dgrad = false;
  WgradRoute w;
};

// Refusals that hold whatever backward would compute, checked before anything is read or written.
void check_backward_allowed(const LinearCtx& c) {
  FP8DP_CHECK(!c.released,
              "fp8dp Linear/LayerNormLinear: backward through the same forward a second time is "
              "not supported (its saved tensors were freed after the first backward)");
  const LinearConfig& cfg = c.core->config();  // released() dropped the core: checked first
  // create_graph=True runs backward with grad mode on. This backward is not differentiable (its
  // GEMMs and casts are not recorded), so a second-order gradient through it would silently be
  // zero (a gradient penalty that never acts): refuse it here, before anything is written.
  FP8DP_CHECK(!at::GradMode::is_enabled(), cfg.name,
              ": double backward (backward or autograd.grad with create_graph=True) through an "
              "fp8dp layer is not supported: its backward is not differentiable, so the "
              "second-order gradient would be zero; compute such terms with torch.nn.Linear");
}

BackwardPlan plan_backward(AutogradContext* ctx, const LinearCtx& c, const LinearConfig& cfg) {
  BackwardPlan p;
  p.need_x = c.needs_grad(ctx, 0);
  p.need_w = c.needs_grad(ctx, 1);
  p.need_b = c.needs_grad(ctx, 2);
  p.need_ln = c.needs_grad(ctx, 3) || c.needs_grad(ctx, 4);
  p.need_dgrad = p.need_x || p.need_ln;
  p.w = plan_wgrad(cfg, c, c.weight, p.need_w);
  return p;
}

// How many of forward's outputs are y: q, k, v with qkv_heads, else y itself.
size_t num_y_outputs(const LinearConfig& cfg) { return cfg.qkv_heads > 0 ? 3 : 1; }

// y [..., out] as forward returns it: itself, or with qkv_heads its q, k, v blocks, each a view
// [..., qkv_heads, head_dim] (unbind of the [..., 3, heads, head_dim] view).
variable_list split_output(const at::Tensor& y, const LinearConfig& cfg) {
  if (cfg.qkv_heads == 0) return {y};
  std::vector<int64_t> shape(y.sizes().begin(), y.sizes().end() - 1);
  shape.insert(shape.end(), {3, cfg.qkv_heads, cfg.out_features / (3 * cfg.qkv_heads)});
  const std::vector<at::Tensor> qkv = y.view(shape).unbind(-3);
  return variable_list(qkv.begin(), qkv.end());
}

// grad_output as backward reads it: dy [tokens, out] (contiguous), or with qkv_heads, where only
// the delayed recipe's FP8 cast reads it, the gradients of q, k and v where attention left them
// (parts, each [tokens..., heads, head_dim] viewed as 4-d; dy undefined). Every other route joins
// them into dy first, which is what autograd's unbind backward did. (Autograd hands an output
// that got no gradient over as zeros: the function materializes grads, the default.)
//
// With an activation, dy is the GEMM output's gradient, dy_act · act'(pre), except where the
// FP8 cast of grad_output is all that reads it: then dy stays the activated output's gradient
// and pre is set, and the cast applies the derivative in its pass.
struct GradOutput {
  at::Tensor dy;
  std::vector<at::Tensor> parts;
  at::Tensor pre;
};

GradOutput grad_output(const LinearCtx& c, const BackwardPlan& p, const variable_list& saved,
                       const variable_list& grads) {
  const LinearConfig& cfg = c.core->config();
  const HighPrecision hp = high_precision(c.ac, p.need_w);
  GradOutput go;
  if (cfg.activation) {
    go.dy = grads[0].reshape({-1, cfg.output_features()}).contiguous();
    if (c.ac.enabled && !hp.dgrad && !hp.wgrad) {
      go.pre = saved[kPreAct];
    } else {
      go.dy = activation_backward(go.dy, saved[kPreAct], *cfg.activation);
    }
    return go;
  }
  if (cfg.qkv_heads == 0) {
    go.dy = grads[0].reshape({-1, cfg.out_features}).contiguous();
    return go;
  }
  const int64_t cols = cfg.out_features / 3;
  const bool cast_reads_parts = c.ac.enabled && !hp.dgrad && !hp.wgrad;
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < 3; ++i) {
    const at::Tensor& g = grads[i];
    if (cast_reads_parts) {
      // [tokens..., heads, head_dim] as 4-d: two token dimensions as they are (a transformer's
      // [seq, batch], whose attention gradient is a permuted view), else [1, tokens].
      parts.push_back(g.dim() == 4 ? g : g.reshape({1, -1, g.size(-2), g.size(-1)}));
    } else {
      parts.push_back(g.reshape({-1, cols}));
    }
  }
  if (cast_reads_parts) {
    go.parts = std::move(parts);
  } else {
    go.dy = at::cat(parts, 1);
  }
  return go;
}

// The data gradient (before the norm's backward) and the bias gradient when it is computed
// eagerly.
struct DgradResult {
  at::Tensor dgrad, dbias;
};

// grad_output's pass: the dgrad GEMM, the eager bias gradient, and the weight-gradient GEMM's
// operands written into task (run now or later by the next step).
DgradResult dgrad_and_wgrad_operands(LinearCore& core, const LinearCtx& c, const BackwardPlan& p,
                                     const variable_list& saved, const GradOutput& go,
                                     WgradTask& task) {
  // undefined where only the FP8 cast reads grad_output (parts); with go.pre the activated
  // output's gradient, which only that cast reads
  const at::Tensor& dy = go.dy;
  DgradResult r;
  GemmArgs g;
  g.out_dtype = c.act_dtype;
  if (c.ac.enabled) {
    g.use_split_accumulator = c.ac.recipe.split_accumulator_dgrad;
    task.use_split_accumulator = c.ac.recipe.split_accumulator_wgrad;
    // One pass over grad_output: E5M2 bytes, their transpose for an FP8 wgrad, and the bias
    // gradient from the unquantized values (C4: eager, returned to autograd below). The cast
    // runs even when only a high-precision wgrad needs dy: it records dy's amax, so that delayed
    // scaling's history (and every rank's, C9) sees each backward. It then writes the E5M2 bytes
    // that nothing reads: every cast asks for at least one output, the case the kernels are
    // tested for.
    const HighPrecision hp = high_precision(c.ac, p.need_w);
    const bool cast_data = p.need_dgrad && !hp.dgrad;
    const bool cast_t = p.need_w && !hp.wgrad;
    const QuantizeOptions opts{cast_data || !(cast_t || p.need_b), cast_t, p.need_b,
                               p.need_b ? c.bias.scalar_type() : at::ScalarType::Float};
    const LinearConfig& cfg = core.config();
    const Quantized q =
        go.pre.defined()
            ? core.cast_activation(dy, go.pre, *cfg.activation, Role::kGradOutput, c.ac, opts)
        : go.parts.empty() ? core.cast(dy, Role::kGradOutput, c.ac, opts)
                           : core.cast_parts(go.parts, Role::kGradOutput, c.ac, opts);
    if (p.need_dgrad && hp.dgrad) {  // a transpose view, as without FP8 (below)
      g.a = dy;
      g.b = saved[kWHp].t();
      r.dgrad = gemm(g);
    } else if (p.need_dgrad) {
      g.a = q.data;
      g.a_scale_inv = q.scale_inv;
      g.b = saved[kWT];
      g.b_scale_inv = saved[kWScaleInv];
      r.dgrad = gemm(g);
    }
    if (p.need_b) r.dbias = q.dbias;
    if (hp.wgrad) {  // column-major transpose views, as without FP8 (below)
      task.a = dy.t();
      task.b = saved[kInHp].t();
    } else {
      task.a = q.data_t;
      task.a_scale_inv = q.scale_inv_for_t();
      task.b = saved[kInT];
      task.b_scale_inv = saved[kInScaleInv];
    }
  } else {
    // Without FP8 the GEMMs take transpose views (column-major operands, gemm.h): a strided
    // transpose copy of dy, x or W would cost more than the GEMM's own memory traffic.
    if (p.need_dgrad) {
      g.a = dy;
      g.b = saved[kWHp].t();
      r.dgrad = gemm(g);
    }
    if (p.need_w) {
      task.a = dy.t();
      task.b = saved[kInHp].t();
      // Without FP8 the bias gradient travels with the weight gradient (deferred with it).
      if (p.need_b) task.dy = dy;
    } else if (p.need_b) {
      r.dbias = bias_grad_hp(dy, c.bias.scalar_type());
    }
  }
  return r;
}

// The gradients of the inputs: dx (through the norm's backward for LayerNormLinear, with the
// gradient of the returned norm output added; through the input activation's derivative) and the
// norm's weight and bias gradients.
struct InputGrads {
  at::Tensor dx, dln_w, dln_b;
};

InputGrads input_grads(const LinearCtx& c, const BackwardPlan& p, const variable_list& saved,
                       const at::Tensor& dgrad, const variable_list& grads) {
  const LinearConfig& cfg = c.core->config();
  InputGrads r;
  if (cfg.layernorm && p.need_dgrad) {
    at::Tensor dz = dgrad;
    size_t next = num_y_outputs(cfg);
    if (cfg.return_layernorm_output) dz = dz + grads[next++].reshape({-1, cfg.in_features});
    // The returned input's gradient (the residual path's), added to dx before its rounding.
    at::Tensor dx_add;
    if (cfg.return_layernorm_input && p.need_x && grads[next].defined())
      dx_add = grads[next].reshape({-1, cfg.in_features});
    const NormGrads ng = norm_backward(dz, saved[kX2d], saved[kMu], saved[kRsigma],
                                       saved[kLnWeight], c.has_ln_bias, cfg.norm, dx_add);
    r.dx = ng.dx.view(c.x_shape);
    r.dln_w = ng.dgamma;
    r.dln_b = ng.dbeta;
  } else if (p.need_x && cfg.input_activation) {
    r.dx = activation_backward(dgrad, saved[kInPreAct], *cfg.input_activation).view(c.x_shape);
  } else if (p.need_x) {
    r.dx = dgrad.view(c.x_shape);
  }
  return r;
}

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  // check inputs → (norm and) cast the input → cast the weight, GEMM (+ bias) (→ activation) →
  // bind the weight gradient to its destination → save for backward.
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor weight,
                               std::optional<at::Tensor> bias_opt,
                               std::optional<at::Tensor> ln_weight_opt,
                               std::optional<at::Tensor> ln_bias_opt,
                               std::optional<at::Tensor> residual_opt,
                               std::shared_ptr<LinearCore> core, std::optional<bool> first,
                               AutocastState ac, bool need_wgrad) {
    const LinearConfig& cfg = core->config();
    const ForwardInputs in{x,
                           weight,
                           bias_opt.value_or(at::Tensor()),
                           ln_weight_opt.value_or(at::Tensor()),
                           ln_bias_opt.value_or(at::Tensor()),
                           residual_opt.value_or(at::Tensor())};
    auto c = make_context(in, std::move(core), ac);
    const at::Tensor x2d = x.reshape({-1, cfg.input_features()});
    variable_list saved(kNumSaved);
    const GemmInput gin = prepare_gemm_input(*c, in, x2d, need_wgrad, saved);
    at::Tensor y = fprop_gemm(*c, in, gin, first, need_wgrad, saved);
    if (cfg.activation) y = activate_output(y, cfg, saved);
    if (need_wgrad) bind_weight_gradient(*c, weight);
    ctx->save_for_backward(std::move(saved));
    ctx->saved_data["ctx"] = at::IValue::make_capsule(std::move(c));
    variable_list outs = split_output(y, cfg);
    if (cfg.return_layernorm_output) outs.push_back(gin.ln_out.view(x.sizes()));
    // x itself: autograd returns an input as a view of it whose gradient comes back to this
    // node's backward (input_grads adds it to dx).
    if (cfg.return_layernorm_input) outs.push_back(x);
    return outs;
  }

  // refuse what cannot be done → plan the routes → unpack the saved tensors → grad_output cast,
  // dgrad and eager dbias → weight gradient now or queued, delivered → norm backward → release.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto c = c10::static_intrusive_pointer_cast<LinearCtx>(ctx->saved_data["ctx"].toCapsule());
    check_backward_allowed(*c);
    LinearCore& core = *c->core;
    const LinearConfig& cfg = core.config();
    const BackwardPlan p = plan_backward(ctx, *c, cfg);
    // Hooks the route would bypass, the sink's acceptance (C11), the ledger's announcement of a
    // gradient that will not come (C14): before the grad_output cast records its amax and
    // before anything is written, so that a refusal changes nothing.
    prepare_wgrad(core, *c, p.w, c->weight, c->bias, p.need_b, c->ac.enabled, cfg.name, "");
    // Unpacking runs the saved-tensor hooks: a non-reentrant checkpoint recomputes its region
    // here, with the grad mode it chooses.
    const variable_list saved = ctx->get_saved_variables();
    const GradOutput dy = grad_output(*c, p, saved, grads);

    WgradTask task;
    task.weight = c->weight;
    task.bias = c->bias;
    if (p.w.fused) task.main_grad = c->main_grad;
    DgradResult d = dgrad_and_wgrad_operands(core, *c, p, saved, dy, task);
    const at::Tensor dweight =
        route_wgrad(core, *c, p.w, c->weight, c->bias, c->ac.enabled, std::move(task), d.dbias);
    const InputGrads ig = input_grads(*c, p, saved, d.dgrad, grads);
    // y = gemm + residual: the residual's gradient is grad_output itself (no copy), as autograd's
    // add would hand it over (forward refuses a residual with qkv_heads, so grads[0] is y's).
    const at::Tensor dres = c->needs_grad(ctx, 5) ? grads[0] : at::Tensor();
    // Drop the parameter references and the core; autograd frees the saved tensors (the queued
    // task holds its own references to its operands).
    c->release();
    return {ig.dx, dweight,      d.dbias,      ig.dln_w,     ig.dln_b,
            dres,  at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool in_backward_pass() { return torch::autograd::get_current_graph_task_id() != -1; }

// True when autograd hands the weight's gradient back to the caller instead of accumulating it
// (torch.autograd.grad(..., inputs=weight)): its AccumulateGrad node is in the graph task as a
// capture only, not to be executed. A plain backward() has no exec_info at all; backward(inputs=)
// marks the node as needed.
bool gradient_captured(const at::Tensor& param) {
  const auto* exec = torch::autograd::get_current_graph_task_exec_info();
  if (exec == nullptr || exec->empty()) return false;
  const auto acc = torch::autograd::impl::try_get_grad_accumulator(param);
  if (!acc) return false;  // not a leaf: nothing accumulates it here
  const auto it = exec->find(acc.get());
  return it != exec->end() && !it->second.needed_;
}

bool has_tensor_pre_hooks(const at::Tensor& t) {
  return t.defined() && t.requires_grad() && !torch::autograd::impl::hooks(t).empty();
}

std::vector<at::Tensor> apply_linear_function(const at::Tensor& x, const at::Tensor& weight,
                                              const at::Tensor& bias, const at::Tensor& ln_weight,
                                              const at::Tensor& ln_bias,
                                              std::shared_ptr<LinearCore> core,
                                              std::optional<bool> is_first_microbatch,
                                              const AutocastState& ac, bool need_wgrad,
                                              const at::Tensor& residual) {
  auto opt = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  return LinearFunction::apply(x, weight, opt(bias), opt(ln_weight), opt(ln_bias), opt(residual),
                               std::move(core), is_first_microbatch, ac, need_wgrad);
}

at::Tensor residual_2d(const at::Tensor& residual, int64_t out_features) {
  at::Tensor r = residual.detach().reshape({-1, out_features});
  // The GEMM reads C row by row; a residual whose rows are not contiguous (a broadcast or a
  // permuted view) is copied once, which is what the unfused add would have read anyway.
  if ((r.size(1) > 1 && r.stride(1) != 1) || (r.size(0) > 1 && r.stride(0) < out_features))
    r = r.contiguous();
  return r;
}

}  // namespace fp8dp
