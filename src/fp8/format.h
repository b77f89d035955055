// FP8 formats (C7): E4M3 (max 448, no infinities) and E5M2 (max 57344), and float <-> FP8 bit casts.
#pragma once

#include <cstdint>
#include <cstring>

namespace fp8dp {

enum class Format : int { kE4M3 = 0, kE5M2 = 1 };

constexpr float fp8_max(Format f) { return f == Format::kE4M3 ? 448.0f : 57344.0f; }
const char* format_name(Format f);

// Round-to-nearest-even of a float that is already within [-max, max] or NaN; NaN maps to NaN.
// Written without data-dependent branches so that the compiler vectorises loops that call it.
// The same bit recipe as the FP8 hardware conversion with satfinite once the input is clamped.
#if defined(__CUDACC__)
#define FP8DP_HD __host__ __device__ __forceinline__
#else
#define FP8DP_HD inline
#endif

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

// kMant = mantissa bits, kBias = exponent bias of the FP8 format.
template <int kMant, int kBias>
FP8DP_HD uint8_t fp8_from_clamped_float(float x) {
  const uint32_t bits = float_bits(x);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t mag = bits ^ sign;
  // Smallest normal FP8 value is 2^(1 - bias): below it the result is subnormal.
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 - kBias + 1) << 23;
  // Subnormals: adding 2^(shift) moves the FP8 subnormal grid onto float's last mantissa bits, and
  // float addition rounds to nearest even for us.
  constexpr uint32_t kDenormMagic = static_cast<uint32_t>((127 - kBias) + (23 - kMant) + 1) << 23;
  const float magic = bits_float(kDenormMagic);
  const uint32_t sub = float_bits(bits_float(mag) + magic) - kDenormMagic;
  // Normals: rebias the exponent and round the dropped mantissa bits to nearest even.
  const uint32_t odd = (mag >> (23 - kMant)) & 1u;
  const uint32_t norm =
      (mag + (static_cast<uint32_t>(kBias - 127) << 23) + ((1u << (23 - kMant - 1)) - 1u) + odd) >>
      (23 - kMant);
  uint32_t r = mag < kMinNormal ? sub : norm;
  r = mag > 0x7F800000u ? 0x7Fu : r;  // NaN stays NaN
  return static_cast<uint8_t>(r | (sign >> 24));
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

// Saturating quantize of one value: saturate(rne(x)); x must already be multiplied by the scale.
template <Format F>
FP8DP_HD uint8_t quantize_one(float v) {
  constexpr float kMax = fp8_max(F);
  v = v > kMax ? kMax : (v < -kMax ? -kMax : v);  // comparisons with NaN are false: NaN passes through
  if constexpr (F == Format::kE4M3) {
    return fp8_from_clamped_float<3, 7>(v);
  } else {
    return fp8_from_clamped_float<2, 15>(v);
  }
}

}  // namespace fp8dp
