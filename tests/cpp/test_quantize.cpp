// quantize / cast_transpose / amax (C7): bit-identical to torch's float8 conversion wherever
// torch's conversion is defined (|x * scale| <= max), saturating beyond it, NaN kept, amax with
// NaN/Inf rules.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <tuple>
#include <vector>

#include "common/check.h"
#include "fp8/cast.h"
#include "fp8/quantize.h"
#include "fp8_test_util.h"

namespace fp8dp::test {
namespace {

// Index and values of the first element where a != b among `mask`, or "" when they agree.
std::string first_mismatch(const at::Tensor& x, const at::Tensor& got, const at::Tensor& want,
                           const at::Tensor& mask) {
  const at::Tensor bad = (got.ne(want)).logical_and(mask).flatten().nonzero();
  if (bad.numel() == 0) return "";
  const int64_t i = bad[0][0].item<int64_t>();
  std::ostringstream os;
  os << bad.size(0) << " mismatches; first at " << i << ": x=" << x.flatten()[i].item<float>()
     << " got 0x" << std::hex << got.flatten()[i].item<int>() << " want 0x"
     << want.flatten()[i].item<int>();
  return os.str();
}

// Checks every byte of quantize(x, scale): torch's bytes in range, +-max beyond, NaN for NaN.
void expect_matches_reference(const at::Tensor& x, float scale, Format f, const at::Tensor& got) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor y = xf * scale;
  const at::Tensor ok = in_range(xf, scale, f);
  const at::Tensor ref = torch_fp8_bytes(xf, scale, f);
  EXPECT_EQ(first_mismatch(xf, got, ref, ok), "") << "in-range values differ from torch";
  // Beyond max (finite overflow and +-Inf): saturate to +-max.
  const at::Tensor over = y.isnan().logical_not().logical_and(ok.logical_not());
  const at::Tensor sat = at::where(y.lt(0), at::full({}, 0x80 | max_byte(f), at::kByte),
                                   at::full({}, max_byte(f), at::kByte));
  EXPECT_EQ(first_mismatch(xf, got, sat, over), "") << "overflow does not saturate";
  // NaN stays NaN: 0x7F / 0xFF are NaN in both formats.
  const at::Tensor nan = y.isnan();
  const at::Tensor low7 = got.bitwise_and(0x7F);
  EXPECT_EQ(first_mismatch(xf, low7, at::full_like(low7, 0x7F), nan), "") << "NaN not kept";
}

// ---- exhaustive: all 65,536 BF16 bit patterns, both formats, several scales ----

using ExhaustiveParam = std::tuple<Format, float>;
class ExhaustiveBf16 : public ::testing::TestWithParam<ExhaustiveParam> {};

TEST_P(ExhaustiveBf16, EveryBitPatternMatchesTorch) {
  const auto [f, scale] = GetParam();
  const at::Tensor x = at::arange(-32768, 32768, at::kInt).to(at::kShort).view(at::kBFloat16);
  ASSERT_EQ(x.numel(), 65536);
  // A meaningful share of patterns must be compared against torch (not just NaN / overflow).
  EXPECT_GT(in_range(x, scale, f).sum().item<int64_t>(), 25000);
  for (const at::Tensor& input : {x, x.to(at::kFloat)}) {  // same values as BF16 and as FP32
    SCOPED_TRACE(dtype_name(input.scalar_type()));
    const Quantized q = quantize(input, scalar_scale(scale), f);
    expect_matches_reference(input, scale, f, bytes(q.data));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fp8, ExhaustiveBf16,
    ::testing::Combine(::testing::Values(Format::kE4M3, Format::kE5M2),
                       // 1; non-powers of two (the product rounds in FP32 first); tiny and huge
                       ::testing::Values(1.0f, 0.3f, 3.14159f, 1.0f / 1024, 4096.0f)),
    [](const ::testing::TestParamInfo<ExhaustiveParam>& info) {
      std::string s = std::string(format_name(std::get<0>(info.param))) + "_scale_" +
                      std::to_string(std::get<1>(info.param));
      for (char& c : s) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
      return s;
    });

// ---- every FP32 exponent and every rounding position ----

class FloatSweep : public ::testing::TestWithParam<Format> {};

// All floats whose top 20 bits are arbitrary and whose low 12 bits are one of a few patterns. FP8
// rounding drops the low 20 (E4M3) or 21 (E5M2) bits of the mantissa, more for subnormals, so every
// halfway case (dropped bits 100...0) and both of its neighbours (low bits 0x001 / 0xFFF) appear
// for every exponent, every kept mantissa and every sign.
TEST_P(FloatSweep, RoundingBoundariesOfEveryExponent) {
  const Format f = GetParam();
  const at::Tensor top = at::arange(0, int64_t{1} << 20, at::kLong).mul(int64_t{1} << 12);
  std::vector<at::Tensor> parts;
  for (int64_t low : {0x000, 0x001, 0x7FF, 0x800, 0x801, 0xFFF}) parts.push_back(top + low);
  at::Tensor u = at::cat(parts);
  u = at::where(u.ge(int64_t{1} << 31), u - (int64_t{1} << 32), u);  // as int32 bit patterns
  const at::Tensor x = u.to(at::kInt).view(at::kFloat);
  const Quantized q = quantize(x, scalar_scale(1.0f), f);
  expect_matches_reference(x, 1.0f, f, bytes(q.data));
}

INSTANTIATE_TEST_SUITE_P(Fp8, FloatSweep, ::testing::Values(Format::kE4M3, Format::kE5M2),
                         [](const auto& info) { return std::string(format_name(info.param)); });

// ---- hand-picked values: RNE ties, subnormals, saturation, specials (readable failures) ----

struct Case {
  float x;
  uint8_t e4m3;
  uint8_t e5m2;
};

TEST(QuantizeValues, TiesRoundToEvenAndOverflowSaturates) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<Case> cases = {
      {1.0f, 0x38, 0x3C},
      {1.0625f, 0x38, 0x3C},                 // E4M3 tie between 1 and 1.125: even mantissa (1.0)
      {1.1875f, 0x3A, 0x3D},                 // E4M3 tie between 1.125 and 1.25: even (1.25)
      {1.125f, 0x39, 0x3C},                  // E5M2 tie between 1 and 1.25: even (1.0)
      {1.375f, 0x3B, 0x3E},                  // E5M2 tie between 1.25 and 1.5: even (1.5)
      {std::ldexp(1.0f, -10), 0x00, 0x14},   // E4M3: half its smallest subnormal 2^-9 -> 0
      {std::ldexp(3.0f, -10), 0x02, 0x1A},   // E4M3 subnormal tie 1.5 * 2^-9 -> 2 * 2^-9
      {std::ldexp(1.0f, -17), 0x00, 0x00},   // E5M2: half its smallest subnormal 2^-16 -> 0
      {std::ldexp(3.0f, -17), 0x00, 0x02},   // E5M2 subnormal tie -> 2 * 2^-16
      {std::ldexp(15.5f, -10), 0x08, 0x24},  // E4M3: 7.75 * 2^-9, above its largest subnormal
                                             // 7 * 2^-9: rounds up into the smallest normal 0x08
      {448.0f, 0x7E, 0x5F},
      {464.0f, 0x7E, 0x5F},  // tie between 448 and 480 (E4M3 NaN slot): 448
      {465.0f, 0x7E, 0x5F},  // torch gives NaN here; saturation gives max
      {57344.0f, 0x7E, 0x7B},
      {61439.0f, 0x7E, 0x7B},
      {1e30f, 0x7E, 0x7B},
      {inf, 0x7E, 0x7B},  // Inf * scale saturates to max (C7: saturate)
      {-inf, 0xFE, 0xFB},
      {-1e30f, 0xFE, 0xFB},
      {-0.0f, 0x80, 0x80},
      {0.0f, 0x00, 0x00},
  };
  std::vector<float> xs;
  for (const Case& c : cases) xs.push_back(c.x);
  const at::Tensor x = at::tensor(xs, at::kFloat);
  const at::Tensor b4 = bytes(quantize(x, scalar_scale(1.0f), Format::kE4M3).data);
  const at::Tensor b5 = bytes(quantize(x, scalar_scale(1.0f), Format::kE5M2).data);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(b4[i].item<int>(), cases[i].e4m3) << "E4M3 of " << cases[i].x;
    EXPECT_EQ(b5[i].item<int>(), cases[i].e5m2) << "E5M2 of " << cases[i].x;
  }
}

