#include "grad_buffer/readiness.h"

#include "common/check.h"

namespace fp8dp {

Readiness::Readiness(std::vector<int64_t> group_of_param, std::vector<std::string> names,
                     int64_t num_groups)
    : group_of_param_(std::move(group_of_param)),
      names_(std::move(names)),
      params_of_group_(num_groups),
      count_(group_of_param_.size(), 0),
      golden_(group_of_param_.size(), 0),
      outstanding_(group_of_param_.size(), 0),
      uncounted_(group_of_param_.size(), 0),
      pending_(num_groups, 0) {
  FP8DP_CHECK_ARG(names_.size() == group_of_param_.size(), "names: expected ",
                  group_of_param_.size(), " names, got ", names_.size());
  for (size_t p = 0; p < group_of_param_.size(); ++p) {
    const int64_t g = group_of_param_[p];
    FP8DP_CHECK_ARG(g >= 0 && g < num_groups, "group_of_param[", p, "]: expected in [0, ",
                    num_groups, "), got ", g);
    params_of_group_[g].push_back(static_cast<int64_t>(p));
  }
}

bool Readiness::update(int64_t p, bool was) {
  if (!golden_known_) return false;  // the first iteration learns; nothing completes
  const bool now = done(p);
  if (now == was) return false;
  const int64_t g = group_of_param_[p];
  if (!now) {
    ++pending_[g];
    return false;
  }
  return --pending_[g] == 0;
}

void Readiness::check_mark(int64_t p) const {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(count_.size()),
                  "param index: expected in [0, ", count_.size(), "), got ", p);
  if (golden_known_)
    FP8DP_CHECK(count_[p] < golden_[p], "parameter '", names_[p], "' was reported ready ",
                count_[p] + 1, " times in this iteration but ", golden_[p],
                " times in the first one: its gradient would be counted twice (is a hook firing "
                "twice, or is backward_dw() called more often than backward?)");
}

void Readiness::check_mark_delivery(int64_t p) const {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(count_.size()),
                  "param index: expected in [0, ", count_.size(), "), got ", p);
  FP8DP_CHECK(outstanding_[p] > 0, "parameter '", names_[p],
              "': backward_dw() delivered a gradient that no backward of this iteration queued "
              "(is backward_dw() called more often than backward?)");
}

bool Readiness::mark(int64_t p) {
  check_mark(p);
  const bool was = done(p);
  ++count_[p];
  any_reported_ = true;
  return update(p, was);
}

void Readiness::expect_delivery(int64_t p) {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(count_.size()),
                  "param index: expected in [0, ", count_.size(), "), got ", p);
  const bool was = done(p);
  ++outstanding_[p];
  any_reported_ = true;
  update(p, was);
}

bool Readiness::mark_delivery(int64_t p) {
  check_mark_delivery(p);
  const bool was = done(p);
  --outstanding_[p];
  return update(p, was);
}

void Readiness::expect_uncounted(int64_t p) {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(count_.size()),
                  "param index: expected in [0, ", count_.size(), "), got ", p);
  const bool was = done(p);
  ++uncounted_[p];
  update(p, was);
}

bool Readiness::mark_uncounted_delivery(int64_t p) {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(count_.size()),
                  "param index: expected in [0, ", count_.size(), "), got ", p);
  FP8DP_CHECK(uncounted_[p] > 0, "parameter '", names_[p],
              "': backward_dw() delivered a gradient that no backward of this iteration queued "
              "(is backward_dw() called more often than backward?)");
  const bool was = done(p);
  --uncounted_[p];
  return update(p, was);
}

std::vector<std::string> Readiness::incomplete(int64_t g) const {
  std::vector<std::string> out;
  if (!golden_known_) return out;
  for (int64_t p : params_of_group_[g]) {
    if (done(p)) continue;
    std::string s = "'" + names_[p] + "' (ready " + std::to_string(count_[p]) + " of " +
                    std::to_string(golden_[p]);
    if (outstanding_[p] + uncounted_[p] > 0)
      s += ", " + std::to_string(outstanding_[p] + uncounted_[p]) +
           " queued for backward_dw() not delivered";
    out.push_back(s + ")");
  }
  return out;
}

int64_t Readiness::first_at_golden() const {
  if (!golden_known_) return -1;
  for (size_t p = 0; p < count_.size(); ++p)
    if (golden_[p] > 0 && count_[p] >= golden_[p]) return static_cast<int64_t>(p);
  return -1;
}

void Readiness::end_iteration() {
  if (!golden_known_) {
    bool any = false;
    for (int64_t c : count_) any = any || c > 0;
    if (any) {
      golden_ = count_;
      golden_known_ = true;
    }
  }
  reset();
}

void Readiness::reset() {
  std::fill(count_.begin(), count_.end(), 0);
  std::fill(outstanding_.begin(), outstanding_.end(), 0);
  std::fill(uncounted_.begin(), uncounted_.end(), 0);
  any_reported_ = false;
  for (size_t g = 0; g < params_of_group_.size(); ++g) {
    pending_[g] = 0;
    if (golden_known_)
      for (int64_t p : params_of_group_[g]) pending_[g] += golden_[p] > 0 ? 1 : 0;
  }
}

}  // namespace fp8dp
