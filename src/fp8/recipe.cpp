// The fp8_autocast stack.
#include "fp8/recipe.h"

#include <cmath>
#include <mutex>
#include <vector>

#include "common/check.h"

namespace fp8dp {
namespace {

std::mutex& stack_mutex() {
  static std::mutex m;
  return m;
}

std::vector<AutocastState>& stack() {
  static std::vector<AutocastState> s;
  return s;
}

}  // namespace

void autocast_enter(bool enabled, const Recipe& recipe) {
  FP8DP_CHECK_ARG(!enabled || recipe.kind != RecipeKind::kDelayed || recipe.amax_history_len >= 1,
                  "fp8_autocast: amax_history_len must be >= 1, got ", recipe.amax_history_len);
  if (enabled && recipe.kind == RecipeKind::kBlock) {
    for (const BlockQParams* q : {&recipe.block_inp, &recipe.block_weight, &recipe.block_grad})
      FP8DP_CHECK_ARG(std::isfinite(q->amax_epsilon) && q->amax_epsilon >= 0.0f,
                      "fp8_autocast: Float8BlockScaling amax_epsilon must be finite and >= 0, got ",
                      q->amax_epsilon);
  }
  std::lock_guard<std::mutex> lock(stack_mutex());
  stack().push_back(AutocastState{enabled, recipe});
}

void autocast_exit() {
  std::lock_guard<std::mutex> lock(stack_mutex());
  FP8DP_CHECK(!stack().empty(), "fp8_autocast: exit without a matching enter");
  stack().pop_back();
}

AutocastState autocast_current() {
  std::lock_guard<std::mutex> lock(stack_mutex());
  return stack().empty() ? AutocastState{} : stack().back();
}

int64_t autocast_depth() {
  std::lock_guard<std::mutex> lock(stack_mutex());
  return static_cast<int64_t>(stack().size());
}

}  // namespace fp8dp