// ---- random inputs and scales over shapes that straddle the vector width and the 64-wide tile
// ----

using RandomParam = std::tuple<Format, at::ScalarType, std::vector<int64_t>>;

std::string random_param_name(const ::testing::TestParamInfo<RandomParam>& info) {
  const auto& [f, dt, shape] = info.param;
  return std::string(format_name(f)) + "_" + dtype_name(dt) + "_" + shape_name(shape);
}

// Values over ~16 binades (so that the scaled values hit subnormals, normals and overflow), and a
// scale that maps the amax somewhere between 1/8 and 8 times the format max.
at::Tensor random_input(const std::vector<int64_t>& shape, at::ScalarType dt, int64_t seed) {
  at::manual_seed(seed);
  return (at::randn(shape) * at::exp2(at::randn(shape) * 3.0)).to(dt);
}

float random_scale(const at::Tensor& x, Format f, int64_t seed) {
  const float amax = x.numel() ? x.abs().max().item<float>() : 1.0f;
  const float jitter = std::exp2(static_cast<float>(seed % 7) - 3.0f) * (1.0f + 0.37f * (seed % 3));
  return amax > 0 ? fp8_max(f) / amax * jitter : 1.0f;
}

class QuantizeRandom : public ::testing::TestWithParam<RandomParam> {};

