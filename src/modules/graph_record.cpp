// GraphRecord (graph_record.h): records and re-issues the host work of captured fp8dp layers.
#include "modules/graph_record.h"

#include <algorithm>
#include <atomic>

#include "common/check.h"
#include "fp8/scaling_registry.h"
#include "modules/linear_core.h"

namespace fp8dp {
namespace {

std::atomic<GraphRecord*> g_active{nullptr};

bool same_block(const BlockQParams& a, const BlockQParams& b) {
  return a.power_2_scale == b.power_2_scale && a.amax_epsilon == b.amax_epsilon;
}

bool same_recipe(const Recipe& a, const Recipe& b) {
  return a.kind == b.kind && a.fwd_format == b.fwd_format && a.bwd_format == b.bwd_format &&
         a.amax_history_len == b.amax_history_len && a.amax_compute_algo == b.amax_compute_algo &&
         a.margin == b.margin && a.split_accumulator_fprop == b.split_accumulator_fprop &&
         a.split_accumulator_dgrad == b.split_accumulator_dgrad &&
         a.split_accumulator_wgrad == b.split_accumulator_wgrad &&
         a.fprop_high_precision == b.fprop_high_precision &&
         a.dgrad_high_precision == b.dgrad_high_precision &&
         a.wgrad_high_precision == b.wgrad_high_precision && same_block(a.block_inp, b.block_inp) &&
         same_block(a.block_weight, b.block_weight) && same_block(a.block_grad, b.block_grad);
}

}  // namespace

GraphRecord* active_graph_record() { return g_active.load(); }

bool same_autocast(const AutocastState& a, const AutocastState& b) {
  return a.enabled == b.enabled && (!a.enabled || same_recipe(a.recipe, b.recipe));
}

void GraphRecord::begin(Phase phase) {
  GraphRecord* expected = nullptr;
  FP8DP_CHECK(g_active.compare_exchange_strong(expected, this),
              "make_graphed_callables: another capture of fp8dp layers is in progress in this "
              "process; capture one set of callables at a time");
  std::lock_guard<std::mutex> lock(mu_);
  active_ = true;
  phase_ = phase;
  saved_observed_ = registry_observed();
  registry_set_observed(false);
}

void GraphRecord::end() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!active_) return;
  active_ = false;
  if (phase_ != Phase::kWarmup) observed_[phase_ == Phase::kForward ? 0 : 1] = registry_observed();
  registry_set_observed(saved_observed_);
  g_active.store(nullptr);
}

void GraphRecord::note_recipe(const Recipe& recipe) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!active_ || phase_ != Phase::kForward) return;
  const bool known = std::any_of(recipes_.begin(), recipes_.end(),
                                 [&](const Recipe& r) { return same_recipe(r, recipe); });
  if (!known) recipes_.push_back(recipe);
}

void GraphRecord::note_grad_added(const std::shared_ptr<LinearCore>& core) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!active_ || phase_ != Phase::kBackward) return;
  if (std::find(grad_added_.begin(), grad_added_.end(), core) == grad_added_.end())
    grad_added_.push_back(core);
}

void GraphRecord::replay_forward() {
  std::lock_guard<std::mutex> lock(mu_);
  if (observed_[0]) registry_mark_observed();
  for (const Recipe& r : recipes_) registry_note_recipe(r);
}

void GraphRecord::replay_backward() {
  std::vector<std::shared_ptr<LinearCore>> cores;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (observed_[1]) registry_mark_observed();
    cores = grad_added_;
  }
  // Calls into Python (the weight attribute), so not under the lock.
  for (const auto& core : cores) core->mark_grad_added_to_main_grad();
}

int64_t GraphRecord::grad_added_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(grad_added_.size());
}

}  // namespace fp8dp
