// Tensor-level activation of LayerNormMLP (GELU, SwiGLU), alone or fused with the FP8 cast of its
// result: checks at::Tensor arguments, allocates outputs, dispatches to activation_kernel.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <string_view>

#include "fp8/activation_math.h"
#include "fp8/cast.h"

namespace fp8dp {

// "gelu" or "swiglu"; anything else is a ValueError naming `where` and the accepted names.
Activation parse_activation(const std::string& name, std::string_view where);
const char* activation_name(Activation act);

// h: [rows, in_cols] of float32 / bfloat16 / float16 (in_cols = cols for GELU, 2 cols for SwiGLU:
// [gate | up]). Returns a = act(h) [rows, cols] in h's dtype (computed in FP32, rounded once).
at::Tensor activation_forward(const at::Tensor& h, Activation act);
// da: [rows, cols], h as above, one dtype. Returns dh [rows, in_cols] in that dtype.
at::Tensor activation_backward(const at::Tensor& da, const at::Tensor& h, Activation act);

// The same results cast to FP8 in the same pass, as quantize() casts a tensor (cast.h: scale,
// opts, amax_into have its meaning; opts.dbias only backward), without writing the high-precision
// result on CUDA. The bytes equal quantize(activation_forward(h)) / quantize(activation_backward(
// da, h)) on every device. `da` undefined = forward.
Quantized activation_cast(const at::Tensor& da, const at::Tensor& h, Activation act,
                          const at::Tensor& scale, Format format, QuantizeOptions opts,
                          const at::Tensor& amax_into = {});
// float32 [1]: max |result| (current scaling's first pass, and a delayed-scaling role's first
// scale), nothing else written.
at::Tensor activation_amax(const at::Tensor& da, const at::Tensor& h, Activation act);

// Whether the CUDA kernels look bf16 inputs up in tables (activation_lut.h; the default) or
// compute every element. Both give the same bits; the switch serves the benchmark's
// same-process comparison (bench/layernorm_mlp_gpu.py) and the GPU test that compares the two.
// Returns the previous setting.
bool set_activation_lut(bool enabled);

}  // namespace fp8dp
