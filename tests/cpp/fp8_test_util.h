// Helpers shared by the FP8 GoogleTests: torch's own float8 conversion as the reference, byte
// views, and readable parameter names.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fp8/cast.h"
#include "fp8/format.h"

namespace fp8dp::test {

inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "f32";
    case at::kBFloat16:
      return "bf16";
    case at::kHalf:
      return "f16";
    default:
      return "other";
  }
}

inline std::string shape_name(const std::vector<int64_t>& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
  return s.empty() ? "scalar" : s;
}

// Largest finite FP8 value's byte (sign clear): 448 = 0x7E in E4M3, 57344 = 0x7B in E5M2.
inline uint8_t max_byte(Format f) { return f == Format::kE4M3 ? 0x7E : 0x7B; }

// FP8 tensor -> uint8 tensor of the same bytes.
inline at::Tensor bytes(const at::Tensor& t) { return t.contiguous().view(at::kByte); }

// torch's float8 conversion of x * scale (computed in FP32, as the kernel does). torch turns values
// beyond the format's max into NaN, so the result is only a reference where |x * scale| <= max.
inline at::Tensor torch_fp8_bytes(const at::Tensor& x, float scale, Format f) {
  return bytes((x.to(at::kFloat) * scale).to(fp8_dtype(f)));
}

// Mask of the elements where torch's conversion is the reference: finite and |x * scale| <= max.
inline at::Tensor in_range(const at::Tensor& x, float scale, Format f) {
  return (x.to(at::kFloat) * scale).abs().le(fp8_max(f));
}

inline at::Tensor scalar_scale(float s) { return at::full({1}, s, at::kFloat); }

}  // namespace fp8dp::test
