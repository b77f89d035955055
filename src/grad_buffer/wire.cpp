// Encode and decode-accumulate of the low-precision gradient wires, on the FP8 cast kernels of
// src/fp8 (the same bytes on CPU and CUDA, C7) and plain ATen ops for BF16.
#include "grad_buffer/wire.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "common/check.h"
#include "common/dispatch.h"
#include "fp8/format.h"
#include "fp8/quantize.h"

namespace fp8dp {
namespace {

Format format_of(Wire w) { return w == Wire::kE4M3 ? Format::kE4M3 : Format::kE5M2; }

// Elements of chunk k that hold data when n elements are split in chunks of m.
int64_t valid(int64_t n, int64_t m, int64_t k) { return std::clamp<int64_t>(n - k * m, 0, m); }

void check_flat(const at::Tensor& t, at::ScalarType dt, const char* what) {
  FP8DP_CHECK(t.defined() && t.dim() == 1 && t.is_contiguous() && t.scalar_type() == dt, what,
              ": expected a flat contiguous ", dt, " tensor, got ",
              t.defined() ? c10::toString(t.scalar_type()) : "an undefined one", " sizes ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
}

void check_chunks(const at::Tensor& data, const at::Tensor& scale_inv, Wire w) {
  FP8DP_CHECK(w != Wire::kFP32, "wire: the 'fp32' wire has no encoding");
  check_flat(data, wire_dtype(w), "wire data");
  check_flat(scale_inv, at::kFloat, "wire scale_inv");
  FP8DP_CHECK(scale_inv.numel() > 0 && data.numel() % scale_inv.numel() == 0,
              "wire data: ", data.numel(), " elements do not split into ", scale_inv.numel(),
              " chunks");
}

// FP8 decode of n bytes at data[offset] with scale_inv[k] into out (float32), on data's device.
void decode_fp8(const at::Tensor& data, int64_t offset, int64_t n, const at::Tensor& scale_inv,
                int64_t k, Wire w, const at::Tensor& out) {
  if (n == 0) return;
  DequantizeParams p;
  p.input = data.const_data_ptr<uint8_t>() + offset;
  p.numel = n;
  p.format = format_of(w);
  p.scale_inv = scale_inv.const_data_ptr<float>() + k;
  p.out = out.data_ptr<float>();
  p.out_dtype = DType::kFloat32;
  dispatch_kernel(data.device(), dequantize_cpu, FP8DP_CUDA_KERNEL(dequantize_cuda), p);
}

}  // namespace

Wire wire_from_name(const std::string& name) {
  if (name == "fp32") return Wire::kFP32;
  if (name == "bf16") return Wire::kBF16;
  if (name == "fp8_e4m3") return Wire::kE4M3;
  if (name == "fp8_e5m2") return Wire::kE5M2;
  // The old name of "fp32": a config written for it must fail loudly, not fall back silently.
  FP8DP_CHECK_ARG(name != "buffer",
                  "grad_reduce_wire: 'buffer' was renamed to 'fp32' (the bucket is reduced as "
                  "it is, FP32 with grad_reduce_in_fp32=True); use grad_reduce_wire='fp32'");
  FP8DP_CHECK_ARG(false,
                  "grad_reduce_wire: expected one of 'fp32', 'bf16', 'fp8_e4m3', 'fp8_e5m2', "
                  "got '",
                  name, "'");
}

const char* wire_name(Wire w) {
  switch (w) {
    case Wire::kFP32:
      return "fp32";
    case Wire::kBF16:
      return "bf16";
    case Wire::kE4M3:
      return "fp8_e4m3";
    case Wire::kE5M2:
      return "fp8_e5m2";
  }
  return "?";
}

at::ScalarType wire_dtype(Wire w) { return w == Wire::kBF16 ? at::kBFloat16 : at::kByte; }

bool wire_is_fp8(Wire w) { return w == Wire::kE4M3 || w == Wire::kE5M2; }

void encode_chunks(const at::Tensor& src, Wire w, const at::Tensor& data,
                   const at::Tensor& scale_inv) {
  check_chunks(data, scale_inv, w);
  check_flat(src, at::kFloat, "wire src");
  const int64_t chunks = scale_inv.numel(), m = data.numel() / chunks, n = src.numel();
  FP8DP_CHECK(n <= data.numel(), "wire src: ", n, " elements do not fit ", chunks, " chunks of ",
              m);
  if (w == Wire::kBF16) {
    data.narrow(0, 0, n).copy_(src);  // round to nearest even
    scale_inv.fill_(1.0);
    return;
  }
  const Format f = format_of(w);
  auto f32 = src.options().dtype(at::kFloat);
  // Chunk k's cast: its valid elements as one row (0 columns past the end of src).
  auto chunk = [&](int64_t k) {
    QuantizeParams p;
    p.cols = valid(n, m, k);
    p.input = p.cols > 0 ? src.const_data_ptr<float>() + k * m : nullptr;
    p.input_dtype = DType::kFloat32;
    p.rows = 1;
    p.format = f;
    return p;
  };
  // Pass 1: each chunk's amax (the cast kernel without output bytes; NaN if any NaN, Inf if any
  // Inf, 0 when empty).
  at::Tensor amax = at::zeros({chunks}, f32);
  const at::Tensor one = at::ones({1}, f32);
  for (int64_t k = 0; k < chunks; ++k) {
    QuantizeParams p = chunk(k);
    if (p.cols == 0) continue;
    p.scale = one.const_data_ptr<float>();
    p.amax = amax.data_ptr<float>() + k;
    dispatch_kernel(src.device(), quantize_cpu, FP8DP_CUDA_KERNEL(quantize_cuda), p);
  }
  // The scales, on the device (no host sync): e = exponent of fp8_max / amax minus one, so that
  // 2^e <= fp8_max / amax < 2^(e + 1); built from the exponent bits, hence exact powers of two.
  const at::Tensor finite = at::isfinite(amax);
  const at::Tensor usable = at::logical_and(finite, amax > 0);
  // The ratio is capped below float's overflow (an amax near float's smallest values), so frexp
  // always sees a finite number; e then stays within [-125, 125] and both 2^e and 2^-e are normal.
  const at::Tensor ratio =
      at::where(usable, at::div(at::full({1}, fp8_max(f), f32), amax), at::ones_like(amax))
          .clamp_max(std::ldexp(1.0, 125));
  at::Tensor e = std::get<1>(at::frexp(ratio)).sub(1).clamp(-125, 125);
  const at::Tensor scale = e.add(127).bitwise_left_shift(23).view(at::kFloat);
  at::Tensor inv = e.neg().add(127).bitwise_left_shift(23).view(at::kFloat);
  inv = at::where(finite, inv, at::full({1}, NAN, f32));
  scale_inv.copy_(inv);
  // Pass 2: the bytes, each chunk with its own scale.
  for (int64_t k = 0; k < chunks; ++k) {
    QuantizeParams p = chunk(k);
    if (p.cols == 0) continue;
    p.scale = scale.const_data_ptr<float>() + k;
    p.out = data.data_ptr<uint8_t>() + k * m;
    dispatch_kernel(src.device(), quantize_cpu, FP8DP_CUDA_KERNEL(quantize_cuda), p);
  }
}

void decode_sum(const at::Tensor& data, const at::Tensor& scale_inv, Wire w, const at::Tensor& out,
                const at::Tensor& tmp, double post_scale) {
  check_chunks(data, scale_inv, w);
  check_flat(out, at::kFloat, "wire out");
  const int64_t chunks = scale_inv.numel(), m = data.numel() / chunks, len = out.numel();
  FP8DP_CHECK(len <= m, "wire out: ", len, " elements, more than a chunk of ", m);
  if (len == 0) return;
  for (int64_t k = 0; k < chunks; ++k) {
    if (w == Wire::kBF16) {
      const at::Tensor c = data.narrow(0, k * m, len);
      // bfloat16 -> float32 is exact; add_ computes in float32: one rounding per addition.
      if (k == 0)
        out.copy_(c);
      else
        out.add_(c);
      continue;
    }
    check_flat(tmp, at::kFloat, "wire tmp");
    FP8DP_CHECK(tmp.numel() >= len, "wire tmp: ", tmp.numel(), " elements, need ", len);
    // Decoding is exact (FP8 value times a power of two): the adds are the only roundings.
    if (k == 0) {
      decode_fp8(data, 0, len, scale_inv, 0, w, out);
    } else {
      const at::Tensor t = tmp.narrow(0, 0, len);
      decode_fp8(data, k * m, len, scale_inv, k, w, t);
      out.add_(t);
    }
  }
  if (post_scale != 1.0) out.mul_(post_scale);
}

void decode_chunks(const at::Tensor& data, const at::Tensor& scale_inv, Wire w,
                   const at::Tensor& out) {
  check_chunks(data, scale_inv, w);
  check_flat(out, at::kFloat, "wire out");
  const int64_t chunks = scale_inv.numel(), m = data.numel() / chunks, n = out.numel();
  FP8DP_CHECK(n <= data.numel(), "wire out: ", n, " elements, more than ", chunks, " chunks of ",
              m);
  if (w == Wire::kBF16) {
    out.copy_(data.narrow(0, 0, n));
    return;
  }
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t len = valid(n, m, k);
    if (len > 0) decode_fp8(data, k * m, len, scale_inv, k, w, out.narrow(0, k * m, len));
  }
}

}  // namespace fp8dp
