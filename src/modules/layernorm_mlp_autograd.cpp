// The autograd function of LayerNormMLP.
//
// Forward: norm (+ FP8 cast with fc1's input scaling) -> fc1 GEMM -> h [tokens, fc1_out] ->
// activation fused with the FP8 cast of fc2's input (a is never written in high precision with
// FP8 on) -> fc2 GEMM. Backward: grad_output cast (+ eager fc2 bias gradient, C4) -> fc2 dgrad da
// -> activation derivative fused with the FP8 cast of fc1's grad_output (+ eager fc1 bias
// gradient; dh is never written in high precision with FP8 on) -> fc1 dgrad -> norm backward.
// Each weight gradient takes the route its LinearCore's config and binding give (C2/C3): returned,
// fused into main_grad, or queued in that core's WeightGradStore for backward_dw(), delivered to
// DistributedDataParallel's sink when bound, exactly as linear_autograd.cpp does for one GEMM.
//
// Saved for backward (C14: all through save_for_backward), FP8 on: the norm's input x and its
// statistics, FP8 ln_outᵀ (fc1 wgrad), h in the activation dtype (the derivative needs it; the
// unfused path saves it too: torch's GELU saves its input), FP8 aᵀ (fc2 wgrad) and the two cached
// FP8 transposed weights. Nothing of size tokens × ffn in high precision but h. FP8 off: ln_out,
// h and a in the activation dtype, as the unfused stack saves them. Block scaling: the activation
// and its derivative in the activation dtype (not saved), then block casts
// (LinearCore::cast_activation).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <array>

#include "common/check.h"
#include "fp8/activation.h"
#include "fp8/scaling_state.h"
#include "gemm/gemm.h"
#include "modules/layernorm_mlp.h"
#include "modules/linear_autograd.h"
#include "modules/sink_use.h"
#include "modules/wgrad_route.h"

namespace fp8dp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Inputs of the function, in apply order (only the defined ones get an autograd edge). kRes: the
// residual added in fc2's GEMM epilogue.
enum Input : int { kX, kLnW, kLnB, kW1, kB1, kW2, kB2, kRes, kNumInputs };

enum Saved : size_t {
  kX2d,
  kMu,
  kRsigma,
  kLnWeight,
  kH,  // fc1's output, the activation's input
  // fc1: wgrad operand (FP8 ln_outᵀ + scale_inv, or ln_out), dgrad operand (FP8 W1ᵀ, or W1)
  kIn1T,
  kIn1ScaleInv,
  kIn1Hp,
  kW1T,
  kW1ScaleInv,
  kW1Hp,
  // fc2: the same with a = act(h)
  kIn2T,
  kIn2ScaleInv,
  kIn2Hp,
  kW2T,
  kW2ScaleInv,
  kW2Hp,
  kNumSaved
};

// One GEMM's weight-gradient routing state (LinearCtx of linear_autograd.cpp, for one of two);
// SinkUse holds the sink binding and the ledger announcement.
struct GemmUse : SinkUse {
  std::shared_ptr<LinearCore> core;
  at::Tensor weight, bias, main_grad;

  // Forward: bind to the core's sink and announce what this use will deliver itself (C8 ledger).
  void bind(const AutocastState& ac, bool need_wgrad) {
    const LinearConfig& cfg = core->config();
    if (need_wgrad && (sink = core->grad_sink())) {
      sink_weight = core->sink_weight();
      sink_bias = core->sink_bias();
      microbatch = sink->microbatch();
      // A forward inside a backward is a recompute (activation checkpointing): see
      // linear_autograd.cpp; either way each use announces once.
      if (!in_backward_pass()) announce(cfg, ac);
    }
    if (need_wgrad && cfg.fuse_wgrad_accumulation)
      main_grad = sink ? sink->main_grad(sink_weight) : core->main_grad_for(weight);
  }

  void announce(const LinearConfig& cfg, const AutocastState& ac) {
    announce_use(*this, cfg, ac.enabled, bias);
  }
};

