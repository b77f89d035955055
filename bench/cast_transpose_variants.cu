// Tuning benchmark of the cast-transpose kernel: times its launch choices (how dbias partials are
// combined, tiles per block, grid order, resident-block target) against each other and against a
// device-to-device copy of the same input, interleaved, E4M3 output, with and without dbias. Every
// dbias variant's result is then checked against an FP64 host sum (within the FP32 bound), so a
// variant that is fast because it is wrong (a race in the last-block finalize) shows up as FAIL.
// Build (no torch needed; this file includes cast_transpose.cu, the other two link):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -DFP8DP_WITH_CUDA=1 -I src \
//        -o build/ct_variants bench/cast_transpose_variants.cu src/fp8/cuda/quantize.cu \
//        src/fp8/cuda/cast_workspace.cu
// Run: build/ct_variants   (one table per shape, then the fastest dbias variant of each shape)
#include "fp8/cuda/cast_transpose.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace fp8dp::cuda {
namespace {

#define CK(x) FP8DP_CHECK_CUDA(x)

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Variant {
  std::string name;
  bool dbias;
  std::function<void(float* dbias_out)> run;
};

float host_float(const uint16_t* h, int64_t i, bool f32) {
  uint32_t u;
  if (f32) {
    std::memcpy(&u, h + 2 * i, 4);
  } else {
    u = static_cast<uint32_t>(h[i]) << 16;  // bf16 -> fp32 is a shift
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
void bench_shape(int64_t rows, int64_t cols, const char* dtype) {
  constexpr bool kF32 = sizeof(T) == 4;
  const int64_t n = rows * cols;
  std::vector<uint16_t> host(n * sizeof(T) / 2);
  uint32_t state = 12345;
  for (auto& h : host) {  // random finite values: a small LCG over sign, exponent and mantissa
    state = state * 1664525u + 1013904223u;
    h = static_cast<uint16_t>((state >> 16) & 0xBFFF);
  }
  void *in, *copy_dst;
  uint8_t *out, *out_t;
  float *scal, *dbias, *dbias_check;
  CK(cudaMalloc(&in, n * sizeof(T)));
  CK(cudaMalloc(&copy_dst, n * sizeof(T)));
  CK(cudaMalloc(&out, n));
  CK(cudaMalloc(&out_t, n));
  CK(cudaMalloc(&scal, 64));
  CK(cudaMalloc(&dbias, cols * 4));
  CK(cudaMalloc(&dbias_check, cols * 4));
  CK(cudaMemcpy(in, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  const float one = 1.0f;
  CK(cudaMemcpy(scal, &one, 4, cudaMemcpyHostToDevice));
  QuantizeParams p;
  p.input = in;
  p.input_dtype = kF32 ? DType::kFloat32 : DType::kBFloat16;
  p.rows = rows;
  p.cols = cols;
  p.scale = scal;
  p.out = out;
  p.out_t = out_t;
  p.amax = scal + 1;
  p.scale_inv = scal + 2;
  cudaStream_t st = nullptr;
  std::vector<Variant> vs;
  vs.push_back({"copy", false, [&](float*) {
                  CK(cudaMemcpyAsync(copy_dst, in, n * sizeof(T), cudaMemcpyDeviceToDevice, st));
                }});
  vs.push_back({"library", false, [&](float*) { quantize_cuda(p, st); }});
  vs.push_back({"library +dbias", true, [&](float* d) {
                  QuantizeParams q = p;
                  q.dbias = d;
                  quantize_cuda(q, st);
                }});
  // launcher(params, stream, config): one residency choice of launch_tiled (which zeroes or
  // resets amax itself, as quantize_cuda would).
  auto add = [&](auto launcher, const std::string& tag, bool db, CastTransposeConfig cfg) {
    const char* rn[] = {"last", "2pass", "2pass-alloc"};
    const int strip = cfg.strip_tiles;
    std::string name = tag + (db ? std::string(" ") + rn[static_cast<int>(cfg.dbias_reduce)] : "") +
                       " strip=" + (strip ? std::to_string(strip) : "auto") +
                       (cfg.rows_fastest ? " rows-first" : "") +
                       (cfg.fused_amax_reset ? "" : " amax-memset") + (db ? " +dbias" : "");
    vs.push_back({name, db, [&, launcher, db, cfg](float* d) {
                    QuantizeParams q = p;
                    q.dbias = db ? d : nullptr;
                    launcher(q, st, cfg);
                  }});
  };
  constexpr Format E = Format::kE4M3;
  auto mb5 = [](const QuantizeParams& q, cudaStream_t s, const CastTransposeConfig& c) {
    launch_tiled<E, T, 5, 5>(q, s, c);
  };
  auto mb4 = [](const QuantizeParams& q, cudaStream_t s, const CastTransposeConfig& c) {
    launch_tiled<E, T, 4, 4>(q, s, c);
  };
  using R = DbiasReduce;
  for (bool rf : {false, true})
    for (bool fused : {true, false}) add(mb5, "mb5", false, {R::kLastBlock, 1, rf, fused});
  for (R red : {R::kLastBlock, R::kTwoPass, R::kTwoPassAlloc})
    for (int strip : {0, 1, 2, 4, 8})
      for (bool rf : {false, true}) add(mb5, "mb5", true, {red, strip, rf, true});
  // The first version: two passes, a scratch allocation per call, a memset for amax.
  add(mb5, "mb5", true, {R::kTwoPassAlloc, 0, false, false});
  for (int strip : {0, 1, 2, 4}) {
    for (bool rf : {false, true}) add(mb5, "mb5", true, {R::kLastBlock, strip, rf, false});
    for (bool rf : {false, true}) add(mb4, "mb4", true, {R::kLastBlock, strip, rf, true});
  }

  for (auto& v : vs) for (int w = 0; w < 3; ++w) v.run(dbias);
  CK(cudaDeviceSynchronize());
  const int kRounds = 15;
  std::vector<std::vector<std::pair<cudaEvent_t, cudaEvent_t>>> ev(vs.size());
  for (int r = 0; r < kRounds; ++r) {
    for (size_t i = 0; i < vs.size(); ++i) {
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      CK(cudaEventRecord(a, st));
      vs[i].run(dbias);
      CK(cudaEventRecord(b, st));
      ev[i].push_back({a, b});
    }
  }
  CK(cudaDeviceSynchronize());
  std::vector<float> ms(vs.size());
  for (size_t i = 0; i < vs.size(); ++i) {
    std::vector<float> t;
    for (auto& [a, b] : ev[i]) {
      float x;
      CK(cudaEventElapsedTime(&x, a, b));
      t.push_back(x);
      CK(cudaEventDestroy(a));
      CK(cudaEventDestroy(b));
    }
    ms[i] = median(t);
  }

  // FP64 column sums on the host; a variant's FP32 dbias must lie within (rows - 1) 2^-24 sum|x|
  // of it (the worst-case error of any order of FP32 additions).
  std::vector<double> ref(cols, 0.0), abs_sum(cols, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double v = host_float(host.data(), r * cols + c, kF32);
      ref[c] += v;
      abs_sum[c] += std::fabs(v);
    }
  }
  std::vector<float> got(cols);
  const double copy_bw = 2.0 * n * sizeof(T) / ms[0] / 1e9;
  std::printf("\n%s %lldx%lld (%.0f MiB), copy %.2f TB/s\n", dtype, (long long)rows,
              (long long)cols, n * sizeof(T) / 1048576.0, copy_bw);
  size_t best = 0;
  for (size_t i = 1; i < vs.size(); ++i) {
    const bool db = vs[i].dbias;
    const char* verdict = "";
    if (db) {
      CK(cudaMemset(dbias_check, 0xFF, cols * 4));  // NaN: a column never written fails
      vs[i].run(dbias_check);
      CK(cudaMemcpy(got.data(), dbias_check, cols * 4, cudaMemcpyDeviceToHost));
      bool ok = true;
      for (int64_t c = 0; c < cols && ok; ++c) {
        // 1.01: the bound is (n - 1) u / (1 - (n - 1) u), a hair above the first-order term.
        ok = std::fabs(got[c] - ref[c]) <=
             1.01 * std::max<int64_t>(rows - 1, 1) * std::ldexp(1.0, -24) * abs_sum[c];
      }
      verdict = ok ? "ok" : "FAIL";
      if (ok && (best == 0 || ms[i] < ms[best])) best = i;
    }
    const double bytes = n * sizeof(T) + 2.0 * n + (db ? 4.0 * cols : 0.0);
    const double bw = bytes / ms[i] / 1e9;
    std::printf("  %-34s %8.1f us %6.2f TB/s %5.1f%% %s\n", vs[i].name.c_str(), ms[i] * 1e3, bw,
                100.0 * bw / copy_bw, verdict);
  }
  if (best) {
    std::printf("  fastest correct +dbias: %s (%.1f us)\n", vs[best].name.c_str(), ms[best] * 1e3);
  }
  cudaFree(in);
  cudaFree(copy_dst);
  cudaFree(out);
  cudaFree(out_t);
  cudaFree(scal);
  cudaFree(dbias);
  cudaFree(dbias_check);
}

}  // namespace
}  // namespace fp8dp::cuda

int main() {
  using fp8dp::cuda::bench_shape;
  bench_shape<__nv_bfloat16>(16384, 8192, "bf16");
  bench_shape<__nv_bfloat16>(4096, 8192, "bf16");
  bench_shape<float>(8192, 8192, "fp32");
  return 0;
}
