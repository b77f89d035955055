// GraphRecord: the host work of fp8dp layers inside CUDA graphs made by
// fp8dp.make_graphed_callables (python/fp8dp/graph.py), and its re-issue at every replay.
//
// A replay runs the captured kernels only. What a layer does on the host during a forward or a
// backward happens once, at capture (capture_check.h lists it). Two such effects matter for a
// layer that is not bound to DistributedDataParallel and queues no weight gradient:
//   - C9: a delayed-scaling cast marks the step's amaxes as observed; without the mark
//     update_fp8_scales() updates nothing and every scale freezes. The casts' amaxes themselves
//     are written by the captured kernels into row 0 of each state's history, whose address
//     stays fixed (the update and ScalingState::restore write in place), so replays record them.
//     A stateless recipe (current, block) is noted for the cross-rank check instead.
//   - C2 b: the fused route sets weight.grad_added_to_main_grad (a Python attribute) before its
//     GEMM accumulates into main_grad; the GEMM is in the graph, the flag is not.
// While a record is active (begin/end), the layers let delayed scaling and the fused route be
// captured (capture_refusal's `recorded`, plan_wgrad) and report those effects here; a capture
// phase also takes back the observed mark that the capture itself left, since no kernel ran.
// replay_forward / replay_backward then do what each phase's host code did. DDP-bound layers,
// delay_wgrad_compute and is_first_microbatch=False stay refused (their host work is the
// gradient accounting itself; docs/cuda_graphs_design.md says how a later version records it).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fp8/recipe.h"

namespace fp8dp {

class LinearCore;

class GraphRecord {
 public:
  // kWarmup: the layers' host work runs for real (the caller saves and restores what it changes);
  // kForward / kBackward: a capture, whose host effects are recorded for that phase's replays.
  enum class Phase { kWarmup, kForward, kBackward };

  // Makes this record the active one (process-wide: autograd runs backward on its own threads),
  // and saves and clears the registry's observed mark: warm-up amaxes are put back by the caller
  // (make_graphed_callables restores every state), and a capture observes nothing.
  void begin(Phase phase);
  // No record is active afterwards; a capture phase notes whether its host code marked observed;
  // the saved mark is put back.
  void end();

  // Called by the layers while this record is active.
  void note_recipe(const Recipe& recipe);
  void note_grad_added(const std::shared_ptr<LinearCore>& core);

  // The host effects of the captured forward / backward, once per replay of it.
  void replay_forward();
  void replay_backward();

  bool forward_observed() const { return observed_[0]; }
  bool backward_observed() const { return observed_[1]; }
  int64_t grad_added_count() const;

 private:
  mutable std::mutex mu_;
  bool active_ = false;
  Phase phase_ = Phase::kWarmup;
  bool saved_observed_ = false;
  bool observed_[2] = {false, false};  // forward, backward
  std::vector<Recipe> recipes_;
  std::vector<std::shared_ptr<LinearCore>> grad_added_;
};

// The active record, or null outside fp8dp.make_graphed_callables' warm-up and capture.
GraphRecord* active_graph_record();

// Two fp8_autocast states that cast and multiply alike (every field): a graph replays only under
// the state it was captured with.
bool same_autocast(const AutocastState& a, const AutocastState& b);

}  // namespace fp8dp
