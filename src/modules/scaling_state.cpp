// Delayed-scaling state per module and the per-process registry that update_fp8_scales() walks.
#include "modules/scaling_state.h"

#include <ATen/ATen.h>

#include <cfloat>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "common/check.h"

namespace fp8dp {
namespace {

struct Registry {
  std::mutex mu;
  int64_t next_id = 0;
  std::map<int64_t, ScalingState*> states;  // ordered by creation: the same order on every rank
  std::vector<int64_t> collected;           // ids behind the last registry_amaxes() result
};

Registry& registry() {
  static Registry r;
  return r;
}

Format role_format(Role r, const Recipe& recipe) {
  return r == Role::kGradOutput ? recipe.bwd_format : recipe.fwd_format;
}

}  // namespace

const char* role_name(Role r) {
  switch (r) {
    case Role::kInput:
      return "input";
    case Role::kWeight:
      return "weight";
    case Role::kGradOutput:
      return "grad_output";
  }
  return "?";
}

ScalingState::ScalingState() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  id_ = reg.next_id++;
  reg.states[id_] = this;
}

ScalingState::~ScalingState() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.states.erase(id_);
}

void ScalingState::place(const at::Device& device) {
  if (!unplaced_ || amax_history_.device() == device) return;
  // A checkpoint loaded into a module that had not cast yet (e.g. resuming on a GPU).
  for (at::Tensor* t : {&amax_history_, &scale_, &scale_inv_, &fp8_max_}) *t = t->to(device);
}

void ScalingState::allocate(const Recipe& recipe, const at::Device& device) {
  place(device);
  unplaced_ = false;
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t len = recipe.amax_history_len;
  if (!amax_history_.defined()) {
    amax_history_ = at::zeros({len, kNumRoles}, f32);
    scale_ = at::ones({kNumRoles}, f32);
    scale_inv_ = at::ones({kNumRoles}, f32);
    fp8_max_ = at::empty({kNumRoles}, f32);
    initialized_.fill(false);
  } else if (amax_history_.size(0) != len) {
    // A recipe with another history length: keep the most recent rows that fit.
    at::Tensor h = at::zeros({len, kNumRoles}, f32);
    const int64_t keep = std::min(len, amax_history_.size(0));
    h.narrow(0, 0, keep).copy_(amax_history_.narrow(0, 0, keep));
    amax_history_ = h;
  }
  FP8DP_CHECK_ARG(amax_history_.device() == device, "FP8 scaling state lives on ",
                  amax_history_.device(), " but a tensor on ", device,
                  " was cast with it (move the module before its first FP8 forward)");
  for (int r = 0; r < kNumRoles; ++r) {
    fp8_max_[r].fill_(fp8_max(role_format(static_cast<Role>(r), recipe)));
  }
  algo_ = recipe.amax_compute_algo;
  margin_ = recipe.margin;
}

at::Tensor ScalingState::prepare_scale(Role role, const Recipe& recipe,
                                       const at::Tensor& device_like,
                                       const std::function<at::Tensor()>& first_amax) {
  allocate(recipe, device_like.device());
  const int r = static_cast<int>(role);
  if (!initialized_[r]) {
    const float a = first_amax().item<float>();
    const float s = compute_scale(a, fp8_max(role_format(role, recipe)), recipe.margin, 1.0f);
    scale_[r].fill_(s);
    scale_inv_[r].fill_(1.0f / s);
    initialized_[r] = true;
  }
  return scale_.narrow(0, r, 1);
}

void ScalingState::record_amax(Role role, const at::Tensor& amax) {
  // Row 0 is the max over every cast of this role in the step (NaN propagates, and keeps the
  // previous scale at the update, C7).
  at::Tensor slot = amax_history_.select(0, 0).narrow(0, static_cast<int>(role), 1);
  slot.copy_(at::maximum(slot, amax.to(slot.device())));
}

