// Raw-pointer kernels of LayerNormMLP's activation, fused with the FP8 cast of its result (C7):
// forward a = act(h) cast for fc2's input, backward dh = act'(h) · da cast for fc1's grad_output.
// One signature for the CPU and CUDA versions; src/fp8/activation.h checks tensors and passes
// pointers down. The math is activation_math.h on both devices, so both give the same bits.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "fp8/activation_math.h"
#include "fp8/format.h"

namespace fp8dp {

// Columns of the activation's input for `cols` output columns: GELU maps h [rows, cols] to
// a [rows, cols]; SwiGLU maps h = [gate | up] [rows, 2 cols] to silu(gate) * up [rows, cols].
inline int64_t activation_in_cols(Activation act, int64_t cols) {
  return act == Activation::kSwiglu ? 2 * cols : cols;
}

// One pass over h (and, backward, da). The result r (forward: a [rows, cols]; backward: dh
// [rows, in_cols], the layout of h) is computed in FP32 and rounded once to `dtype` (so its bytes
// equal those of the unfused path, which stores r in dtype and casts it), then:
//   out_hp    r as dtype (the high-precision route without FP8), optional
//   out       saturate(rne(r * scale)) as FP8 bytes, row-major, optional
//   out_t     the same bytes transposed [out_cols, rows], optional
//   amax      max |r| (quantize's rules: NaN wins, then Inf), written or max-merged
//             (amax_accumulate); optional; alone it is the amax pass of current scaling
//   scale_inv 1 / scale, written with the bytes
//   dbias     column sums of r in FP32 (64-row chunks in row order, then the chunks in order),
//             stored as dbias_dtype: fc1's bias gradient (backward only)
// scale points to one float (host memory on the CPU, device memory on CUDA); needed whenever an
// FP8 output is asked for.
struct ActParams {
  Activation act = Activation::kGelu;
  bool backward = false;
  const void* input = nullptr;  // h [rows, in_cols]
  const void* grad = nullptr;   // backward: da [rows, cols]
  DType dtype = DType::kBFloat16;
  int64_t rows = 0;
  int64_t cols = 0;  // the activation's output columns (ffn_hidden_size)
  void* out_hp = nullptr;
  const float* scale = nullptr;
  Format format = Format::kE4M3;
  uint8_t* out = nullptr;
  uint8_t* out_t = nullptr;
  float* amax = nullptr;
  bool amax_accumulate = false;
  float* scale_inv = nullptr;
  void* dbias = nullptr;
  DType dbias_dtype = DType::kFloat32;
  // CUDA, bf16 input: look the activation up (activation_lut.h) instead of computing it. The
  // same bits either way; the CPU always computes.
  bool lut = true;

  int64_t in_cols() const { return activation_in_cols(act, cols); }
  int64_t out_cols() const { return backward ? in_cols() : cols; }
};

void activation_cpu(const ActParams& p);

#if defined(FP8DP_WITH_CUDA)
// stream is a cudaStream_t (src/fp8/cuda/activation_cast.cu).
void activation_cuda(const ActParams& p, void* stream);
#endif

}  // namespace fp8dp
