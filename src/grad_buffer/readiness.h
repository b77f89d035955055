// Readiness by counts (contracts C5, C11): which bucket groups are complete for the last
// micro-batch. A parameter's reports come in two kinds:
// - learned: the autograd hook (one call per backward that reaches the parameter, with or without a
//   gradient) and the fused GEMM's delivery in backward. Their number per micro-batch depends on
//   the graph, not on the route a gradient takes, so the first iteration learns it as the golden
//   count (more than one when the parameter is used several times);
// - expected: a weight (or, without FP8, bias) gradient that backward queued for backward_dw()
//   (C3). Backward announces each one (expect_delivery) before the parameter's autograd hook runs,
//   and backward_dw() delivers it later. Whether the deferred GEMM makes the bias gradient depends
//   on FP8 (C4), so these are counted exactly, per micro-batch, never learned: FP8 switched on or
//   off between iterations changes nothing that was learned.
// A parameter is done when its learned count is golden and nothing expected is outstanding; a
// group completes when all of its parameters are. A queued gradient of an earlier micro-batch
// (queued under no_sync(), so not counted) that backward_dw() delivers only after the last
// micro-batch's backward blocks completion too (expect_uncounted): otherwise the last
// micro-batch's other reports (another use of a tied weight, or another module's delivery) could
// complete and launch the group, and the late delivery would find it being reduced.
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

  // Counts one learned report of p. Returns true when this report completed p's group (only once
  // the golden counts are known). Throws fp8dp::Error naming p when p was already reported as often
  // as in the first iteration: a gradient that would be counted twice.
  bool mark(int64_t p);
  // Throws what mark(p) / mark_delivery(p) would throw, counting nothing (a layer asks before its
  // GEMM writes into main_grad: GradSink::check_accepting).
  void check_mark(int64_t p) const;
  void check_mark_delivery(int64_t p) const;
  // Backward queued a gradient of p that backward_dw() will deliver: p is not done until it is.
  void expect_delivery(int64_t p);
  // The queued gradient of p announced by expect_delivery() arrived. Returns true when this
  // completed p's group (as mark()). Throws fp8dp::Error when none was outstanding.
  bool mark_delivery(int64_t p);
  // The same for a gradient queued under no_sync() (an earlier micro-batch's): it is not counted
  // (nothing is learned from it) but p is not done until it is delivered. Returns true when the
  // delivery completed p's group; the caller launches it only outside no_sync().
  void expect_uncounted(int64_t p);
  bool mark_uncounted_delivery(int64_t p);

  bool golden_known() const { return golden_known_; }
  // Some report was counted in this iteration (mark() or expect_delivery(): outside no_sync()).
  // An iteration without any (no micro-batch, or all inside no_sync()) is not a partial one.
  bool any_reported() const { return any_reported_; }
  // The first parameter already reported as often as in the first iteration (its next report
  // would be refused by mark()), or -1; always -1 while the golden counts are not known.
  int64_t first_at_golden() const;
  // Parameters of group g that are not done, as "name (ready n of m)" strings (with the number of
  // gradients still queued for backward_dw(), when any).
  std::vector<std::string> incomplete(int64_t g) const;
  bool complete(int64_t g) const { return golden_known_ && pending_[g] == 0; }
  // Ends the iteration: the first iteration with any learned report learns the counts as golden.
  void end_iteration();
  // Forgets this iteration's counts (keeps the golden ones).
  void reset();

  int64_t count(int64_t p) const { return count_[p]; }
  int64_t golden(int64_t p) const { return golden_[p]; }
  int64_t outstanding(int64_t p) const { return outstanding_[p]; }

 private:
  bool done(int64_t p) const {
    return count_[p] == golden_[p] && outstanding_[p] == 0 && uncounted_[p] == 0;
  }
  // p's done-ness changed from `was`: keeps pending_ of its group in step; true when the group
  // just completed.
  bool update(int64_t p, bool was);

  std::vector<int64_t> group_of_param_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> params_of_group_;
  std::vector<int64_t> count_, golden_, outstanding_, uncounted_;
  std::vector<int64_t> pending_;  // per group: parameters (with golden > 0) not done
  bool golden_known_ = false;
  bool any_reported_ = false;
};

}  // namespace fp8dp
