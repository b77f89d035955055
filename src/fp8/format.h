// FP8 formats (C7): E4M3 (max 448, no infinities) and E5M2 (max 57344); float <-> FP8 bit casts.
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>

namespace fp8dp {

// Everything below but format_name is shared by the CPU and the CUDA kernels (host + device).
#if defined(__CUDACC__)
#define FP8DP_HD __host__ __device__ __forceinline__
#else
#define FP8DP_HD inline
#endif

enum class Format : int { kE4M3 = 0, kE5M2 = 1 };

FP8DP_HD constexpr float fp8_max(Format f) { return f == Format::kE4M3 ? 448.0f : 57344.0f; }
// Bit pattern of the format's largest finite value (448 = 0x43E00000, 57344 = 0x47600000).
FP8DP_HD constexpr uint32_t fp8_max_bits(Format f) {
  return f == Format::kE4M3 ? 0x43E00000u : 0x47600000u;
}
const char* format_name(Format f);

FP8DP_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

FP8DP_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// The scale_inv a cast writes for its scale: 1 / scale for a valid scale (finite and > 0), else
// NaN. The entry points refuse an invalid scale held on the CPU; one on a GPU is not read back
// (that would synchronise every cast), so the cast marks its result instead: whatever uses the
// scale_inv (dequantize, the GEMMs) gives NaN, which the NaN checks report, where 1 / +Inf = 0
// would have made every output a silent zero and 1 / 0 = +Inf a NaN only where a byte was 0.
FP8DP_HD float scale_inverse(float scale) {
  return scale > 0.0f && scale <= FLT_MAX ? 1.0f / scale : bits_float(0x7FC00000u);
}

// All ones when cond holds, else 0 (for branch-free selects).
FP8DP_HD uint32_t mask_if(bool cond) { return 0u - static_cast<uint32_t>(cond); }

// FP8 code (sign bit clear) of a float magnitude given as its bit pattern `mag` (sign cleared),
// which must be at most the format's max (not NaN); kMant = mantissa bits, kBias = exponent bias.
//
// Rounding by addition: C = 2^(e + 23 - kMant), where e is the exponent of mag but at least that of
// the smallest FP8 normal (FP8 subnormals share its spacing), has a float ulp equal to the FP8
// spacing at mag. mag + C lies in [C, 2C), so the float add rounds mag to that spacing, to nearest
// even, and its bits minus C's bits count FP8 steps: the 1+kMant significand bits of the FP8 value
// (or a subnormal's mantissa). Adding the FP8 exponent above the smallest normal gives the code; a
// significand that rounds up to the next power of two carries into the exponent by itself.
// Only integer ops, one float add and no branches, so loops over it vectorise.
template <int kMant, int kBias>
FP8DP_HD uint32_t fp8_code_of_magnitude(uint32_t mag) {
  constexpr uint32_t kMinExp = static_cast<uint32_t>(127 - kBias + 1) << 23;
  const uint32_t e = mag & 0x7F800000u;
  const uint32_t E = e > kMinExp ? e : kMinExp;
  const uint32_t C = E + (static_cast<uint32_t>(23 - kMant) << 23);
  const uint32_t steps = float_bits(bits_float(mag) + bits_float(C)) - C;
  return steps + ((E - kMinExp) >> (23 - kMant));
}

// Round-to-nearest-even of a float that is already within [-max, max] or NaN.
template <int kMant, int kBias>
FP8DP_HD uint8_t fp8_from_clamped_float(float x) {
  const uint32_t bits = float_bits(x);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t mag = bits ^ sign;
  const uint32_t code = mag > 0x7F800000u ? 0x7Fu : fp8_code_of_magnitude<kMant, kBias>(mag);
  return static_cast<uint8_t>(code | (sign >> 24));
}

// Exact decode of an FP8 byte (E4M3: 0x7F/0xFF are NaN, no infinities; E5M2: IEEE-like specials).
FP8DP_HD float fp8_decode(uint8_t v, Format f) {
  const int mant = f == Format::kE4M3 ? 3 : 2;
  const int bias = f == Format::kE4M3 ? 7 : 15;
  const uint32_t sign = static_cast<uint32_t>(v & 0x80) << 24;
  const uint32_t exp = (v & 0x7Fu) >> mant;
  const uint32_t man = v & ((1u << mant) - 1u);
  if (f == Format::kE4M3 && (v & 0x7F) == 0x7F) return bits_float(0x7FC00000u | sign);
  if (f == Format::kE5M2 && exp == 31) return bits_float((man ? 0x7FC00000u : 0x7F800000u) | sign);
  if (exp == 0) {  // subnormal: man * 2^(1 - bias - mant)
    const float f32 =
        static_cast<float>(man) * bits_float(static_cast<uint32_t>(127 + 1 - bias - mant) << 23);
    return bits_float(float_bits(f32) | sign);
  }
  return bits_float(sign | ((exp + 127 - bias) << 23) | (man << (23 - mant)));
}

// Saturating quantize of one value: saturate(rne(v)); v must already be multiplied by the scale.
// |v| > max (including +-Inf) gives +-max; NaN gives NaN. The clamp works on the magnitude's bits:
// for non-negative floats integer order is float order and NaN patterns lie above Inf's, so one
// unsigned min saturates finite overflow and Inf; the NaN test looks at the unclamped magnitude.
template <Format F>
FP8DP_HD uint8_t quantize_one(float v) {
  constexpr uint32_t kMaxBits = fp8_max_bits(F);
  const uint32_t bits = float_bits(v);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t mag = bits ^ sign;
  const uint32_t clamped = mag < kMaxBits ? mag : kMaxBits;
  uint32_t code;
  if constexpr (F == Format::kE4M3) {
    code = fp8_code_of_magnitude<3, 7>(clamped);
  } else {
    code = fp8_code_of_magnitude<2, 15>(clamped);
  }
  // NaN: OR-ing 0x7F into a code <= 0x7E gives 0x7F, NaN in both formats. A mask rather than `?:`:
  // with `?:` compilers move the float add into the non-NaN branch and then refuse to vectorise the
  // loop (a float add may trap, so it is not executed speculatively under -ftrapping-math).
  code |= mask_if(mag > 0x7F800000u) & 0x7Fu;
  return static_cast<uint8_t>(code | (sign >> 24));
}

}  // namespace fp8dp
