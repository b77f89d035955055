// Gradient ledger (contracts C2 and C8 made checkable): records every contribution of every
// parameter in every micro-batch and, at the end of the iteration, reports any parameter with a
// missing or duplicated one. A contribution is one arrival by any route (grad_sink.h): the DDP hook
// (with p.grad, or without when an external consumer moved it), the fused GEMM in backward, or the
// deferred GEMM of backward_dw(), which counts against the micro-batch whose backward queued it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "grad_buffer/grad_sink.h"

namespace fp8dp {

class Ledger {
 public:
  explicit Ledger(std::vector<std::string> names);

  // A micro-batch's forward began (DDP's forward calls this).
  void begin_microbatch();
  // The current micro-batch (0-based; 0 before any forward), for a deferred gradient to name its
  // own micro-batch when it arrives later.
  int64_t current_microbatch() const { return std::max<int64_t>(microbatches_, 1) - 1; }
  // microbatch: the one the contribution belongs to, or -1 for the current one.
  void record(int64_t p, Route route, int64_t microbatch = -1);

  // Checks the iteration and starts the next one. The first checked iteration learns how many
  // contributions each parameter makes per micro-batch (its uses in one forward); it must be the
  // same in every micro-batch and at least one. Returns "" when every parameter has microbatches x
  // uses contributions, else a message naming each parameter that has too few or too many.
  std::string end_iteration();
  void reset();

  int64_t microbatches() const { return microbatches_; }

 private:
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> per_microbatch_;  // [param][microbatch] contributions
  std::vector<int64_t> routes_[kNumRoutes];                    // [route][param] contributions
  std::vector<int64_t> uses_;                         // learned contributions per micro-batch
  int64_t microbatches_ = 0;
  bool learned_ = false;
};

}  // namespace fp8dp
