#include "modules/wgrad_route.h"

#include "common/check.h"
#include "modules/graph_record.h"
#include "modules/linear_autograd.h"

namespace fp8dp {

void announce_use(SinkUse& use, const LinearConfig& cfg, bool fp8, const at::Tensor& bias) {
  use.announce(cfg.fuse_wgrad_accumulation || cfg.delay_wgrad_compute,
               cfg.delay_wgrad_compute && !fp8 && bias.defined() && bias.requires_grad() &&
                   use.sink_bias >= 0);
}

WgradRoute plan_wgrad(const LinearConfig& cfg, const SinkUse& use, const at::Tensor& weight,
                      bool need_w) {
  WgradRoute r;
  r.need_w = need_w;
  // C14: autograd.grad wants the gradient back, as nn.Linear gives it, and nothing accumulated:
  // fusion and deferral apply only to a gradient that autograd accumulates. Except under
  // fp8dp.make_graphed_callables, which captures the backward through autograd.grad but replays
  // it inside a backward that accumulates: there the layer keeps its own route.
  r.captured = need_w && gradient_captured(weight) && active_graph_record() == nullptr;
  r.fused = cfg.fuse_wgrad_accumulation && !r.captured;
  r.delayed = cfg.delay_wgrad_compute && !r.captured;
  r.bound = use.sink != nullptr && !r.captured;
  return r;
}

void prepare_wgrad(LinearCore& core, SinkUse& use, const WgradRoute& r, const at::Tensor& weight,
                   const at::Tensor& bias, bool need_b, bool fp8, const std::string& module,
                   const std::string& param) {
  // A tensor hook on the weight must see, and may replace, the gradient that accumulates; the
  // fused and delayed routes never hand it to autograd, so the hook would be skipped or fed a
  // stand-in. The same for the bias when its gradient is deferred with the weight's (C4).
  FP8DP_CHECK(!(r.need_w && (r.fused || r.delayed) && core.has_tensor_hooks(weight)), module,
              ": parameter '", param, "weight' has a tensor hook (register_hook), but with ",
              r.fused ? "fuse_wgrad_accumulation=True" : "delay_wgrad_compute=True",
              " its gradient never passes through autograd, so the hook would not see it; "
              "remove the hook, use register_wgrad_accumulation_and_reduce_hooks (runs after "
              "backward_dw) or read main_grad, or build the layer without ",
              r.fused ? "fuse_wgrad_accumulation" : "delay_wgrad_compute");
  FP8DP_CHECK(!(r.need_w && need_b && r.delayed && !fp8 && core.has_tensor_hooks(bias)), module,
              ": parameter '", param,
              "bias' has a tensor hook (register_hook), but with delay_wgrad_compute=True and "
              "FP8 off its gradient is computed by backward_dw() and never passes through "
              "autograd, so the hook would not see it; remove the hook or build the layer "
              "without delay_wgrad_compute");
  // C11: a gradient this layer writes itself (fused: into main_grad during the GEMM) must be one
  // the sink still accepts (its bucket not launched or reduced).
  if (r.need_w && (r.fused || r.delayed) && r.bound)
    use.sink->check_accepting(use.sink_weight, r.delayed ? Route::kDelayed : Route::kFused, false);
  // What the forward announced will not be delivered: the gradient is captured (C14), or not
  // wanted at all (autograd.grad / backward(inputs=) for other tensors).
  if ((r.captured || !r.need_w) && use.sink != nullptr && use.announced) use.withdraw();
}

at::Tensor route_wgrad(LinearCore& core, SinkUse& use, const WgradRoute& r,
                       const at::Tensor& weight, const at::Tensor& bias, bool fp8, WgradTask task,
                       at::Tensor& dbias) {
  if (!r.need_w) return {};
  if (r.bound) {
    // Bound to DistributedDataParallel: what this module computes itself goes to the sink, and
    // autograd gets only real gradients (none for the weight when fused or delayed), so the DDP
    // hook adds exactly the other uses' gradients (C8).
    if ((r.fused || r.delayed) && !use.announced)
      announce_use(use, core.config(), fp8, bias);  // a reentrant recompute
    if (r.delayed) {
      task.sink = use.sink;
      task.sink_weight = use.sink_weight;
      task.sink_bias = use.sink_bias;
      // Under a capture the task becomes the record's template; each replay asks for its tokens.
      if (GraphRecord* rec = active_graph_record();
          rec != nullptr && rec->note_wgrad(core.shared_from_this(), task))
        return {};
      task.weight_token = use.sink->expect(use.sink_weight, use.microbatch, core.sink_name());
      if (task.dy.defined() && use.sink_bias >= 0)
        task.bias_token = use.sink->expect(use.sink_bias, use.microbatch, core.sink_name());
      core.enqueue(std::move(task));  // C3: backward_dw() runs it and delivers
      return {};
    }
    const WgradResult w = run_wgrad(task);
    if (w.dbias.defined()) dbias = w.dbias;
    if (!r.fused) return w.dweight;
    use.sink->deliver(use.sink_weight, at::Tensor(), Route::kFused,
                      GradSink::Token{use.microbatch, -1, {}});
    return {};
  }
  // Not bound (or captured): through autograd (C2 a), into main_grad with a stand-in for autograd
  // (C2 b: the flag set before the GEMM, so a consumer that sees the stand-in knows not to add
  // it), or to the queue (C3).
  if (r.fused) {
    core.mark_grad_added_to_main_grad();
    if (GraphRecord* rec = active_graph_record()) rec->note_grad_added(core.shared_from_this());
  }
  at::Tensor dweight;
  if (r.delayed) {
    // Under a capture the task becomes the record's template; each replay queues a copy of it.
    GraphRecord* rec = active_graph_record();
    if (rec == nullptr || !rec->note_wgrad(core.shared_from_this(), task))
      core.enqueue(std::move(task));
  } else {
    const WgradResult w = run_wgrad(task);
    dweight = w.dweight;
    if (w.dbias.defined()) dbias = w.dbias;
  }
  if (r.fused) dweight = core.dummy_wgrad(weight);
  return dweight;
}

}  // namespace fp8dp
