// The autograd function of Linear / LayerNormLinear: forward (norm + FP8 casts + fprop GEMM) and
// backward (grad_output cast with the eager bias gradient, dgrad GEMM, norm backward, and the
// weight gradient computed now or queued for backward_dw). Only this file sees autograd headers.
#include "modules/linear_autograd.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>

#include "common/check.h"
#include "gemm/gemm.h"
#include "modules/linear_core.h"

namespace fp8dp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What backward needs, kept in one object (held in the autograd context as a capsule).
struct LinearCtx : torch::CustomClassHolder {
  std::shared_ptr<LinearCore> core;
  AutocastState ac;
  std::optional<bool> first;
  std::vector<int64_t> x_shape;
  at::ScalarType act_dtype = at::kFloat;
  // wgrad operand b: FP8 xᵀ [in, tokens] + scale_inv, or the high-precision GEMM input [tokens, in]
  at::Tensor in_t, in_scale_inv, in_hp;
  // dgrad operand b: FP8 Wᵀ [in, out] + scale_inv, or the high-precision weight [out, in]
  at::Tensor w_t, w_scale_inv, w_hp;
  at::Tensor weight, bias, main_grad;
  // DistributedDataParallel's gradient sink when the module is bound to one (linear_core.h).
  std::shared_ptr<GradSink> sink;
  int64_t sink_weight = -1, sink_bias = -1;
  int64_t microbatch = -1;  // the sink's micro-batch at forward (the ledger's attribution)
  // LayerNormLinear: the norm's input and statistics
  at::Tensor x2d, mu, rsigma, ln_weight;
  bool has_ln_bias = false;
  bool released = false;
  // Autograd numbers only the inputs that are defined: edge[i] of input i (x, weight, bias,
  // ln_weight, ln_bias), or -1 when that input was absent.
  std::array<int, 5> edge{};

  bool needs_grad(AutogradContext* ctx, int input) const {
    return edge[input] >= 0 && ctx->needs_input_grad(static_cast<size_t>(edge[input]));
  }

