// CPU vs CUDA FP8 kernels (C7): identical FP8 bytes, transposed bytes, amax, scale_inv and scaling
// state for the same input and scale; dbias within the FP32 summation bound. Skips without a GPU.
#include <gtest/gtest.h>

#if defined(FP8DP_WITH_CUDA)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_scratch.h"
#include "cuda_test_util.h"
#include "fp8/quantize.h"
#include "fp8/scaling.h"

namespace fp8dp {
namespace {

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

// Device buffer with `pad` bytes in front, so tests can hand the kernels misaligned pointers.
struct DevBuf {
  uint8_t* base = nullptr;
  size_t pad = 0;
  DevBuf(size_t bytes, size_t pad_ = 0) : pad(pad_) {
    EXPECT_EQ(cudaMalloc(&base, bytes + pad + 16), cudaSuccess);
    EXPECT_EQ(cudaMemset(base, 0xA5, bytes + pad + 16), cudaSuccess);  // poison: unwritten shows
  }
  ~DevBuf() { cudaFree(base); }
  template <typename T = void>
  T* get() const {
    return reinterpret_cast<T*>(base + pad);
  }
};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Host input of `dtype` as raw bytes, plus its exact float values.
struct Input {
  std::vector<uint8_t> bytes;
  std::vector<float> values;
};

void put(Input& in, DType d, size_t i, float v) {
  if (d == DType::kFloat32) {
    std::memcpy(in.bytes.data() + 4 * i, &v, 4);
    in.values[i] = v;
  } else if (d == DType::kBFloat16) {
    const c10::BFloat16 b(v);
    std::memcpy(in.bytes.data() + 2 * i, &b, 2);
    in.values[i] = static_cast<float>(b);
  } else {
    const c10::Half h(v);
    std::memcpy(in.bytes.data() + 2 * i, &h, 2);
    in.values[i] = static_cast<float>(h);
  }
}

enum class Special { kNone, kNaN, kInf };

// Random values over many binades (random exponent and mantissa bits hit every rounding case,
// ties included), zeros of both signs, values at and beyond the FP8 maxima, and optional NaN / Inf.
Input make_input(DType d, int64_t n, uint32_t seed, Special special) {
  Input in{std::vector<uint8_t>(n * dtype_size(d)), std::vector<float>(n)};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> mant(0, (1u << 23) - 1), exp(127 - 24, 127 + 17),
      pick(0, 19);
  std::uniform_int_distribution<int> small_exp(-22, 3);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const float edges[] = {0.0f,         -0.0f,          448.0f,       -448.0f, 464.0f,
                         480.0f,       57344.0f,       -61440.0f,    1e30f,   0.0009765625f,
                         0.001953125f, 1.5258789e-05f, 2.0f * 448.0f};
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t k = pick(rng);
    float v;
    if (k < 8) {
      v = std::ldexp(1.0f + mant(rng) / float(1u << 23), int(exp(rng)) - 127) *
          (k & 1 ? -1.f : 1.f);
    } else if (k < 12) {
      v = normal(rng);
    } else if (k < 16) {
      // Six significant bits: after scaling by a power of two most of these sit exactly halfway
      // between two FP8 values (normal and subnormal), where round-to-nearest-even decides.
      v = std::ldexp(static_cast<float>(mant(rng) % 64), small_exp(rng)) * (k & 1 ? -1.f : 1.f);
    } else {
      v = edges[mant(rng) % (sizeof(edges) / sizeof(float))];
    }
    put(in, d, i, v);
  }
  if (n > 0 && special != Special::kNone) {
    const float s = special == Special::kNaN ? std::numeric_limits<float>::quiet_NaN()
                                             : -std::numeric_limits<float>::infinity();
    const size_t at = static_cast<size_t>(seed) % n;
    put(in, d, at, s);
    // With a NaN, an Inf elsewhere must not win: amax stays NaN.
    if (special == Special::kNaN && at != static_cast<size_t>(n - 1)) {
      put(in, d, n - 1, std::numeric_limits<float>::infinity());
    }
    // A negative NaN too: its FP8 byte keeps the sign (0xFF), which the hardware conversion alone
    // would not give.
    const size_t neg = (at + 1) % static_cast<size_t>(n);
    if (special == Special::kNaN && n >= 2 && neg != static_cast<size_t>(n - 1)) {
      put(in, d, neg, -std::numeric_limits<float>::quiet_NaN());
    }
  }
  return in;
}

enum class Mode { kAmaxOnly, kFlat, kTranspose, kTransposeDbias, kDbiasOnly };

const char* mode_name(Mode m) {
  const char* names[] = {"amax", "flat", "transpose", "transpose+dbias", "dbias"};
  return names[static_cast<int>(m)];
}

struct Case {
  DType dtype;
  Format format;
  int64_t rows, cols;
  Mode mode = Mode::kFlat;
};

std::string name_of(const testing::TestParamInfo<Case>& i) {
  const Case& c = i.param;
  const char* d = c.dtype == DType::kFloat32 ? "f32" : c.dtype == DType::kBFloat16 ? "bf16" : "f16";
  return std::string(d) + "_" + format_name(c.format) + "_" + std::to_string(c.rows) + "x" +
         std::to_string(c.cols);
}

class QuantizeCudaTest : public testing::TestWithParam<Case> {};

// Runs CPU and CUDA on the same input / scale (input and outputs offset by `pad` bytes on the
// device) and compares everything bit for bit, dbias within the summation bound.
void check_case(const Case& c, Special special, float scale, size_t pad, uint32_t seed) {
  const int64_t n = c.rows * c.cols;
  const Input in = make_input(c.dtype, n, seed, special);
  const bool want_out =
      c.mode == Mode::kFlat || c.mode == Mode::kTranspose || c.mode == Mode::kTransposeDbias;
  const bool want_t = c.mode == Mode::kTranspose || c.mode == Mode::kTransposeDbias;
  const bool want_db = c.mode == Mode::kTransposeDbias || c.mode == Mode::kDbiasOnly;

  std::vector<uint8_t> out(n, 0x11), out_t(n, 0x22);
  std::vector<float> dbias(c.cols, -1.0f);
  float amax = -1.0f, scale_inv = -1.0f;
  QuantizeParams p;
  p.input = in.bytes.data();
  p.input_dtype = c.dtype;
  p.rows = c.rows;
  p.cols = c.cols;
  p.scale = &scale;
  p.format = c.format;
  p.out = want_out ? out.data() : nullptr;
  p.out_t = want_t ? out_t.data() : nullptr;
  p.amax = &amax;
  p.scale_inv = &scale_inv;
  p.dbias = want_db ? dbias.data() : nullptr;
  quantize_cpu(p);

  DevBuf d_in(in.bytes.size(), pad * dtype_size(c.dtype)), d_out(n, pad), d_out_t(n, pad);
  DevBuf d_db(c.cols * 4), d_scalars(16);
  CK(cudaMemcpy(d_in.get(), in.bytes.data(), in.bytes.size(), cudaMemcpyHostToDevice));
  float* d_scale = d_scalars.get<float>();
  const float big = 1e30f;  // amax must be overwritten, not max-accumulated with this
  CK(cudaMemcpy(d_scale, &scale, 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_scale + 1, &big, 4, cudaMemcpyHostToDevice));
  QuantizeParams g = p;
  g.input = d_in.get();
  g.scale = d_scale;
  g.out = want_out ? d_out.get<uint8_t>() : nullptr;
  g.out_t = want_t ? d_out_t.get<uint8_t>() : nullptr;
  g.amax = d_scale + 1;
  g.scale_inv = d_scale + 2;
  g.dbias = want_db ? d_db.get<float>() : nullptr;
  quantize_cuda(g, nullptr);
  CK(cudaDeviceSynchronize());

  float g_amax, g_scale_inv;
  CK(cudaMemcpy(&g_amax, d_scale + 1, 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&g_scale_inv, d_scale + 2, 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(bits(g_amax), bits(amax)) << "amax gpu=" << g_amax << " cpu=" << amax;
  EXPECT_EQ(bits(g_scale_inv), bits(scale_inv));
  if (special == Special::kNaN && n > 0) {
    EXPECT_TRUE(std::isnan(g_amax));
  }
  if (special == Special::kInf && n > 0) {
    EXPECT_TRUE(std::isinf(g_amax));
  }
  if (want_out) {
    std::vector<uint8_t> got(n);
    CK(cudaMemcpy(got.data(), d_out.get(), n, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(got[i], out[i]) << "byte " << i << " of " << n << ", x=" << in.values[i];
    }
  }
  if (want_t) {
    std::vector<uint8_t> got(n);
    CK(cudaMemcpy(got.data(), d_out_t.get(), n, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], out_t[i]) << "transposed byte " << i;
  }
  if (want_db) {
    std::vector<float> got(c.cols);
    CK(cudaMemcpy(got.data(), d_db.get(), c.cols * 4, cudaMemcpyDeviceToHost));
    for (int64_t j = 0; j < c.cols; ++j) {
      // Both sides sum `rows` FP32 terms, in different orders; each differs from the exact sum by
      // at most (rows - 1) * 2^-24 * sum|x|, so the two differ by at most twice that.
      double abs_sum = 0.0;
      for (int64_t r = 0; r < c.rows; ++r) abs_sum += std::fabs(in.values[r * c.cols + j]);
      if (std::isnan(dbias[j]) || std::isinf(abs_sum)) {
        EXPECT_EQ(std::isnan(got[j]), std::isnan(dbias[j])) << "column " << j;
        continue;
      }
      const double tol = 2.0 * std::max<int64_t>(c.rows - 1, 1) * std::ldexp(1.0, -24) * abs_sum;
      EXPECT_LE(std::fabs(double(got[j]) - double(dbias[j])), tol) << "dbias column " << j;
    }
  }
}

// One test per (dtype, format, shape); every output combination and input kind inside it, so the
// GPU run starts few processes.
TEST_P(QuantizeCudaTest, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (Mode m :
       {Mode::kAmaxOnly, Mode::kFlat, Mode::kTranspose, Mode::kTransposeDbias, Mode::kDbiasOnly}) {
    SCOPED_TRACE(mode_name(m));
    Case c = GetParam();
    c.mode = m;
    check_case(c, Special::kNone, 1.0f, 0, 1);
    check_case(c, Special::kNone, 37.25f, 0, 2);  // pushes many values into saturation
    check_case(c, Special::kNaN, 0.5f, 0, 3);
    check_case(c, Special::kInf, 2.0f, 0, 4);
    check_case(c, Special::kNone, 0.75f, 1, 5);  // misaligned pointers: the scalar paths
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  const int64_t shapes[][2] = {{1, 1},   {1, 17},   {3, 5},     {64, 64},  {127, 129},
                               {16, 48}, {257, 96}, {1000, 40}, {2, 4099}, {300, 512}};
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    for (Format f : {Format::kE4M3, Format::kE5M2})
      for (auto& s : shapes) v.push_back({d, f, s[0], s[1]});
  return v;
}

INSTANTIATE_TEST_SUITE_P(All, QuantizeCudaTest, testing::ValuesIn(all_cases()), name_of);

TEST(QuantizeCuda, LargeFlatMatchesCpu) {  // many blocks and grid-stride iterations
  SKIP_WITHOUT_GPU();
  check_case({DType::kBFloat16, Format::kE4M3, 4099, 1024, Mode::kFlat}, Special::kNone, 3.0f, 0,
             6);
  check_case({DType::kFloat32, Format::kE5M2, 1030, 2048, Mode::kTransposeDbias}, Special::kNone,
             0.01f, 0, 7);
}

TEST(QuantizeCuda, EmptyInput) {
  SKIP_WITHOUT_GPU();
  check_case({DType::kFloat32, Format::kE4M3, 0, 8, Mode::kTransposeDbias}, Special::kNone, 2.0f, 0,
             8);
  check_case({DType::kFloat32, Format::kE4M3, 0, 0, Mode::kFlat}, Special::kNone, 2.0f, 0, 9);
}

TEST(DequantizeCuda, EveryByteMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 256 * 9 + 5;  // every byte value, vector body plus a tail
  std::vector<uint8_t> in(n);
  for (int64_t i = 0; i < n; ++i) in[i] = static_cast<uint8_t>(i * 7);
  for (Format f : {Format::kE4M3, Format::kE5M2}) {
    for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (float s : {1.0f, 0.0123f, 300.0f}) {
        const size_t es = dtype_size(d);
        std::vector<uint8_t> cpu(n * es), got(n * es);
        DequantizeParams p;
        p.input = in.data();
        p.numel = n;
        p.format = f;
        p.scale_inv = &s;
        p.out = cpu.data();
        p.out_dtype = d;
        dequantize_cpu(p);
        DevBuf d_in(n), d_out(n * es), d_s(4);
        CK(cudaMemcpy(d_in.get(), in.data(), n, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_s.get(), &s, 4, cudaMemcpyHostToDevice));
        p.input = d_in.get<uint8_t>();
        p.scale_inv = d_s.get<float>();
        p.out = d_out.get();
        dequantize_cuda(p, nullptr);
        CK(cudaMemcpy(got.data(), d_out.get(), n * es, cudaMemcpyDeviceToHost));
        // NaN payloads may differ between the host and device conversions; compare NaN-ness there.
        for (int64_t i = 0; i < n; ++i) {
          float a, b;
          if (d == DType::kFloat32) {
            std::memcpy(&a, &cpu[4 * i], 4);
            std::memcpy(&b, &got[4 * i], 4);
          } else if (d == DType::kBFloat16) {
            a = static_cast<float>(reinterpret_cast<c10::BFloat16*>(cpu.data())[i]);
            b = static_cast<float>(reinterpret_cast<c10::BFloat16*>(got.data())[i]);
          } else {
            a = static_cast<float>(reinterpret_cast<c10::Half*>(cpu.data())[i]);
            b = static_cast<float>(reinterpret_cast<c10::Half*>(got.data())[i]);
          }
          if (std::isnan(a)) {
            ASSERT_TRUE(std::isnan(b)) << "byte " << int(in[i]);
          } else {
            ASSERT_EQ(bits(a), bits(b)) << "byte " << int(in[i]) << " scale_inv " << s;
          }
        }
      }
    }
  }
}

TEST(UpdateScalingCuda, MatchesCpuForManyTensors) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(0.0f, 1000.0f);
  for (int64_t L : {1, 2, 7, 64, 130, 1024}) {
    for (int64_t n : {1, 33, 100}) {
      for (AmaxAlgo algo : {AmaxAlgo::kMax, AmaxAlgo::kMostRecent}) {
        std::vector<float> hist(L * n), scale(n), scale_inv(n), fmax(n);
        for (auto& h : hist) h = u(rng);
        for (int64_t t = 0; t < n; ++t) {
          scale[t] = 1.0f + t;
          scale_inv[t] = 1.0f / scale[t];
          fmax[t] = t % 2 ? 448.0f : 57344.0f;
          const int kind = t % 6;  // zero / NaN / Inf / tiny amax columns keep or clamp the scale
          if (kind == 1)
            for (int64_t i = 0; i < L; ++i) hist[i * n + t] = 0.0f;
          if (kind == 2) hist[((t * 7) % L) * n + t] = std::numeric_limits<float>::quiet_NaN();
          if (kind == 3) hist[0 * n + t] = std::numeric_limits<float>::infinity();
          if (kind == 4)
            for (int64_t i = 0; i < L; ++i) hist[i * n + t] = 1e-38f;
        }
        const float margin = static_cast<float>(L % 3);
        DevBuf d_h(hist.size() * 4), d_s(n * 4), d_si(n * 4), d_m(n * 4);
        CK(cudaMemcpy(d_h.get(), hist.data(), hist.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_s.get(), scale.data(), n * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_si.get(), scale_inv.data(), n * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_m.get(), fmax.data(), n * 4, cudaMemcpyHostToDevice));
        ScalingUpdateParams p{hist.data(), scale.data(), scale_inv.data(), fmax.data(), n, L,
                              algo,        margin};
        update_scaling_cpu(p);
        ScalingUpdateParams g{d_h.get<float>(),
                              d_s.get<float>(),
                              d_si.get<float>(),
                              d_m.get<float>(),
                              n,
                              L,
                              algo,
                              margin};
        update_scaling_cuda(g, nullptr);
        std::vector<float> gh(L * n), gs(n), gsi(n);
        CK(cudaMemcpy(gh.data(), d_h.get(), gh.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(gs.data(), d_s.get(), n * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(gsi.data(), d_si.get(), n * 4, cudaMemcpyDeviceToHost));
        for (int64_t t = 0; t < n; ++t) {
          ASSERT_EQ(bits(gs[t]), bits(scale[t])) << "scale of tensor " << t << " L=" << L;
          ASSERT_EQ(bits(gsi[t]), bits(scale_inv[t])) << "scale_inv of tensor " << t;
        }
        for (size_t i = 0; i < gh.size(); ++i) {
          ASSERT_TRUE(bits(gh[i]) == bits(hist[i]) || (std::isnan(gh[i]) && std::isnan(hist[i])))
              << "history element " << i << " L=" << L << " n=" << n;
        }
      }
    }
  }
}

// The batched update (update_fp8_scales' path): more slots than one launch takes, each slot with
// its own history length, algorithm, margin and row 0, against the CPU batch, bit for bit.
TEST(UpdateScalingCuda, BatchedMatchesCpuAcrossLaunches) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> u(0.0f, 1000.0f);
  const int64_t count = 2 * kMaxSlotsPerLaunch + 7;
  const int64_t lengths[] = {1, 2, 64, 300, 1024};
  std::vector<std::vector<float>> hist(count), scale(count), scale_inv(count), fmax(count),
      row0(count);
  std::vector<DevBuf> d_hist, d_scale, d_scale_inv, d_fmax, d_row0;
  // Reserved up front: DevBuf owns its allocation and must not be copied by a reallocation.
  for (auto* v : {&d_hist, &d_scale, &d_scale_inv, &d_fmax, &d_row0}) v->reserve(count);
  std::vector<ScalingSlot> cpu(count), gpu(count);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t L = lengths[k % 5], n = k % 7 == 0 ? 200 : 3;
    const AmaxAlgo algo = k % 3 == 0 ? AmaxAlgo::kMostRecent : AmaxAlgo::kMax;
    const float margin = static_cast<float>(k % 2);
    hist[k].resize(L * n);
    for (auto& h : hist[k]) h = u(rng);
    if (k % 4 == 1) hist[k][(L - 1) * n] = std::numeric_limits<float>::quiet_NaN();
    if (k % 4 == 2)
      for (int64_t i = 0; i < L; ++i) hist[k][i * n + 1] = 0.0f;
    scale[k].assign(n, 2.0f);
    scale_inv[k].assign(n, 0.5f);
    fmax[k].assign(n, k % 2 ? 448.0f : 57344.0f);
    row0[k].resize(n);
    for (auto& r : row0[k]) r = u(rng);
    d_hist.emplace_back(hist[k].size() * 4);
    d_scale.emplace_back(n * 4);
    d_scale_inv.emplace_back(n * 4);
    d_fmax.emplace_back(n * 4);
    d_row0.emplace_back(n * 4);
    CK(cudaMemcpy(d_hist[k].get(), hist[k].data(), hist[k].size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_scale[k].get(), scale[k].data(), n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_scale_inv[k].get(), scale_inv[k].data(), n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_fmax[k].get(), fmax[k].data(), n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_row0[k].get(), row0[k].data(), n * 4, cudaMemcpyHostToDevice));
    const bool with_row0 = k % 5 != 3;
    cpu[k].params = {hist[k].data(), scale[k].data(), scale_inv[k].data(), fmax[k].data(), n, L,
                     algo,           margin};
    cpu[k].row0 = with_row0 ? row0[k].data() : nullptr;
    gpu[k].params = {d_hist[k].get<float>(),
                     d_scale[k].get<float>(),
                     d_scale_inv[k].get<float>(),
                     d_fmax[k].get<float>(),
                     n,
                     L,
                     algo,
                     margin};
    gpu[k].row0 = with_row0 ? d_row0[k].get<float>() : nullptr;
  }
  update_scaling_batched_cpu(cpu.data(), count);
  update_scaling_batched_cuda(gpu.data(), count, nullptr);
  CK(cudaDeviceSynchronize());
  for (int64_t k = 0; k < count; ++k) {
    const int64_t n = static_cast<int64_t>(scale[k].size());
    std::vector<float> gh(hist[k].size()), gs(n), gsi(n);
    CK(cudaMemcpy(gh.data(), d_hist[k].get(), gh.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gs.data(), d_scale[k].get(), n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gsi.data(), d_scale_inv[k].get(), n * 4, cudaMemcpyDeviceToHost));
    for (int64_t t = 0; t < n; ++t) {
      ASSERT_EQ(bits(gs[t]), bits(scale[k][t])) << "slot " << k << " scale " << t;
      ASSERT_EQ(bits(gsi[t]), bits(scale_inv[k][t])) << "slot " << k << " scale_inv " << t;
    }
    for (size_t i = 0; i < gh.size(); ++i) {
      ASSERT_TRUE(bits(gh[i]) == bits(hist[k][i]) || (std::isnan(gh[i]) && std::isnan(hist[k][i])))
          << "slot " << k << " history element " << i;
    }
  }
}

TEST(UpdateScalingCuda, BatchedRejectsTooManyColumns) {
  SKIP_WITHOUT_GPU();
  ScalingSlot s;
  s.params.n = 257;
  s.params.history_len = 4;
  try {
    update_scaling_batched_cuda(&s, 1, nullptr);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("n must be in [1, 256], got 257"), std::string::npos)
        << e.what();
  }
}

// current_scale_cuda and the CPU rule agree bit for bit on every case (integer margins: exp2f is
// exact on both sides), and an accumulated amax merges into what the buffer held.
TEST(CurrentScaleCuda, MatchesComputeScale) {
  SKIP_WITHOUT_GPU();
  const float vals[] = {3.5f,
                        448.0f,
                        1e-30f,
                        std::numeric_limits<float>::denorm_min(),
                        0.0f,
                        std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity(),
                        6e4f};
  DevBuf a(4), s(4);
  for (float margin : {0.0f, 2.0f}) {
    for (float v : vals) {
      CK(cudaMemcpy(a.get(), &v, 4, cudaMemcpyHostToDevice));
      current_scale_cuda(a.get<float>(), s.get<float>(), 448.0f, margin, nullptr);
      float got = 0.0f;
      CK(cudaMemcpy(&got, s.get(), 4, cudaMemcpyDeviceToHost));
      EXPECT_EQ(bits(got), bits(compute_scale(v, 448.0f, margin, 1.0f))) << v;
    }
  }
}

TEST(QuantizeCuda, AmaxAccumulateMergesIntoTheBuffer) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> x = {1.0f, -2.5f, 0.25f, 2.0f};
  DevBuf in(16), amax(4), scale(4), out(4);
  CK(cudaMemcpy(in.get(), x.data(), 16, cudaMemcpyHostToDevice));
  const float one = 1.0f;
  CK(cudaMemcpy(scale.get(), &one, 4, cudaMemcpyHostToDevice));
  for (const auto& [start, want] : {std::pair<float, float>{7.0f, 7.0f}, {1.0f, 2.5f}}) {
    CK(cudaMemcpy(amax.get(), &start, 4, cudaMemcpyHostToDevice));
    QuantizeParams p;
    p.input = in.get();
    p.rows = 1;
    p.cols = 4;
    p.scale = scale.get<float>();
    p.out = out.get<uint8_t>();
    p.amax = amax.get<float>();
    p.amax_accumulate = true;
    quantize_cuda(p, nullptr);
    float got = 0.0f;
    CK(cudaMemcpy(&got, amax.get(), 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, want) << "start " << start;
  }
}

// The dbias partial sums come from fp8dp's scratch pool, which keeps its memory across a
// synchronize: the default pool (cudaMallocAsync) hands it back to the driver there, and the next
// call's allocation cost 238 us of host time on the H200 machine. Fails if the cast allocates its
// scratch elsewhere (the pool then holds nothing after the call) or leaks it.
TEST(QuantizeCuda, DbiasScratchStaysInThePoolAcrossSynchronize) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 256, cols = 512;
  cudaMemPool_t pool = cuda::scratch_pool();
  CK(cudaDeviceSynchronize());
  CK(cudaMemPoolTrimTo(pool, 0));
  auto pool_bytes = [&](cudaMemPoolAttr attr) -> uint64_t {
    uint64_t v = 0;
    EXPECT_EQ(cudaMemPoolGetAttribute(pool, attr, &v), cudaSuccess);
    return v;
  };
  ASSERT_EQ(pool_bytes(cudaMemPoolAttrReservedMemCurrent), 0u);
  std::vector<float> x(rows * cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 97) - 48.0f;
  DevBuf in(x.size() * 4), out(x.size()), out_t(x.size()), db(cols * 4), scalars(16);
  CK(cudaMemcpy(in.get(), x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  const float one = 1.0f;
  CK(cudaMemcpy(scalars.get(), &one, 4, cudaMemcpyHostToDevice));
  QuantizeParams p;
  p.input = in.get();
  p.input_dtype = DType::kFloat32;
  p.rows = rows;
  p.cols = cols;
  p.scale = scalars.get<float>();
  p.out = out.get<uint8_t>();
  p.out_t = out_t.get<uint8_t>();
  p.amax = scalars.get<float>() + 1;
  p.scale_inv = scalars.get<float>() + 2;
  p.dbias = db.get<float>();
  uint64_t reserved = 0;
  for (int call = 0; call < 2; ++call) {
    quantize_cuda(p, nullptr);
    CK(cudaDeviceSynchronize());
    if (call == 0) reserved = pool_bytes(cudaMemPoolAttrReservedMemCurrent);
    EXPECT_GT(reserved, 0u) << "the scratch was not taken from fp8dp's pool";
    EXPECT_EQ(pool_bytes(cudaMemPoolAttrReservedMemCurrent), reserved) << "call " << call;
    EXPECT_EQ(pool_bytes(cudaMemPoolAttrUsedMemCurrent), 0u) << "scratch not given back";
  }
  // Column j of the input holds i % 97 - 48 for i = r * cols + j: the sums are exact in FP32.
  std::vector<float> got(cols);
  CK(cudaMemcpy(got.data(), db.get(), cols * 4, cudaMemcpyDeviceToHost));
  for (int64_t j = 0; j < cols; ++j) {
    double want = 0.0;
    for (int64_t r = 0; r < rows; ++r) want += x[r * cols + j];
    EXPECT_EQ(got[j], static_cast<float>(want)) << "column " << j;
  }
}

}  // namespace
}  // namespace fp8dp

#else

TEST(QuantizeCuda, NeedsCudaBuild) { GTEST_SKIP() << "fp8dp was built without CUDA"; }

#endif
