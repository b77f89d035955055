// Raw-pointer LayerNorm / RMSNorm kernels: the forward fused with the FP8 cast of its output (one
// pass over each row reads x and writes the normalized row, high precision and/or FP8, and the row
// statistics), and the backward (CUDA). One signature for the CPU and CUDA forwards;
// src/norm/norm.h checks tensors above them.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "fp8/format.h"

namespace fp8dp {

// z = (x - mu) * rsigma * g + beta    (LayerNorm; RMSNorm: mu = 0, no beta)
//   rsigma = 1 / sqrt(mean((x - mu)^2) + eps)   (RMSNorm: 1 / sqrt(mean(x^2) + eps))
//   g = gamma, or 1 + gamma with zero_centered_gamma (so weight decay pulls the scale towards 1)
// Statistics are computed in FP32. z is rounded to `dtype` first; out_fp8 and amax are taken from
// that rounded value, so the fused cast gives the same bytes as quantize(out) with the same scale.
struct NormFwdParams {
  const void* input = nullptr;  // [rows, cols] row-major in `dtype`
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  const void* gamma = nullptr;  // [cols] in `dtype`
  const void* beta = nullptr;   // [cols] in `dtype`; nullptr for RMSNorm (or a bias-free LayerNorm)
  float eps = 1e-5f;
  bool rms = false;
  bool zero_centered_gamma = false;
  void* out = nullptr;           // optional [rows, cols] in `dtype`
  uint8_t* out_fp8 = nullptr;    // optional [rows, cols] FP8 bytes: saturate(rne(z * scale))
  const float* scale = nullptr;  // needed with out_fp8 (host memory on the CPU, device on CUDA)
  float* scale_inv = nullptr;    // optional [1]: 1 / scale (what the GEMM reads); needs scale
  Format format = Format::kE4M3;
  float* amax = nullptr;         // optional [1]: max |z| (NaN if any z is NaN), written, or with
  bool amax_accumulate = false;  // max-merged into the amax already there (quantize.h)
  float* mu = nullptr;           // optional [rows] (0 for RMSNorm)
  float* rsigma = nullptr;       // optional [rows]
};

void norm_fwd_cpu(const NormFwdParams& p);

// Backward from the statistics the forward saved, all arithmetic in FP32. With
//   xhat = (x - mu) * rsigma, g = gamma (+ 1 with zero_centered_gamma), dxhat = dz * g:
//   dx     = rsigma * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))   (RMSNorm: no mean(dxhat))
//   dgamma = sum over rows of dz * xhat,   dbeta = sum over rows of dz
// dgamma / dbeta are summed in a fixed order (per row group in row order, then the groups in
// order), so repeated calls on the same device and shape give the same bits.
struct NormBwdParams {
  const void* dz = nullptr;  // [rows, cols] in `dtype`
  const void* x = nullptr;   // [rows, cols] in `dtype`
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  const float* mu = nullptr;      // [rows]; ignored (taken as 0) for RMSNorm
  const float* rsigma = nullptr;  // [rows]
  const void* gamma = nullptr;    // [cols] in `dtype`
  bool rms = false;
  bool zero_centered_gamma = false;
  void* dx = nullptr;  // [rows, cols] in `dtype`
  // optional [rows, cols] in `dtype`: added to dx in FP32 before its one rounding. The gradient of
  // a residual branch that reads the norm's input too (a pre-norm block's x): fused here it costs
  // one read instead of autograd's separate add (two reads, one write).
  const void* dx_add = nullptr;
  void* dgamma = nullptr;  // [cols] in `dtype`
  void* dbeta = nullptr;   // optional [cols] in `dtype`
  // CUDA: whether the kernel may add the per-block partial sums of dgamma / dbeta itself after a
  // grid-wide barrier (a cooperative launch; faster at every shape measured) instead of leaving
  // them to a second kernel. Both add in the same fixed order, so the bits are the same; false
  // exists for the test that checks it and for the tuning benchmark.
  bool cooperative_tail = true;
};

#if defined(FP8DP_WITH_CUDA)
// stream: a cudaStream_t (void* keeps this header free of CUDA headers).
void norm_fwd_cuda(const NormFwdParams& p, void* stream);
void norm_bwd_cuda(const NormBwdParams& p, void* stream);
#endif

}  // namespace fp8dp
