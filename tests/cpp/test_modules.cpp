// C++ pieces of src/modules: the fused norm + FP8 cast kernel, the WeightGradStore FIFO, the
// delayed-scaling first-cast rule and registry update, the CPU GEMM, and the autograd function's
// routing of a captured weight gradient (C14), and what a forward refuses under CUDA graph capture.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "common/check.h"
#include "fp8/cast.h"
#include "fp8/scaling_registry.h"
#include "fp8/scaling_state.h"
#include "gemm/gemm.h"
#include "modules/capture_check.h"
#include "modules/linear_autograd.h"
#include "modules/linear_core.h"
#include "modules/wgrad_store.h"
#include "norm/norm.h"

namespace fp8dp {
namespace {

// ---- norm kernel: (rms, dtype, rows, cols) --------------------------------------------------
using NormCase = std::tuple<bool, at::ScalarType, int64_t, int64_t>;

class NormKernel : public ::testing::TestWithParam<NormCase> {};

TEST_P(NormKernel, FusedCastEqualsQuantizeOfItsOutput) {
  const auto [rms, dtype, rows, cols] = GetParam();
  at::manual_seed(rows * 131 + cols);
  const at::Tensor x = (at::randn({rows, cols}) * 3 + 1).to(dtype);
  const at::Tensor gamma = at::randn({cols}).to(dtype);
  const at::Tensor beta = rms ? at::Tensor() : at::randn({cols}).to(dtype);
  NormConfig cfg;
  cfg.rms = rms;
  const at::Tensor scale = at::full({1}, 37.5f);
  for (Format f : {Format::kE4M3, Format::kE5M2}) {
    const NormForward fused = norm_forward(x, gamma, beta, cfg, true, scale, f);
    // One pass writes the FP8 bytes of its own rounded output: identical to a separate cast.
    const Quantized q = quantize(fused.out, scale, f);
    EXPECT_TRUE(at::equal(fused.out_fp8.view(at::kByte), q.data.view(at::kByte)));
    EXPECT_EQ(fused.amax.item<float>(), q.amax.item<float>());
    // Against the ATen formulation: FP32 statistics in another summation order, so equal up to
    // a few FP32 ulps before the rounding into `dtype` (one ulp of dtype after it).
    const NormForward ref = norm_forward_aten(x, gamma, beta, cfg, at::Tensor(), f);
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
    EXPECT_TRUE(at::allclose(fused.out.to(at::kFloat), ref.out.to(at::kFloat), tol, tol));
    EXPECT_TRUE(at::allclose(fused.rsigma, ref.rsigma, 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose(fused.mu, ref.mu, 1e-5, 1e-6));
  }
}

TEST(NormKernelEdge, NanRowGivesNanAmax) {
  at::Tensor x = at::randn({4, 32});
  x[2][5] = std::numeric_limits<float>::quiet_NaN();
  const NormForward r = norm_forward(x, at::ones({32}), at::zeros({32}), NormConfig{}, true,
                                     at::ones({1}), Format::kE4M3);
  EXPECT_TRUE(std::isnan(r.amax.item<float>()));
  EXPECT_TRUE(at::isfinite(r.out[0]).all().item<bool>());  // other rows are untouched
}

std::string norm_name(const ::testing::TestParamInfo<NormCase>& info) {
  const auto [rms, dtype, rows, cols] = info.param;
  return std::string(rms ? "RMS" : "LN") + "_" + c10::toString(dtype) + "_" + std::to_string(rows) +
         "x" + std::to_string(cols);
}

INSTANTIATE_TEST_SUITE_P(Shapes, NormKernel,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(at::kFloat, at::kBFloat16, at::kHalf),
                                            ::testing::Values<int64_t>(1, 17, 64),
                                            ::testing::Values<int64_t>(1, 33, 128)),
                         norm_name);

// ---- WeightGradStore ----------------------------------------------------------------------
TEST(WeightGradStore, PopsInFifoOrder) {
  WeightGradStore store;
  EXPECT_TRUE(store.empty());
  for (int i = 0; i < 3; ++i) {
    WgradTask t;
    t.a = at::full({1}, static_cast<float>(i));
    store.push(std::move(t));
  }
  EXPECT_EQ(store.size(), 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(store.pop().a.item<float>(), static_cast<float>(i));
  EXPECT_TRUE(store.empty());
}

// C2 (b): the fused GEMM always accumulates (beta = 1); only zero_grad_buffer() zeroes main_grad.
// Overwriting (the former is_first_microbatch=True rule) fails the first expectation: 5 is lost.
TEST(WeightGradStore, RunWgradAlwaysAccumulatesIntoMainGrad) {
  WgradTask t;
  t.a = at::randn({16, 32});  // dyᵀ [out, tokens]
  t.b = at::randn({8, 32});   // xᵀ  [in, tokens]
  t.weight = at::empty({16, 8});
  t.main_grad = at::full({16, 8}, 5.0f);
  const at::Tensor dw = at::mm(t.a, t.b.t());
  EXPECT_FALSE(run_wgrad(t).dweight.defined());
  EXPECT_TRUE(at::allclose(t.main_grad, 5 + dw, 1e-5, 1e-5));
  run_wgrad(t);
  EXPECT_TRUE(at::allclose(t.main_grad, 5 + 2 * dw, 1e-5, 1e-5));
}

// ---- ScalingState ---------------------------------------------------------------------------
TEST(ScalingState, FirstCastUsesOwnAmaxThenUpdateUsesHistory) {
  ScalingState st;
  Recipe r;
  r.amax_history_len = 2;
  const at::Tensor x = at::tensor({1.0f, -4.0f, 2.0f});
  st.cast(x, Role::kInput, r, QuantizeOptions{});
  EXPECT_FLOAT_EQ(st.scale()[0].item<float>(), 448.0f / 4.0f);  // first cast: its own amax
  st.cast(x * 2, Role::kInput, r, QuantizeOptions{});
  EXPECT_FLOAT_EQ(st.scale()[0].item<float>(), 448.0f / 4.0f);   // fixed within the step
  EXPECT_FLOAT_EQ(st.amax_history()[0][0].item<float>(), 8.0f);  // max over the step's casts
  const int64_t n = registry_size();
  EXPECT_GE(n, 1);
  registry_update(registry_amaxes());
  EXPECT_FLOAT_EQ(st.scale()[0].item<float>(), 448.0f / 8.0f);
  EXPECT_FLOAT_EQ(st.amax_history()[1][0].item<float>(), 8.0f);  // rolled
  EXPECT_FLOAT_EQ(st.amax_history()[0][0].item<float>(), 0.0f);
  EXPECT_FLOAT_EQ(st.scale()[2].item<float>(), 1.0f);  // grad_output never cast
}

TEST(ScalingState, RegistryUpdateRejectsWrongSize) {
  ScalingState st;
  st.cast(at::ones({4}), Role::kWeight, Recipe{}, QuantizeOptions{});
  registry_amaxes();
  EXPECT_THROW(registry_update(at::zeros({1})), ValueError);
}

// ---- CPU GEMM --------------------------------------------------------------------------------
TEST(GemmCpu, HighPrecisionMatchesMm) {
  GemmArgs g;
  g.a = at::randn({7, 5});
  g.b = at::randn({3, 5});
  g.bias = at::randn({3});
  EXPECT_TRUE(at::allclose(gemm(g), at::addmm(g.bias, g.a, g.b.t()), 1e-6, 1e-6));
}

// The residual joins the FP32 sum: (a·bᵀ + bias) + residual, the same FP32 operations in the same
// order as mm, add bias, add residual, so the same bytes; a residual with accumulate is refused by
// name.
TEST(GemmCpu, ResidualAddedInTheFp32Sum) {
  GemmArgs g;
  g.a = at::randn({7, 5});
  g.b = at::randn({3, 5});
  g.bias = at::randn({3});
  g.residual = at::randn({7, 3});
  EXPECT_TRUE(at::equal(gemm(g), at::mm(g.a, g.b.t()).add_(g.bias).add_(g.residual)));
  g.out = at::zeros({7, 3});
  g.accumulate = true;
  try {
    gemm(g);
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'residual' cannot be combined with accumulate=True"),
              std::string::npos)
        << e.what();
  }
}

TEST(GemmCpu, Fp8NeedsMultiplesOf16) {
  GemmArgs g;
  g.a = at::zeros({16, 24}).to(at::kFloat8_e4m3fn);
  g.b = at::zeros({16, 24}).to(at::kFloat8_e4m3fn);
  g.a_scale_inv = g.b_scale_inv = at::ones({1});
  try {
    gemm(g);
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("inner dimension k to be a multiple of 16, got k=24"),
              std::string::npos)
        << e.what();
  }
}

// ---- LinearCore under autograd (C14) ---------------------------------------------------------
// A fused and delayed Linear whose main_grad (7s) is the callable's tensor, as the bindings set it.
struct FusedLinear {
  std::shared_ptr<LinearCore> core;
  at::Tensor weight = at::randn({16, 32}).set_requires_grad(true);
  at::Tensor main_grad = at::full({16, 32}, 7.0f);
  explicit FusedLinear(bool delay) {
    LinearConfig c;
    c.name = "Linear(in_features=32, out_features=16)";
    c.in_features = 32;
    c.out_features = 16;
    c.fuse_wgrad_accumulation = true;
    c.delay_wgrad_compute = delay;
    core = std::make_shared<LinearCore>(c);
    WeightAttrs a;
    a.main_grad = [mg = main_grad] { return mg; };
    core->set_weight_attrs(a);
  }
};

// torch::autograd::grad(loss, weight) gets dW = dyᵀ x back, as for a plain linear layer, and
// nothing is fused or queued. With the capture check removed (`captured` always false), the
// returned gradient is the fused route's undefined one (or a stand-in) and main_grad has changed.
TEST(LinearAutograd, CapturedWeightGradientIsReturnedNotFused) {
  for (bool delay : {false, true}) {
    FusedLinear m(delay);
    const at::Tensor x = at::randn({32, 32}).set_requires_grad(true);
    const at::Tensor dy = at::randn({32, 16});
    const at::Tensor y = m.core->forward(x, m.weight, {}, {}, {}, std::nullopt)[0];
    const auto g = torch::autograd::grad({(y * dy).sum()}, {m.weight});
    ASSERT_TRUE(g[0].defined());
    // FP32 GEMM over 32 tokens of O(1) values against float64: 32 2^-24 relative to the magnitude
    // sum (< 32 * 9), so 1e-4 absolute is loose.
    const at::Tensor ref = at::mm(dy.to(at::kDouble).t(), x.detach().to(at::kDouble));
    EXPECT_TRUE(at::allclose(g[0].to(at::kDouble), ref, 0, 1e-4)) << "delay=" << delay;
    EXPECT_TRUE(at::equal(m.main_grad, at::full({16, 32}, 7.0f))) << "delay=" << delay;
    EXPECT_EQ(m.core->queued_wgrads(), 0);
    EXPECT_FALSE(m.weight.grad().defined());
    // A plain backward of the same layer takes the fused (and delayed) route again.
    m.core->forward(x, m.weight, {}, {}, {}, std::nullopt)[0].mul(dy).sum().backward();
    if (delay) {
      EXPECT_EQ(m.core->queued_wgrads(), 1);
      m.core->backward_dw();
    }
    EXPECT_TRUE(at::allclose(m.main_grad.to(at::kDouble), 7 + ref, 0, 1e-4)) << "delay=" << delay;
  }
}

TEST(LinearAutograd, ForwardOutsideBackwardIsNoRecompute) { EXPECT_FALSE(in_backward_pass()); }

// ---- CUDA graph capture: what a replay would get wrong is refused (capture_check.h) ------------
TEST(CaptureRefusal, RefusesExactlyWhatAReplaySkips) {
  AutocastState off;
  off.enabled = false;
  AutocastState delayed;
  delayed.enabled = true;
  delayed.recipe.kind = RecipeKind::kDelayed;
  AutocastState current = delayed;
  current.recipe.kind = RecipeKind::kCurrent;
  AutocastState block = delayed;
  block.recipe.kind = RecipeKind::kBlock;
  // grad mode on (a training forward) unless an argument says otherwise
  auto why = [](const AutocastState& ac, bool wgrad, bool bound, bool delay,
                std::optional<bool> first, bool grad = true) -> std::string {
    const char* r = capture_refusal(ac, grad, wgrad, bound, delay, first);
    return r ? r : "";
  };
  // Capturable: current / block scaling or FP8 off, unbound, no delayed wgrad, weight recast.
  for (const AutocastState* ac : {&off, &current, &block}) {
    EXPECT_EQ(why(*ac, true, false, false, std::nullopt), "");
    EXPECT_EQ(why(*ac, true, false, false, true), "");
    EXPECT_EQ(why(*ac, false, true, true, std::nullopt), "");  // no weight gradient wanted
  }
  EXPECT_EQ(why(off, true, false, false, false), "");  // FP8 off keeps no FP8 weight cache
  // An inference forward under delayed scaling: nothing updates its scales.
  EXPECT_EQ(why(delayed, false, false, false, std::nullopt, /*grad=*/false), "");
  // Refused, each for its reason.
  EXPECT_NE(why(delayed, false, false, false, std::nullopt).find("delayed scaling"),
            std::string::npos);
  EXPECT_NE(why(current, true, true, false, std::nullopt).find("DistributedDataParallel"),
            std::string::npos);
  EXPECT_NE(why(block, true, false, true, std::nullopt).find("delay_wgrad_compute"),
            std::string::npos);
  EXPECT_NE(why(current, true, false, false, false).find("is_first_microbatch=False"),
            std::string::npos);
  // Under fp8dp.make_graphed_callables (a GraphRecord re-marks the amaxes at every replay),
  // delayed scaling in training, a DDP-bound layer and delayed weight gradients are capturable;
  // a reused weight cast is still refused.
  auto recorded = [](const AutocastState& ac, bool bound, bool delay,
                     std::optional<bool> first) -> std::string {
    const char* r = capture_refusal(ac, true, true, bound, delay, first, /*recorded=*/true);
    return r ? r : "";
  };
  EXPECT_EQ(recorded(delayed, false, false, std::nullopt), "");
  EXPECT_EQ(recorded(delayed, true, false, std::nullopt), "");
  EXPECT_EQ(recorded(delayed, false, true, std::nullopt), "");
  EXPECT_NE(recorded(delayed, false, false, false).find("is_first_microbatch=False"),
            std::string::npos);
}

// check_graph_capture does nothing where nothing is captured (CPU tensors).
TEST(CaptureRefusal, NothingIsRefusedOutsideCapture) {
  AutocastState delayed;
  delayed.enabled = true;
  delayed.recipe.kind = RecipeKind::kDelayed;
  EXPECT_NO_THROW(
      check_graph_capture(c10::Device(c10::kCPU), "m", delayed, true, true, true, true, false));
}

}  // namespace
}  // namespace fp8dp
