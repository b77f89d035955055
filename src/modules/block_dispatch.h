// The Linear layers' casts under Float8BlockScaling (RecipeKind::kBlock): which tile shape, format
// and scale rule each role takes.
#pragma once

#include <ATen/core/Tensor.h>

#include "fp8/block_cast.h"
#include "fp8/recipe.h"
#include "fp8/scaling_state.h"

namespace fp8dp {

// Weights in 128x128 blocks (a block of W is a block of Wᵀ: the dgrad operand is the same bytes
// transposed); the input and grad_output in 1x128 tiles along the GEMM's reduction dimension, their
// transposes (the wgrad operands, reduced over tokens) re-cast from the high-precision tensor in
// 1x128 tiles along the tokens. Input and weight in the forward format, grad_output in the
// backward one; each role with its own QParams. No scaling state: nothing is recorded (C9).
inline Quantized cast_block(const at::Tensor& x, Role role, const Recipe& r, QuantizeOptions opts) {
  switch (role) {
    case Role::kWeight:
      return block_quantize(x, r.fwd_format, BlockShape::k128x128, r.block_weight, opts);
    case Role::kGradOutput:
      return block_quantize(x, r.bwd_format, BlockShape::k1x128, r.block_grad, opts);
    case Role::kInput:
    default:
      return block_quantize(x, r.fwd_format, BlockShape::k1x128, r.block_inp, opts);
  }
}

}  // namespace fp8dp