Quantized ScalingState::cast(const at::Tensor& x, Role role, const Recipe& recipe,
                             QuantizeOptions opts) {
  at::Tensor s = prepare_scale(role, recipe, x, [&] { return fp8dp::amax(x); });
  Quantized q = quantize(x, s, role_format(role, recipe), opts);
  record_amax(role, q.amax);
  return q;
}

at::Tensor ScalingState::current_amax() const { return amax_history_.select(0, 0); }

ScalingSlot ScalingState::update_slot(const float* row0) {
  ScalingSlot s;
  s.params.amax_history = amax_history_.data_ptr<float>();
  s.params.scale = scale_.data_ptr<float>();
  s.params.scale_inv = scale_inv_.data_ptr<float>();
  s.params.fp8_max = fp8_max_.data_ptr<float>();
  s.params.n = kNumRoles;
  s.params.history_len = amax_history_.size(0);
  s.params.algo = algo_;
  s.params.margin = margin_;
  s.row0 = row0;
  return s;
}

ScalingState::Snapshot ScalingState::snapshot() const {
  Snapshot s;
  if (!allocated()) return s;
  s.amax_history = amax_history_.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
  s.scale = scale_.to(at::kCPU, false, true);
  s.scale_inv = scale_inv_.to(at::kCPU, false, true);
  s.fp8_max = fp8_max_.to(at::kCPU, false, true);
  s.initialized = at::empty({kNumRoles}, at::kBool);
  for (int r = 0; r < kNumRoles; ++r) s.initialized[r].fill_(initialized_[r]);
  s.algo = static_cast<int64_t>(algo_);
  s.margin = margin_;
  return s;
}

void ScalingState::restore(const Snapshot& s) {
  constexpr const char* fn = "set_extra_state";
  if (!s.amax_history.defined()) {
    reset();
    return;
  }
  FP8DP_CHECK_ARG(s.amax_history.dim() == 2 && s.amax_history.size(1) == kNumRoles &&
                      s.amax_history.size(0) >= 1,
                  fn, ": 'amax_history' must be [L, ", kNumRoles, "], got ",
                  s.amax_history.sizes());
  for (const at::Tensor* t : {&s.scale, &s.scale_inv, &s.fp8_max, &s.initialized}) {
    FP8DP_CHECK_ARG(t->defined() && t->numel() == kNumRoles, fn,
                    ": scale, scale_inv, fp8_max and initialized need ", kNumRoles, " elements");
  }
  // The update trusts these (update_fp8_scales can run before the next forward sets them from
  // the recipe), so a corrupt checkpoint is refused here.
  FP8DP_CHECK_ARG(s.algo == static_cast<int64_t>(AmaxAlgo::kMax) ||
                      s.algo == static_cast<int64_t>(AmaxAlgo::kMostRecent),
                  fn, ": 'amax_compute_algo' must be 0 (max) or 1 (most_recent), got ", s.algo);
  FP8DP_CHECK_ARG(std::isfinite(s.margin) && s.margin >= 0.0, fn,
                  ": 'margin' must be finite and >= 0, got ", s.margin);
  // Keep the current device when the state already lives somewhere; else the saved one (CPU).
  unplaced_ = !allocated() || unplaced_;
  const at::Device dev = allocated() ? amax_history_.device() : at::Device(at::kCPU);
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  amax_history_ = s.amax_history.to(f32, false, true).contiguous();
  scale_ = s.scale.to(f32, false, true).contiguous();
  scale_inv_ = s.scale_inv.to(f32, false, true).contiguous();
  fp8_max_ = s.fp8_max.to(f32, false, true).contiguous();
  at::Tensor init = s.initialized.to(at::kCPU).to(at::kBool);
  for (int r = 0; r < kNumRoles; ++r) initialized_[r] = init[r].item<bool>();
  algo_ = static_cast<AmaxAlgo>(s.algo);
  margin_ = static_cast<float>(s.margin);
}

