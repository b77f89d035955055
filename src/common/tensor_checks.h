// The checks of at::Tensor arguments that the LibTorch layers (fp8, gemm, norm, modules) share, and
// the one mapping of torch dtypes onto DType. Every failure is a ValueError that reads
// "<fn>: <what> must be ..., got ...": fn names the entry point ("fp8dp.quantize", a module's
// name), what the argument ("argument 'x'", "parameter 'weight'", "'bias'").
#pragma once

#include <ATen/core/Tensor.h>

#include <string_view>

#include "common/dtype.h"

namespace fp8dp {

bool is_high_precision(at::ScalarType t);  // float32, bfloat16 or float16
bool is_fp8(at::ScalarType t);             // float8_e4m3fn or float8_e5m2

// The DType of a torch dtype: any of the five (a GEMM operand), or only the three high-precision
// ones (what the cast and norm kernels read and write). Anything else is an error.
DType to_dtype(at::ScalarType t, std::string_view fn, std::string_view what);
DType to_high_precision_dtype(at::ScalarType t, std::string_view fn, std::string_view what);

// t lives where this build has kernels: the CPU, or a CUDA device in a CUDA build.
void check_device_supported(const at::Tensor& t, std::string_view fn, std::string_view what);

}  // namespace fp8dp
