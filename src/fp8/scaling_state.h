// Per-module FP8 scaling state (the input, weight and grad_output roles). Every state joins the
// per-process registry that update_fp8_scales() reduces and updates once per step
// (scaling_registry.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "fp8/cast.h"
#include "fp8/recipe.h"

namespace fp8dp {

enum class Role : int { kInput = 0, kWeight = 1, kGradOutput = 2 };
constexpr int kNumRoles = 3;
const char* role_name(Role r);

// Delayed scaling of one module's three tensors (C7). Tensors are allocated on the first FP8 cast
// (history length and device come from that cast) and live on the module's device:
//   amax_history [L, 3]: row 0 collects the max amax of every cast of the current step
//   scale, scale_inv, fp8_max [3]
// First scale: a role whose scale was never set takes, on its very first non-empty cast, the scale
// that its own amax gives (current scaling once), so step 0 is not cast with an arbitrary scale
// of 1. A cast whose amax is 0 or NaN / Inf is no observation (C7): it is cast with scale 1 and
// the role's next cast chooses again. After that the scale only changes in update_fp8_scales(),
// from the history (whose max skips non-finite amaxes, scaling.h).
// Empty casts (0 elements, e.g. a 0-token micro-batch) are not amax observations (C9): they join
// the registry (the module took part in the step) but record no amax and set no first scale.
// Inference (torch.inference_mode()) never changes this state: see prepare_scale.
// Every state registers itself in a per-process registry under an identity (C9): the module's
// name in the model that DistributedDataParallel wraps (set_identity), or until then
// "unnamed #k <what>", k counting the states created with the same `what` in this process.
class ScalingState {
 public:
  explicit ScalingState(const std::string& what = "ScalingState");
  ~ScalingState();
  ScalingState(const ScalingState&) = delete;
  ScalingState& operator=(const ScalingState&) = delete;

  // Casts x for `role` with the recipe's delayed scaling and records the amax in row 0.
  Quantized cast(const at::Tensor& x, Role role, const Recipe& recipe, QuantizeOptions opts);
  // The same for x given as column blocks (quantize_parts, fp8/cast.h), read where they lie.
  Quantized cast_parts(at::TensorList parts, Role role, const Recipe& recipe, QuantizeOptions opts);
  // For casts done elsewhere (the fused norm kernel): the scale to use (a [1] tensor, the
  // first-cast rule applied with `first_amax` when it is needed) and where the cast records its
  // amax: amax_slot(role, numel) is the [1] view of row 0 that the kernel max-merges into (its
  // amax_into argument; no launches of its own), or undefined when nothing is recorded (`numel`,
  // the number of elements cast, is 0); a defined slot marks the step as observed.
  // Under torch.inference_mode() prepare_scale allocates and initialises nothing and amax_slot
  // records nothing: an inference cast uses the scale that training set, or, for a role that has
  // none yet, the scale its own amax gives (current scaling, not kept). Evaluation must not move
  // training's scales, and tensors made in inference mode could never be updated in place by
  // training afterwards. (Casts under torch.no_grad() do record: that is a normal forward.)
  at::Tensor prepare_scale(Role role, const Recipe& recipe, const at::Tensor& device_like,
                           const std::function<at::Tensor()>& first_amax);
  at::Tensor amax_slot(Role role, int64_t numel);

  bool allocated() const { return amax_history_.defined(); }
  // Restored from a checkpoint and not yet bound to a device by a cast; place() moves such a
  // state's tensors to `device` (it stays unplaced: the first cast still decides).
  bool unplaced() const { return unplaced_; }
  void place(const at::Device& device);
  int64_t id() const { return id_; }
  const at::Tensor& amax_history() const { return amax_history_; }
  const at::Tensor& scale() const { return scale_; }
  const at::Tensor& scale_inv() const { return scale_inv_; }