void ScalingState::reset() {
  unplaced_ = false;
  amax_history_ = at::Tensor();
  scale_ = scale_inv_ = fp8_max_ = at::Tensor();
  initialized_.fill(false);
}

at::Tensor current_scale(const at::Tensor& amax, Format format, float margin) {
  // Same float operations as compute_scale(): fp8_max / amax / 2^margin, FLT_MAX on overflow, and
  // 1 when amax says nothing (0, NaN or Inf).
  at::Tensor s = at::div(at::div(at::full_like(amax, fp8_max(format)), amax), std::exp2(margin));
  s = at::where(at::isinf(s), at::full_like(s, FLT_MAX), s);
  const at::Tensor usable = at::logical_and(at::gt(amax, 0.0), at::isfinite(amax));
  return at::where(usable, s, at::ones_like(s));
}

Quantized cast_current(const at::Tensor& x, Format format, float margin, QuantizeOptions opts) {
  return quantize(x, current_scale(fp8dp::amax(x), format, margin), format, opts);
}

at::Tensor registry_amaxes() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::vector<at::Tensor> parts;
  reg.collected.clear();
  // States restored from a checkpoint that no cast has placed yet join the device of the others:
  // an update right after loading a checkpoint into a GPU model would otherwise find them on the
  // CPU beside the GPU states of modules that did cast.
  for (auto& [id, st] : reg.states) {
    if (st->allocated() && !st->unplaced()) {
      const at::Device device = st->amax_history().device();
      for (auto& [other_id, other] : reg.states)
        if (other->allocated() && other->unplaced()) other->place(device);
      break;
    }
  }
  for (auto& [id, st] : reg.states) {
    if (!st->allocated()) continue;
    if (!parts.empty()) {
      FP8DP_CHECK(parts.front().device() == st->current_amax().device(),
                  "update_fp8_scales: FP8 states live on different devices (",
                  parts.front().device(), " and ", st->current_amax().device(),
                  "); one process updates the states of one device");
    }
    parts.push_back(st->current_amax());
    reg.collected.push_back(id);
  }
  if (parts.empty()) return at::empty({0}, at::kFloat);
  return at::cat(parts);
}

void registry_update(const at::Tensor& reduced) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const int64_t n = static_cast<int64_t>(reg.collected.size()) * kNumRoles;
  FP8DP_CHECK_ARG(reduced.dim() == 1 && reduced.numel() == n && reduced.scalar_type() == at::kFloat,
                  "update_fp8_scales: 'reduced' must be float32 [", n,
                  "] (the result of registry_amaxes), got ", reduced.scalar_type(), " ",
                  reduced.sizes());
  if (n == 0) return;
  std::vector<ScalingSlot> slots;
  slots.reserve(reg.collected.size());
  std::optional<at::Device> device;
  at::Tensor values;  // `reduced` on the states' device; kept alive until the update is enqueued
  for (int64_t id : reg.collected) {
    auto it = reg.states.find(id);
    FP8DP_CHECK(it != reg.states.end() && it->second->allocated(),
                "update_fp8_scales: an FP8 state was destroyed between collecting and updating");
    if (!device) {
      device = it->second->amax_history().device();
      values = reduced.to(*device).contiguous();
    }
    // registry_amaxes checked that every collected state lives on one device.
    const int64_t off = static_cast<int64_t>(slots.size()) * kNumRoles;
    slots.push_back(it->second->update_slot(values.data_ptr<float>() + off));
  }
  // One launch for the whole model on CUDA (the per-state updates were one copy and one launch
  // each, 2 x modules launches per step).
  update_scaling_batched(slots, *device);
  reg.collected.clear();
}

int64_t registry_size() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  int64_t n = 0;
  for (auto& [id, st] : reg.states) n += st->allocated() ? 1 : 0;
  return n;
}

}  // namespace fp8dp
