// CUDA LayerNorm / RMSNorm kernels through norm_forward / norm_backward, one case per launch
// variant (vectorised or element-wise rows; a row held in 4 or 8 register vectors per thread or
// re-read from memory; several rows per block or one): the fused FP8 bytes equal quantize() of the
// kernel's own output, the statistics and gradients are within the FP32 bounds of an FP64
// reference. Small enough to run under compute-sanitizer memcheck. Skips without a GPU;
// tests/python/test_norm_cuda.py derives the bounds and holds the wider sweep.
#include <gtest/gtest.h>

#if defined(FP8DP_WITH_CUDA)
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_test_util.h"
#include "fp8/cast.h"
#include "norm/norm.h"
#include "norm/norm_kernel.h"

namespace fp8dp {
namespace {

// (rms, dtype, rows, cols)
using Case = std::tuple<bool, at::ScalarType, int64_t, int64_t>;

class NormCuda : public ::testing::TestWithParam<Case> {};

constexpr double kU = 1.0 / (1 << 24);  // FP32 unit roundoff

// One ulp of `dtype` at |v| (v in float64).
at::Tensor ulp(const at::Tensor& v, at::ScalarType dtype) {
  const int mant = dtype == at::kFloat ? 23 : dtype == at::kBFloat16 ? 7 : 10;
  const int emin = dtype == at::kHalf ? -14 : -126;
  const at::Tensor e = at::floor(at::log2(v.abs().clamp_min(std::ldexp(1.0, emin))));
  return at::pow(2.0, e.clamp_min(emin) - mant);
}

// |got - want| <= bound + one ulp of the dtype got was rounded to (want and bound in float64).
void expect_within(const at::Tensor& got, const at::Tensor& want, const at::Tensor& bound,
                   const char* what) {
  const at::Tensor diff = (got.cpu().to(at::kDouble) - want).abs();
  const at::Tensor lim = bound + ulp(want.abs() + bound, got.scalar_type());
  EXPECT_TRUE((diff <= lim).all().item<bool>())
      << what << ": worst excess " << (diff - lim).max().item<double>();
}

// The checks are exact or use the bounds derived in tests/python/test_norm_cuda.py: mu within
// (n + 1) u mean|x| of FP64 and rsigma within (n / 2 + 4) u (+ d^2 / 2var) relative; dgamma within
// (rows + 4) u sum|dz xhat|, dbeta within rows u sum|dz|, dx within
// rsigma (dm1 + |xhat| dm2 + 6u (|dxhat| + |m1| + |xhat m2|)), each plus one ulp of the dtype.
TEST_P(NormCuda, MatchesFp64WithinFp32Bounds) {
  SKIP_WITHOUT_GPU();
  const auto [rms, dtype, rows, cols] = GetParam();
  at::manual_seed(rows * 977 + cols);
  const at::Tensor x = (at::randn({rows, cols}) * 2 + 0.5).to(dtype);
  const at::Tensor gamma = (at::randn({cols}) * 0.3 + 1).to(dtype);
  const at::Tensor beta = rms ? at::Tensor() : at::randn({cols}).to(dtype);
  const at::Tensor dz = at::randn({rows, cols}).to(dtype);
  NormConfig cfg;
  cfg.rms = rms;
  cfg.zero_centered_gamma = !rms;  // both settings over the cases
  const float eps = cfg.eps;
  auto dev = [](const at::Tensor& t) { return t.defined() ? t.to(at::kCUDA) : t; };
  const at::Tensor scale = at::full({1}, 5.0f).to(at::kCUDA);

  const NormForward g =
      norm_forward(dev(x), dev(gamma), dev(beta), cfg, true, scale, Format::kE4M3);
  ASSERT_TRUE(g.out.is_cuda());
  // The fused cast is quantize() of the kernel's own rounded output, amax included.
  const Quantized q = quantize(g.out, scale, Format::kE4M3);
  EXPECT_TRUE(at::equal(g.out_fp8.view(at::kByte).cpu(), q.data.view(at::kByte).cpu()));
  EXPECT_EQ(g.amax.item<float>(), q.amax.item<float>());

  const double n = static_cast<double>(cols);
  const at::Tensor xd = x.to(at::kDouble);
  const at::Tensor mu64 = rms ? at::zeros({rows}, xd.options()) : xd.mean(1);
  const at::Tensor xc = rms ? xd : xd - mu64.unsqueeze(1);
  const at::Tensor var = (xc * xc).mean(1);
  const at::Tensor rs64 = at::rsqrt(var + eps);
  const at::Tensor dmu = (g.mu.cpu().to(at::kDouble) - mu64).abs();
  EXPECT_TRUE((dmu <= (n + 1) * kU * xd.abs().mean(1)).all().item<bool>()) << "mu";
  const at::Tensor rel_rs = (g.rsigma.cpu().to(at::kDouble) / rs64 - 1).abs();
  EXPECT_TRUE((rel_rs <= (n / 2 + 4) * kU + dmu * dmu / (2 * (var + eps))).all().item<bool>())
      << "rsigma";

  const NormGrads gg = norm_backward(dev(dz), dev(x), g.mu, g.rsigma, dev(gamma), !rms, cfg);
  const at::Tensor mu = g.mu.cpu().to(at::kDouble).unsqueeze(1);
  const at::Tensor rs = g.rsigma.cpu().to(at::kDouble).unsqueeze(1);
  const at::Tensor xhat = (rms ? xd : xd - mu) * rs;
  const at::Tensor dzd = dz.to(at::kDouble);
  const at::Tensor dxhat = dzd * (gamma.to(at::kDouble) + (cfg.zero_centered_gamma ? 1.0 : 0.0));
  const at::Tensor m1 = rms ? at::zeros({rows, 1}, xd.options()) : dxhat.mean(1, true);
  const at::Tensor m2 = (dxhat * xhat).mean(1, true);
  const at::Tensor dx = rs * (dxhat - m1 - xhat * m2);
  const at::Tensor dm1 = (n + 2) * kU * dxhat.abs().mean(1, true);
  const at::Tensor dm2 = (n + 6) * kU * (dxhat * xhat).abs().mean(1, true);
  const at::Tensor terms = dxhat.abs() + m1.abs() + (xhat * m2).abs();
  expect_within(gg.dx, dx, rs * (dm1 + xhat.abs() * dm2 + 6 * kU * terms), "dx");
  expect_within(gg.dgamma, (dzd * xhat).sum(0), (rows + 4) * kU * (dzd * xhat).abs().sum(0),
                "dgamma");
  if (!rms) expect_within(gg.dbeta, dzd.sum(0), rows * kU * dzd.abs().sum(0), "dbeta");
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [rms, dtype, rows, cols] = info.param;
  return std::string(rms ? "RMS" : "LN") + "_" + c10::toString(dtype) + "_" + std::to_string(rows) +
         "x" + std::to_string(cols);
}

// Columns: 33 / 1027 (element-wise rows, several rows per block), 1024 and 8192 (16-byte vectors,
// 4 per thread), 12288 fp32 (8 per thread forward, 6 backward), 20000 bf16 (8 per thread forward),
// 40000 (rows from memory).
INSTANTIATE_TEST_SUITE_P(
    Variants, NormCuda,
    ::testing::Combine(::testing::Bool(), ::testing::Values(at::kFloat, at::kBFloat16),
                       ::testing::Values<int64_t>(3, 130),
                       ::testing::Values<int64_t>(33, 1024, 1027, 8192, 12288, 20000, 40000)),
    case_name);

// Enough rows that every block of the persistent grid takes several row groups in turn, so the
// copy-engine stages of the sm_90 kernels are refilled and their barriers change phase (at 3 or
// 130 rows each block sees one group at most): about 5-11 groups per block on an H200.
INSTANTIATE_TEST_SUITE_P(Stages, NormCuda,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Values<int64_t>(20011),
                                            ::testing::Values<int64_t>(1024)),
                         case_name);
INSTANTIATE_TEST_SUITE_P(StagesWide, NormCuda,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Values<int64_t>(3001),
                                            ::testing::Values<int64_t>(8192)),
                         case_name);

