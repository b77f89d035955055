// Tensor-argument checks and the torch dtype -> DType mapping (tensor_checks.h).
#include "common/tensor_checks.h"

#include "common/check.h"

namespace fp8dp {

bool is_high_precision(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

DType to_dtype(at::ScalarType t, std::string_view fn, std::string_view what) {
  if (t == at::kFloat8_e4m3fn) return DType::kE4M3;
  if (t == at::kFloat8_e5m2) return DType::kE5M2;
  FP8DP_CHECK_ARG(is_high_precision(t), fn, ": ", what,
                  " must be float8_e4m3fn, float8_e5m2, float32, bfloat16 or float16, got ", t);
  return to_high_precision_dtype(t, fn, what);
}

DType to_high_precision_dtype(at::ScalarType t, std::string_view fn, std::string_view what) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      FP8DP_CHECK_ARG(false, fn, ": ", what, " must be float32, bfloat16 or float16, got ", t);
  }
}

void check_device_supported(const at::Tensor& t, std::string_view fn, std::string_view what) {
#if defined(FP8DP_WITH_CUDA)
  FP8DP_CHECK_ARG(t.is_cpu() || t.is_cuda(), fn, ": ", what,
                  " must be on the CPU or a CUDA device, got ", t.device());
#else
  FP8DP_CHECK_ARG(t.is_cpu(), fn, ": ", what,
                  " must be on the CPU (this build of fp8dp has no CUDA), got ", t.device());
#endif
}

}  // namespace fp8dp