struct MLPCtx : torch::CustomClassHolder {
  MLPConfig cfg;
  AutocastState ac;
  std::vector<int64_t> x_shape;
  at::ScalarType act_dtype = at::kFloat;
  GemmUse fc1, fc2;
  bool has_ln_bias = false;
  // residual is x itself (mlp(x, residual=x), a pre-norm block): backward adds grad_output to
  // dx inside the norm's backward instead of returning it for autograd to add to the same x.
  bool residual_is_x = false;
  bool released = false;
  std::array<int, kNumInputs> edge{};

  bool needs_grad(AutogradContext* ctx, int input) const {
    return edge[input] >= 0 && ctx->needs_input_grad(static_cast<size_t>(edge[input]));
  }
  void release() {
    for (GemmUse* u : {&fc1, &fc2}) {
      u->weight = u->bias = u->main_grad = at::Tensor();
      u->core.reset();
      u->sink.reset();
    }
    released = true;
  }
};

// One GEMM's gradients in this backward: the weight's route (wgrad_route.h) and the bias's need.
struct Routing : WgradRoute {
  bool need_b = false;
};

Routing routing(const GemmUse& u, bool need_w, bool need_b) {
  Routing r;
  static_cast<WgradRoute&>(r) = plan_wgrad(u.core->config(), u, u.weight, need_w);
  r.need_b = need_b;
  return r;
}

// Runs or queues one weight gradient (task filled with its operands) and returns what autograd
// gets for the weight; dbias may be set by the immediate high-precision route (C4).
at::Tensor route_gemm_wgrad(GemmUse& u, const Routing& r, WgradTask task, const AutocastState& ac,
                            at::Tensor& dbias) {
  task.weight = u.weight;
  task.bias = u.bias;
  if (r.fused) task.main_grad = u.main_grad;
  return route_wgrad(*u.core, u, r, u.weight, u.bias, ac.enabled, std::move(task), dbias);
}