TEST_P(QuantizeRandom, MatchesTorchWithAmaxAndScaleInv) {
  const auto& [f, dt, shape] = GetParam();
  for (int64_t seed = 0; seed < 3; ++seed) {
    const at::Tensor x = random_input(shape, dt, seed);
    const float scale = random_scale(x, f, seed);
    const Quantized q = quantize(x, scalar_scale(scale), f);
    ASSERT_EQ(q.data.sizes(), x.sizes());
    ASSERT_EQ(q.data.scalar_type(), fp8_dtype(f));
    expect_matches_reference(x, scale, f, bytes(q.data));
    // amax is exact: a max of |x| loses nothing.
    EXPECT_EQ(q.amax.item<float>(), x.abs().max().to(at::kFloat).item<float>());
    EXPECT_EQ(q.scale_inv.item<float>(), 1.0f / scale);
  }
}

// cast_transpose: the transposed bytes are exactly the transpose of the row-major bytes, which are
// the plain quantize bytes; dbias is the column sum.
TEST_P(QuantizeRandom, CastTransposeAndDbias) {
  const auto& [f, dt, shape] = GetParam();
  const at::Tensor x = random_input(shape, dt, 7);
  const float scale = random_scale(x, f, 7);
  const Quantized plain = quantize(x, scalar_scale(scale), f);
  const Quantized q = quantize(x, scalar_scale(scale), f, QuantizeOptions{true, true, true});
  const int64_t cols = x.dim() ? x.size(-1) : 1;
  const at::Tensor x2 = x.reshape({-1, cols});
  EXPECT_TRUE(at::equal(bytes(q.data), bytes(plain.data)));
  ASSERT_EQ(q.data_t.sizes(), (std::vector<int64_t>{cols, x2.size(0)}));
  EXPECT_TRUE(at::equal(bytes(q.data_t), bytes(plain.data).reshape({-1, cols}).t().contiguous()));
  EXPECT_EQ(q.amax.item<float>(), plain.amax.item<float>());
  // dbias in FP32 vs an FP64 reference: a sum of n terms carries at most (n-1) * eps * sum|x|
  // of rounding error (the classical bound for recursive summation).
  const at::Tensor xd = x2.to(at::kDouble);
  const at::Tensor ref = xd.sum(0);
  const at::Tensor bound = xd.abs().sum(0) * (x2.size(0) * std::numeric_limits<float>::epsilon());
  EXPECT_TRUE((q.dbias.to(at::kDouble) - ref).abs().le(bound).all().item<bool>())
      << "max error " << (q.dbias.to(at::kDouble) - ref).abs().max().item<double>();
}

