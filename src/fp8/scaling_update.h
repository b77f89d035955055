// Tensor-level delayed-scaling update: checks at::Tensor arguments and dispatches to the CPU or
// CUDA kernel of scaling.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "fp8/scaling.h"

namespace fp8dp {

// In-place update of delayed-scaling state (see ScalingUpdateParams). amax_history [L, n],
// scale / scale_inv / fp8_max [n], all float32 contiguous on one device.
void update_scaling(at::Tensor& amax_history, at::Tensor& scale, at::Tensor& scale_inv,
                    const at::Tensor& fp8_max, AmaxAlgo algo, float margin);

// update_scaling of many states at once (ScalingSlot, scaling.h), whose buffers all live on
// `device`: one launch on the current stream on CUDA, a loop on the CPU. The caller owns the
// buffers and has checked them (ScalingState does).
void update_scaling_batched(const std::vector<ScalingSlot>& slots, const at::Device& device);

}  // namespace fp8dp
