// The activations of LayerNormMLP (GELU, SwiGLU) and their derivatives, one definition for the CPU
// and the CUDA kernels (host + device), so both compute the same FP32 bits for the same input.
//
// Why not std::erf / expf: glibc's and CUDA's libm differ in the last bit for some inputs, and a
// last-bit difference survives the rounding to bf16 (and then the FP8 cast) whenever the value
// lies next to a rounding boundary, so CPU and CUDA bytes would differ (C7 asks for identical
// bytes). Everything below is built from IEEE-correctly-rounded +, -, *, /, reciprocal and fma,
// which both devices implement exactly alike. Every operation is spelled out: nvcc contracts a*b+c
// into an fma on its own (the device macros use the _rn intrinsics, which it never contracts) and
// so does g++ with -march=native (the CPU file that includes this header turns fp-contract off).
//
// Accuracy (against float64): exp within 2 ulp; erf within 2e-7 absolute (Abramowitz-Stegun
// 7.1.26 refined: see act_erf); far below the bf16 rounding (2^-9 relative) that every result
// goes through before the FP8 cast.
#pragma once

#include <cstdint>

#include "fp8/format.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#include <cstring>
#endif

namespace fp8dp {

enum class Activation : int { kGelu = 0, kSwiglu = 1 };

namespace act {

#if defined(__CUDA_ARCH__)
FP8DP_HD float mul(float a, float b) { return __fmul_rn(a, b); }
FP8DP_HD float add(float a, float b) { return __fadd_rn(a, b); }
FP8DP_HD float sub(float a, float b) { return __fsub_rn(a, b); }
FP8DP_HD float rcp(float a) { return __frcp_rn(a); }
FP8DP_HD float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
FP8DP_HD float from_bits(uint32_t u) { return __uint_as_float(u); }
FP8DP_HD uint32_t to_bits(float f) { return __float_as_uint(f); }
#else
FP8DP_HD float mul(float a, float b) { return a * b; }
FP8DP_HD float add(float a, float b) { return a + b; }
FP8DP_HD float sub(float a, float b) { return a - b; }
FP8DP_HD float rcp(float a) { return 1.0f / a; }  // correctly rounded, as __frcp_rn
FP8DP_HD float fma(float a, float b, float c) { return std::fma(a, b, c); }
FP8DP_HD float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
FP8DP_HD uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
#endif

// 2^k for k in [-126, 127], exactly.
FP8DP_HD float pow2(int k) { return from_bits(static_cast<uint32_t>(k + 127) << 23); }

// e^x = e^r 2^k, x = k ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2), e^r by a degree-7
// Taylor polynomial in Horner form (truncation < 2e-9 relative); for x in [-103.972084,
// 88.7228394]. k = rint(x log2 e) by the shifter 1.5 * 2^23: adding it rounds to an integer (to
// nearest even; |x log2 e| < 2^22 here), and the sum's low bits are k, so no float-to-int
// conversion is needed: the kernels are bound by instruction issue, and FRND / F2I run at a
// quarter of the FMA rate.
struct ExpSplit {
  float p;  // e^r, in [0.70, 1.42]
  int k;
};
FP8DP_HD ExpSplit exp_split(float x) {
  constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23
  const float shifted = add(mul(x, 1.44269504f), kShifter);
  const float k = sub(shifted, kShifter);
  const float r = fma(-k, -2.12194440e-4f, fma(-k, 0.693359375f, x));  // ln2 = hi + lo (Cephes)
  float p = 1.0f / 5040.0f;
  p = fma(p, r, 1.0f / 720.0f);
  p = fma(p, r, 1.0f / 120.0f);
  p = fma(p, r, 1.0f / 24.0f);
  p = fma(p, r, 1.0f / 6.0f);
  p = fma(p, r, 0.5f);
  p = fma(p, r, 1.0f);
  p = fma(p, r, 1.0f);
  return {p, static_cast<int>(static_cast<int32_t>(to_bits(shifted) - to_bits(kShifter)))};
}

// e^x for x in [-103.972084, 88.7228394]: the scaling by 2^k in two exact steps, so that only the
// last one rounds (the result may be subnormal).
FP8DP_HD float exp_in_range(float x) {
  const ExpSplit e = exp_split(x);
  const int k1 = e.k / 2;
  return mul(mul(e.p, pow2(k1)), pow2(e.k - k1));
}

// e^x for x in [-80, 80] (erf's arguments are in (-36, 0]), where e^x is a normal float and 2^k is
// finite (k <= 116): one scaling by 2^k, exact, so the same bits as exp_in_range.
FP8DP_HD float exp_normal(float x) {
  const ExpSplit e = exp_split(x);
  return mul(e.p, pow2(e.k));
}

// e^x for every x: NaN stays NaN, overflow gives +Inf, underflow 0. The out-of-range inputs are
// computed on a stand-in and answered by selects, not branches.
FP8DP_HD float exp(float x) {
  const bool high = x > 88.7228394f, low = x < -103.972084f;
  const float e = exp_in_range((high || low || x != x) ? 0.0f : x);
  return x != x ? x : (high ? from_bits(0x7F800000u) : (low ? 0.0f : e));
}

// The argument split of erf(x): |x| clamped to the polynomial's range (ac, 0 for |x| >= 6 and
// NaN, where the result is a select) and e^{-ac^2}, which dgelu shares with the normal density.
struct ErfArg {
  float ac;
  bool big;
  float e;
};
FP8DP_HD ErfArg erf_arg(float x) {
  const float ax = x < 0.0f ? -x : x;
  const bool big = !(ax < 6.0f);  // and NaN
  const float ac = big ? 0.0f : ax;
  return {ac, big, exp_normal(-mul(ac, ac))};  // in (-36, 0]
}

// erf(x) for |x| by Abramowitz-Stegun 7.1.26 (|error| <= 1.5e-7), odd in x; 1 for |x| >= 6.
// Branch-free as exp: |x| >= 6 and NaN are computed on a stand-in and answered by selects.
FP8DP_HD float erf_of(float x, const ErfArg& g) {
  const float t = rcp(fma(0.3275911f, g.ac, 1.0f));
  float p = 1.061405429f;
  p = fma(p, t, -1.453152027f);
  p = fma(p, t, 1.421413741f);
  p = fma(p, t, -0.284496736f);
  p = fma(p, t, 0.254829592f);
  p = mul(p, t);
  const float y = g.big ? 1.0f : sub(1.0f, mul(p, g.e));
  return x != x ? x : (x < 0.0f ? -y : y);
}
FP8DP_HD float erf(float x) { return erf_of(x, erf_arg(x)); }

constexpr float kSqrtHalf = 0.707106781f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.398942280f;  // 1 / sqrt(2 pi)

// GELU (the exact, erf form: torch.nn.functional.gelu's default): x Φ(x).
FP8DP_HD float gelu(float x) {
  const float cdf = mul(0.5f, add(1.0f, erf(mul(x, kSqrtHalf))));
  return mul(x, cdf);
}
// d/dx x Φ(x) = Φ(x) + x φ(x). φ(x) takes erf's exponential, e^{-(x/√2)^2} with x/√2 rounded,
// instead of a second one (a third of the derivative's arithmetic): the exponent differs from
// -x^2/2 by under 3e-7 relative, so x φ(x) by under 1e-7 absolute (max of x^3 φ(x) / 2 is 0.23).
// Where erf saturates (|x| >= 6 √2) φ is taken as 0: x φ(x) < 1e-14 there.
FP8DP_HD float dgelu(float x) {
  const float z = mul(x, kSqrtHalf);
  const ErfArg g = erf_arg(z);
  const float cdf = mul(0.5f, add(1.0f, erf_of(z, g)));
  const float pdf = g.big ? 0.0f : mul(kInvSqrt2Pi, g.e);
  return add(cdf, mul(x, pdf));
}

// sigmoid(x) = 1 / (1 + e^-x): 0 for x below -88 (e^-x overflows), no NaN from Inf / Inf.
FP8DP_HD float sigmoid(float x) { return rcp(add(1.0f, exp(-x))); }
FP8DP_HD float silu(float x) { return mul(x, sigmoid(x)); }

// SwiGLU forward of one (gate, up) pair: silu(gate) * up.
FP8DP_HD float swiglu(float gate, float up) { return mul(silu(gate), up); }
// silu'(g) = s (1 + g (1 - s)) given s = sigmoid(g).
FP8DP_HD float dsilu_of(float g, float s) { return mul(s, add(1.0f, mul(g, sub(1.0f, s)))); }
FP8DP_HD float dsilu(float g) { return dsilu_of(g, sigmoid(g)); }
// Its gradients given da: d gate = da * up * silu'(gate), d up = da * silu(gate). The kernels'
// tables (activation_lut.h) hold silu and silu' of the gate: the same operations, the same bits.
FP8DP_HD void dswiglu(float da, float gate, float up, float& dgate, float& dup) {
  const float s = sigmoid(gate);
  dgate = mul(mul(da, up), dsilu_of(gate, s));
  dup = mul(da, mul(gate, s));
}

}  // namespace act
}  // namespace fp8dp
