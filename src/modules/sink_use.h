// One use of a weight (and its bias) by a layer that delivers the gradient to
// DistributedDataParallel's sink itself (fused into main_grad, or deferred to backward_dw()): the
// binding the forward made, what it announced to the ledger (C8), and taking that back. Shared by
// the autograd functions of Linear / LayerNormLinear (linear_autograd.cpp) and of LayerNormMLP's
// two GEMMs (layernorm_mlp_autograd.cpp), so that both keep the ledger exact the same way.
#pragma once

#include <cstdint>
#include <memory>

#include "grad_buffer/grad_sink.h"

namespace fp8dp {

struct SinkUse {
  std::shared_ptr<GradSink> sink;  // null: not bound (or released after the backward)
  int64_t sink_weight = -1, sink_bias = -1;
  int64_t microbatch = -1;  // the sink's micro-batch at forward (the ledger's attribution)
  int64_t iteration = -1;   // the sink's iteration at the announcement
  bool announced = false, announced_weight = false, announced_bias = false;

  SinkUse() = default;
  SinkUse(const SinkUse&) = delete;
  SinkUse& operator=(const SinkUse&) = delete;

  // The forward (or a reentrant recompute's backward) tells the ledger what this use will deliver
  // to the sink itself: the weight's gradient and / or the bias's.
  void announce(bool weight, bool bias) {
    announced_weight = weight;
    announced_bias = bias;
    if (weight) sink->announce(sink_weight);
    if (bias) sink->announce(sink_bias);
    announced = true;
    iteration = sink->iteration();
  }

  // Takes the announcement back: nothing of this use will be delivered (torch.autograd.grad
  // captured the gradient, or the backward does not want it; C14).
  void withdraw() {
    if (announced_weight) sink->withdraw(sink_weight, microbatch);
    if (announced_bias) sink->withdraw(sink_bias, microbatch);
    announced = announced_weight = announced_bias = false;
  }

  // A use whose graph is freed while its announcement stands (and the sink not yet released by a
  // backward) delivers nothing: its backward never ran (autograd.grad or backward(inputs=) that
  // did not reach the layer, or a loss dropped without a backward), so the announcement goes with
  // the graph. Only within the iteration that made it: a later iteration's ledger owes it nothing.
  // (Under DDP's forward a forgotten backward is still reported: DDP announced the autograd-hook
  // contributions too.)
  ~SinkUse() {
    if (!announced || !sink) return;
    try {
      if (sink->iteration() == iteration) withdraw();
    } catch (...) {  // a destructor must not throw; the ledger then reports the use at finish
    }
  }
};

}  // namespace fp8dp
