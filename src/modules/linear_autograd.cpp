// The autograd function of Linear / LayerNormLinear: forward (norm + FP8 casts + fprop GEMM) and
// backward (grad_output cast with the eager bias gradient, dgrad GEMM, norm backward, and the
// weight gradient computed now or queued for backward_dw). Only this file sees autograd headers.
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
#include "gemm/gemm.h"
#include "modules/linear_core.h"

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
  kNumSaved
};

// What backward needs besides the saved activations (held in the autograd context as a capsule).
struct LinearCtx : torch::CustomClassHolder {
  std::shared_ptr<LinearCore> core;
  AutocastState ac;
  std::vector<int64_t> x_shape;
  at::ScalarType act_dtype = at::kFloat;
  at::Tensor weight, bias, main_grad;  // parameters (identity, not activations) and main_grad
  // DistributedDataParallel's gradient sink when the module is bound to one (linear_core.h).
  std::shared_ptr<GradSink> sink;
  int64_t sink_weight = -1, sink_bias = -1;
  int64_t microbatch = -1;  // the sink's micro-batch at forward (the ledger's attribution)
  // Whether the forward told the ledger what this use will deliver (see announce()).
  bool announced = false;
  bool has_ln_bias = false;
  bool released = false;
  // Autograd numbers only the inputs that are defined: edge[i] of input i (x, weight, bias,
  // ln_weight, ln_bias), or -1 when that input was absent.
  std::array<int, 5> edge{};

  bool needs_grad(AutogradContext* ctx, int input) const {
    return edge[input] >= 0 && ctx->needs_input_grad(static_cast<size_t>(edge[input]));
  }

  // The ledger learns what this use will deliver to the sink itself (the rest, through autograd,
  // DDP's forward announces from the graph): the weight gradient when fused or delayed, the bias
  // gradient when the deferred GEMM makes it (delayed, not FP8).
  void announce(const LinearConfig& cfg) {
    if (cfg.fuse_wgrad_accumulation || cfg.delay_wgrad_compute) sink->announce(sink_weight);
    if (cfg.delay_wgrad_compute && !ac.enabled && bias.defined() && bias.requires_grad() &&
        sink_bias >= 0)
      sink->announce(sink_bias);
    announced = true;
  }

