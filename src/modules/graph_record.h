// GraphRecord: the host work of fp8dp layers inside CUDA graphs made by
// fp8dp.make_graphed_callables (python/fp8dp/graph.py), and its re-issue at every replay.
//
// A replay runs the captured kernels only. What a layer does on the host during a forward or a
// backward happens once, at capture (capture_check.h lists it). These effects matter:
//   - C9: a delayed-scaling cast marks the step's amaxes as observed; without the mark
//     update_fp8_scales() updates nothing and every scale freezes. The casts' amaxes themselves
//     are written by the captured kernels into row 0 of each state's history, whose address
//     stays fixed (the update and ScalingState::restore write in place), so replays record them.
//     A stateless recipe (current, block) is noted for the cross-rank check instead.
//   - C2 b: the fused route sets weight.grad_added_to_main_grad (a Python attribute) before its
//     GEMM accumulates into main_grad; the GEMM is in the graph, the flag is not.
//   - C3: delay_wgrad_compute queues the weight-gradient GEMM for backward_dw(). Under capture
//     the task becomes a template (its operands are the backward graph's static tensors), whose
//     GEMM is captured in a graph of its own (capture_wgrad); each backward replay queues a copy
//     whose run replays that graph, so backward_dw() and its hooks run as eagerly. Because the
//     next backward replay overwrites the operands, before_backward() refuses while a replayed
//     task is still queued.
// While a record is active (begin/end), the layers let delayed scaling and the fused route be
// captured (capture_refusal's `recorded`, plan_wgrad) and report those effects here; a capture
// phase also takes back the observed mark that the capture itself left, since no kernel ran.
//   - C2 / C5 / C8 / C11: a layer bound to DistributedDataParallel announces its gradients to the
//     ledger, asks the sink whether it accepts them, delivers the fused ones and takes tokens for
//     the delayed ones: graph_sink.h records these calls (a RecordingSink stands in for DDP's sink
//     while a record is active) and the replays re-issue them against DDP.
// replay_forward / replay_backward then do what each phase's host code did.
// is_first_microbatch is accepted by a graphed callable and decides nothing
// (python/fp8dp/graph.py): every replay casts the weight again, so no replay reuses a cast it did
// not make.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fp8/recipe.h"
#include "modules/graph_sink.h"
#include "modules/wgrad_store.h"

namespace fp8dp {

class LinearCore;

// Owned by a std::shared_ptr (the Python binding's holder): the sinks it hands out reach it weakly.
class GraphRecord : public std::enable_shared_from_this<GraphRecord> {
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
  // A delayed weight gradient: true when the backward capture keeps it as a template (the caller
  // then queues nothing); false outside a backward capture. A bound task's sink (a RecordingSink)
  // is kept as the real one; each replay asks it for the tokens (expect).
  bool note_wgrad(const std::shared_ptr<LinearCore>& core, const WgradTask& task);
  // The sink a bound layer uses while this record is active: records (capture) or drops (warm-up)
  // what would change DistributedDataParallel's state (graph_sink.h).
  std::shared_ptr<GradSink> sink_for(const std::shared_ptr<GradSink>& real);

  // The templates, in the order the backward captured them. capture_wgrad(i) runs template i's
  // GEMM (the caller captures it into a graph) and keeps its results as the static outputs;
  // set_wgrad_replay(i, fn) gives the call that replays that graph.
  int64_t wgrad_count() const;
  void capture_wgrad(int64_t i);
  void set_wgrad_replay(int64_t i, std::function<void()> replay);

  // The host effects of the captured forward / backward, once per replay of it. before_forward /
  // before_backward run before that graph replays: they refuse (changing nothing) while a task
  // queued by a backward replay still waits for backward_dw(), since its GEMM reads the forward's
  // and the backward's static buffers.
  void before_forward() const;
  // Remembers where `core`'s FP8 state lives now (after capture): before_forward refuses once it
  // moved (a restore with another history length, a reset), which the graphs would not see.
  void watch_state(const std::shared_ptr<LinearCore>& core);
  // Returns what this replay announced to the sinks (the forward's micro-batch), which its backward
  // replay takes: before_backward re-issues the sinks' acceptance checks (C11) before the graph
  // runs, replay_backward the deliveries and the delayed tasks after it.
  std::shared_ptr<ReplayUse> replay_forward();
  void before_backward(const ReplayUse& use) const;
  void replay_backward(ReplayUse& use);

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
  struct Template {
    std::shared_ptr<LinearCore> core;
    WgradTask task;
    WgradResult result;  // the dw graph's static outputs (undefined when fused / FP8)
    std::function<void()> replay;
    std::atomic<int> queued{0};  // replayed tasks not yet run (backward_dw runs them)
  };
  std::vector<std::shared_ptr<Template>> templates_;
  struct Watched {
    std::shared_ptr<LinearCore> core;
    const void *history, *scale, *scale_inv;
  };
  std::vector<Watched> watched_;
  std::vector<std::shared_ptr<RecordingSink>> sinks_;
  std::vector<SinkEvent> forward_events_;
  // The backward's sink calls and delayed templates, in the order they came (a step is one or the
  // other: template >= 0 names templates_[template]).
  struct BackwardStep {
    SinkEvent event;
    int64_t tmpl = -1;
  };
  std::vector<BackwardStep> backward_steps_;
  void record(SinkEvent e);
  std::shared_ptr<Template> template_at(int64_t i, const char* fn) const;
  void before_replay(const char* what) const;
};

// The active record, or null outside fp8dp.make_graphed_callables' warm-up and capture.
GraphRecord* active_graph_record();

// Two fp8_autocast states that cast and multiply alike (every field): a graph replays only under
// the state it was captured with.
bool same_autocast(const AutocastState& a, const AutocastState& b);

}  // namespace fp8dp
