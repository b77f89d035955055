// Readiness by counts (contract C5): which bucket groups are complete for the last micro-batch.
// The first iteration learns the golden count of every parameter (how often its gradient is
// reported ready in one micro-batch: more than once when it is used several times in one forward);
// later iterations complete a group the moment each of its parameters reached its golden count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp8dp {

class Readiness {
 public:
  // group_of_param[p]: the bucket group of parameter p; names[p]: its name for error messages.
  Readiness(std::vector<int64_t> group_of_param, std::vector<std::string> names,
            int64_t num_groups);

  // Counts one readiness report of p. Returns true when this report completed p's group (only once
  // the golden counts are known). Throws fp8dp::Error naming p when p was already reported as often
  // as in the first iteration: a gradient that would be counted twice.
  bool mark(int64_t p);

  bool golden_known() const { return golden_known_; }
  // Parameters of group g whose count is not yet golden, as "name (ready n of m)" strings.
  std::vector<std::string> incomplete(int64_t g) const;
  bool complete(int64_t g) const { return golden_known_ && pending_[g] == 0; }
  // Ends the iteration: the first iteration with any report learns the counts as golden.
  void end_iteration();
  // Forgets this iteration's counts (keeps the golden ones).
  void reset();

  int64_t count(int64_t p) const { return count_[p]; }
  int64_t golden(int64_t p) const { return golden_[p]; }

 private:
  std::vector<int64_t> group_of_param_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> params_of_group_;
  std::vector<int64_t> count_, golden_;
  std::vector<int64_t> pending_;  // per group: parameters below their golden count
  bool golden_known_ = false;
};

}  // namespace fp8dp
