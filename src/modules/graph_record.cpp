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

bool GraphRecord::note_wgrad(const std::shared_ptr<LinearCore>& core, const WgradTask& task) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!active_ || phase_ != Phase::kBackward) return false;
  auto t = std::make_shared<Template>();
  t->core = core;
  t->task = task;
  if (t->task.sink) t->task.sink = real_sink(t->task.sink);
  t->task.weight_token = t->task.bias_token = GradSink::Token{};
  backward_steps_.push_back(BackwardStep{SinkEvent{}, static_cast<int64_t>(templates_.size())});
  templates_.push_back(std::move(t));
  return true;
}

std::shared_ptr<GradSink> GraphRecord::sink_for(const std::shared_ptr<GradSink>& real) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& s : sinks_)
    if (s->real() == real) return s;
  // A layer's autograd context may keep the sink past this record (an output of the capture kept
  // alive): its calls then go nowhere.
  std::weak_ptr<GraphRecord> self = weak_from_this();
  FP8DP_CHECK(!self.expired(), "GraphRecord: must be owned by a std::shared_ptr");
  sinks_.push_back(std::make_shared<RecordingSink>(real, [self](SinkEvent e) {
    if (const auto r = self.lock()) r->record(std::move(e));
  }));
  return sinks_.back();
}

void GraphRecord::record(SinkEvent e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!active_ || phase_ == Phase::kWarmup) return;  // the warm-up's gradients go nowhere
  if (phase_ == Phase::kForward) {
    forward_events_.push_back(std::move(e));
  } else {
    backward_steps_.push_back(BackwardStep{std::move(e), -1});
  }
}

int64_t GraphRecord::wgrad_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(templates_.size());
}

std::shared_ptr<GraphRecord::Template> GraphRecord::template_at(int64_t i, const char* fn) const {
  std::lock_guard<std::mutex> lock(mu_);
  FP8DP_CHECK_ARG(i >= 0 && i < static_cast<int64_t>(templates_.size()), "GraphRecord.", fn,
                  ": index must be in [0, ", templates_.size(), "), got ", i);
  return templates_[static_cast<size_t>(i)];
}

void GraphRecord::capture_wgrad(int64_t i) {
  const auto t = template_at(i, "capture_wgrad");
  t->result = run_wgrad(t->task);
}

void GraphRecord::set_wgrad_replay(int64_t i, std::function<void()> replay) {
  FP8DP_CHECK_ARG(static_cast<bool>(replay), "GraphRecord.set_wgrad_replay: needs a callable");
  template_at(i, "set_wgrad_replay")->replay = std::move(replay);
}

namespace {
const void* address(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
}  // namespace

void GraphRecord::watch_state(const std::shared_ptr<LinearCore>& core) {
  std::lock_guard<std::mutex> lock(mu_);
  ScalingState& s = core->scaling();
  watched_.push_back({core, address(s.amax_history()), address(s.scale()), address(s.scale_inv())});
}

void GraphRecord::before_forward() const {
  before_replay("forward");
  std::lock_guard<std::mutex> lock(mu_);
  for (const Watched& w : watched_) {
    ScalingState& s = w.core->scaling();
    FP8DP_CHECK(address(s.amax_history()) == w.history && address(s.scale()) == w.scale &&
                    address(s.scale_inv()) == w.scale_inv,
                w.core->config().name,
                ": its FP8 scaling state was replaced since capture (set_extra_state or "
                "load_state_dict with another amax history length, or a reset); the graphs read "
                "the old tensors. Capture again");
  }
}

void GraphRecord::before_backward(const ReplayUse& use) const {
  before_replay("backward");
  FP8DP_CHECK(!use.consumed(), "a graphed callable's backward ran twice for one forward");
  std::lock_guard<std::mutex> lock(mu_);
  for (const BackwardStep& s : backward_steps_) {
    if (s.tmpl < 0 && s.event.kind == SinkEvent::Kind::kCheck)
      s.event.sink->check_accepting(s.event.p, s.event.route, s.event.counted);
  }
}

std::shared_ptr<ReplayUse> GraphRecord::replay_forward() {
  auto use = std::make_shared<ReplayUse>();
  std::lock_guard<std::mutex> lock(mu_);
  if (observed_[0]) registry_mark_observed();
  for (const Recipe& r : recipes_) registry_note_recipe(r);
  use->announce(forward_events_);
  return use;
}

void GraphRecord::before_replay(const char* what) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& t : templates_) {
    FP8DP_CHECK(t->queued == 0, t->core->config().name,
                ": the weight gradient queued by the previous backward of this graphed callable "
                "has not run yet; call backward_dw() after each backward of a graphed callable "
                "(the queued GEMM reads the graphs' static buffers, which this ",
                what, " would overwrite)");
    FP8DP_CHECK(static_cast<bool>(t->replay), t->core->config().name,
                ": its weight-gradient graph was never captured (make_graphed_callables did "
                "not finish)");
  }
}

void GraphRecord::replay_backward(ReplayUse& use) {
  std::vector<std::shared_ptr<LinearCore>> cores;
  std::vector<std::shared_ptr<Template>> templates;
  std::vector<BackwardStep> steps;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (observed_[1]) registry_mark_observed();
    cores = grad_added_;
    templates = templates_;
    steps = backward_steps_;
  }
  use.consume();
  // Calls into Python (the weight attribute), so not under the lock.
  for (const auto& core : cores) core->mark_grad_added_to_main_grad();
  for (const BackwardStep& s : steps) {
    if (s.tmpl < 0) {
      const SinkEvent& e = s.event;
      const int64_t mb = use.of(e.sink).microbatch;
      if (e.kind == SinkEvent::Kind::kDeliver) {
        e.sink->deliver(e.p, at::Tensor(), e.route, GradSink::Token{mb, -1, {}});
      } else if (e.kind == SinkEvent::Kind::kWithdraw) {
        e.sink->withdraw(e.p, mb);
      } else if (e.kind == SinkEvent::Kind::kAnnounce) {
        e.sink->announce(e.p);  // a reentrant recompute announces in backward
      }
      continue;
    }
    const auto& t = templates[static_cast<size_t>(s.tmpl)];
    WgradTask task = t->task;
    if (task.sink) {  // bound: the tokens of this micro-batch, as route_wgrad asks eagerly
      const int64_t mb = use.of(task.sink).microbatch;
      task.weight_token = task.sink->expect(task.sink_weight, mb, t->core->sink_name());
      if (task.dy.defined() && task.sink_bias >= 0)
        task.bias_token = task.sink->expect(task.sink_bias, mb, t->core->sink_name());
    }
    // Copies of the static outputs: backward_dw may make one the weight's .grad, which the next
    // replay of the dw graph must not overwrite.
    task.replay = [t] {
      --t->queued;
      t->replay();
      WgradResult r;
      if (t->result.dweight.defined()) r.dweight = t->result.dweight.clone();
      if (t->result.dbias.defined()) r.dbias = t->result.dbias.clone();
      return r;
    };
    ++t->queued;
    t->core->enqueue(std::move(task));
  }
}

int64_t GraphRecord::grad_added_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(grad_added_.size());
}

}  // namespace fp8dp
