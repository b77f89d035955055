// What an fp8dp layer refuses to be captured into a CUDA graph with (torch.cuda.graph,
// torch.cuda.make_graphed_callables): the host-side work that a replay would skip, silently.
// A replay re-runs the captured kernels only; what fp8dp does on the host during a forward or
// backward happens once, at capture. Three of those break a contract when skipped:
//   - a training forward under delayed scaling marks the step's amaxes as observed (C9):
//     without the mark update_fp8_scales() updates nothing, and every scale freezes at its
//     capture-time value (an inference forward is capturable: nothing updates its scales);
//   - a layer bound to DistributedDataParallel hands its weight gradient to the gradient sink
//     (C2, C5): replays would deliver nothing, and the bucket's collective would never see it;
//   - delay_wgrad_compute queues the weight gradient for backward_dw() (C3): replays queue
//     nothing, and the gradient is lost.
// And is_first_microbatch=False reuses the FP8 weight cast before capture in every replay, after
// the optimizer has changed the weight (C13). What remains capturable (current or block scaling,
// or FP8 off; no fp8dp DistributedDataParallel; no delayed weight gradients; the weight cast in
// every forward) is the same on replay as eagerly. fp8dp.make_graphed_callables records and
// re-issues the amax marks (modules/graph_record.h), which makes delayed scaling capturable
// under it; docs/cuda_graphs_design.md: how the rest would be recorded.
#pragma once

#include <c10/core/Device.h>

#include <optional>
#include <string>

#include "fp8/recipe.h"

namespace fp8dp {

// Why a forward with these settings cannot be captured (the first reason that applies), or null
// when its replays compute what the eager forward computes. Pure, so the table is tested on the
// CPU (tests/cpp/test_modules.cpp); check_graph_capture applies it only under capture.
// `grad_enabled`: autograd records this forward (a training forward, whose scales the step
// updates); an inference forward under delayed scaling is capturable, since nothing updates its
// scales. `recorded`: fp8dp.make_graphed_callables captures (a GraphRecord is active, which
// re-marks the amaxes, hands the gradients to DistributedDataParallel and queues the weight
// gradients at every replay), so delayed scaling in training, a bound layer and
// delay_wgrad_compute are capturable too.
const char* capture_refusal(const AutocastState& ac, bool grad_enabled, bool need_wgrad, bool bound,
                            bool delay_wgrad, std::optional<bool> is_first_microbatch,
                            bool recorded = false);

// `what`: the layer's name; `bound`: its weight gradient goes to a DistributedDataParallel sink.
// FP8DP_UNSAFE_CAPTURE=1 lets the capture through anyway, for measurements that replay without
// the host work (dev/graph_ceiling.py), never for training.
void check_graph_capture(const c10::Device& device, const std::string& what,
                         const AutocastState& ac, bool grad_enabled, bool need_wgrad, bool bound,
                         bool delay_wgrad, std::optional<bool> is_first_microbatch);

}  // namespace fp8dp