struct MLPFunction : torch::autograd::Function<MLPFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor ln_weight,
                               std::optional<at::Tensor> ln_bias_opt, at::Tensor w1,
                               std::optional<at::Tensor> b1_opt, at::Tensor w2,
                               std::optional<at::Tensor> b2_opt,
                               std::optional<at::Tensor> residual_opt, MLPConfig cfg,
                               std::shared_ptr<LinearCore> core1, std::shared_ptr<LinearCore> core2,
                               std::optional<bool> first, AutocastState ac, bool need_wgrad1,
                               bool need_wgrad2) {
    const at::Tensor ln_bias = ln_bias_opt.value_or(at::Tensor());
    const at::Tensor b1 = b1_opt.value_or(at::Tensor());
    const at::Tensor b2 = b2_opt.value_or(at::Tensor());
    const at::Tensor residual = residual_opt.value_or(at::Tensor());
    auto c = c10::make_intrusive<MLPCtx>();
    {
      const at::Tensor* t[kNumInputs] = {&x, &ln_weight, &ln_bias, &w1, &b1, &w2, &b2, &residual};
      int next = 0;
      for (int i = 0; i < kNumInputs; ++i) c->edge[i] = t[i]->defined() ? next++ : -1;
    }
    const LinearConfig& cfg1 = core1->config();
    c->cfg = cfg;
    c->ac = ac;
    c->x_shape = x.sizes().vec();
    c->act_dtype = x.scalar_type();
    c->has_ln_bias = ln_bias.defined();
    c->residual_is_x = residual.defined() && residual.is_same(x);
    const bool fp8 = ac.enabled;
    const at::Tensor x2d = x.reshape({-1, cfg1.in_features});
    variable_list saved(kNumSaved);

    // ---- norm (+ cast for fc1): as LinearFunction does for a LayerNormLinear
    at::Tensor gemm_in1;
    Quantized qin1;
    NormForward nf;
    {
      const Format fmt = ac.recipe.fwd_format;
      if (fp8 && ac.recipe.kind == RecipeKind::kDelayed) {
        at::Tensor s = core1->scaling().prepare_scale(Role::kInput, ac.recipe, x2d, [&] {
          return norm_forward(x2d, ln_weight, ln_bias, cfg1.norm, false, {}, fmt).amax;
        });
        nf = norm_forward(x2d, ln_weight, ln_bias, cfg1.norm, false, s, fmt,
                          core1->scaling().amax_slot(Role::kInput, x2d.numel()));
        qin1.data = nf.out_fp8;
        qin1.scale_inv = nf.scale_inv;
        if (need_wgrad1) qin1.data_t = transpose_fp8(nf.out_fp8);
      } else {
        nf = norm_forward(x2d, ln_weight, ln_bias, cfg1.norm, true, {}, fmt);
        if (fp8) {
          qin1 = core1->cast(nf.out, Role::kInput, ac, QuantizeOptions{true, need_wgrad1, false});
        } else {
          gemm_in1 = nf.out;
        }
      }
      saved[kX2d] = x2d;
      saved[kMu] = nf.mu;
      saved[kRsigma] = nf.rsigma;
      saved[kLnWeight] = ln_weight.detach();
    }

    // ---- fc1
    GemmArgs g1;
    g1.bias = b1.defined() ? b1.detach() : b1;
    g1.out_dtype = x.scalar_type();
    g1.use_split_accumulator = ac.recipe.split_accumulator_fprop;
    if (fp8) {
      const Quantized qw = core1->weight_fp8(w1, ac, first);
      g1.a = qin1.data;
      g1.a_scale_inv = qin1.scale_inv;
      g1.b = qw.data;
      g1.b_scale_inv = qw.scale_inv;
      saved[kIn1T] = qin1.data_t;
      saved[kIn1ScaleInv] = qin1.scale_inv_for_t();
      saved[kW1T] = qw.data_t;
      saved[kW1ScaleInv] = qw.scale_inv_for_t();
    } else {
      g1.a = gemm_in1.contiguous();
      g1.b = w1.detach().contiguous();
      if (need_wgrad1) saved[kIn1Hp] = g1.a;
      saved[kW1Hp] = g1.b;
    }
    const at::Tensor h = gemm(g1);
    saved[kH] = h;

    // ---- activation (+ cast for fc2) and fc2
    GemmArgs g2;
    g2.bias = b2.defined() ? b2.detach() : b2;
    // The residual in fc2's epilogue (linear_autograd.cpp's fprop_gemm): nothing saved for it.
    if (residual.defined()) g2.residual = residual_2d(residual, core2->config().out_features);
    g2.out_dtype = x.scalar_type();
    g2.use_split_accumulator = ac.recipe.split_accumulator_fprop;
    if (fp8) {
      const Quantized qin2 = core2->cast_activation(at::Tensor(), h, cfg.activation, Role::kInput,
                                                    ac, QuantizeOptions{true, need_wgrad2, false});
      const Quantized qw = core2->weight_fp8(w2, ac, first);
      g2.a = qin2.data;
      g2.a_scale_inv = qin2.scale_inv;
      g2.b = qw.data;
      g2.b_scale_inv = qw.scale_inv;
      saved[kIn2T] = qin2.data_t;
      saved[kIn2ScaleInv] = qin2.scale_inv_for_t();
      saved[kW2T] = qw.data_t;
      saved[kW2ScaleInv] = qw.scale_inv_for_t();
    } else {
      g2.a = activation_forward(h, cfg.activation);
      g2.b = w2.detach().contiguous();
      if (need_wgrad2) saved[kIn2Hp] = g2.a;
      saved[kW2Hp] = g2.b;
    }
    std::vector<int64_t> y_shape = c->x_shape;
    y_shape.back() = core2->config().out_features;
    at::Tensor y = gemm(g2).view(y_shape);

    c->fc1.core = core1;
    c->fc1.weight = w1;
    c->fc1.bias = b1;
    c->fc2.core = core2;
    c->fc2.weight = w2;
    c->fc2.bias = b2;
    c->fc1.bind(ac, need_wgrad1);
    c->fc2.bind(ac, need_wgrad2);
    ctx->save_for_backward(std::move(saved));
    ctx->saved_data["ctx"] = at::IValue::make_capsule(std::move(c));
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto c = c10::static_intrusive_pointer_cast<MLPCtx>(ctx->saved_data["ctx"].toCapsule());
    const std::string& mod = c->cfg.name;
    FP8DP_CHECK(!c->released, mod,
                ": backward through the same forward a second time is not supported (its saved "
                "tensors were freed after the first backward)");
    FP8DP_CHECK(!at::GradMode::is_enabled(), mod,
                ": double backward (backward or autograd.grad with create_graph=True) through an "
                "fp8dp layer is not supported: its backward is not differentiable, so the "
                "second-order gradient would be zero");
    const AutocastState& ac = c->ac;
    const Activation act = c->cfg.activation;
    const bool need_x = c->needs_grad(ctx, kX);
    const bool need_ln = c->needs_grad(ctx, kLnW) || c->needs_grad(ctx, kLnB);
    const Routing r1 = routing(c->fc1, c->needs_grad(ctx, kW1), c->needs_grad(ctx, kB1));
    const Routing r2 = routing(c->fc2, c->needs_grad(ctx, kW2), c->needs_grad(ctx, kB2));
    // Hooks the routes would bypass, the sink's acceptance (C11), the ledger's announcements of
    // gradients that will not come (C14): before any cast records an amax or a GEMM writes.
    prepare_wgrad(*c->fc1.core, c->fc1, r1, c->fc1.weight, c->fc1.bias, r1.need_b, ac.enabled, mod,
                  "fc1.");
    prepare_wgrad(*c->fc2.core, c->fc2, r2, c->fc2.weight, c->fc2.bias, r2.need_b, ac.enabled, mod,
                  "fc2.");
    const bool need_dz = need_x || need_ln;                  // fc1 dgrad
    const bool need_dh = need_dz || r1.need_w || r1.need_b;  // anything below the activation
    const variable_list saved = ctx->get_saved_variables();
    const int64_t hidden = c->fc2.core->config().out_features;
    const at::Tensor dy = grads[0].reshape({-1, hidden}).contiguous();
    const at::Tensor& h = saved[kH];

    // ---- fc2: grad_output cast, dgrad da, weight gradient
    WgradTask t2;
    at::Tensor da, db2, dw2;
    GemmArgs g;
    g.out_dtype = c->act_dtype;
    if (ac.enabled) {
      g.use_split_accumulator = ac.recipe.split_accumulator_dgrad;
      t2.use_split_accumulator = ac.recipe.split_accumulator_wgrad;
      const Quantized q = c->fc2.core->cast(
          dy, Role::kGradOutput, ac,
          QuantizeOptions{need_dh, r2.need_w, r2.need_b,
                          r2.need_b ? c->fc2.bias.scalar_type() : at::ScalarType::Float});
      if (need_dh) {
        g.a = q.data;
        g.a_scale_inv = q.scale_inv;
        g.b = saved[kW2T];
        g.b_scale_inv = saved[kW2ScaleInv];
        da = gemm(g);
      }
      if (r2.need_b) db2 = q.dbias;
      t2.a = q.data_t;
      t2.a_scale_inv = q.scale_inv_for_t();
      t2.b = saved[kIn2T];
      t2.b_scale_inv = saved[kIn2ScaleInv];
    } else {
      if (need_dh) {
        g.a = dy;
        g.b = saved[kW2Hp].t();
        da = gemm(g);
      }
      if (r2.need_w) {
        t2.a = dy.t();
        t2.b = saved[kIn2Hp].t();
        if (r2.need_b) t2.dy = dy;
      } else if (r2.need_b) {
        db2 = bias_grad_hp(dy, c->fc2.bias.scalar_type());
      }
    }
    dw2 = route_gemm_wgrad(c->fc2, r2, std::move(t2), ac, db2);

    // ---- activation derivative (+ cast for fc1), fc1 dgrad dz, weight gradient
    at::Tensor dz, db1, dw1;
    if (need_dh) {
      WgradTask t1;
      GemmArgs g1;
      g1.out_dtype = c->act_dtype;
      if (ac.enabled) {
        g1.use_split_accumulator = ac.recipe.split_accumulator_dgrad;
        t1.use_split_accumulator = ac.recipe.split_accumulator_wgrad;
        const Quantized q = c->fc1.core->cast_activation(
            da, h, act, Role::kGradOutput, ac,
            QuantizeOptions{need_dz, r1.need_w, r1.need_b,
                            r1.need_b ? c->fc1.bias.scalar_type() : at::ScalarType::Float});
        if (need_dz) {
          g1.a = q.data;
          g1.a_scale_inv = q.scale_inv;
          g1.b = saved[kW1T];
          g1.b_scale_inv = saved[kW1ScaleInv];
          dz = gemm(g1);
        }
        if (r1.need_b) db1 = q.dbias;
        t1.a = q.data_t;
        t1.a_scale_inv = q.scale_inv_for_t();
        t1.b = saved[kIn1T];
        t1.b_scale_inv = saved[kIn1ScaleInv];
      } else {
        const at::Tensor dh = activation_backward(da, h, act);
        if (need_dz) {
          g1.a = dh;
          g1.b = saved[kW1Hp].t();
          dz = gemm(g1);
        }
        if (r1.need_w) {
          t1.a = dh.t();
          t1.b = saved[kIn1Hp].t();
          if (r1.need_b) t1.dy = dh;
        } else if (r1.need_b) {
          db1 = bias_grad_hp(dh, c->fc1.bias.scalar_type());
        }
      }
      dw1 = route_gemm_wgrad(c->fc1, r1, std::move(t1), ac, db1);
    }

    // ---- norm backward
    // y = fc2(...) + residual: the residual's gradient is grad_output itself, no copy; when the
    // residual is x, added to dx in the norm's backward (then nothing goes to the residual's edge:
    // it is x's, and x's gradient already holds it).
    const bool fold = c->residual_is_x && need_x;  // need_x implies need_dz
    at::Tensor dx, dln_w, dln_b;
    if (need_dz) {
      const NormGrads ng = norm_backward(
          dz, saved[kX2d], saved[kMu], saved[kRsigma], saved[kLnWeight], c->has_ln_bias,
          c->fc1.core->config().norm,
          fold ? grads[0].reshape({-1, c->fc1.core->config().in_features}) : at::Tensor());
      if (need_x) dx = ng.dx.view(c->x_shape);
      dln_w = ng.dgamma;
      dln_b = ng.dbeta;
    }
    const at::Tensor dres = !fold && c->needs_grad(ctx, kRes) ? grads[0] : at::Tensor();
    c->release();
    return {dx,           dln_w,        dln_b,        dw1,          db1,
            dw2,          db2,          dres,         at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor apply_layernorm_mlp_function(const at::Tensor& x, const at::Tensor& ln_weight,
                                        const at::Tensor& ln_bias, const at::Tensor& fc1_weight,
                                        const at::Tensor& fc1_bias, const at::Tensor& fc2_weight,
                                        const at::Tensor& fc2_bias, const at::Tensor& residual,
                                        const MLPConfig& cfg, std::shared_ptr<LinearCore> fc1,
                                        std::shared_ptr<LinearCore> fc2,
                                        std::optional<bool> is_first_microbatch,
                                        const AutocastState& ac, bool need_wgrad1,
                                        bool need_wgrad2) {
  auto opt = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  return MLPFunction::apply(x, ln_weight, opt(ln_bias), fc1_weight, opt(fc1_bias), fc2_weight,
                            opt(fc2_bias), opt(residual), cfg, std::move(fc1), std::move(fc2),
                            is_first_microbatch, ac, need_wgrad1, need_wgrad2)[0];
}

}  // namespace fp8dp
