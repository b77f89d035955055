// The CPU kernels through their raw-pointer entry points, linked against fp8dp_kernels only (no
// libtorch in this binary: a kernel that reached for ATen would fail to link it). Expected values
// are exact (FP8 encodings by hand, maxima) or a float64 reference within the FP32 bound.
//
// Mutations tried: norm_cpu.cpp back on at::parallel_for (#include <ATen/Parallel.h>) -> this
// binary failed to link (undefined at::get_thread_num, c10::ParallelGuard::ParallelGuard...);
// parallel_reduce keeping the last part instead of combining -> QuantizeIsTheSameOnAnyChunking
// failed on the flat path's amax (1, the max of the chunk run last, instead of 448).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "common/parallel.h"
#include "fp8/activation_lut.h"
#include "fp8/quantize.h"
#include "norm/norm_kernel.h"

namespace fp8dp {
namespace {

struct Cast {
  std::vector<uint8_t> out, out_t;
  float amax = -1.0f, scale_inv = -1.0f;
  std::vector<float> dbias;
};

Cast quantize(const std::vector<float>& x, int64_t rows, int64_t cols, float scale, Format f) {
  Cast c;
  c.out.resize(x.size());
  c.out_t.resize(x.size());
  c.dbias.resize(static_cast<size_t>(cols));
  QuantizeParams p;
  p.input = x.data();
  p.rows = rows;
  p.cols = cols;
  p.scale = &scale;
  p.format = f;
  p.out = c.out.data();
  p.out_t = c.out_t.data();
  p.amax = &c.amax;
  p.scale_inv = &c.scale_inv;
  p.dbias = c.dbias.data();
  quantize_cpu(p);
  return c;
}

TEST(KernelsCpu, QuantizeGivesTheFormatsBytes) {
  // E4M3: sign | 4 exponent bits (bias 7) | 3 mantissa bits; 448 is the largest, and larger
  // values saturate to it. [2, 3] row-major.
  const std::vector<float> x = {1.0f, 0.5f, -2.0f, 448.0f, 1000.0f, 0.0f};
  const Cast c = quantize(x, 2, 3, 1.0f, Format::kE4M3);
  EXPECT_EQ(c.out, (std::vector<uint8_t>{0x38, 0x30, 0xC0, 0x7E, 0x7E, 0x00}));
  EXPECT_EQ(c.out_t, (std::vector<uint8_t>{0x38, 0x7E, 0x30, 0x7E, 0xC0, 0x00}));
  EXPECT_EQ(c.amax, 1000.0f);
  EXPECT_EQ(c.scale_inv, 1.0f);
  EXPECT_EQ(c.dbias, (std::vector<float>{449.0f, 1000.5f, -2.0f}));  // exact in FP32
}

TEST(KernelsCpu, DequantizeInvertsExactlyRepresentableValues) {
  const std::vector<float> x = {1.0f, 0.5f, -2.0f, 448.0f, -0.25f, 6.0f};
  const float scale = 0.5f;  // a power of two: the scaling is exact both ways
  const Cast c = quantize(x, 1, 6, scale, Format::kE5M2);
  std::vector<float> back(x.size());
  DequantizeParams d;
  d.input = c.out.data();
  d.numel = static_cast<int64_t>(x.size());
  d.format = Format::kE5M2;
  d.scale_inv = &c.scale_inv;
  d.out = back.data();
  dequantize_cpu(d);
  EXPECT_EQ(back, x);
}

// A pool that runs the chunks of `grain` elements last one first, as a stand-in for threads that
// finish in any order.
void reversed_chunks(int64_t begin, int64_t end, int64_t grain,
                     const std::function<void(int64_t, int64_t)>& f) {
  const int64_t g = std::max<int64_t>(grain, 1);
  for (int64_t b = begin + (end - begin - 1) / g * g; b >= begin; b -= g)
    f(b, std::min(end, b + g));
}

// The flat path (bytes and amax only: parallel_reduce over chunks of 2^16 elements).
Cast quantize_flat(const std::vector<float>& x, float scale, Format f) {
  Cast c;
  c.out.resize(x.size());
  QuantizeParams p;
  p.input = x.data();
  p.rows = 1;
  p.cols = static_cast<int64_t>(x.size());
  p.scale = &scale;
  p.format = f;
  p.out = c.out.data();
  p.amax = &c.amax;
  quantize_cpu(p);
  return c;
}

TEST(KernelsCpu, QuantizeIsTheSameOnAnyChunking) {
  // Large enough for several chunks of the flat and the tiled paths; the amax sits in a middle
  // chunk, neither the first nor the last that the reversed pool runs.
  const int64_t rows = 300, cols = 1000;
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.001f * static_cast<float>(i));
  x[x.size() / 2] = 448.0f;
  const Cast serial = quantize(x, rows, cols, 1.0f, Format::kE4M3);
  const Cast serial_flat = quantize_flat(x, 1.0f, Format::kE4M3);
  set_parallel_for(&reversed_chunks);
  const Cast chunked = quantize(x, rows, cols, 1.0f, Format::kE4M3);
  const Cast chunked_flat = quantize_flat(x, 1.0f, Format::kE4M3);
  set_parallel_for(nullptr);
  EXPECT_EQ(serial.amax, 448.0f);
  EXPECT_EQ(chunked.amax, serial.amax);
  EXPECT_EQ(chunked.out, serial.out);
  EXPECT_EQ(chunked.out_t, serial.out_t);
  EXPECT_EQ(chunked.dbias, serial.dbias);  // partials added in a fixed order (quantize.h)
  EXPECT_EQ(serial_flat.amax, 448.0f);
  EXPECT_EQ(chunked_flat.amax, serial_flat.amax);
  EXPECT_EQ(chunked_flat.out, serial.out);
}

TEST(KernelsCpu, LayerNormMatchesAFloat64Reference) {
  const int64_t rows = 7, cols = 33;
  std::vector<float> x(static_cast<size_t>(rows * cols)), gamma(cols), beta(cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.37f * static_cast<float>(i)) * 3.0f;
  for (int64_t c = 0; c < cols; ++c) {
    gamma[c] = 0.5f + 0.01f * static_cast<float>(c);
    beta[c] = -0.1f * static_cast<float>(c % 5);
  }
  std::vector<float> out(x.size()), mu(rows), rsigma(rows);
  NormFwdParams p;
  p.input = x.data();
  p.rows = rows;
  p.cols = cols;
  p.gamma = gamma.data();
  p.beta = beta.data();
  p.eps = 1e-5f;
  p.out = out.data();
  p.mu = mu.data();
  p.rsigma = rsigma.data();
  norm_fwd_cpu(p);
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0.0, v = 0.0;
    for (int64_t c = 0; c < cols; ++c) m += x[r * cols + c];
    m /= cols;
    for (int64_t c = 0; c < cols; ++c) v += (x[r * cols + c] - m) * (x[r * cols + c] - m);
    const double rs = 1.0 / std::sqrt(v / cols + 1e-5);
    for (int64_t c = 0; c < cols; ++c) {
      const double want = (x[r * cols + c] - m) * rs * gamma[c] + beta[c];
      // FP32 statistics over 33 terms and a few FP32 operations per element: |z| <= ~6, each
      // step within 2^-24 relative, the sums within cols * 2^-24: 1e-5 is well above that.
      EXPECT_NEAR(out[r * cols + c], want, 1e-5) << "row " << r << " col " << c;
    }
    EXPECT_NEAR(mu[r], m, 1e-6);
    EXPECT_NEAR(rsigma[r], rs, 1e-5 * rs);
  }
}

