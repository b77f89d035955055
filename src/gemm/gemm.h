// GEMM front end: out[m, n] = a[m, k] · b[n, k]ᵀ ("TN", K contiguous in both operands), FP8 or
// high-precision, with bias, residual and accumulate epilogues. The CPU version dequantizes and
// multiplies in FP32 (the math of an FP8 tensor-core GEMM with FP32 accumulation); the CUDA version
// is cuBLASLt.
#pragma once

#include <ATen/core/Tensor.h>

namespace fp8dp {

// Every FP8 GEMM of a Linear layer in TN form:
//   fprop  y  = x  · Wᵀ : a = x  [tokens, in],  b = W   [out, in]
//   dgrad  dx = dy · W  : a = dy [tokens, out], b = Wᵀ  [in, out]    (cached transposed weight)
//   wgrad  dW = dyᵀ· x  : a = dyᵀ [out, tokens], b = xᵀ [in, tokens] (cast_transpose outputs)
// High-precision operands may instead be column-major, i.e. the transpose view of a contiguous
// tensor (w.t(), dy.t()): cuBLASLt then reads them with a transposed op instead of a copy, which
// is how the layers without FP8 run dgrad and wgrad (a strided transpose copy costs more than the
// GEMM's own memory traffic). FP8 operands must be row-major: Hopper's FP8 tensor cores take TN
// only, so their transposes come from the cast kernels.
struct GemmArgs {
  at::Tensor a;  // [m, k]; FP8 (e4m3 / e5m2) or float32 / bfloat16 / float16
  // float32 [1] when a is FP8 (per tensor), or a 2-D block layout (Float8BlockScaling: [m,
  // ceil(k/128)] per 1x128 tile, [ceil(m/128), ceil(k/128)] per 128x128 block; block_cast.h and
  // block_gemm.h); undefined for high precision.
  at::Tensor a_scale_inv;
  at::Tensor b;            // [n, k]; FP8 when a is FP8, else a's dtype
  at::Tensor b_scale_inv;  // as a_scale_inv, for b [n, k]
  at::Tensor bias;         // optional [n], added to every row (fprop epilogue)
  // Optional [m, n] in the output's dtype, rows contiguous: out = a·bᵀ + bias + residual, summed
  // in FP32 and rounded once into the output (cuBLASLt's C with beta = 1 and C != D), so that a
  // transformer's residual add needs no kernel of its own. Not with accumulate.
  at::Tensor residual;
  at::Tensor out;           // optional preallocated [m, n] output (e.g. a main_grad view)
  bool accumulate = false;  // out += a·bᵀ (beta = 1); needs `out`
  at::ScalarType out_dtype = at::kFloat;  // dtype of a newly allocated output (ignored with `out`)
  bool use_split_accumulator = true;      // CUDA FP8: exact FP32 accumulation (dgrad / wgrad)
};

// What check_gemm_args asks of the strides: gemm() takes row-major contiguous operands (or, high
// precision, column-major ones) and a contiguous `out`; gemm_cuda() copies operands of any other
// layout and writes into an `out` whose rows are contiguous (a slice of a wider buffer).
enum class GemmStrides { kContiguous, kAny };

// The one set of GEMM argument checks: dtypes, devices, shapes (FP8 needs k % 16 == 0 and
// n % 16 == 0), scale_inv, bias, residual, out, accumulate. Throws ValueError naming the argument
// that is wrong, what was expected and what came. Device limits (cuBLASLt's) are checked by
// gemm_cuda.
void check_gemm_args(const GemmArgs& args, GemmStrides strides);

// Checks every argument (check_gemm_args, contiguous) and runs the GEMM on the operands' device.
// Returns `out` (the given one or a new one).
at::Tensor gemm(const GemmArgs& args);

#if defined(FP8DP_WITH_CUDA)
// cuBLASLt directly, for the GPU tests and benchmarks (bound as _gemm_cuda): CUDA operands on one
// device, checked by check_gemm_args with any strides, then as gemm_cuda_checked.
at::Tensor gemm_cuda(const GemmArgs& args);
// cuBLASLt on arguments check_gemm_args has passed (gemm() calls it for CUDA tensors); checks only
// what cuBLASLt adds (no float8_e5m2 x float8_e5m2, FP8 row strides multiples of 16).
at::Tensor gemm_cuda_checked(const GemmArgs& args);
#endif

}  // namespace fp8dp