// dgamma / dbeta are sums of per-block partial rows, added either by the backward kernel itself
// after a grid-wide barrier (the cooperative launch, the library's choice) or by a second kernel.
// Both must add in one fixed order (column_sum.cuh), so the two give the same bits, and dx is the
// same either way. Shapes where the cooperative launch applies: bf16 with several rows per block
// (2048 columns) and one row per block (8192), fp32 rows of 6 register vectors per thread (3072).
TEST(NormCudaTail, CooperativeAndSeparateColumnSumsGiveTheSameBits) {
  SKIP_WITHOUT_GPU();
  for (const auto& [dtype, rows, cols] : {std::tuple{at::kBFloat16, int64_t{4096}, int64_t{2048}},
                                          std::tuple{at::kBFloat16, int64_t{1000}, int64_t{8192}},
                                          std::tuple{at::kFloat, int64_t{3000}, int64_t{3072}}}) {
    for (const bool rms : {false, true}) {
      SCOPED_TRACE(std::string(rms ? "RMS " : "LN ") + c10::toString(dtype) + " " +
                   std::to_string(rows) + "x" + std::to_string(cols));
      at::manual_seed(rows + cols);
      auto on_gpu = at::TensorOptions().device(at::kCUDA);
      const at::Tensor x = (at::randn({rows, cols}, on_gpu) * 2 + 0.5).to(dtype);
      const at::Tensor dz = at::randn({rows, cols}, on_gpu).to(dtype);
      const at::Tensor gamma = (at::randn({cols}, on_gpu) * 0.3 + 1).to(dtype);
      const at::Tensor mu = at::randn({rows}, on_gpu) * 0.1;
      const at::Tensor rsigma = at::rand({rows}, on_gpu) + 0.5;
      std::vector<at::Tensor> outs[2];
      for (const bool coop : {true, false}) {
        at::Tensor dx = at::empty_like(x), dgamma = at::empty_like(gamma);
        at::Tensor dbeta = at::empty_like(gamma);
        NormBwdParams p;
        p.dz = dz.data_ptr();
        p.x = x.data_ptr();
        p.dtype = dtype == at::kFloat ? DType::kFloat32 : DType::kBFloat16;
        p.rows = rows;
        p.cols = cols;
        p.mu = mu.data_ptr<float>();
        p.rsigma = rsigma.data_ptr<float>();
        p.gamma = gamma.data_ptr();
        p.rms = rms;
        p.dx = dx.data_ptr();
        p.dgamma = dgamma.data_ptr();
        p.dbeta = rms ? nullptr : dbeta.data_ptr();
        p.cooperative_tail = coop;
        norm_bwd_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
        outs[coop ? 0 : 1] = {dx, dgamma, rms ? at::zeros_like(dbeta) : dbeta};
      }
      const char* names[] = {"dx", "dgamma", "dbeta"};
      for (int i = 0; i < 3; ++i) {
        EXPECT_TRUE(at::equal(outs[0][i].cpu(), outs[1][i].cpu())) << names[i];
      }
      // The sums are real sums (not both zero or both garbage): dgamma against FP64.
      const at::Tensor xhat =
          (x.cpu().to(at::kDouble) -
           (rms ? at::zeros({rows, 1}, at::kDouble) : mu.cpu().to(at::kDouble).unsqueeze(1))) *
          rsigma.cpu().to(at::kDouble).unsqueeze(1);
      const at::Tensor dzd = dz.cpu().to(at::kDouble);
      expect_within(outs[0][1], (dzd * xhat).sum(0), (rows + 4) * kU * (dzd * xhat).abs().sum(0),
                    "dgamma");
    }
  }
}

}  // namespace
}  // namespace fp8dp

#else
TEST(NormCuda, NeedsCudaBuild) { GTEST_SKIP() << "fp8dp was built without CUDA"; }
#endif