  void release() {
    for (at::Tensor* t : {&weight, &bias, &main_grad}) *t = at::Tensor();
    core.reset();
    sink.reset();
    released = true;
  }
};

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
    c->x_shape = x.sizes().vec();
    c->act_dtype = x.scalar_type();
    const bool fp8 = ac.enabled;
    const at::Tensor x2d = x.reshape({-1, cfg.in_features});
    variable_list saved(kNumSaved);

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
      saved[kX2d] = x2d;
      saved[kMu] = nf.mu;
      saved[kRsigma] = nf.rsigma;
      saved[kLnWeight] = ln_weight.detach();
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
      saved[kInT] = qin.data_t;
      saved[kInScaleInv] = qin.scale_inv_for_t();
      // The FP8 weight cache, shared by the micro-batches that reuse it: saving it adds a
      // reference (no copy), and a checkpoint's recompute gets the same cache back.
      saved[kWT] = qw.data_t;
      saved[kWScaleInv] = qw.scale_inv_for_t();
    } else {
      g.a = gemm_in.contiguous();
      g.b = weight.detach().contiguous();
      if (need_wgrad) saved[kInHp] = g.a;
      saved[kWHp] = g.b;
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
      // A forward inside a backward is a recompute (activation checkpointing). Non-reentrant:
      // its backward never runs (only its saved tensors are used, by the node of the forward
      // that announced already). Reentrant: the original forward ran without grad and announced
      // nothing, and this node's backward announces when it delivers. Either way: once per use.
      if (!in_backward_pass()) c->announce(cfg);
    }
    if (need_wgrad && cfg.fuse_wgrad_accumulation)
      c->main_grad = c->sink ? c->sink->main_grad(c->sink_weight) : core->main_grad_for(weight);
    ctx->save_for_backward(std::move(saved));
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
    // C14: torch.autograd.grad(loss, weight) wants the gradient back, as nn.Linear gives it, and
    // nothing accumulated: fusion into main_grad and deferral to backward_dw() apply only to a
    // gradient that autograd accumulates. So a captured one is computed now and returned, and
    // main_grad, the wgrad queue and the sink are left alone.
    const bool captured = need_w && gradient_captured(c->weight);
    const bool fused = cfg.fuse_wgrad_accumulation && !captured;
    const bool delayed = cfg.delay_wgrad_compute && !captured;
    // A tensor hook on the weight (weight.register_hook) must see, and may replace, the gradient
    // that accumulates. The fused and the delayed routes never hand it to autograd, so the hook
    // would be skipped or fed a stand-in: refuse, before the grad_output cast records its amax
    // and before anything reaches main_grad or the queue. The same for the bias when its gradient
    // is deferred with the weight's (delayed, FP8 off: C4).
    FP8DP_CHECK(!(need_w && (fused || delayed) && core.has_tensor_hooks(c->weight)), cfg.name,
                ": parameter 'weight' has a tensor hook (weight.register_hook), but with ",
                fused ? "fuse_wgrad_accumulation=True" : "delay_wgrad_compute=True",
                " its gradient never passes through autograd, so the hook would not see it; "
                "remove the hook, use register_wgrad_accumulation_and_reduce_hooks (runs after "
                "backward_dw) or read main_grad, or build the layer without ",
                fused ? "fuse_wgrad_accumulation" : "delay_wgrad_compute");
    FP8DP_CHECK(!(need_w && need_b && delayed && !c->ac.enabled && core.has_tensor_hooks(c->bias)),
                cfg.name,
                ": parameter 'bias' has a tensor hook (bias.register_hook), but with "
                "delay_wgrad_compute=True and FP8 off its gradient is computed by backward_dw() "
                "and never passes through autograd, so the hook would not see it; remove the hook "
                "or build the layer without delay_wgrad_compute");
    // Unpacking runs the saved-tensor hooks: a non-reentrant checkpoint recomputes its region
    // here, with the grad mode it chooses.
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor dy = grads[0].reshape({-1, cfg.out_features}).contiguous();

    WgradTask task;
    task.weight = c->weight;
    task.bias = c->bias;
    if (fused) task.main_grad = c->main_grad;
    const bool bound = c->sink != nullptr && !captured;
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
        g.b = saved[kWT];
        g.b_scale_inv = saved[kWScaleInv];
        dgrad = gemm(g);
      }
      if (need_b) dbias = q.dbias;
      task.a = q.data_t;
      task.a_scale_inv = q.scale_inv_for_t();
      task.b = saved[kInT];
      task.b_scale_inv = saved[kInScaleInv];
    } else {
      // Without FP8 the GEMMs take transpose views (column-major operands, gemm.h): a strided
      // transpose copy of dy, x or W would cost more than the GEMM's own memory traffic.
      if (need_dgrad) {
        g.a = dy;
        g.b = saved[kWHp].t();
        dgrad = gemm(g);
      }
      if (need_w) {
        task.a = dy.t();
        task.b = saved[kInHp].t();
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
      if ((fused || delayed) && !c->announced) c->announce(cfg);  // a reentrant recompute's node
      if (delayed) {
        task.sink = c->sink;
        task.sink_weight = c->sink_weight;
        task.sink_bias = c->sink_bias;
        task.weight_token = c->sink->expect(c->sink_weight, c->microbatch, core.sink_name());
        if (task.dy.defined() && c->sink_bias >= 0)
          task.bias_token = c->sink->expect(c->sink_bias, c->microbatch, core.sink_name());
        core.enqueue(std::move(task));  // C3: backward_dw() runs it and delivers
      } else {
        const WgradResult r = run_wgrad(task);
        if (fused) {
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
      if (fused) core.mark_grad_added_to_main_grad();
      if (delayed) {
        core.enqueue(std::move(task));  // C3: backward_dw() runs it
      } else {
        const WgradResult r = run_wgrad(task);
        dweight = r.dweight;
        if (r.dbias.defined()) dbias = r.dbias;
      }
      if (fused) dweight = core.dummy_wgrad(c->weight);
    }

    at::Tensor dx, dln_w, dln_b;
    if (cfg.layernorm && need_dgrad) {
      at::Tensor dz = dgrad;
      if (cfg.return_layernorm_output) dz = dz + grads[1].reshape({-1, cfg.in_features});
      const NormGrads ng = norm_backward(dz, saved[kX2d], saved[kMu], saved[kRsigma],
                                         saved[kLnWeight], c->has_ln_bias, cfg.norm);
      dx = ng.dx.view(c->x_shape);
      dln_w = ng.dgamma;
      dln_b = ng.dbeta;
    } else if (need_x) {
      dx = dgrad.view(c->x_shape);
    }
    // Drop the parameter references and the core; autograd frees the saved tensors (the queued
    // task holds its own references to its operands).
    c->release();
    return {dx,           dweight,      dbias,        dln_w,       dln_b,
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool in_backward_pass() { return torch::autograd::get_current_graph_task_id() != -1; }

bool has_tensor_pre_hooks(const at::Tensor& t) {
  return t.defined() && t.requires_grad() && !torch::autograd::impl::hooks(t).empty();
}

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
