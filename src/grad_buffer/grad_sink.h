// GradSink: how a layer that writes weight gradients itself (the fused GEMM of C2 b, the deferred
// GEMM of C3) hands them to the owner of main_grad, without putting a stand-in gradient into
// autograd. GradSync implements it; DistributedDataParallel binds it to every fp8dp module it
// wraps. Header only: src/modules depends on this interface, not on the grad buffer.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "grad_buffer/route.h"

namespace fp8dp {

class GradSink {
 public:
  virtual ~GradSink() = default;

  // main_grad of parameter p (a view that lives as long as the sink).
  virtual at::Tensor main_grad(int64_t p) const = 0;
  // The parameter the sink knows as p, to check that a layer still uses the one it was bound to.
  virtual const at::Tensor& param(int64_t p) const = 0;

  // The micro-batch whose forward is running (for the ledger), and the announcement, during that
  // forward, of one gradient of p that this use will deliver to the sink (fused or delayed), so
  // that the ledger (when on) knows what each micro-batch owes.
  virtual int64_t microbatch() const = 0;
  virtual void announce(int64_t p) = 0;
  // Takes back one announcement of p for `microbatch`: the use's gradient was captured by
  // torch.autograd.grad (C14) instead, so it will never be delivered.
  virtual void withdraw(int64_t p, int64_t microbatch) = 0;

  // Backward queued a weight gradient of p for backward_dw() (C3). Every expected gradient must be
  // delivered before finish_grad_sync(), or it reports the parameter as never delivered. Returns
  // the token to deliver it with: it names the micro-batch (whose forward announced it) and the
  // iteration it belongs to.
  struct Token {
    int64_t microbatch = -1;
    int64_t iteration = -1;
    std::string module;  // who queued it
    // Whether readiness counts its delivery (it was queued while readiness was counting, i.e.
    // outside no_sync(): the last micro-batch's): set by expect(), carried back by deliver().
    bool counted = false;
  };
  // module: the queueing module's name in the model, for the error that names a forgotten one.
  virtual Token expect(int64_t p, int64_t microbatch, const std::string& module) = 0;
  // The iteration a queued gradient must belong to; zero_grad_buffer() and a failed
  // finish_grad_sync() start a new one, so gradients queued before are stale and must be dropped.
  virtual int64_t iteration() const = 0;

  // Whether a gradient of p by `route` would be accepted now (phase, C11; readiness, C5): throws
  // the error deliver() would throw, but BEFORE a layer writes anything. The fused GEMM accumulates
  // into main_grad before it delivers, and backward_dw() pops its queue before it delivers, so
  // both ask first; a refusal then leaves main_grad, the queue and the counts as they were.
  // counted_delivery: for Route::kDelayed, the token's `counted`.
  virtual void check_accepting(int64_t p, Route route, bool counted_delivery) = 0;

  // One use's gradient of p arrives: `grad` is added to main_grad (undefined when the GEMM already
  // accumulated into main_grad), then p counts ready (C5). `token` is the one expect() returned for
  // a delayed gradient; for one computed in backward it carries the forward's micro-batch only.
  virtual void deliver(int64_t p, const at::Tensor& grad, Route route, Token token) = 0;
};

}  // namespace fp8dp
