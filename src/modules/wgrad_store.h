// WeightGradStore: the FIFO of deferred weight-gradient GEMMs of one module (C3), and the one
// function that runs such a GEMM, used by both the immediate and the deferred route so that they
// give bit-identical gradients.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>

#include "grad_buffer/grad_sink.h"

namespace fp8dp {

struct WgradResult {
  at::Tensor dweight;  // undefined when fused into main_grad
  at::Tensor dbias;    // undefined in FP8 mode (computed eagerly in backward, C4)
};

// dW = a · bᵀ with a = dyᵀ [out, tokens] and b = xᵀ [in, tokens] (FP8 with scale_inv, or high
// precision, where a and b are transpose views of dy and x: gemm.h's column-major operands),
// written into main_grad (fused) or returned.
struct WgradTask {
  at::Tensor a, a_scale_inv, b, b_scale_inv;
  bool use_split_accumulator = true;  // FP8 on CUDA: the recipe's split_accumulator_wgrad
  at::Tensor dy;  // [tokens, out] high precision: the bias gradient without FP8, else undefined
  at::Tensor weight, bias;  // the parameters (variables) the gradients belong to
  // Fused route: where dW accumulates. Always accumulated (beta = 1, C2 b): only
  // zero_grad_buffer() zeroes main_grad, so the order in which uses and micro-batches run their
  // weight-gradient GEMMs cannot lose or overwrite one of them.
  at::Tensor main_grad;
  // Set when DistributedDataParallel bound its gradient sink to the module: the result goes to the
  // sink (weight and bias indices there, -1 when not managed), with the tokens from expect().
  std::shared_ptr<GradSink> sink;
  int64_t sink_weight = -1, sink_bias = -1;
  GradSink::Token weight_token, bias_token;
  // Set by a replayed CUDA graph (GraphRecord::replay_backward): runs the captured GEMM instead and
  // returns its results (copies of the graph's static outputs); delivery is as for any task.
  std::function<WgradResult()> replay;
};

WgradResult run_wgrad(const WgradTask& t);

// Bias gradient of the high-precision route: column sums of dy in FP32, in dy's parameter dtype.
at::Tensor bias_grad_hp(const at::Tensor& dy, at::ScalarType dtype);

class WeightGradStore {
 public:
  void push(WgradTask t) { q_.push_back(std::move(t)); }
  // Oldest first. The caller checks empty() (and names its module in the error).
  WgradTask pop() {
    WgradTask t = std::move(q_.front());
    q_.pop_front();
    return t;
  }
  const WgradTask& front() const { return q_.front(); }
  bool empty() const { return q_.empty(); }
  int64_t size() const { return static_cast<int64_t>(q_.size()); }

 private:
  std::deque<WgradTask> q_;
};

}  // namespace fp8dp
