// Delayed-scaling state per module (C7); the registry it joins is in scaling_registry.cpp.
#include "fp8/scaling_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/dispatch.h"
#include "fp8/scaling.h"
#include "fp8/scaling_registry.h"
#include "fp8/scaling_update.h"

namespace fp8dp {
namespace {

Format role_format(Role r, const Recipe& recipe) {
  return r == Role::kGradOutput ? recipe.bwd_format : recipe.fwd_format;
}

// State tensors are training state. Whatever mode the caller runs in, they are created (and
// replaced) as normal tensors that no autograd graph records: tensors made under
// torch.inference_mode() are inference tensors, which training could never update in place again.
struct NormalTensorMode {
  c10::InferenceMode not_inference{false};
  c10::NoGradGuard no_grad;
};

// "[nan, 1, 0.5]": the values of a small tensor, for error messages.
std::string values_of(const at::Tensor& t) {
  const at::Tensor f = t.detach().to(at::kCPU).to(at::kFloat).contiguous().view(-1);
  std::ostringstream os;
  os << "[";
  for (int64_t i = 0; i < f.numel(); ++i) os << (i ? ", " : "") << f.data_ptr<float>()[i];
  os << "]";
  return os.str();
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

ScalingState::ScalingState(const std::string& what) {
  const RegistryEntry e = registry_add(this, what);
  id_ = e.id;
  identity_ = e.default_identity;
}

ScalingState::~ScalingState() { registry_remove(id_, allocated()); }

void ScalingState::set_identity(std::string identity) {
  FP8DP_CHECK_ARG(!identity.empty(), "FP8 scaling state identity must not be empty");
  identity_ = std::move(identity);
  registry_touch();
}

std::string ScalingState::describe() const {
  std::ostringstream os;
  os << identity_ << " [";
  if (!allocated()) {
    os << "no FP8 cast yet]";
  } else {
    os << format_name(fwd_format_) << "/" << format_name(bwd_format_)
       << " history=" << amax_history_.size(0) << " "
       << (algo_ == AmaxAlgo::kMax ? "max" : "most_recent") << " margin=" << margin_ << "]";
  }
  return os.str();
}

void ScalingState::place(const at::Device& device) {
  if (!unplaced_ || amax_history_.device() == device) return;
  // A checkpoint loaded into a module that had not cast yet (e.g. resuming on a GPU).
  NormalTensorMode normal;
  for (at::Tensor* t : {&amax_history_, &scale_, &scale_inv_, &fp8_max_, &seen_}) {
    *t = t->to(device);
  }
}

void ScalingState::allocate(const Recipe& recipe, const at::Device& device) {
  NormalTensorMode normal;
  place(device);
  unplaced_ = false;
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t len = recipe.amax_history_len;
  const bool fresh = !amax_history_.defined();
  if (fresh) {
    amax_history_ = at::zeros({len, kNumRoles}, f32);
    scale_ = at::ones({kNumRoles}, f32);
    scale_inv_ = at::ones({kNumRoles}, f32);
    fp8_max_ = at::empty({kNumRoles}, f32);
    seen_ = at::zeros({kNumRoles}, f32.dtype(at::kBool));
    initialized_.fill(false);
    registry_touch();
  } else if (amax_history_.size(0) != len) {
    // A recipe with another history length: keep the most recent rows that fit.
    at::Tensor h = at::zeros({len, kNumRoles}, f32);
    const int64_t keep = std::min(len, amax_history_.size(0));
    h.narrow(0, 0, keep).copy_(amax_history_.narrow(0, 0, keep));
    amax_history_ = h;
    registry_touch();
  }
  FP8DP_CHECK_ARG(amax_history_.device() == device, "FP8 scaling state lives on ",
                  amax_history_.device(), " but a tensor on ", device,
                  " was cast with it (move the module before its first FP8 forward)");
  // Only when the formats can have changed: this runs before every cast, and three fills per cast
  // were three kernel launches (and their host time) per role and step.
  if (fresh || fwd_format_ != recipe.fwd_format || bwd_format_ != recipe.bwd_format) {
    for (int r = 0; r < kNumRoles; ++r) {
      fp8_max_[r].fill_(fp8_max(role_format(static_cast<Role>(r), recipe)));
    }
  }
  if (algo_ != recipe.amax_compute_algo || margin_ != recipe.margin ||
      fwd_format_ != recipe.fwd_format || bwd_format_ != recipe.bwd_format) {
    registry_touch();  // the recipe is part of the cross-rank signature (C9)
  }
  algo_ = recipe.amax_compute_algo;
  margin_ = recipe.margin;
  fwd_format_ = recipe.fwd_format;
  bwd_format_ = recipe.bwd_format;
}

bool ScalingState::has_scale(int r) {
  if (initialized_[r]) return true;
  if (seen_.defined() && seen_[r].item<bool>()) initialized_[r] = true;  // see note_reduced
  return initialized_[r];
}

at::Tensor ScalingState::prepare_scale(Role role, const Recipe& recipe,
                                       const at::Tensor& device_like,
                                       const std::function<at::Tensor()>& first_amax) {
  const int r = static_cast<int>(role);
  if (c10::InferenceMode::is_enabled()) {
    // Inference changes no training state (see the header): no allocation, no first scale.
    if (allocated() && has_scale(r)) return scale_.narrow(0, r, 1).to(device_like.device());
    if (device_like.numel() == 0) {
      return at::ones({1}, device_like.options().dtype(at::kFloat));
    }
    return current_scale(first_amax(), role_format(role, recipe), recipe.margin);
  }
  allocate(recipe, device_like.device());
  // C9: an empty cast is not an amax observation, so it cannot choose the first scale either
  // (it would fix the scale at 1 until the next update). Nor can a cast whose amax is 0 (an
  // all-zero first gradient) or NaN / Inf (C7): it is cast with scale 1 (compute_scale keeps the
  // 1 it is given) and the role stays without a scale, so that its next non-empty cast, or an
  // update from another rank's finite amax (note_reduced), chooses it. Marking the role as set here
  // cast the next step with scale 1 (and, with a NaN in the history, the next amax_history_len).
  if (!has_scale(r) && device_like.numel() > 0) {
    const float a = first_amax().item<float>();
    const float s = compute_scale(a, fp8_max(role_format(role, recipe)), recipe.margin, 1.0f);
    scale_[r].fill_(s);
    scale_inv_[r].fill_(1.0f / s);
    initialized_[r] = a > 0.0f && std::isfinite(a);
  }
  return role_views().scale_r[r];
}

const ScalingState::RoleViews& ScalingState::role_views() {
  if (!views_.hist.is_same(amax_history_) || !views_.scale.is_same(scale_)) {
    views_.hist = amax_history_;
    views_.scale = scale_;
    const at::Tensor row0 = amax_history_.select(0, 0);
    for (int r = 0; r < kNumRoles; ++r) {
      views_.scale_r[r] = scale_.narrow(0, r, 1);
      views_.amax_r[r] = row0.narrow(0, r, 1);
    }
  }
  return views_;
}

at::Tensor ScalingState::amax_slot(Role role, int64_t numel) {
  // C9: an empty cast says nothing about the range; an inference cast changes no training state.
  if (numel == 0 || c10::InferenceMode::is_enabled()) return at::Tensor();
  registry_mark_observed();
  // Row 0 is the max over every cast of this role in the step (NaN propagates; the update counts a
  // non-finite row 0 as no observation, C7). Row-major [L, roles]: the slot is one contiguous
  // float.
  return role_views().amax_r[static_cast<int>(role)];
}

Quantized ScalingState::cast(const at::Tensor& x, Role role, const Recipe& recipe,
                             QuantizeOptions opts) {
  at::Tensor s = prepare_scale(role, recipe, x, [&] { return fp8dp::amax(x); });
  return quantize(x, s, role_format(role, recipe), opts, amax_slot(role, x.numel()));
}

Quantized ScalingState::cast_parts(at::TensorList parts, Role role, const Recipe& recipe,
                                   QuantizeOptions opts) {
  FP8DP_CHECK_ARG(!parts.empty(), identity_, ": cast_parts needs at least one part");
  // The parts share one shape (quantize_parts checks it), so parts[0] stands for the device and
  // for whether the cast is empty.
  const int64_t numel = parts[0].numel() * static_cast<int64_t>(parts.size());
  at::Tensor s = prepare_scale(role, recipe, parts[0], [&] { return amax_parts(parts); });
  return quantize_parts(parts, s, role_format(role, recipe), opts, amax_slot(role, numel));
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

void ScalingState::note_reduced(const at::Tensor& reduced) {
  // Only while a role has no scale of its own (the first steps, or a role never cast here, such
  // as grad_output in evaluation): afterwards this costs nothing.
  if (initialized_[0] && initialized_[1] && initialized_[2]) return;
  NormalTensorMode normal;
  seen_.logical_or_(at::logical_and(at::gt(reduced, 0.0), at::isfinite(reduced)));
}

ScalingState::Snapshot ScalingState::snapshot() const {
  Snapshot s;
  if (!allocated()) return s;
  s.amax_history = amax_history_.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
  s.scale = scale_.to(at::kCPU, false, true);
  s.scale_inv = scale_inv_.to(at::kCPU, false, true);
  s.fp8_max = fp8_max_.to(at::kCPU, false, true);
  // A role whose scale an update set from another rank's amax has a scale too.
  const at::Tensor seen = seen_.to(at::kCPU);
  s.initialized = at::empty({kNumRoles}, at::kBool);
  for (int r = 0; r < kNumRoles; ++r) {
    s.initialized[r].fill_(initialized_[r] || seen[r].item<bool>());
  }
  s.algo = static_cast<int64_t>(algo_);
  s.margin = margin_;
  return s;
}

void ScalingState::restore(const Snapshot& s, const std::string& where) {
  const std::string& fn = where;
  if (!s.amax_history.defined()) {
    reset();
    return;
  }
  FP8DP_CHECK_ARG(s.amax_history.dim() == 2 && s.amax_history.size(1) == kNumRoles &&
                      s.amax_history.size(0) >= 1,
                  fn, ": 'amax_history' must be [L, ", kNumRoles, "] with L >= 1, got ",
                  s.amax_history.sizes());
  const std::pair<const char*, const at::Tensor*> vectors[] = {{"scale", &s.scale},
                                                               {"scale_inv", &s.scale_inv},
                                                               {"fp8_max", &s.fp8_max},
                                                               {"initialized", &s.initialized}};
  for (const auto& [key, t] : vectors) {
    FP8DP_CHECK_ARG(t->defined() && t->numel() == kNumRoles, fn, ": '", key, "' must have ",
                    kNumRoles, " elements (input, weight, grad_output), got ",
                    t->defined() ? t->sizes() : at::IntArrayRef{});
  }
  const std::pair<const char*, const at::Tensor*> floats[] = {{"amax_history", &s.amax_history},
                                                              {"scale", &s.scale},
                                                              {"scale_inv", &s.scale_inv},
                                                              {"fp8_max", &s.fp8_max}};
  for (const auto& [key, t] : floats) {
    FP8DP_CHECK_ARG(at::isFloatingType(t->scalar_type()), fn, ": '", key,
                    "' must be a floating-point tensor, got ", t->scalar_type());
  }
  // The update and the casts trust these (update_fp8_scales can run before the next forward sets
  // them from the recipe, and the CUDA quantize does not check its scale), so a corrupt
  // checkpoint is refused here.
  FP8DP_CHECK_ARG(s.algo == static_cast<int64_t>(AmaxAlgo::kMax) ||
                      s.algo == static_cast<int64_t>(AmaxAlgo::kMostRecent),
                  fn, ": 'amax_compute_algo' must be 0 (max) or 1 (most_recent), got ", s.algo);
  FP8DP_CHECK_ARG(std::isfinite(s.margin) && s.margin >= 0.0 && s.margin <= kMaxMargin, fn,
                  ": 'margin' must be finite, >= 0 and <= ", kMaxMargin,
                  " (log2(448 / 2^-6): past it even the amax casts below E4M3's normals), got ",
                  s.margin);
  for (const auto& [key, t] : {floats[1], floats[2]}) {
    const at::Tensor v = t->detach().to(at::kCPU).to(at::kFloat);
    FP8DP_CHECK_ARG(at::logical_and(at::isfinite(v), at::gt(v, 0.0)).all().item<bool>(), fn, ": '",
                    key, "' must hold finite values > 0, got ", values_of(v));
  }
  const at::Tensor fmax = s.fp8_max.detach().to(at::kCPU).to(at::kFloat).contiguous().view(-1);
  auto format_of = [](float m, Format* f) {
    if (m == fp8_max(Format::kE4M3))
      *f = Format::kE4M3;
    else if (m == fp8_max(Format::kE5M2))
      *f = Format::kE5M2;
    else
      return false;
    return true;
  };
  Format fwd = Format::kE4M3, weight_fmt = Format::kE4M3, bwd = Format::kE5M2;
  const float* m = fmax.data_ptr<float>();
  FP8DP_CHECK_ARG(format_of(m[0], &fwd) && format_of(m[1], &weight_fmt) && format_of(m[2], &bwd) &&
                      fwd == weight_fmt,
                  fn, ": 'fp8_max' must be the format maxima [f, f, g] of input, weight and ",
                  "grad_output, each 448 (E4M3) or 57344 (E5M2), got ", values_of(fmax));
  const at::Tensor hist = s.amax_history.detach().to(at::kCPU).to(at::kFloat);
  const at::Tensor negative = at::lt(hist, 0.0);  // NaN and Inf are amaxes too (C7 skips them)
  FP8DP_CHECK_ARG(!negative.any().item<bool>(), fn,
                  ": 'amax_history' must hold amaxes >= 0 (NaN and Inf allowed), got ",
                  hist.masked_select(negative)[0].item<float>(), " at row ",
                  negative.nonzero()[0][0].item<int64_t>());

  NormalTensorMode normal;
  if (allocated() && !unplaced_ && amax_history_.sizes() == s.amax_history.sizes()) {
    // In place: the tensors keep their addresses (a captured CUDA graph reads them by pointer).
    amax_history_.copy_(s.amax_history.detach().view_as(amax_history_));
    scale_.copy_(s.scale.detach().reshape({kNumRoles}));
    scale_inv_.copy_(s.scale_inv.detach().reshape({kNumRoles}));
    fp8_max_.copy_(s.fp8_max.detach().reshape({kNumRoles}));
    seen_.zero_();
  } else {
    // Keep the current device when the state already lives somewhere; else the saved one (CPU).
    unplaced_ = !allocated() || unplaced_;
    const at::Device dev = allocated() ? amax_history_.device() : at::Device(at::kCPU);
    auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
    amax_history_ = s.amax_history.detach().to(f32, false, true).contiguous();
    scale_ = s.scale.detach().to(f32, false, true).contiguous().view({kNumRoles});
    scale_inv_ = s.scale_inv.detach().to(f32, false, true).contiguous().view({kNumRoles});
    fp8_max_ = s.fp8_max.detach().to(f32, false, true).contiguous().view({kNumRoles});
    seen_ = at::zeros({kNumRoles}, f32.dtype(at::kBool));
  }
  at::Tensor init = s.initialized.detach().to(at::kCPU).to(at::kBool).contiguous().view(-1);
  for (int r = 0; r < kNumRoles; ++r) initialized_[r] = init[r].item<bool>();
  algo_ = static_cast<AmaxAlgo>(s.algo);
  margin_ = static_cast<float>(s.margin);
  fwd_format_ = fwd;
  bwd_format_ = bwd;
  registry_touch();
  // A checkpoint taken mid-step carries that step's amaxes in row 0: the next update uses them.
  if (at::ne(hist[0], 0.0).any().item<bool>()) registry_mark_observed();
}

std::string ScalingState::capture_refusal(const Recipe& recipe, bool with_grad_output) {
  std::ostringstream os;
  if (!allocated() || unplaced_) {
    os << "has not cast in FP8 on its device yet";
  } else if (amax_history_.size(0) != recipe.amax_history_len) {
    os << "has an amax history of length " << amax_history_.size(0)
       << " but the recipe asks for amax_history_len=" << recipe.amax_history_len;
  } else if (fwd_format_ != recipe.fwd_format || bwd_format_ != recipe.bwd_format) {
    os << "casts with " << format_name(fwd_format_) << "/" << format_name(bwd_format_)
       << " but the recipe asks for " << format_name(recipe.fwd_format) << "/"
       << format_name(recipe.bwd_format);
  } else {
    for (int r = 0; r < (with_grad_output ? kNumRoles : 2); ++r) {
      if (!has_scale(r)) {
        os << "has no scale for " << role_name(static_cast<Role>(r))
           << " yet (every cast of it so far saw only zeros, or it was never cast)";
        break;
      }
    }
  }
  return os.str();
}

void ScalingState::reset() {
  if (allocated()) registry_touch();
  unplaced_ = false;
  amax_history_ = at::Tensor();
  scale_ = scale_inv_ = fp8_max_ = seen_ = at::Tensor();
  views_ = RoleViews{};
  initialized_.fill(false);
}

at::Tensor current_scale(const at::Tensor& amax, Format format, float margin) {
  // compute_scale()'s rule (fp8_max / amax / 2^margin, FLT_MAX on overflow, 1 when amax says
  // nothing: 0, NaN or Inf) where the amax lives: one launch on CUDA. It was ten element-wise ATen
  // ops, each a launch, which made current scaling host-bound.
  FP8DP_CHECK(amax.scalar_type() == at::kFloat && amax.numel() == 1 && amax.is_contiguous(),
              "current_scale: amax must be one contiguous float32, got ", amax.scalar_type(), " ",
              amax.sizes());
  at::Tensor s = at::empty({1}, amax.options());
  dispatch_kernel(amax.device(), current_scale_cpu, FP8DP_CUDA_KERNEL(current_scale_cuda),
                  static_cast<const float*>(amax.data_ptr<float>()), s.data_ptr<float>(),
                  fp8_max(format), margin);
  return s;
}

Quantized cast_current(const at::Tensor& x, Format format, float margin, QuantizeOptions opts) {
  return quantize(x, current_scale(fp8dp::amax(x), format, margin), format, opts);
}

}  // namespace fp8dp
