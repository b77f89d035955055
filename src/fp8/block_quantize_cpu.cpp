// CPU block-scaled FP8 casts (block_quantize.h): the reference the CUDA kernels match byte for
// byte. Work goes by bands of 128 input rows (one task each): the band is widened to FP32 once,
// then every output that needs it (row tiles, 128 x 128 blocks, the transpose's column tiles) is
// cast from that buffer. Clarity over speed: this path emulates the GPU's numerics for tests.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "common/check.h"
#include "fp8/block_quantize.h"

namespace fp8dp {
namespace {

void widen_rows(const void* in, DType dt, int64_t first, int64_t n, float* out) {
  switch (dt) {
    case DType::kFloat32:
      std::copy_n(static_cast<const float*>(in) + first, n, out);
      return;
    case DType::kBFloat16: {
      const auto* p = static_cast<const c10::BFloat16*>(in) + first;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
      return;
    }
    case DType::kFloat16: {
      const auto* p = static_cast<const c10::Half*>(in) + first;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
      return;
    }
    default:
      FP8DP_CHECK(false, "block_quantize_cpu: no kernel for input dtype ", dtype_name(dt));
  }
}

// The amax rule of quantize.h: NaN if any NaN, else +Inf if any Inf, else max |x|. Kept as the max
// of the magnitudes' bit patterns (for non-negative floats integer order is float order, and NaN
// patterns lie above +Inf's).
inline uint32_t mag_bits(float v) { return float_bits(v) & 0x7FFFFFFFu; }
inline float amax_of_bits(uint32_t b) {
  return b > 0x7F800000u ? bits_float(0x7FC00000u) : bits_float(b);
}

template <Format F>
void quantize_band(const BlockQuantizeParams& p, int64_t r0, const float* band, int64_t nr) {
  const int64_t cols = p.cols, kb = ceil_blocks(cols), rb = r0 / kBlockLen;
  const float fmax = fp8_max(F);
  auto scale_of = [&](uint32_t amax_bits) {
    return block_scale(amax_of_bits(amax_bits), fmax, p.power_2_scale, p.amax_epsilon);
  };
  if (p.shape == BlockShape::k1x128) {
    if (p.out != nullptr) {
      for (int64_t r = 0; r < nr; ++r) {
        const float* x = band + r * cols;
        uint8_t* o = p.out + (r0 + r) * cols;
        for (int64_t t = 0; t < kb; ++t) {
          const int64_t c0 = t * kBlockLen, c1 = std::min(cols, c0 + kBlockLen);
          uint32_t m = 0;
          for (int64_t c = c0; c < c1; ++c) m = std::max(m, mag_bits(x[c]));
          const float s = scale_of(m);
          for (int64_t c = c0; c < c1; ++c) o[c] = quantize_one<F>(x[c] * s);
          p.scale_inv[(r0 + r) * kb + t] = 1.0f / s;
        }
      }
    }
    if (p.out_t != nullptr) {
      // Column c of this band is one tile of row c of the transpose.
      const int64_t kbt = ceil_blocks(p.rows);
      for (int64_t c = 0; c < cols; ++c) {
        uint32_t m = 0;
        for (int64_t r = 0; r < nr; ++r) m = std::max(m, mag_bits(band[r * cols + c]));
        const float s = scale_of(m);
        uint8_t* o = p.out_t + c * p.rows + r0;
        for (int64_t r = 0; r < nr; ++r) o[r] = quantize_one<F>(band[r * cols + c] * s);
        p.scale_inv_t[c * kbt + rb] = 1.0f / s;
      }
    }
    return;
  }
  // 128 x 128 blocks: one scale per block of this band, shared by out and out_t.
  const int64_t kbt = ceil_blocks(p.rows);
  for (int64_t t = 0; t < kb; ++t) {
    const int64_t c0 = t * kBlockLen, c1 = std::min(cols, c0 + kBlockLen);
    uint32_t m = 0;
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t c = c0; c < c1; ++c) m = std::max(m, mag_bits(band[r * cols + c]));
    const float s = scale_of(m);
    for (int64_t r = 0; r < nr; ++r) {
      for (int64_t c = c0; c < c1; ++c) {
        const uint8_t q = quantize_one<F>(band[r * cols + c] * s);
        if (p.out != nullptr) p.out[(r0 + r) * cols + c] = q;
        if (p.out_t != nullptr) p.out_t[c * p.rows + r0 + r] = q;
      }
    }
    if (p.scale_inv != nullptr) p.scale_inv[rb * kb + t] = 1.0f / s;
    if (p.scale_inv_t != nullptr) p.scale_inv_t[t * kbt + rb] = 1.0f / s;
  }
}

template <Format F>
float dequantize_one_block(const BlockDequantizeParams& p, int64_t r, int64_t c) {
  const int64_t kb = ceil_blocks(p.cols);
  const int64_t si =
      p.shape == BlockShape::k1x128 ? r * kb + c / kBlockLen : (r / kBlockLen) * kb + c / kBlockLen;
  return fp8_decode(p.input[r * p.cols + c], F) * p.scale_inv[si];
}

template <Format F, typename T>
void dequantize_rows(const BlockDequantizeParams& p, int64_t r0, int64_t r1) {
  T* out = static_cast<T*>(p.out);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < p.cols; ++c)
      out[r * p.cols + c] = static_cast<T>(dequantize_one_block<F>(p, r, c));
}

template <Format F>
void dequantize_rows_any(const BlockDequantizeParams& p, int64_t r0, int64_t r1) {
  switch (p.out_dtype) {
    case DType::kFloat32:
      return dequantize_rows<F, float>(p, r0, r1);
    case DType::kBFloat16:
      return dequantize_rows<F, c10::BFloat16>(p, r0, r1);
    case DType::kFloat16:
      return dequantize_rows<F, c10::Half>(p, r0, r1);
    default:
      FP8DP_CHECK(false, "block_dequantize_cpu: no kernel for output dtype ",
                  dtype_name(p.out_dtype));
  }
}

}  // namespace

void block_quantize_cpu(const BlockQuantizeParams& p) {
  FP8DP_CHECK(p.rows >= 0 && p.cols >= 0, "block_quantize_cpu: bad shape [", p.rows, ", ", p.cols,
              "]");
  FP8DP_CHECK((p.out == nullptr) == (p.scale_inv == nullptr) &&
                  (p.out_t == nullptr) == (p.scale_inv_t == nullptr),
              "block_quantize_cpu: every FP8 output needs its scale_inv and vice versa");
  const int64_t bands = ceil_blocks(p.rows);
  at::parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> band;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kBlockLen, nr = std::min(kBlockLen, p.rows - r0);
      band.resize(static_cast<size_t>(nr * p.cols));
      widen_rows(p.input, p.input_dtype, r0 * p.cols, nr * p.cols, band.data());
      if (p.format == Format::kE4M3) {
        quantize_band<Format::kE4M3>(p, r0, band.data(), nr);
      } else {
        quantize_band<Format::kE5M2>(p, r0, band.data(), nr);
      }
    }
  });
}

void block_dequantize_cpu(const BlockDequantizeParams& p) {
  FP8DP_CHECK(p.rows >= 0 && p.cols >= 0, "block_dequantize_cpu: bad shape [", p.rows, ", ", p.cols,
              "]");
  at::parallel_for(0, p.rows, 64, [&](int64_t r0, int64_t r1) {
    if (p.format == Format::kE4M3) {
      dequantize_rows_any<Format::kE4M3>(p, r0, r1);
    } else {
      dequantize_rows_any<Format::kE5M2>(p, r0, r1);
    }
  });
}

}  // namespace fp8dp
