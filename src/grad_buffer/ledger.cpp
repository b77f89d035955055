#include "grad_buffer/ledger.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "common/check.h"

namespace fp8dp {

Ledger::Ledger(std::vector<std::string> names)
    : names_(std::move(names)), per_microbatch_(names_.size()), uses_(names_.size(), 0) {
  for (auto& r : routes_) r.assign(names_.size(), 0);
}

void Ledger::begin_microbatch() {
  ++microbatches_;
  for (auto& v : per_microbatch_) v.resize(microbatches_, 0);
}

const char* route_name(Route r) {
  switch (r) {
    case Route::kAutograd:
      return "added from .grad";
    case Route::kNone:
      return "hook without .grad";
    case Route::kFused:
      return "fused GEMM";
    case Route::kDelayed:
      return "backward_dw";
  }
  return "?";
}

void Ledger::record(int64_t p, Route route, int64_t microbatch) {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(names_.size()),
                  "param index: expected in [0, ", names_.size(), "), got ", p);
  // A contribution before any forward (a gradient computed outside the wrapped model's forward)
  // still counts, against micro-batch 1.
  const int64_t mb = microbatch >= 0 ? microbatch : current_microbatch();
  if (static_cast<int64_t>(per_microbatch_[p].size()) <= mb) per_microbatch_[p].resize(mb + 1, 0);
  ++per_microbatch_[p][mb];
  ++routes_[static_cast<int>(route)][p];
}

std::string Ledger::end_iteration() {
  std::ostringstream err;
  const int64_t n = std::max<int64_t>(microbatches_, 1);
  for (size_t p = 0; p < names_.size(); ++p) {
    const auto& v = per_microbatch_[p];
    const int64_t total = std::accumulate(v.begin(), v.end(), int64_t{0});
    int64_t expected;
    if (learned_) {
      expected = uses_[p] * n;
    } else {
      // Learn from the micro-batch with the fewest contributions: a duplicate in one micro-batch of
      // the first iteration then shows as an excess instead of being learned.
      int64_t lo = v.empty() ? 0 : v[0];
      for (int64_t c : v) lo = std::min(lo, c);
      if (static_cast<int64_t>(v.size()) < n) lo = 0;
      uses_[p] = lo;
      expected = lo * n;
      if (lo == 0) {  // a micro-batch without this parameter's gradient: every use contributes
        const int64_t hi = v.empty() ? 0 : *std::max_element(v.begin(), v.end());
        expected = std::max<int64_t>(hi, 1) * n;
      }
    }
    // Per micro-batch too: a use lost in one micro-batch and doubled in another keeps the total.
    bool uneven = false;
    if (learned_)
      for (int64_t k = 0; k < n; ++k)
        uneven = uneven || (k < static_cast<int64_t>(v.size()) ? v[k] : 0) != uses_[p];
    if (total != expected || uneven) {
      err << "\n  '" << names_[p] << "': " << total << " contributions in " << n
          << " micro-batch(es), expected " << expected;
      if (total != expected)
        err << " (" << (total < expected ? "missing " : "duplicated ")
            << (total < expected ? expected - total : total - expected) << ")";
      else
        err << " (" << uses_[p] << " in each)";
      err << "; per micro-batch:";
      for (size_t k = 0; k < v.size(); ++k) err << (k ? "," : " ") << v[k];
      err << "; routes:";
      for (int r = 0; r < kNumRoutes; ++r)
        err << (r ? ", " : " ") << route_name(static_cast<Route>(r)) << " " << routes_[r][p];
    }
  }
  std::string msg = err.str();
  if (msg.empty()) {
    learned_ = true;
  } else {
    msg =
        "gradient ledger: each micro-batch's gradient must enter main_grad exactly once per use "
        "(contract C2), but:" +
        msg;
  }
  reset();
  return msg;
}

void Ledger::reset() {
  microbatches_ = 0;
  for (auto& v : per_microbatch_) v.clear();
  for (auto& r : routes_) std::fill(r.begin(), r.end(), 0);
}

}  // namespace fp8dp
