// Tensor-level delayed-scaling update: argument checks, CPU / CUDA dispatch.
#include "fp8/scaling_update.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <utility>

#include "common/check.h"
#include "common/dispatch.h"
#include "common/tensor_checks.h"

namespace fp8dp {

void update_scaling(at::Tensor& amax_history, at::Tensor& scale, at::Tensor& scale_inv,
                    const at::Tensor& fp8_max, AmaxAlgo algo, float margin) {
  constexpr const char* fn = "fp8dp.update_scaling";
  const std::pair<const at::Tensor*, const char*> args[] = {{&amax_history, "amax_history"},
                                                            {&scale, "scale"},
                                                            {&scale_inv, "scale_inv"},
                                                            {&fp8_max, "fp8_max"}};
  for (const auto& [t, name] : args) {
    FP8DP_CHECK_ARG(t->defined(), fn, ": argument '", name, "' is undefined");
    check_device_supported(*t, fn, std::string("argument '") + name + "'");
    FP8DP_CHECK_ARG(t->scalar_type() == at::kFloat, fn, ": argument '", name,
                    "' must be float32, got ", t->scalar_type());
    FP8DP_CHECK_ARG(t->is_contiguous(), fn, ": argument '", name, "' must be contiguous");
    FP8DP_CHECK_ARG(t->device() == amax_history.device(), fn, ": argument '", name, "' is on ",
                    t->device(), " but 'amax_history' is on ", amax_history.device());
  }
  FP8DP_CHECK_ARG(amax_history.dim() == 2 && amax_history.size(0) >= 1, fn,
                  ": argument 'amax_history' must be [L, n] with L >= 1, got ",
                  amax_history.sizes());
  const int64_t n = amax_history.size(1);
  FP8DP_CHECK_ARG(scale.numel() == n, fn, ": argument 'scale' needs ", n, " elements, got ",
                  scale.numel());
  FP8DP_CHECK_ARG(scale_inv.numel() == n, fn, ": argument 'scale_inv' needs ", n, " elements, got ",
                  scale_inv.numel());
  FP8DP_CHECK_ARG(fp8_max.numel() == n, fn, ": argument 'fp8_max' needs ", n, " elements, got ",
                  fp8_max.numel());
  FP8DP_CHECK_ARG(std::isfinite(margin) && margin >= 0.0f, fn,
                  ": argument 'margin' must be finite and >= 0, got ", margin);
  ScalingUpdateParams p;
  p.amax_history = amax_history.data_ptr<float>();
  p.scale = scale.data_ptr<float>();
  p.scale_inv = scale_inv.data_ptr<float>();
  p.fp8_max = fp8_max.data_ptr<float>();
  p.n = n;
  p.history_len = amax_history.size(0);
  p.algo = algo;
  p.margin = margin;
  dispatch_kernel(amax_history.device(), update_scaling_cpu, FP8DP_CUDA_KERNEL(update_scaling_cuda),
                  p);
}

void update_scaling_batched(const std::vector<ScalingSlot>& slots, const at::Device& device) {
  if (slots.empty()) return;
  dispatch_kernel(device, update_scaling_batched_cpu,
                  FP8DP_CUDA_KERNEL(update_scaling_batched_cuda), slots.data(),
                  static_cast<int64_t>(slots.size()));
}

}  // namespace fp8dp
