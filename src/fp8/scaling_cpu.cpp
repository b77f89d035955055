// CPU delayed-scaling update: one call updates every tensor of a step (C7).
#include <cfloat>
#include <cmath>
#include <cstring>

#include "common/check.h"
#include "fp8/scaling.h"

namespace fp8dp {

float compute_scale(float amax, float fp8_max, float margin, float previous_scale) {
  // An amax of 0 (tensor never seen or all zeros) or non-finite (overflow upstream) says nothing
  // about the range to expect, so the previous scale stays.
  if (!(amax > 0.0f) || !std::isfinite(amax)) return previous_scale;
  float s = fp8_max / amax / std::exp2(margin);
  if (std::isinf(s)) s = FLT_MAX;  // amax so small that fp8_max / amax overflows
  return s;
}

void current_scale_cpu(const float* amax, float* scale, float fp8_max, float margin) {
  *scale = compute_scale(*amax, fp8_max, margin, 1.0f);
}

void update_scaling_cpu(const ScalingUpdateParams& p) {
  FP8DP_CHECK(p.history_len >= 1, "update_scaling: history_len must be >= 1, got ", p.history_len);
  FP8DP_CHECK(p.n >= 0, "update_scaling: n must be >= 0, got ", p.n);
  const int64_t n = p.n, L = p.history_len;
  float* h = p.amax_history;
  for (int64_t t = 0; t < n; ++t) {
    // The max over the finite entries only: a NaN or Inf amax (one overflowed cast) is no
    // observation, and letting it win would keep the scale for the L steps it stays in the window.
    float amax = finite_max(0.0f, h[t]);
    if (p.algo == AmaxAlgo::kMax) {
      for (int64_t i = 1; i < L; ++i) amax = finite_max(amax, h[i * n + t]);
    }
    p.scale[t] = compute_scale(amax, p.fp8_max[t], p.margin, p.scale[t]);
    p.scale_inv[t] = 1.0f / p.scale[t];
  }
  // The roll writes non-finite entries as 0 (no observation), so none enters the history.
  for (int64_t i = L - 1; i >= 1; --i) {
    for (int64_t t = 0; t < n; ++t) h[i * n + t] = finite_or_zero(h[(i - 1) * n + t]);
  }
  for (int64_t t = 0; t < n; ++t) h[t] = 0.0f;
}

void update_scaling_batched_cpu(const ScalingSlot* slots, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const ScalingSlot& s = slots[i];
    if (s.row0 != nullptr && s.params.n > 0) {
      std::memcpy(s.params.amax_history, s.row0, static_cast<size_t>(s.params.n) * sizeof(float));
    }
    update_scaling_cpu(s.params);
  }
}

}  // namespace fp8dp
