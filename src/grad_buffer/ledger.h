// Gradient ledger (contracts C2 and C8 made checkable): for every parameter and micro-batch, the
// contributions the forward announced against the ones that arrived, by any route (grad_sink.h):
// the DDP hook (with p.grad, or without when an external consumer moved it), the fused GEMM in
// backward, or the deferred GEMM of backward_dw(), which counts against the micro-batch whose
// forward announced it. At the end of the iteration any difference is reported, naming the
// parameter, the micro-batch and the routes. Because the forward announces what each micro-batch
// will deliver, parameters that are unused, or used only in some micro-batches, are exact too.
//
// Which micro-batch an autograd-hook contribution belongs to: the hook does not say, and under
// pipeline parallelism the forwards run ahead of the backwards (F0 F1 B0 F2 B1 ...), so "the
// latest forward" is wrong there. DDP's forward puts a hook on its outputs that names the
// micro-batch whose backward begins (set_backward_microbatch); an autograd contribution counts
// against that one. When it owes nothing more (one backward through several micro-batches'
// outputs summed), the oldest micro-batch that still owes the parameter one takes it; when none
// does, it is reported as counted twice. A forward inside a backward (the recompute of a
// checkpoint around DDP itself) begins no micro-batch: it repeats one (ddp.py).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "grad_buffer/route.h"

namespace fp8dp {

class Ledger {
 public:
  explicit Ledger(std::vector<std::string> names);

  // A micro-batch's forward began (DDP's forward calls this).
  void begin_microbatch();
  // The current micro-batch (0-based; 0 before any forward), for a deferred gradient to name its
  // own micro-batch when it arrives later.
  int64_t current_microbatch() const { return std::max<int64_t>(microbatches_, 1) - 1; }
  // Micro-batch mb (0-based; -1: the current one) will deliver one contribution of p (announced
  // during its forward: one per backward that reaches p's autograd hook, one per fp8dp use that
  // delivers to the sink; or during its backward, by a reentrant checkpoint's recompute).
  void expect(int64_t p, int64_t mb = -1);
  // Takes back one expect(p, mb) (mb -1: the current micro-batch): that use's gradient will not
  // come (torch.autograd.grad captured it). A no-op when nothing was announced for it (the ledger
  // was reset since: zero_grad_buffer() between the forward and the backward).
  void unexpect(int64_t p, int64_t mb);
  // One contribution of p arrived. microbatch: the one it belongs to, or -1 for an autograd-hook
  // contribution: the backward's micro-batch (else the current one), as the header says.
  void record(int64_t p, Route route, int64_t microbatch = -1);
  // The backward of micro-batch mb (0-based) began; -1: no backward named (the current forward's
  // micro-batch is assumed). begin_microbatch() clears it.
  void set_backward_microbatch(int64_t mb) { backward_microbatch_ = mb; }

  // Checks the iteration and starts the next one: "" when every parameter received exactly what
  // each micro-batch announced, else a message naming each parameter and micro-batch that got too
  // few (lost) or too many (counted twice).
  std::string end_iteration();
  // The same check without starting the next iteration (a refused finish_grad_sync() that changed
  // nothing keeps the counts, so the call can be repeated once the cause is fixed).
  std::string check() const;
  void reset();

  int64_t microbatches() const { return microbatches_; }

 private:
  // The micro-batch an autograd-hook contribution of p counts against (see the header comment).
  int64_t attribute(int64_t p) const;

  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> expected_;  // [param][microbatch]
  std::vector<std::vector<int64_t>> received_;  // [param][microbatch]
  std::vector<int64_t> routes_[kNumRoutes];     // [route][param] contributions
  int64_t microbatches_ = 0;
  int64_t backward_microbatch_ = -1;
};

}  // namespace fp8dp
