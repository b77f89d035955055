// Tables of the activation functions over bf16 inputs, for the CUDA activation kernels.
//
// Why: the kernels are bound by instruction issue, not memory (12-03 profile: GELU 0.14 ms against
// torch's 0.05 for 2048 x 8192 in bf16), because activation_math.h builds erf and exp from
// IEEE-rounded operations only, so that CPU and CUDA give the same bits (C7): GELU takes 65 SASS
// instructions per element, its derivative 73. A bf16 input has 65,536 values, so each function
// of it is a table: one shared-memory load instead. The table holds the function's own results,
// computed on the device by activation_math.h (fill_lut), so a looked-up value has exactly the
// bits the computation would have had; inputs outside the table's range are computed as before.
//
// Layout: the magnitudes 2^-12 <= |x| < 2^4 (16 binades of 128 bf16 values each), positive then
// negative; `slot` maps a bf16 value to its index, `value` back. Outside that range (zero, tiny,
// |x| >= 16, Inf, NaN: rare in a pre-activation, whose values are O(1)) the kernels compute the
// function. Each function reads its entry as one float (GELU, its derivative, SiLU) or a pair
// (SwiGLU's backward: silu(g) and silu'(g)).
#pragma once

#include <cstdint>

#include "fp8/activation_math.h"

namespace fp8dp {
namespace act_lut {

constexpr uint32_t kExpLo = 127 - 12;                  // biased exponent of 2^-12
constexpr uint32_t kExpHi = 127 + 4;                   // of 2^4: the first one past the table
constexpr uint32_t kPerSign = (kExpHi - kExpLo) << 7;  // 2048 magnitudes
constexpr uint32_t kLutSize = 2 * kPerSign;            // 4096 slots
constexpr uint32_t kLoBits = kExpLo << 7;              // bf16 bits of 2^-12

// Slot of x, a bf16 value widened to float (its low 16 bits are 0), and whether x lies in the
// table (`in`); the slot is 0 when it does not, so that a load from it stays inside.
FP8DP_HD uint32_t slot(float x, bool& in) {
  const uint32_t b = act::to_bits(x) >> 16;
  const uint32_t off = (b & 0x7FFFu) - kLoBits;  // wraps above kPerSign below the range
  in = off < kPerSign;
  return in ? off + (b >> 15) * kPerSign : 0u;
}

// The bf16 value (as float) whose slot is i < kLutSize: slot(value(i)) == i.
FP8DP_HD float value(uint32_t i) {
  const uint32_t sign = i >= kPerSign ? 0x8000u : 0u;
  const uint32_t mag = (i >= kPerSign ? i - kPerSign : i) + kLoBits;
  return act::from_bits((sign | mag) << 16);
}

// v rounded to nearest even into bf16, widened back, as the kernels' from_float / to_float do
// (v is finite or infinite: no table holds a NaN).
FP8DP_HD float round_bf16(float v) {
  const uint32_t u = act::to_bits(v);
  return act::from_bits((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

// What a table holds. Each is the activation_math.h expression the kernels would evaluate.
enum class Fn : int {
  kGelu = 0,   // gelu(x) rounded to bf16: GELU's forward output itself, nothing left to round
  kDgelu = 1,  // dgelu(x)
  kSilu = 2,   // silu(x) (SwiGLU's forward: swiglu(g, u) = silu(g) * u)
  kDsilu =
      3,  // silu'(x) (SwiGLU's backward, with kSilu: dgate = (da u) silu'(g), dup = da silu(g))
};
constexpr int kFns = 4;

FP8DP_HD float eval(Fn f, float x) {
  switch (f) {
    case Fn::kGelu:
      return round_bf16(act::gelu(x));
    case Fn::kDgelu:
      return act::dgelu(x);
    case Fn::kSilu:
      return act::silu(x);
    default:
      return act::dsilu(x);
  }
}

}  // namespace act_lut

}  // namespace fp8dp