INSTANTIATE_TEST_SUITE_P(
    Fp8, QuantizeRandom,
    ::testing::Combine(::testing::Values(Format::kE4M3, Format::kE5M2),
                       ::testing::Values(at::kFloat, at::kBFloat16, at::kHalf),
                       ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{1, 1},
                                         std::vector<int64_t>{7}, std::vector<int64_t>{3, 31},
                                         std::vector<int64_t>{2, 32}, std::vector<int64_t>{5, 33},
                                         std::vector<int64_t>{64, 64}, std::vector<int64_t>{65, 63},
                                         std::vector<int64_t>{127, 129},
                                         std::vector<int64_t>{3, 5, 67},
                                         std::vector<int64_t>{131, 1},
                                         std::vector<int64_t>{1, 4099},
                                         std::vector<int64_t>{301, 257})),
    random_param_name);

// ---- dbias: exact on integers, independent of the thread count ----

TEST(QuantizeDbias, ExactColumnSumsOfIntegers) {
  at::manual_seed(3);
  // Small integers: every partial sum is exact in FP32, so dbias must equal the column sums
  // exactly.
  const at::Tensor x = at::randint(-50, 50, {333, 77}).to(at::kFloat);
  const Quantized q =
      quantize(x, scalar_scale(1.0f), Format::kE5M2, QuantizeOptions{false, false, true});
  EXPECT_FALSE(q.data.defined());
  EXPECT_TRUE(at::equal(q.dbias, x.sum(0)));
}

TEST(QuantizeDbias, SameBitsForAnyThreadCount) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({1000, 200});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor one = quantize(x, scalar_scale(2.0f), Format::kE4M3, {true, true, true}).dbias;
  at::set_num_threads(std::max(2, threads));
  const at::Tensor many = quantize(x, scalar_scale(2.0f), Format::kE4M3, {true, true, true}).dbias;
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one, many));
}

// ---- layouts: non-contiguous input, empty and 0-d tensors ----

TEST(QuantizeLayout, NonContiguousInputEqualsItsContiguousCopy) {
  at::manual_seed(5);
  const at::Tensor base = at::randn({70, 90});
  for (const at::Tensor& x : {base.t(), base.slice(1, 0, 90, 2), base.narrow(0, 3, 50).t()}) {
    ASSERT_FALSE(x.is_contiguous());
    const Quantized a = quantize(x, scalar_scale(8.0f), Format::kE4M3, {true, true, true});
    const Quantized b =
        quantize(x.contiguous(), scalar_scale(8.0f), Format::kE4M3, {true, true, true});
    EXPECT_TRUE(at::equal(bytes(a.data), bytes(b.data)));
    EXPECT_TRUE(at::equal(bytes(a.data_t), bytes(b.data_t)));
    EXPECT_TRUE(at::equal(a.dbias, b.dbias));
    EXPECT_EQ(a.amax.item<float>(), b.amax.item<float>());
    expect_matches_reference(x, 8.0f, Format::kE4M3, bytes(a.data));
  }
}

