// Delayed-scaling state update (C7) over raw buffers: amax history roll and scale computation.
// Torch-free: src/fp8/scaling_update.h checks tensors and passes pointers down.
#pragma once

#include <cfloat>
#include <cstdint>

#include "fp8/format.h"  // FP8DP_HD

namespace fp8dp {

enum class AmaxAlgo : int { kMax = 0, kMostRecent = 1 };

// State of n tensors that share one history length L:
//   amax_history [L, n]  row 0 collects the current step's amax (max over every cast of the step)
//   scale, scale_inv [n]
//   fp8_max [n]          the format maximum of each tensor (HYBRID mixes 448 and 57344)
// update: amax = max over the finite entries of the L rows (kMax) or of row 0 (kMostRecent), 0 when
// there are none; when amax > 0, scale = fp8_max / amax / 2^margin (an infinite result clamps to
// FLT_MAX), else the scale is kept; scale_inv = 1 / scale. Then the history rolls once: row i
// takes row i-1 (a NaN or Inf entry becomes 0) and row 0 becomes 0.
// A non-finite amax (an Inf or NaN in a cast tensor) is no observation (C7): it neither wins the
// max nor stays in the history, so one bad step cannot pin the scale for L steps.
struct ScalingUpdateParams {
  float* amax_history = nullptr;
  float* scale = nullptr;
  float* scale_inv = nullptr;
  const float* fp8_max = nullptr;
  int64_t n = 0;
  int64_t history_len = 1;
  AmaxAlgo algo = AmaxAlgo::kMax;
  float margin = 0.0f;
};

void update_scaling_cpu(const ScalingUpdateParams& p);

// The two element rules of the update, shared by the CPU and CUDA kernels so they agree bit for
// bit: a history entry takes part in the max only when finite, and the roll stores it as 0 when
// not. (Written with comparisons only, no library call: the same expression on host and device.)
FP8DP_HD bool finite_amax(float a) {
  return a <= FLT_MAX && a >= -FLT_MAX;  // false for NaN (every comparison is) and for +-Inf
}
FP8DP_HD float finite_max(float m, float a) { return (finite_amax(a) && a > m) ? a : m; }
FP8DP_HD float finite_or_zero(float a) { return finite_amax(a) ? a : 0.0f; }

// One state of a batched update: update_scaling's buffers for one [history_len, n] history, and
// row0, the n values that row 0 takes before the update (a step's cross-rank reduced amaxes; null
// keeps row 0). A batch updates every slot as update_scaling would after that copy; the slots
// share nothing, so each may have its own history length, algorithm and margin.
struct ScalingSlot {
  ScalingUpdateParams params;
  const float* row0 = nullptr;
};

void update_scaling_batched_cpu(const ScalingSlot* slots, int64_t count);

// The scale a current-scaling cast uses for a tensor whose amax is `amax` (same rule, no history).
float compute_scale(float amax, float fp8_max, float margin, float previous_scale);

// *scale = compute_scale(*amax, fp8_max, margin, 1): a current-scaling cast's scale from the amax
// its first pass wrote, computed where the amax is (host memory for the CPU version, device memory
// for CUDA: one launch and no host sync instead of a chain of element-wise ops).
void current_scale_cpu(const float* amax, float* scale, float fp8_max, float margin);

#if defined(FP8DP_WITH_CUDA)
void current_scale_cuda(const float* amax, float* scale, float fp8_max, float margin, void* stream);
void update_scaling_cuda(const ScalingUpdateParams& p, void* stream);
// Every slot in ceil(count / kMaxSlotsPerLaunch) launches (the slots travel as kernel parameters;
// one block per slot), so the delayed-scaling update of a whole model is one launch (C7).
// Slots need n <= 256.
inline constexpr int64_t kMaxSlotsPerLaunch = 96;
void update_scaling_batched_cuda(const ScalingSlot* slots, int64_t count, void* stream);
#endif

}  // namespace fp8dp
