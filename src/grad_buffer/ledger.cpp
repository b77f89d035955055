#include "grad_buffer/ledger.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "common/check.h"

namespace fp8dp {

Ledger::Ledger(std::vector<std::string> names)
    : names_(std::move(names)), expected_(names_.size()), received_(names_.size()) {
  for (auto& r : routes_) r.assign(names_.size(), 0);
}

void Ledger::begin_microbatch() {
  ++microbatches_;
  backward_microbatch_ = -1;
}

namespace {

void bump(std::vector<int64_t>& v, int64_t mb) {
  if (static_cast<int64_t>(v.size()) <= mb) v.resize(mb + 1, 0);
  ++v[mb];
}

int64_t at(const std::vector<int64_t>& v, int64_t mb) {
  return mb < static_cast<int64_t>(v.size()) ? v[mb] : 0;
}

}  // namespace

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

void Ledger::expect(int64_t p, int64_t mb) {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(names_.size()),
                  "param index: expected in [0, ", names_.size(), "), got ", p);
  FP8DP_CHECK_ARG(mb >= -1 && mb <= current_microbatch(),
                  "micro-batch: expected -1 (the current one) or a forward's index in [0, ",
                  current_microbatch(), "], got ", mb);
  bump(expected_[p], mb < 0 ? current_microbatch() : mb);
}

void Ledger::unexpect(int64_t p, int64_t mb) {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(names_.size()),
                  "param index: expected in [0, ", names_.size(), "), got ", p);
  if (mb < 0) mb = current_microbatch();
  if (at(expected_[p], mb) > 0) --expected_[p][mb];
}

void Ledger::record(int64_t p, Route route, int64_t microbatch) {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(names_.size()),
                  "param index: expected in [0, ", names_.size(), "), got ", p);
  // A contribution before any forward (a gradient computed outside the wrapped model's forward)
  // counts against micro-batch 1, which announced nothing for it: reported as counted twice.
  if (microbatch < 0) microbatch = attribute(p);
  bump(received_[p], microbatch);
  ++routes_[static_cast<int>(route)][p];
}

int64_t Ledger::attribute(int64_t p) const {
  const int64_t preferred = backward_microbatch_ >= 0 ? backward_microbatch_ : current_microbatch();
  const auto& want = expected_[p];
  const auto& got = received_[p];
  const auto owes = [&](int64_t mb) { return at(got, mb) < at(want, mb); };
  if (owes(preferred)) return preferred;
  for (int64_t mb = 0; mb < static_cast<int64_t>(want.size()); ++mb)
    if (owes(mb)) return mb;
  return preferred;
}

std::string Ledger::end_iteration() {
  std::string msg = check();
  reset();
  return msg;
}

std::string Ledger::check() const {
  std::ostringstream err;
  for (size_t p = 0; p < names_.size(); ++p) {
    const auto& want = expected_[p];
    const auto& got = received_[p];
    const int64_t n = static_cast<int64_t>(std::max(want.size(), got.size()));
    std::ostringstream bad;
    for (int64_t mb = 0; mb < n; ++mb) {
      const int64_t w = at(want, mb), g = at(got, mb);
      if (w == g) continue;
      bad << (bad.tellp() > 0 ? "; " : " ") << "micro-batch " << mb + 1 << ": " << g << " of " << w
          << " (" << (g < w ? "missing " : "duplicated ") << (g < w ? w - g : g - w) << ")";
    }
    if (bad.tellp() == 0) continue;
    err << "\n  '" << names_[p] << "':" << bad.str() << "; routes:";
    for (int r = 0; r < kNumRoutes; ++r)
      err << (r ? ", " : " ") << route_name(static_cast<Route>(r)) << " " << routes_[r][p];
  }
  std::string msg = err.str();
  if (!msg.empty())
    msg =
        "gradient ledger: each micro-batch's gradient must enter main_grad exactly once per use "
        "(contracts C2, C8), but (contributions received of announced):" +
        msg;
  return msg;
}

void Ledger::reset() {
  microbatches_ = 0;
  backward_microbatch_ = -1;
  for (auto& v : expected_) v.clear();
  for (auto& v : received_) v.clear();
  for (auto& r : routes_) std::fill(r.begin(), r.end(), 0);
}

}  // namespace fp8dp