class QuantizeEmpty : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(QuantizeEmpty, AmaxZeroAndShapesKept) {
  const std::vector<int64_t> shape = GetParam();
  const at::Tensor x = at::empty(shape);
  const Quantized q = quantize(x, scalar_scale(2.0f), Format::kE4M3, {true, true, true});
  EXPECT_EQ(q.amax.item<float>(), 0.0f);
  EXPECT_EQ(q.scale_inv.item<float>(), 0.5f);
  EXPECT_EQ(q.data.sizes(), x.sizes());
  const int64_t cols = shape.back();
  int64_t rows = 1;  // x is viewed as [product of the leading dims, last dim]
  for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
  EXPECT_EQ(q.data_t.sizes(), (std::vector<int64_t>{cols, rows}));
  EXPECT_TRUE(at::equal(q.dbias, at::zeros({cols})));
  EXPECT_EQ(fp8dp::amax(x).item<float>(), 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Fp8, QuantizeEmpty,
                         ::testing::Values(std::vector<int64_t>{0}, std::vector<int64_t>{0, 5},
                                           std::vector<int64_t>{5, 0}),
                         [](const auto& info) { return shape_name(info.param); });

TEST(QuantizeLayout, ZeroDimTensorIsOneElement) {
  const at::Tensor x = at::full({}, -3.0f);
  const Quantized q = quantize(x, scalar_scale(1.0f), Format::kE4M3);
  EXPECT_EQ(q.data.dim(), 0);
  EXPECT_EQ(bytes(q.data.reshape({1}))[0].item<int>(), 0xC4);  // -3 = -1.5 * 2^1
  EXPECT_EQ(q.amax.item<float>(), 3.0f);
}

// ---- amax with NaN / Inf: NaN wins, then Inf; both in the vector body and the scalar tail ----

using SpecialParam = std::tuple<Format, int64_t>;  // (format, position of the special values)
class QuantizeSpecials : public ::testing::TestWithParam<SpecialParam> {};

TEST_P(QuantizeSpecials, AmaxRulesAndBytes) {
  const auto [f, pos] = GetParam();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t n = 67;  // two 32-wide vector steps and a 3-element tail
  auto make = [&](std::vector<std::pair<int64_t, float>> specials) {
    at::Tensor x = at::linspace(-2.0, 2.0, n);
    for (auto [i, v] : specials) x[i] = v;
    return x;
  };
  struct Expect {
    at::Tensor x;
    float amax;  // NaN means "must be NaN"
  };
  const std::vector<Expect> cases = {
      {make({{pos, inf}}), inf},
      {make({{pos, -inf}}), inf},
      {make({{pos, nan}}), nan},
      {make({{pos, nan}, {(pos + 1) % n, inf}}), nan},
      {make({{pos, -nan}, {(pos + 5) % n, -inf}}), nan},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE("case " + std::to_string(c));
    for (float scale : {1.0f, 100.0f}) {
      const Quantized q = quantize(cases[c].x, scalar_scale(scale), f, {true, true, true});
      const Quantized flat = quantize(cases[c].x, scalar_scale(scale), f);
      for (const at::Tensor& a : {q.amax, flat.amax, fp8dp::amax(cases[c].x)}) {
        if (std::isnan(cases[c].amax)) {
          EXPECT_TRUE(std::isnan(a.item<float>()));
        } else {
          EXPECT_EQ(a.item<float>(), cases[c].amax);
        }
      }
      expect_matches_reference(cases[c].x, scale, f, bytes(q.data));
      expect_matches_reference(cases[c].x, scale, f, bytes(flat.data));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fp8, QuantizeSpecials,
                         ::testing::Combine(::testing::Values(Format::kE4M3, Format::kE5M2),
                                            ::testing::Values(0, 5, 40, 65, 66)),
                         [](const auto& info) {
                           return std::string(format_name(std::get<0>(info.param))) + "_at_" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- bad input: a ValueError that names the argument ----

template <typename Fn>
void expect_value_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << needle;
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(QuantizeArgs, BadInputNamesTheArgument) {
  const at::Tensor x = at::randn({4, 4});
  const Format f = Format::kE4M3;
  expect_value_error([&] { quantize(x.to(at::kInt), scalar_scale(1.0f), f); }, "'x'");
  expect_value_error([&] { quantize(x.to(at::kDouble), scalar_scale(1.0f), f); }, "'x'");
  expect_value_error([&] { quantize(at::Tensor(), scalar_scale(1.0f), f); }, "'x'");
  expect_value_error([&] { quantize(x.to(at::kMeta), scalar_scale(1.0f), f); }, "'x'");
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    expect_value_error([&] { quantize(x, scalar_scale(bad), f); }, "'scale'");
  }
  expect_value_error([&] { quantize(x, at::ones({1}, at::kDouble), f); }, "'scale'");
  expect_value_error([&] { quantize(x, at::ones({2}), f); }, "'scale'");
  expect_value_error([&] { quantize(x, at::ones({1}, at::kMeta), f); }, "'scale'");
  expect_value_error([&] { quantize(x, at::Tensor(), f); }, "'scale'");
  expect_value_error([&] { fp8dp::amax(x.to(at::kInt)); }, "fp8dp.amax: argument 'x'");
}

// scale_inverse (fp8/format.h): the FP32 reciprocal of every valid scale, the largest finite one
// included; NaN for each invalid one, where 1 / scale gave 0 (for +Inf: every use of the cast a
// silent zero), +Inf (for 0) or a negative scale_inv.
TEST(ScaleInverse, ReciprocalOfValidScalesNaNForTheRest) {
  for (float s : {1.0f, 3.0f, 448.0f, 1e-30f, 1.3e-36f, std::numeric_limits<float>::max()}) {
    EXPECT_EQ(float_bits(scale_inverse(s)), float_bits(1.0f / s)) << s;
  }
  for (float bad :
       {0.0f, -0.0f, -1.0f, -std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_TRUE(std::isnan(scale_inverse(bad))) << bad;
  }
}

// An invalid scale that reaches a cast kernel marks its result: scale_inv = NaN, so dequantize
// (and a GEMM) give NaN. The entry points refuse such a scale on the CPU (above); on a GPU they do
// not read it back, so the kernels are the guard there. Here the CPU kernel, called past the entry
// point's check (CUDA: tests/python/test_fp8_scale_invalid.py).
TEST(QuantizeArgs, InvalidScaleReachingTheKernelWritesNaNScaleInv) {
  const at::Tensor x = at::randn({4, 8});
  for (float bad : {0.0f, -2.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    at::Tensor out = at::empty({4, 8}, at::kByte), amax = at::empty({1}),
               scale_inv = at::empty({1});
    QuantizeParams p;
    p.input = x.data_ptr();
    p.rows = 4;
    p.cols = 8;
    p.scale = &bad;
    p.out = out.data_ptr<uint8_t>();
    p.amax = amax.data_ptr<float>();
    p.scale_inv = scale_inv.data_ptr<float>();
    quantize_cpu(p);
    EXPECT_TRUE(std::isnan(scale_inv.item<float>())) << "scale " << bad;
    const at::Tensor deq = dequantize(out.view(at::kFloat8_e4m3fn), scale_inv, at::kFloat);
    EXPECT_TRUE(deq.isnan().all().item<bool>()) << "scale " << bad;
  }
}

// Strided parts (QuantizeParams::strided) are read by the CUDA kernel only: the CPU kernel refuses
// them instead of reading `input` (null) or guessing, and quantize_parts materializes x on the CPU.
TEST(QuantizeParts, CpuKernelRefusesStridedInput) {
  const at::Tensor part = at::randn({2, 3, 2, 8});
  at::Tensor out = at::empty({6, 16}, at::kByte);
  const float scale = 1.0f;
  QuantizeParams p;
  p.rows = 6;
  p.cols = 16;
  p.scale = &scale;
  p.out = out.data_ptr<uint8_t>();
  p.strided.n = 1;
  p.strided.ptr[0] = part.data_ptr();
  p.strided.d1 = 3;
  p.strided.d2 = 2;
  p.strided.d3 = 8;
  p.strided.stride[0] = 48;
  p.strided.stride[1] = 16;
  p.strided.stride[2] = 8;
  try {
    quantize_cpu(p);
    ADD_FAILURE() << "quantize_cpu accepted strided input";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("strided parts input"), std::string::npos) << e.what();
  }
}

// The checks Python cannot reach (its binding refuses None before C++ sees it): an undefined part
// is named by its index.
TEST(QuantizeParts, UndefinedPartNamesItsIndex) {
  const at::Tensor part = at::randn({2, 3, 2, 8});
  expect_value_error(
      [&] { quantize_parts({part, at::Tensor()}, scalar_scale(1.0f), Format::kE4M3); },
      "fp8dp.quantize_parts: argument 'parts[1]' is undefined");
  expect_value_error([&] { amax_parts({at::Tensor()}); },
                     "fp8dp.amax_parts: argument 'parts[0]' is undefined");
  expect_value_error([&] { join_parts({}); }, "fp8dp.join_parts: argument 'parts' must hold");
}

}  // namespace
}  // namespace fp8dp::test