  // C9: the identity that orders this state in the registry's reduction and names it in errors.
  const std::string& identity() const { return identity_; }
  void set_identity(std::string identity);
  // identity plus the recipe this state casts with ("E4M3/E5M2 history=16 max margin=0"): what
  // every rank must agree on, one entry per state, for the cross-rank reduction to be right.
  std::string describe() const;

  // Registry side: row 0 of the history (the step's amaxes), and this state's part of the batched
  // update after the reduction (row0: its kNumRoles reduced amaxes, on the state's device).
  at::Tensor current_amax() const;
  ScalingSlot update_slot(const float* row0);
  // After the batched update: `reduced` holds this state's kNumRoles reduced amaxes. A role that
  // no cast of this process initialised yet, but that another rank observed, now has the scale the
  // update made from that amax; remember that on the device (no host sync), so that this rank's
  // first cast keeps it instead of taking its own (the ranks' scales stay equal).
  void note_reduced(const at::Tensor& reduced);

  // state_dict extra state: undefined tensors when never allocated.
  struct Snapshot {
    at::Tensor amax_history, scale, scale_inv, fp8_max, initialized;  // CPU copies
    int64_t algo = 0;
    double margin = 0.0;
  };
  Snapshot snapshot() const;
  // Validates everything first (ValueError naming `where`, the key and what came), then restores.
  // A state that is allocated on a device with the snapshot's history length is written in place
  // (its tensors keep their addresses, so a CUDA graph that captured them stays valid:
  // fp8dp.make_graphed_callables); otherwise its tensors are replaced.
  void restore(const Snapshot& s, const std::string& where = "set_extra_state");
  void reset();

  // Why a CUDA graph that casts with `recipe` (delayed scaling) cannot capture this state yet, or
  // "" when it can: the state must be allocated on its device with the recipe's history length
  // and formats, and every role the graph casts (`roles`: input and weight, plus grad_output
  // when the graph runs backward) must have a scale. Otherwise the cast allocates, fills or
  // reads the device on the host (the first-cast rule), none of which a replay repeats. May read
  // the device (a role set by another rank's amax, note_reduced): never call it under capture.
  std::string capture_refusal(const Recipe& recipe, bool with_grad_output);

 private:
  void allocate(const Recipe& recipe, const at::Device& device);
  // True when role r has a scale (initialised by a cast, restored, or set by an update from an
  // amax another rank observed); may read the device (only while the role has no scale yet).
  bool has_scale(int r);
  // The [1] views scale_[r] and amax_history_[0][r], made once per pair of tensors (rebuilt when
  // either was replaced: allocation, a new history length, place(), restore()). Each narrow /
  // select is several dispatcher calls on the host, and every cast asked for two: ~700 per step of
  // a GPT block stack. The cache holds the tensors it was made from, so is_same cannot be fooled
  // by a freed tensor's address coming back.
  struct RoleViews {
    at::Tensor hist, scale;
    std::array<at::Tensor, kNumRoles> scale_r, amax_r;
  };
  const RoleViews& role_views();
  RoleViews views_;

  int64_t id_;
  std::string identity_;
  at::Tensor amax_history_, scale_, scale_inv_, fp8_max_;
  at::Tensor seen_;  // bool [3]: an update gave the role a scale from a reduced amax > 0
  std::array<bool, kNumRoles> initialized_{};
  // Restored from a checkpoint into a state that had no device yet: the tensors sit on the CPU
  // (where checkpoints keep them) only until the first cast says which device the module is on.
  bool unplaced_ = false;
  AmaxAlgo algo_ = AmaxAlgo::kMax;
  float margin_ = 0.0f;
  Format fwd_format_ = Format::kE4M3, bwd_format_ = Format::kE5M2;
};

// Current scaling: scale = fp8_max / amax(x) / 2^margin (compute_scale's rule, 1 when amax is 0 or
// not finite), computed on x's device without a host sync; returns the cast.
Quantized cast_current(const at::Tensor& x, Format format, float margin, QuantizeOptions opts);
at::Tensor current_scale(const at::Tensor& amax, Format format, float margin);

}  // namespace fp8dp
