// CPU FP8 cast kernels: quantize (+ amax, + transpose, + dbias) in one pass, and dequantize.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "common/check.h"
#include "fp8/quantize.h"

namespace fp8dp {
namespace {

// Column tile of the transposing path: 64 FP8 bytes per transposed row keeps stores cache-line sized.
constexpr int64_t kTile = 64;
// Elements per task of the flat path: large enough that thread start-up is noise.
constexpr int64_t kGrain = 1 << 15;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

// NaN-propagating amax combine: the partial results of two ranges.
inline float combine_amax(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return std::max(a, b);
}

// Flat path: amax (+ optional row-major bytes). Branch-free inner loop so it vectorises; NaN is
// tracked in a separate flag because max() would drop it.
template <Format F, typename T, bool kWrite>
float quantize_range(const T* in, uint8_t* out, float scale, int64_t begin, int64_t end) {
  float amax = 0.0f;
  int nan = 0;
  for (int64_t i = begin; i < end; ++i) {
    const float v = to_float(in[i]);
    nan |= (v != v);
    const float a = std::fabs(v);
    amax = a > amax ? a : amax;
    if constexpr (kWrite) out[i] = quantize_one<F>(v * scale);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

template <Format F, typename T>
float quantize_flat(const QuantizeParams& p, float scale) {
  const T* in = static_cast<const T*>(p.input);
  const int64_t n = p.rows * p.cols;
  return at::parallel_reduce(
      int64_t{0}, n, kGrain, 0.0f,
      [&](int64_t b, int64_t e, float) {
        return p.out ? quantize_range<F, T, true>(in, p.out, scale, b, e)
                     : quantize_range<F, T, false>(in, nullptr, scale, b, e);
      },
      combine_amax);
}

// Transposing / dbias path: each task owns a block of kTile columns and walks all rows in order, so
// the column sums are deterministic and every transposed row is written in full by one thread.
template <Format F, typename T>
float quantize_tiled(const QuantizeParams& p, float scale) {
  const T* in = static_cast<const T*>(p.input);
  const int64_t rows = p.rows, cols = p.cols;
  const int64_t nblocks = (cols + kTile - 1) / kTile;
  std::vector<float> block_amax(static_cast<size_t>(nblocks), 0.0f);
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    std::array<uint8_t, kTile * kTile> tile;
    std::array<float, kTile> sums;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t c0 = blk * kTile, w = std::min(kTile, cols - c0);
      sums.fill(0.0f);
      float amax = 0.0f;
      int nan = 0;
      for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
        const int64_t h = std::min(kTile, rows - r0);
        for (int64_t r = 0; r < h; ++r) {
          const T* row = in + (r0 + r) * cols + c0;
          uint8_t* orow = p.out ? p.out + (r0 + r) * cols + c0 : nullptr;
          for (int64_t c = 0; c < w; ++c) {
            const float v = to_float(row[c]);
            nan |= (v != v);
            const float a = std::fabs(v);
            amax = a > amax ? a : amax;
            sums[c] += v;
            const uint8_t q = quantize_one<F>(v * scale);
            tile[c * kTile + r] = q;
            if (orow) orow[c] = q;
          }
        }
        if (p.out_t) {
          for (int64_t c = 0; c < w; ++c) {
            std::copy_n(&tile[c * kTile], h, p.out_t + (c0 + c) * rows + r0);
          }
        }
      }
      if (p.dbias) std::copy_n(sums.data(), w, p.dbias + c0);
      block_amax[blk] = nan ? std::numeric_limits<float>::quiet_NaN() : amax;
    }
  });
  float amax = 0.0f;
  for (float a : block_amax) amax = combine_amax(amax, a);
  return amax;
}

template <Format F, typename T>
float quantize_dispatch_path(const QuantizeParams& p, float scale) {
  return (p.out_t || p.dbias) ? quantize_tiled<F, T>(p, scale) : quantize_flat<F, T>(p, scale);
}

template <Format F>
float quantize_dispatch_dtype(const QuantizeParams& p, float scale) {
  switch (p.input_dtype) {
    case DType::kFloat32: return quantize_dispatch_path<F, float>(p, scale);
    case DType::kBFloat16: return quantize_dispatch_path<F, c10::BFloat16>(p, scale);
    case DType::kFloat16: return quantize_dispatch_path<F, c10::Half>(p, scale);
  }
  FP8DP_CHECK(false, "quantize_cpu: unknown input dtype ", static_cast<int>(p.input_dtype));
}

template <typename T>
void dequantize_typed(const DequantizeParams& p, const std::array<float, 256>& lut) {
  T* out = static_cast<T*>(p.out);
  at::parallel_for(0, p.numel, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = static_cast<T>(lut[p.input[i]]);
  });
}

}  // namespace

const char* format_name(Format f) { return f == Format::kE4M3 ? "E4M3" : "E5M2"; }

void quantize_cpu(const QuantizeParams& p) {
  FP8DP_CHECK(p.rows >= 0 && p.cols >= 0, "quantize_cpu: bad shape [", p.rows, ", ", p.cols, "]");
  FP8DP_CHECK(p.scale != nullptr, "quantize_cpu: scale pointer is null");
  FP8DP_CHECK(p.rows * p.cols == 0 || p.input != nullptr, "quantize_cpu: input pointer is null");
  const float scale = *p.scale;
  const float amax = p.format == Format::kE4M3 ? quantize_dispatch_dtype<Format::kE4M3>(p, scale)
                                               : quantize_dispatch_dtype<Format::kE5M2>(p, scale);
  if (p.amax) *p.amax = amax;
  if (p.scale_inv) *p.scale_inv = 1.0f / scale;
}

void dequantize_cpu(const DequantizeParams& p) {
  FP8DP_CHECK(p.scale_inv != nullptr, "dequantize_cpu: scale_inv pointer is null");
  std::array<float, 256> lut;
  const float s = *p.scale_inv;
  for (int i = 0; i < 256; ++i) lut[i] = fp8_decode(static_cast<uint8_t>(i), p.format) * s;
  switch (p.out_dtype) {
    case DType::kFloat32: return dequantize_typed<float>(p, lut);
    case DType::kBFloat16: return dequantize_typed<c10::BFloat16>(p, lut);
    case DType::kFloat16: return dequantize_typed<c10::Half>(p, lut);
  }
  FP8DP_CHECK(false, "dequantize_cpu: unknown output dtype ", static_cast<int>(p.out_dtype));
}

}  // namespace fp8dp
