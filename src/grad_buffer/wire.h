// Low-precision gradient wires (C6 — collectives, grad_reduce_wire): a bucket's reduction sends its
// FP32 gradients as BF16 or as FP8 bytes with a per-chunk scale, and the receiving rank sums the
// decoded chunks in FP32. This header holds the encode and the decode-accumulate steps (tensor
// level, CPU or CUDA through the FP8 cast kernels of src/fp8); BucketGroup runs the collectives
// around them.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace fp8dp {

// kFP32: no encoding, the collective runs on the buffer itself: FP32 on the wire for the FP32
// buffer of grad_reduce_in_fp32 (the default); a buffer in the parameter dtype
// (grad_reduce_in_fp32=False), which the other wires refuse, is reduced in that dtype.
enum class Wire { kFP32, kBF16, kE4M3, kE5M2 };

// "fp32", "bf16", "fp8_e4m3", "fp8_e5m2" -> Wire; anything else is a ValueError that names
// grad_reduce_wire, the accepted values and what came ("buffer", the old name of "fp32", says to
// use "fp32").
Wire wire_from_name(const std::string& name);
const char* wire_name(Wire w);
// The dtype of a wire's buffers: bfloat16, or uint8 holding FP8 bytes.
at::ScalarType wire_dtype(Wire w);
bool wire_is_fp8(Wire w);

// Encodes src (float32, flat, n elements) into data, viewed as chunks = scale_inv.numel() equal
// chunks of m = data.numel() / chunks elements: chunk k gets src[k m, min((k + 1) m, n)); elements
// of data past n are not written (the caller zeroes them once: they are padding).
// BF16: round to nearest even; scale_inv is set to 1.
// FP8: each chunk has its own scale, the largest power of two 2^e with amax_k 2^e <= fp8 max
// (amax_k: the chunk's max |x|; e within [-125, 125]; an empty or all-zero chunk gets 1), and
// the bytes are saturate(rne(x 2^e)) from the FP8 cast kernel (quantize.h). A power of two makes
// the scaling and the decode exact: the FP8 rounding is the only error, at most 2^-4 (E4M3) or
// 2^-3 (E5M2) of |x| above the format's smallest normal, and half a subnormal step (2^-10 or 2^-17
// times 2^-e) below it. A chunk whose amax is NaN or Inf gets scale_inv NaN, so that the whole
// chunk decodes to NaN: the cast would otherwise saturate an Inf to the format's max, and a
// non-finite gradient must not vanish on the wire.
// Runs on src's device (stream-ordered on CUDA: no host sync).
void encode_chunks(const at::Tensor& src, Wire w, const at::Tensor& data,
                   const at::Tensor& scale_inv);

// out (float32, flat, L <= m elements) <- post_scale * sum over k = 0, 1, ..., chunks - 1 of
// decode(first L elements of chunk k) * scale_inv[k], accumulated in float32 in that order (the
// same order on every rank, whichever chunk it owns, so the result does not depend on the owner).
// tmp: float32 scratch of at least L elements (FP8 decodes into it); unused for BF16.
void decode_sum(const at::Tensor& data, const at::Tensor& scale_inv, Wire w, const at::Tensor& out,
                const at::Tensor& tmp, double post_scale);

// out (float32, flat, n <= chunks m elements) <- every chunk decoded in place (element i from
// chunk i / m): the all-gather half of a low-precision all-reduce.
void decode_chunks(const at::Tensor& data, const at::Tensor& scale_inv, Wire w,
                   const at::Tensor& out);

}  // namespace fp8dp
