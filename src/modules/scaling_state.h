// Per-module FP8 scaling state (the input, weight and grad_output roles) and the per-process
// registry of delayed-scaling states that update_fp8_scales() reduces and updates once per step.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>

#include "fp8/ops.h"
#include "fp8/recipe.h"

namespace fp8dp {

enum class Role : int { kInput = 0, kWeight = 1, kGradOutput = 2 };
constexpr int kNumRoles = 3;
const char* role_name(Role r);

// Delayed scaling of one module's three tensors (C7). Tensors are allocated on the first FP8 cast
// (history length and device come from that cast) and live on the module's device:
//   amax_history [L, 3]: row 0 collects the max amax of every cast of the current step
//   scale, scale_inv, fp8_max [3]
// First scale: a role whose scale was never set takes, on its very first cast, the scale that its
// own amax gives (current scaling once), so step 0 is not cast with an arbitrary scale of 1.
// After that the scale only changes in update_fp8_scales(), from the history.
// Every state registers itself in a per-process registry, ordered by creation, which is the same
// on every rank when the ranks build the same model.
class ScalingState {
 public:
  ScalingState();
  ~ScalingState();
  ScalingState(const ScalingState&) = delete;
  ScalingState& operator=(const ScalingState&) = delete;

  // Casts x for `role` with the recipe's delayed scaling and records the amax in row 0.
  Quantized cast(const at::Tensor& x, Role role, const Recipe& recipe, QuantizeOptions opts);
  // For casts done elsewhere (the fused norm kernel): the scale to use (a [1] view, the first-cast
  // rule applied with `first_amax` when it is needed) and the amax to record afterwards.
  at::Tensor prepare_scale(Role role, const Recipe& recipe, const at::Tensor& device_like,
                           const std::function<at::Tensor()>& first_amax);
  void record_amax(Role role, const at::Tensor& amax);

  bool allocated() const { return amax_history_.defined(); }
  // Restored from a checkpoint and not yet bound to a device by a cast; place() moves such a
  // state's tensors to `device` (it stays unplaced: the first cast still decides).
  bool unplaced() const { return unplaced_; }
  void place(const at::Device& device);
  int64_t id() const { return id_; }
  const at::Tensor& amax_history() const { return amax_history_; }
  const at::Tensor& scale() const { return scale_; }
  const at::Tensor& scale_inv() const { return scale_inv_; }

  // Registry side: row 0 of the history (the step's amaxes), and this state's part of the batched
  // update after the reduction (row0: its kNumRoles reduced amaxes, on the state's device).
  at::Tensor current_amax() const;
  ScalingSlot update_slot(const float* row0);

  // state_dict extra state: undefined tensors when never allocated.
  struct Snapshot {
    at::Tensor amax_history, scale, scale_inv, fp8_max, initialized;  // CPU copies
    int64_t algo = 0;
    double margin = 0.0;
  };
  Snapshot snapshot() const;
  void restore(const Snapshot& s);
  void reset();

 private:
  void allocate(const Recipe& recipe, const at::Device& device);

  int64_t id_;
  at::Tensor amax_history_, scale_, scale_inv_, fp8_max_;
  std::array<bool, kNumRoles> initialized_{};
  // Restored from a checkpoint into a state that had no device yet: the tensors sit on the CPU
  // (where checkpoints keep them) only until the first cast says which device the module is on.
  bool unplaced_ = false;
  AmaxAlgo algo_ = AmaxAlgo::kMax;
  float margin_ = 0.0f;
};

// Current scaling: scale = fp8_max / amax(x) / 2^margin (compute_scale's rule, 1 when amax is 0 or
// not finite), computed on x's device without a host sync; returns the cast.
Quantized cast_current(const at::Tensor& x, Format format, float margin, QuantizeOptions opts);
at::Tensor current_scale(const at::Tensor& amax, Format format, float margin);

// The registry (update_fp8_scales is Python glue around these two calls and one all_reduce):
// registry_amaxes() concatenates row 0 of every allocated state, in registration order, into one
// flat float32 tensor; registry_update(reduced) writes the (cross-rank MAX-reduced) values back and
// runs update_scaling on every state: new scales from the history, history rolled once.
at::Tensor registry_amaxes();
void registry_update(const at::Tensor& reduced);
int64_t registry_size();  // allocated states

}  // namespace fp8dp
