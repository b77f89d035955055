// The activations of LayerNormMLP (GELU, SwiGLU) and their derivatives, one definition for the CPU
// and the CUDA kernels (host + device), so both compute the same FP32 bits for the same input.
//
// Why not std::erf / expf: glibc's and CUDA's libm differ in the last bit for some inputs, and a
// last-bit difference survives the rounding to bf16 (and then the FP8 cast) whenever the value
// lies next to a rounding boundary, so CPU and CUDA bytes would differ (C7 asks for identical
// bytes). Everything below is built from IEEE-correctly-rounded +, -, *, /, fma and rint, which
// both devices implement exactly alike. Every operation is spelled out: nvcc contracts a*b+c into
// an fma on its own (the device macros use the _rn intrinsics, which it never contracts) and so
// does g++ with -march=native (the CPU file that includes this header turns fp-contract off).
//
// Accuracy (against float64): exp within 2 ulp; erf within 2e-7 absolute (Abramowitz-Stegun
// 7.1.26 refined: see act_erf); far below the bf16 rounding (2^-9 relative) that every result
// goes through before the FP8 cast.
#pragma once

#include <cstdint>

#include "fp8/format.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace fp8dp {

enum class Activation : int { kGelu = 0, kSwiglu = 1 };

namespace act {

#if defined(__CUDA_ARCH__)
FP8DP_HD float mul(float a, float b) { return __fmul_rn(a, b); }
FP8DP_HD float add(float a, float b) { return __fadd_rn(a, b); }
FP8DP_HD float sub(float a, float b) { return __fsub_rn(a, b); }
FP8DP_HD float div(float a, float b) { return __fdiv_rn(a, b); }
FP8DP_HD float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
FP8DP_HD float rint(float a) { return rintf(a); }
FP8DP_HD float from_bits(uint32_t u) { return __uint_as_float(u); }
#else
FP8DP_HD float mul(float a, float b) { return a * b; }
FP8DP_HD float add(float a, float b) { return a + b; }
FP8DP_HD float sub(float a, float b) { return a - b; }
FP8DP_HD float div(float a, float b) { return a / b; }
FP8DP_HD float fma(float a, float b, float c) { return std::fma(a, b, c); }
FP8DP_HD float rint(float a) { return std::nearbyint(a); }  // default mode: to nearest even
FP8DP_HD float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#endif

// 2^k for k in [-126, 127], exactly.
FP8DP_HD float pow2(int k) { return from_bits(static_cast<uint32_t>(k + 127) << 23); }

// e^x: x = k ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2), e^r by a degree-7 Taylor
// polynomial in Horner form (truncation < 2e-9 relative), scaled by 2^k in two exact steps so that
// only the last one rounds (the result may be subnormal). NaN stays NaN; overflow gives +Inf.
FP8DP_HD float exp(float x) {
  if (x != x) return x;
  if (x > 88.7228394f) return from_bits(0x7F800000u);
  if (x < -103.972084f) return 0.0f;
  const float k = rint(mul(x, 1.44269504f));
  const float r = fma(-k, -2.12194440e-4f, fma(-k, 0.693359375f, x));  // ln2 = hi + lo (Cephes)
  float p = 1.0f / 5040.0f;
  p = fma(p, r, 1.0f / 720.0f);
  p = fma(p, r, 1.0f / 120.0f);
  p = fma(p, r, 1.0f / 24.0f);
  p = fma(p, r, 1.0f / 6.0f);
  p = fma(p, r, 0.5f);
  p = fma(p, r, 1.0f);
  p = fma(p, r, 1.0f);
  const int ki = static_cast<int>(k);
  const int k1 = ki / 2;
  return mul(mul(p, pow2(k1)), pow2(ki - k1));
}

// erf(x) for |x| by Abramowitz-Stegun 7.1.26 (|error| <= 1.5e-7), odd in x; 1 for |x| >= 6.
FP8DP_HD float erf(float x) {
  if (x != x) return x;
  const float ax = x < 0.0f ? -x : x;
  if (ax >= 6.0f) return x < 0.0f ? -1.0f : 1.0f;
  const float t = div(1.0f, fma(0.3275911f, ax, 1.0f));
  float p = 1.061405429f;
  p = fma(p, t, -1.453152027f);
  p = fma(p, t, 1.421413741f);
  p = fma(p, t, -0.284496736f);
  p = fma(p, t, 0.254829592f);
  p = mul(p, t);
  const float y = sub(1.0f, mul(p, exp(-mul(ax, ax))));
  return x < 0.0f ? -y : y;
}

constexpr float kSqrtHalf = 0.707106781f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.398942280f;  // 1 / sqrt(2 pi)

// GELU (the exact, erf form: torch.nn.functional.gelu's default): x Φ(x).
FP8DP_HD float gelu(float x) {
  const float cdf = mul(0.5f, add(1.0f, erf(mul(x, kSqrtHalf))));
  return mul(x, cdf);
}
// d/dx x Φ(x) = Φ(x) + x φ(x).
FP8DP_HD float dgelu(float x) {
  const float cdf = mul(0.5f, add(1.0f, erf(mul(x, kSqrtHalf))));
  const float pdf = mul(kInvSqrt2Pi, exp(mul(-0.5f, mul(x, x))));
  return add(cdf, mul(x, pdf));
}

// sigmoid(x) = 1 / (1 + e^-x): 0 for x below -88 (e^-x overflows), no NaN from Inf / Inf.
FP8DP_HD float sigmoid(float x) { return div(1.0f, add(1.0f, exp(-x))); }
FP8DP_HD float silu(float x) { return mul(x, sigmoid(x)); }

// SwiGLU forward of one (gate, up) pair: silu(gate) * up.
FP8DP_HD float swiglu(float gate, float up) { return mul(silu(gate), up); }
// Its gradients given da: d gate = da * up * silu'(gate), d up = da * silu(gate), where
// silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g).
FP8DP_HD void dswiglu(float da, float gate, float up, float& dgate, float& dup) {
  const float s = sigmoid(gate);
  const float dsilu = mul(s, add(1.0f, mul(gate, sub(1.0f, s))));
  dgate = mul(mul(da, up), dsilu);
  dup = mul(da, mul(gate, s));
}

}  // namespace act
}  // namespace fp8dp
