// Tensor-level FP8 casts: check at::Tensor arguments, allocate outputs, dispatch to the CPU or CUDA
// kernel of quantize.h. Everything above src/fp8 casts through these functions.
#pragma once

#include <ATen/core/Tensor.h>

#include "fp8/format.h"

namespace fp8dp {

at::ScalarType fp8_dtype(Format f);

// Result of one quantize call; tensors that were not asked for are undefined.
struct Quantized {
  at::Tensor data;       // x's shape, FP8 dtype of the format
  at::Tensor data_t;     // [last_dim, numel / last_dim]: the transposed 2-D view of x, quantized
  at::Tensor scale_inv;  // float32 [1]; block-scaled casts (block_cast.h): data's per-tile scales
  at::Tensor amax;       // float32 [1]: max |x| (NaN if x holds NaN); undefined for block casts
  at::Tensor dbias;      // [last_dim] of opts.dbias_dtype: column sums of x viewed as 2-D
  // Block-scaled casts only: data_t's own per-tile scales (a 1x128 tile of x is not one of xᵀ).
  at::Tensor scale_inv_t;

  // The scale_inv that goes with data_t: per-tensor scaling shares one scale between the two.
  const at::Tensor& scale_inv_for_t() const {
    return scale_inv_t.defined() ? scale_inv_t : scale_inv;
  }
};

struct QuantizeOptions {
  bool data = true;
  bool transpose = false;
  bool dbias = false;
  // float32, bfloat16 or float16: the FP32 column sums rounded once (a bias's own dtype, so its
  // gradient needs no conversion of its own).
  at::ScalarType dbias_dtype = at::kFloat;
};

// x: float32 / bfloat16 / float16 of any shape (viewed as [numel / last_dim, last_dim]; a
// non-contiguous x is copied first). scale: float32 with one element on x's device, finite and > 0
// (check_scale_value; on a GPU the check would need a host sync, so the cast writes scale_inv =
// NaN for an invalid scale instead, and every use of the result is NaN, not silently wrong).
// amax_into: optional float32 [1] on x's device holding a running amax (>= 0 or NaN, e.g. a
// delayed-scaling history's row 0); the cast max-merges its amax into it in the same kernel and
// returns it as q.amax.
Quantized quantize(const at::Tensor& x, const at::Tensor& scale, Format format,
                   QuantizeOptions opts = {}, const at::Tensor& amax_into = {});

// quantize() of the matrix x = cat([p.reshape(d0 * d1, d2 * d3) for p in parts], dim=1) without
// building it: parts are 1 to 4 tensors of one 4-d shape [d0, d1, d2, d3], one dtype (float32 /
// bfloat16 / float16) and one device, with any strides. The result is exactly quantize(x, ...)'s
// (data [d0 * d1, n * d2 * d3], data_t, amax, scale_inv, dbias: the same bytes and bits). On CUDA
// the cast reads the parts where they lie when quantize_parts_strided() says so (SDPA's dq, dk,
// dv: the QKV projection's backward then skips autograd's stack of them, a copy as large as the
// cast's own read); otherwise, and on the CPU, it builds x with at::cat and calls quantize.
// Arguments are checked as quantize checks them; errors name 'parts' and what differs.
Quantized quantize_parts(at::TensorList parts, const at::Tensor& scale, Format format,
                         QuantizeOptions opts = {}, const at::Tensor& amax_into = {});

// x itself, materialized: cat([p.reshape(d0 * d1, d2 * d3) for p in parts], dim=1), with the
// checks of quantize_parts. What quantize_parts casts wherever it does not read the parts in place,
// and for casts that need a plain matrix (current scaling's amax pass, block scaling's tiles).
at::Tensor join_parts(at::TensorList parts);

// Whether quantize_parts(parts, ...) reads the parts in place (the strided CUDA kernel) rather than
// materializing x: CUDA tensors whose common layout quantize_cuda_strided_supported accepts (the
// same strides in every part, the last dimension contiguous, 16-byte aligned vectors). The same
// checks as quantize_parts; false on the CPU and in builds without CUDA.
bool quantize_parts_strided(at::TensorList parts);

// float32 [1] tensor: max |x| of quantize_parts' x, with the NaN / Inf rules of amax: for a scale
// computed from the input's own amax before the cast (the first step of a delayed-scaling cast),
// read where the parts lie as quantize_parts reads them.
at::Tensor amax_parts(at::TensorList parts);

// The value check of an FP8 cast's scale argument `arg` of entry point `fn`: a scale held on the
// CPU must be finite and > 0. One on a GPU is not read back (a host sync per cast); the kernels
// write scale_inv = NaN for it instead (scale_inverse, fp8/format.h).
void check_scale_value(const at::Tensor& scale, const char* fn, const char* arg = "scale");

// The check of an amax_into argument (quantize, norm_forward): float32, one element, contiguous,
// on like's device.
void check_amax_into(const at::Tensor& amax_into, const at::Tensor& like, const char* fn);

// float32 [1] tensor: max |x| with the NaN / Inf rules of quantize.
at::Tensor amax(const at::Tensor& x);

// data: a 2-D FP8 tensor [rows, cols]; returns its transpose [cols, rows], contiguous (the tiled
// kernel of src/fp8/cuda/transpose.cu on CUDA where the shape allows, else an ATen copy).
at::Tensor transpose_fp8(const at::Tensor& data);

// data: an FP8 tensor; returns decode(data) * scale_inv as `dtype`.
at::Tensor dequantize(const at::Tensor& data, const at::Tensor& scale_inv, at::ScalarType dtype);

}  // namespace fp8dp
