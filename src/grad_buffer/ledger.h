// Gradient ledger (contract C2 made checkable): records every contribution of every parameter in
// every micro-batch and, at the end of the iteration, reports any parameter with a missing or
// duplicated one. A contribution is one run of the DDP hook for the parameter, whatever route the
// gradient took (added from .grad, already fused into main_grad, or moved there by an external
// consumer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp8dp {

enum class Route { kAccumulated, kFused, kExternal };

class Ledger {
 public:
  explicit Ledger(std::vector<std::string> names);

  // A micro-batch's forward began (DDP's forward calls this).
  void begin_microbatch();
  void record(int64_t p, Route route);

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
  std::vector<int64_t> routes_[3];                    // [route][param] contributions
  std::vector<int64_t> uses_;                         // learned contributions per micro-batch
  int64_t microbatches_ = 0;
  bool learned_ = false;
};

}  // namespace fp8dp
