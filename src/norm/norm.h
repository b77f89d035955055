// Tensor-level LayerNorm / RMSNorm: forward fused with the FP8 cast (norm_kernel.h), and backward.
#pragma once

#include <ATen/core/Tensor.h>

#include "fp8/format.h"

namespace fp8dp {

struct NormConfig {
  bool rms = false;  // RMSNorm instead of LayerNorm
  float eps = 1e-5f;
  bool zero_centered_gamma = false;  // the scale applied is 1 + gamma
};

struct NormForward {
  at::Tensor out;        // [rows, cols] in x's dtype, when asked for
  at::Tensor out_fp8;    // [rows, cols] FP8, when a scale was given
  at::Tensor scale_inv;  // float32 [1]: 1 / scale, when a scale was given
  at::Tensor amax;       // float32 [1]: max |out|
  at::Tensor mu;         // float32 [rows] (zeros for RMSNorm)
  at::Tensor rsigma;     // float32 [rows]
};

// x: [rows, cols]; gamma (and beta, undefined for RMSNorm) [cols], all of x's dtype and device.
// With a defined `scale` (float32 [1], on x's device) the output is also cast to `format` in the
// same pass. CPU and CUDA tensors run the fused kernels of norm_kernel.h on the current stream;
// both give the same FP8 bytes for the same rounded output (which itself may differ in the last
// bits between the devices: FP32 row sums in another order).
// Errors (ValueError) name the argument: not 2-D, no columns, dtype or device mismatches.
// amax_into (optional): a running amax the pass max-merges into instead of a new one (quantize's
// argument of that name, fp8/cast.h); returned as .amax.
NormForward norm_forward(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                         const NormConfig& cfg, bool want_out, const at::Tensor& scale,
                         Format format, const at::Tensor& amax_into = {});

// The same forward in ATen ops (FP32 statistics, output rounded to x's dtype, then one quantize):
// the independent reference of the kernel tests; no longer on a dispatch path (CPU and CUDA both
// have a fused kernel). Always returns `out`.
NormForward norm_forward_aten(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                              const NormConfig& cfg, const at::Tensor& scale, Format format);

struct NormGrads {
  at::Tensor dx, dgamma, dbeta;  // dbeta undefined without beta
};

// dz: gradient of the normalized output [rows, cols]. Computed in FP32 from the saved statistics
// (mu is ignored for RMSNorm). CUDA tensors with one dtype for dz, x and gamma run norm_bwd_cuda
// (deterministic dgamma / dbeta); the CPU and other dtype mixes run the same formulas in ATen.
// dx_add (optional, x's shape): added to dx in FP32 before dx is rounded to x's dtype, on both
// devices: the gradient that a pre-norm block's residual branch sends to the same x, summed here in
// one pass instead of autograd's separate add (which rounds dx first).
NormGrads norm_backward(const at::Tensor& dz, const at::Tensor& x, const at::Tensor& mu,
                        const at::Tensor& rsigma, const at::Tensor& gamma, bool has_beta,
                        const NormConfig& cfg, const at::Tensor& dx_add = at::Tensor());

}  // namespace fp8dp
