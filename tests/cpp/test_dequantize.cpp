// dequantize (C7): every one of the 256 bytes of both formats decodes exactly as torch decodes it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "common/check.h"
#include "fp8/cast.h"
#include "fp8_test_util.h"

namespace fp8dp::test {
namespace {

at::Tensor all_bytes(Format f) {
  return at::arange(0, 256, at::kInt).to(at::kByte).view(fp8_dtype(f));
}

// Exact equality with NaN equal to NaN.
void expect_same_values(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type());
  const at::Tensor g = got.to(at::kFloat), w = want.to(at::kFloat);
  const at::Tensor same = g.eq(w).logical_or(g.isnan().logical_and(w.isnan()));
  const at::Tensor bad = same.logical_not().nonzero();
  EXPECT_EQ(bad.size(0), 0) << "first mismatch at byte " << bad[0][0].item<int64_t>() << ": got "
                            << g[bad[0][0]].item<float>() << " want " << w[bad[0][0]].item<float>();
}

using Param = std::tuple<Format, at::ScalarType, float>;  // format, output dtype, scale_inv
class DequantizeAllBytes : public ::testing::TestWithParam<Param> {};

TEST_P(DequantizeAllBytes, MatchesTorchDecodeTimesScaleInv) {
  const auto [f, dt, scale_inv] = GetParam();
  const at::Tensor data = all_bytes(f);
  const at::Tensor out = dequantize(data, scalar_scale(scale_inv), dt);
  ASSERT_EQ(out.sizes(), data.sizes());
  // torch's decode is exact; the FP32 product with a power of two or 3 is exact for <= 4
  // significant bits, and the final cast to BF16 / FP16 rounds the same way in both.
  expect_same_values(out, (data.to(at::kFloat) * scale_inv).to(dt));
}

INSTANTIATE_TEST_SUITE_P(Fp8, DequantizeAllBytes,
                         ::testing::Combine(::testing::Values(Format::kE4M3, Format::kE5M2),
                                            ::testing::Values(at::kFloat, at::kBFloat16, at::kHalf),
                                            ::testing::Values(1.0f, 0.5f, 3.0f)),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return std::string(format_name(std::get<0>(info.param))) + "_" +
                                  dtype_name(std::get<1>(info.param)) + "_scale_inv_x10_" +
                                  std::to_string(static_cast<int>(std::get<2>(info.param) * 10));
                         });

TEST(Dequantize, SpecialBytes) {
  const at::Tensor e4 = dequantize(all_bytes(Format::kE4M3), scalar_scale(1.0f), at::kFloat);
  EXPECT_EQ(e4[0x7E].item<float>(), 448.0f);
  EXPECT_EQ(e4[0xFE].item<float>(), -448.0f);
  EXPECT_EQ(e4[0x01].item<float>(), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(e4[0x7F].item<float>()));
  EXPECT_TRUE(std::isnan(e4[0xFF].item<float>()));
  const at::Tensor e5 = dequantize(all_bytes(Format::kE5M2), scalar_scale(1.0f), at::kFloat);
  EXPECT_EQ(e5[0x7B].item<float>(), 57344.0f);
  EXPECT_EQ(e5[0x7C].item<float>(), std::numeric_limits<float>::infinity());
  EXPECT_EQ(e5[0xFC].item<float>(), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(e5[0x01].item<float>(), std::ldexp(1.0f, -16));
  for (int b : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(e5[b].item<float>()));
}

// Every x whose x * scale is a finite FP8 value survives quantize -> dequantize unchanged (powers
// of two as scales keep x * scale and x * scale * scale_inv exact).
TEST(Dequantize, RoundTripOfRepresentableValues) {
  for (Format f : {Format::kE4M3, Format::kE5M2}) {
    const at::Tensor v = dequantize(all_bytes(f), scalar_scale(1.0f), at::kFloat);
    const at::Tensor finite = v.masked_select(v.isfinite());
    for (float scale : {1.0f, 4.0f, 0.125f}) {
      const at::Tensor x = finite / scale;
      const Quantized q = quantize(x, scalar_scale(scale), f);
      EXPECT_TRUE(at::equal(dequantize(q.data, q.scale_inv, at::kFloat), x))
          << format_name(f) << " scale " << scale;
    }
  }
}

TEST(Dequantize, NonContiguousInput) {
  const at::Tensor data =
      all_bytes(Format::kE4M3).view(at::kByte).reshape({16, 16}).t().view(at::kFloat8_e4m3fn);
  ASSERT_FALSE(data.is_contiguous());
  expect_same_values(dequantize(data, scalar_scale(2.0f), at::kFloat), data.to(at::kFloat) * 2);
}

TEST(Dequantize, BadInputNamesTheArgument) {
  const at::Tensor data = all_bytes(Format::kE4M3);
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning " << needle;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { dequantize(data.view(at::kByte), scalar_scale(1.0f), at::kFloat); }, "'data'");
  expect_error([&] { dequantize(data, at::ones({1}, at::kDouble), at::kFloat); }, "'scale_inv'");
  expect_error([&] { dequantize(data, at::ones({1}, at::kMeta), at::kFloat); }, "'scale_inv'");
  expect_error([&] { dequantize(data, scalar_scale(1.0f), at::kInt); }, "'dtype'");
}

}  // namespace
}  // namespace fp8dp::test