  void release() {
    for (at::Tensor* t : {&in_t, &in_scale_inv, &in_hp, &w_t, &w_scale_inv, &w_hp, &weight, &bias,
                          &main_grad, &x2d, &mu, &rsigma, &ln_weight}) {
      *t = at::Tensor();
    }
    core.reset();
    sink.reset();
    released = true;
  }
};

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor weight,
                               std::optional<at::Tensor> bias_opt,
                               std::optional<at::Tensor> ln_weight_opt,
                               std::optional<at::Tensor> ln_bias_opt,
                               std::shared_ptr<LinearCore> core, std::optional<bool> first,
                               AutocastState ac, bool need_wgrad) {
    const LinearConfig& cfg = core->config();
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const at::Tensor ln_weight = ln_weight_opt.value_or(at::Tensor());
    const at::Tensor ln_bias = ln_bias_opt.value_or(at::Tensor());
    auto c = c10::make_intrusive<LinearCtx>();
    int next = 0;
    for (int i = 0; i < 5; ++i) {
      const at::Tensor* t[] = {&x, &weight, &bias, &ln_weight, &ln_bias};
      c->edge[i] = t[i]->defined() ? next++ : -1;
    }
    c->core = core;
    c->ac = ac;
    c->first = first;
    c->x_shape = x.sizes().vec();
    c->act_dtype = x.scalar_type();
    const bool fp8 = ac.enabled;
    const at::Tensor x2d = x.reshape({-1, cfg.in_features});

    at::Tensor gemm_in, ln_out;
    Quantized qin;
    const QuantizeOptions in_opts{true, need_wgrad, false};
    if (cfg.layernorm) {
      NormForward nf;
      const Format fmt = ac.recipe.fwd_format;
      if (fp8 && ac.recipe.kind == RecipeKind::kDelayed) {
        // The scale is known before the pass, so the norm writes FP8 directly.
        at::Tensor s = core->scaling().prepare_scale(Role::kInput, ac.recipe, x2d, [&] {
          return norm_forward(x2d, ln_weight, ln_bias, cfg.norm, false, {}, fmt).amax;
        });
        nf = norm_forward(x2d, ln_weight, ln_bias, cfg.norm, cfg.return_layernorm_output, s, fmt,
                          core->scaling().amax_slot(Role::kInput, x2d.numel()));
        qin.data = nf.out_fp8;
        qin.scale_inv = nf.scale_inv;
        if (need_wgrad) qin.data_t = transpose_fp8(nf.out_fp8);
      } else {
        // Current scaling needs the output's amax before the cast: norm, then one cast pass.
        nf = norm_forward(x2d, ln_weight, ln_bias, cfg.norm, true, {}, fmt);
        if (fp8) {
          qin = core->cast(nf.out, Role::kInput, ac, in_opts);
        } else {
          gemm_in = nf.out;
        }
      }
      ln_out = nf.out;
      c->x2d = x2d;
      c->mu = nf.mu;
      c->rsigma = nf.rsigma;
      c->ln_weight = ln_weight.detach();
      c->has_ln_bias = ln_bias.defined();
    } else if (fp8) {
      qin = core->cast(x2d, Role::kInput, ac, in_opts);
    } else {
      gemm_in = x2d;
    }

    GemmArgs g;
    g.bias = bias.defined() ? bias.detach() : bias;
    g.out_dtype = x.scalar_type();
    g.use_split_accumulator = ac.recipe.split_accumulator_fprop;  // default fast (recipe.h)
    if (fp8) {
      const Quantized qw = core->weight_fp8(weight, ac, first);
      g.a = qin.data;
      g.a_scale_inv = qin.scale_inv;
      g.b = qw.data;
      g.b_scale_inv = qw.scale_inv;
      c->in_t = qin.data_t;
      c->in_scale_inv = qin.scale_inv;
      c->w_t = qw.data_t;
      c->w_scale_inv = qw.scale_inv;
    } else {
      g.a = gemm_in.contiguous();
      g.b = weight.detach().contiguous();
      if (need_wgrad) c->in_hp = g.a;
      c->w_hp = g.b;
    }
    std::vector<int64_t> y_shape = c->x_shape;
    y_shape.back() = cfg.out_features;
    at::Tensor y = gemm(g).view(y_shape);

    c->weight = weight;
    c->bias = bias;
    if (need_wgrad && (c->sink = core->grad_sink())) {
      c->sink_weight = core->sink_weight();
      c->sink_bias = core->sink_bias();
      c->microbatch = c->sink->microbatch();
      // The ledger learns here what this use will deliver to the sink itself (the rest, through
      // autograd, DDP's forward announces from the graph): the weight gradient when fused or
      // delayed, the bias gradient when the deferred GEMM makes it (delayed, not FP8).
      if (cfg.fuse_wgrad_accumulation || cfg.delay_wgrad_compute) c->sink->announce(c->sink_weight);
      if (cfg.delay_wgrad_compute && !fp8 && bias.defined() && bias.requires_grad() &&
          c->sink_bias >= 0)
        c->sink->announce(c->sink_bias);
    }
    if (need_wgrad && cfg.fuse_wgrad_accumulation)
      c->main_grad = c->sink ? c->sink->main_grad(c->sink_weight) : core->main_grad_for(weight);
    ctx->saved_data["ctx"] = at::IValue::make_capsule(std::move(c));
    if (cfg.return_layernorm_output) return {y, ln_out.view(x.sizes())};
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto c = c10::static_intrusive_pointer_cast<LinearCtx>(ctx->saved_data["ctx"].toCapsule());
    FP8DP_CHECK(!c->released,
                "fp8dp Linear/LayerNormLinear: backward through the same forward a second time is "
                "not supported (its saved tensors were freed after the first backward)");
    LinearCore& core = *c->core;
    const LinearConfig& cfg = core.config();
    // create_graph=True runs backward with grad mode on. This backward is not differentiable (its
    // GEMMs and casts are not recorded), so a second-order gradient through it would silently be
    // zero (a gradient penalty that never acts): refuse it here, before anything is written.
    FP8DP_CHECK(!at::GradMode::is_enabled(), cfg.name,
                ": double backward (backward or autograd.grad with create_graph=True) through an "
                "fp8dp layer is not supported: its backward is not differentiable, so the "
                "second-order gradient would be zero; compute such terms with torch.nn.Linear");
    const bool need_x = c->needs_grad(ctx, 0), need_w = c->needs_grad(ctx, 1),
               need_b = c->needs_grad(ctx, 2);
    const bool need_ln = c->needs_grad(ctx, 3) || c->needs_grad(ctx, 4);
    const bool need_dgrad = need_x || need_ln;
    const at::Tensor dy = grads[0].reshape({-1, cfg.out_features}).contiguous();

    WgradTask task;
    task.weight = c->weight;
    task.bias = c->bias;
    task.main_grad = c->main_grad;
    const bool bound = c->sink != nullptr;
    at::Tensor dgrad, dbias;
    GemmArgs g;
    g.out_dtype = c->act_dtype;
    if (c->ac.enabled) {
      g.use_split_accumulator = c->ac.recipe.split_accumulator_dgrad;
      task.use_split_accumulator = c->ac.recipe.split_accumulator_wgrad;
      // One pass over grad_output: E5M2 bytes, their transpose for wgrad, and the bias gradient
      // from the unquantized values (C4: eager, returned to autograd below).
      const Quantized q =
          core.cast(dy, Role::kGradOutput, c->ac,
                    QuantizeOptions{need_dgrad, need_w, need_b,
                                    need_b ? c->bias.scalar_type() : at::ScalarType::Float});
      if (need_dgrad) {
        g.a = q.data;
        g.a_scale_inv = q.scale_inv;
        g.b = c->w_t;
        g.b_scale_inv = c->w_scale_inv;
        dgrad = gemm(g);
      }
      if (need_b) dbias = q.dbias;
      task.a = q.data_t;
      task.a_scale_inv = q.scale_inv;
      task.b = c->in_t;
      task.b_scale_inv = c->in_scale_inv;
    } else {
      // Without FP8 the GEMMs take transpose views (column-major operands, gemm.h): a strided
      // transpose copy of dy, x or W would cost more than the GEMM's own memory traffic.
      if (need_dgrad) {
        g.a = dy;
        g.b = c->w_hp.t();
        dgrad = gemm(g);
      }
      if (need_w) {
        task.a = dy.t();
        task.b = c->in_hp.t();
        // Without FP8 the bias gradient travels with the weight gradient (deferred with it).
        if (need_b) task.dy = dy;
      } else if (need_b) {
        dbias = bias_grad_hp(dy, c->bias.scalar_type());
      }
    }

    at::Tensor dweight;
    if (need_w && bound) {
      // Bound to DistributedDataParallel: what this module computes itself goes to the sink, and
      // autograd gets only real gradients (none for the weight when fused or delayed), so the DDP
      // hook adds exactly the other uses' gradients (C8).
      if (cfg.delay_wgrad_compute) {
        task.sink = c->sink;
        task.sink_weight = c->sink_weight;
        task.sink_bias = c->sink_bias;
        task.weight_token = c->sink->expect(c->sink_weight, c->microbatch, core.sink_name());
        if (task.dy.defined() && c->sink_bias >= 0)
          task.bias_token = c->sink->expect(c->sink_bias, c->microbatch, core.sink_name());
        core.enqueue(std::move(task));  // C3: backward_dw() runs it and delivers
      } else {
        const WgradResult r = run_wgrad(task);
        if (cfg.fuse_wgrad_accumulation) {
          c->sink->deliver(c->sink_weight, at::Tensor(), Route::kFused,
                           GradSink::Token{c->microbatch, -1, {}});
        } else {
          dweight = r.dweight;
        }
        if (r.dbias.defined()) dbias = r.dbias;
      }
    } else if (need_w) {
      // C2 (b): the flag is set here, before the GEMM (and before a deferred one), so any consumer
      // that sees the dummy gradient knows that it must not add it.
      if (cfg.fuse_wgrad_accumulation) core.mark_grad_added_to_main_grad();
      if (cfg.delay_wgrad_compute) {
        core.enqueue(std::move(task));  // C3: backward_dw() runs it
      } else {
        const WgradResult r = run_wgrad(task);
        dweight = r.dweight;
        if (r.dbias.defined()) dbias = r.dbias;
      }
      if (cfg.fuse_wgrad_accumulation) dweight = core.dummy_wgrad(c->weight);
    }

    at::Tensor dx, dln_w, dln_b;
    if (cfg.layernorm && need_dgrad) {
      at::Tensor dz = dgrad;
      if (cfg.return_layernorm_output) dz = dz + grads[1].reshape({-1, cfg.in_features});
      const NormGrads ng =
          norm_backward(dz, c->x2d, c->mu, c->rsigma, c->ln_weight, c->has_ln_bias, cfg.norm);
      dx = ng.dx.view(c->x_shape);
      dln_w = ng.dgamma;
      dln_b = ng.dbeta;
    } else if (need_x) {
      dx = dgrad.view(c->x_shape);
    }
    // Free what forward kept; the queued task holds its own references.
    c->release();
    return {dx,           dweight,      dbias,        dln_w,       dln_b,
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::vector<at::Tensor> apply_linear_function(const at::Tensor& x, const at::Tensor& weight,
                                              const at::Tensor& bias, const at::Tensor& ln_weight,
                                              const at::Tensor& ln_bias,
                                              std::shared_ptr<LinearCore> core,
                                              std::optional<bool> is_first_microbatch,
                                              const AutocastState& ac, bool need_wgrad) {
  auto opt = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  return LinearFunction::apply(x, weight, opt(bias), opt(ln_weight), opt(ln_bias), std::move(core),
                               is_first_microbatch, ac, need_wgrad);
}

}  // namespace fp8dp
