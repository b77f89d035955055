// The element types of the raw-pointer kernels and GEMMs below LibTorch. Torch-free, so the CUDA
// sources compile without a CUDA torch; tensor_checks.h maps torch dtypes onto it.
#pragma once

#include <cstddef>

namespace fp8dp {

// The high-precision types are what the cast and norm kernels read and write; the FP8 types occur
// only as GEMM operands (the cast kernels name their FP8 output by its Format, fp8/format.h).
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kE4M3 = 3, kE5M2 = 4 };

inline bool is_fp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }

// torch's spelling of the type ("float32", "float8_e4m3fn", ...), for error messages.
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kE4M3:
      return "float8_e4m3fn";
    case DType::kE5M2:
      return "float8_e5m2";
  }
  return "unknown";
}

// Bytes per element.
inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kE4M3:
    case DType::kE5M2:
      return 1;
  }
  return 0;
}

}  // namespace fp8dp
