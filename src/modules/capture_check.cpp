// check_graph_capture (capture_check.h): what an fp8dp layer refuses under CUDA graph capture.
#include "modules/capture_check.h"

#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "common/dispatch.h"
#include "modules/graph_record.h"

#if defined(FP8DP_WITH_CUDA)
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace fp8dp {
namespace {

bool capturing(const c10::Device& device) {
#if defined(FP8DP_WITH_CUDA)
  if (!device.is_cuda()) return false;
  c10::cuda::CUDAGuard guard(device);
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  (void)device;
  return false;
#endif
}

bool unsafe_capture_allowed() {
  const char* v = std::getenv("FP8DP_UNSAFE_CAPTURE");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace

const char* capture_refusal(const AutocastState& ac, bool grad_enabled, bool need_wgrad, bool bound,
                            bool delay_wgrad, std::optional<bool> is_first_microbatch,
                            bool recorded) {
  if (ac.enabled && ac.recipe.kind == RecipeKind::kDelayed && grad_enabled && !recorded)
    return "in training under delayed scaling (a replay would not mark its amaxes observed, so "
           "update_fp8_scales() would leave every scale at its capture-time value); capture "
           "with fp8dp.make_graphed_callables, which re-marks them at every replay, or use "
           "Float8CurrentScaling or Float8BlockScaling";
  if (need_wgrad && bound && !recorded)
    return "while bound to fp8dp.DistributedDataParallel (a replay would not hand the weight "
           "gradient to its gradient buffer); capture with fp8dp.make_graphed_callables, which "
           "hands it over at every replay";
  if (need_wgrad && delay_wgrad && !recorded)
    return "with delay_wgrad_compute=True (a replay would queue no weight gradient for "
           "backward_dw()); capture with fp8dp.make_graphed_callables, which queues it at every "
           "replay";
  if (ac.enabled && is_first_microbatch.has_value() && !*is_first_microbatch)
    return "with is_first_microbatch=False (every replay would reuse the FP8 weight cast before "
           "capture, after the optimizer has changed the weight); leave it None";
  return nullptr;
}

void check_graph_capture(const c10::Device& device, const std::string& what,
                         const AutocastState& ac, bool grad_enabled, bool need_wgrad, bool bound,
                         bool delay_wgrad, std::optional<bool> is_first_microbatch) {
  if (!capturing(device) || unsafe_capture_allowed()) return;
  const char* why = capture_refusal(ac, grad_enabled, need_wgrad, bound, delay_wgrad,
                                    is_first_microbatch, active_graph_record() != nullptr);
  FP8DP_CHECK(why == nullptr, what, ": cannot be captured into a CUDA graph ", why,
              ". fp8dp does work on the host in each forward and backward that a graph replay "
              "skips; docs/cuda_graphs_design.md says what graphs of fp8dp need");
}

}  // namespace fp8dp