// The CUDA activation kernels load act_lut's table slot of each bf16 input and compute the
// function only where `in` is false (activation_lut.h): each bf16 value in the range must have a
// slot of its own that holds it (value(slot) == x; the device fills slot i with f(value(i))), and
// every value outside must say so. Over all 65,536 bf16 bit patterns. Mutation (2026-12-05): slot()
// one binade lower than value() -> fails at bf16 0x3900 (2^-13, now said to be inside).
TEST(ActivationLut, EveryBf16InTheRangeHasItsOwnSlot) {
  std::vector<int> seen(act_lut::kLutSize, 0);
  int inside = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const float x = act::from_bits(b << 16);
    const float ax = std::fabs(x);
    const bool want_in = ax >= 0x1p-12f && ax < 16.0f;  // false for NaN
    bool in = !want_in;
    const uint32_t s = act_lut::slot(x, in);
    ASSERT_EQ(in, want_in) << "bf16 bits 0x" << std::hex << b;
    ASSERT_LT(s, act_lut::kLutSize);
    if (!in) {
      ASSERT_EQ(s, 0u) << "bf16 bits 0x" << std::hex << b;  // a load from it stays inside
      continue;
    }
    ++inside;
    ++seen[s];
    ASSERT_EQ(act::to_bits(act_lut::value(s)), b << 16) << "slot " << s;
  }
  EXPECT_EQ(inside, static_cast<int>(act_lut::kLutSize));
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<long>(act_lut::kLutSize));
}

// round_bf16 (GELU's forward table holds its outputs rounded) against round-to-nearest-even
// spelled out on the discarded low half: every 4,099th float bit pattern (all exponents, both
// signs) plus the ties and the largest finite values, NaN aside (no table holds one).
// Mutation (2026-12-05): u + 0x8000 (ties away from zero) -> fails at 0x3F808000 (0x3F81, not
// 0x3F80).
TEST(ActivationLut, RoundBf16IsRoundToNearestEven) {
  auto want = [](uint32_t u) {
    const uint32_t lower = u & 0xFFFF0000u, rest = u & 0xFFFFu;
    const bool up = rest > 0x8000u || (rest == 0x8000u && ((lower >> 16) & 1u));
    return up ? lower + 0x10000u : lower;
  };
  std::vector<uint32_t> cases = {0x3F808000u, 0x3F818000u, 0x7F7F8000u, 0x7F7FFFFFu,
                                 0x00008000u, 0x00018000u, 0x7F800000u, 0xFF800000u};
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 4099) cases.push_back(static_cast<uint32_t>(u));
  for (uint32_t u : cases) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) continue;  // NaN
    ASSERT_EQ(act::to_bits(act_lut::round_bf16(act::from_bits(u))), want(u))
        << "float bits 0x" << std::hex << u;
  }
}

}  // namespace
}  // namespace fp8dp
