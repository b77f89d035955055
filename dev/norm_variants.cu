// Tuning benchmark of the LayerNorm / RMSNorm kernels (src/norm/cuda/norm_*.cu): times their
// launch choices against each other and against a device-to-device copy of the input, interleaved
// (A B C ... A B C ..., median of 20 samples of 10 back-to-back calls), on random bf16
// 16384 x 8192 (256 MiB) and the GPT block stack's 4096 x 2048 / 4096 / 8192.
//   forward (LayerNorm, E4M3 output only): copy-engine stages (0 = none, 2, 3), vectors of the
//     row per thread (2, 4, 8: threads per row follow) and the register budget for 1 or 2
//     resident 512-thread blocks per SM (the 8-vector kernel always has 128 registers, and is
//     timed without and with 2 stages);
//   backward (LayerNorm, dx + dgamma + dbeta): copy-engine stages, at least 512 or 256 threads
//     per block (rows per block follow) and the register budget for 1 or 2 blocks.
// The library's own choice is timed first after the copy ("library default").
// Bandwidth counts the bytes each op must move (forward: x read, FP8 written; backward: dz and x
// read, dx written). A variant well ahead of the library's default is the next change to make; a
// variant's neighbours in the timing order move it by up to ~10%, so smaller gaps are ties.
// Build (no torch needed):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -DFP8DP_WITH_CUDA=1 -I src -o build/norm_variants dev/norm_variants.cu \
//        src/fp8/cuda/quantize.cu
// Run: build/norm_variants [--once | --dump FILE] (--once: each op's default twice per shape and
// no tables, for ncu; --dump: every output of the defaults appended to FILE, to compare two builds
// of the kernels bit for bit)
#include "norm/cuda/norm_bwd.cu"
#include "norm/cuda/norm_fwd.cu"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

namespace fp8dp::cuda::norm {
namespace {

#define CK(x) FP8DP_CHECK_CUDA(x)

struct Variant {
  std::string name;
  double bytes;
  std::function<void()> run;
};

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Each sample is kBack calls back to back between two events (per-call time = elapsed / kBack):
// as in a training step, the next launch is queued while the previous kernel runs, so a sample
// does not include the launch latency and the idle GPU of a lone call. Timed one call at a time,
// a small shape's result moved by up to 6 us with its position in the table (4096 x 2048 on the
// H200, 2026-12-02: the same kernel at 27.6 and 21.6 us). "host us" is the wall time of enqueueing
// one call: where it reaches the GPU time, the sample measures the host, not the kernel.
void time_table(const char* title, std::vector<Variant>& vs, cudaStream_t st) {
  constexpr int kRounds = 20;
  constexpr int kBack = 10;
  for (auto& v : vs) {
    for (int i = 0; i < 3; ++i) v.run();
  }
  CK(cudaStreamSynchronize(st));
  std::vector<std::vector<float>> ms(vs.size()), host(vs.size());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int r = 0; r < kRounds; ++r) {
    for (size_t i = 0; i < vs.size(); ++i) {
      CK(cudaEventRecord(e0, st));
      const auto h0 = std::chrono::steady_clock::now();
      for (int k = 0; k < kBack; ++k) vs[i].run();
      const auto h1 = std::chrono::steady_clock::now();
      CK(cudaEventRecord(e1, st));
      host[i].push_back(std::chrono::duration<float, std::milli>(h1 - h0).count() / kBack);
      CK(cudaEventSynchronize(e1));
      float t = 0;
      CK(cudaEventElapsedTime(&t, e0, e1));
      ms[i].push_back(t / kBack);
    }
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  const double copy_tbps = vs[0].bytes / (median(ms[0]) * 1e-3) / 1e12;
  std::printf("\n%s\n%-40s %9s %7s %8s %8s\n", title, "variant", "us", "TB/s", "of copy",
              "host us");
  for (size_t i = 0; i < vs.size(); ++i) {
    const double m = median(ms[i]);
    const double tbps = vs[i].bytes / (m * 1e-3) / 1e12;
    std::printf("%-40s %9.1f %7.2f %7.0f%% %8.1f\n", vs[i].name.c_str(), m * 1e3, tbps,
                100.0 * tbps / copy_tbps, median(host[i]) * 1e3);
  }
}

void fill_random_bf16(__nv_bfloat16* dev, size_t n, float mean, float stddev, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(mean, stddev);
  std::vector<__nv_bfloat16> h(n);
  for (auto& v : h) v = __float2bfloat16(d(gen));
  CK(cudaMemcpy(dev, h.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
}

// Every output of the library's default LayerNorm and RMSNorm, forward (bf16 and E4M3 out, amax,
// mu, rsigma) and backward (dx, dgamma, dbeta), appended to `path`: two builds of the kernels
// compare bit for bit with cmp.
void dump_outputs(int64_t rows, int64_t cols, NormFwdParams f, NormBwdParams b, cudaStream_t st,
                  const char* path) {
  const size_t n = static_cast<size_t>(rows * cols);
  std::vector<uint8_t> host;
  auto save = [&](const void* dev, size_t bytes) {
    const size_t at = host.size();
    host.resize(at + bytes);
    CK(cudaMemcpy(host.data() + at, dev, bytes, cudaMemcpyDeviceToHost));
  };
  void* out;
  CK(cudaMalloc(&out, n * 2));
  f.out = out;
  for (const bool rms : {false, true}) {
    f.rms = b.rms = rms;
    f.beta = rms ? nullptr : f.beta;
    b.dbeta = rms ? nullptr : b.dbeta;
    b.mu = rms ? nullptr : b.mu;
    CK(cudaMemsetAsync(f.amax, 0, 4, st));  // as norm_fwd_cuda does before its launch
    dispatch<__nv_bfloat16>(f, st);
    dispatch<__nv_bfloat16>(b, st);
    CK(cudaStreamSynchronize(st));
    save(f.out, n * 2);
    save(f.out_fp8, n);
    save(f.amax, 4);
    if (!rms) save(f.mu, rows * 4);
    save(f.rsigma, rows * 4);
    save(b.dx, n * 2);
    save(b.dgamma, cols * 2);
    if (!rms) save(b.dbeta, cols * 2);
  }
  CK(cudaFree(out));
  FILE* fp = std::fopen(path, "ab");
  FP8DP_CHECK(fp != nullptr, "norm_variants: cannot open ", path);
  std::fwrite(host.data(), 1, host.size(), fp);
  std::fclose(fp);
}

// once: launch each op's library default twice (warm-up, then the one to profile) and no table, for
// a profiler (`ncu -k regex:norm_ build/norm_variants --once`). dump: dump_outputs to that path
// instead of the tables.
void run_shape(int64_t rows, int64_t cols, cudaStream_t st, bool once, const char* dump) {
  using T = __nv_bfloat16;
  const size_t n = static_cast<size_t>(rows * cols);
  T *x, *dz, *dx, *gamma, *beta, *dgamma, *dbeta, *copy;
  uint8_t* fp8;
  float *scale, *amax, *mu, *rsigma;
  CK(cudaMalloc(&x, n * 2));
  CK(cudaMalloc(&dz, n * 2));
  CK(cudaMalloc(&dx, n * 2));
  CK(cudaMalloc(&copy, n * 2));
  CK(cudaMalloc(&fp8, n));
  CK(cudaMalloc(&gamma, cols * 2));
  CK(cudaMalloc(&beta, cols * 2));
  CK(cudaMalloc(&dgamma, cols * 2));
  CK(cudaMalloc(&dbeta, cols * 2));
  CK(cudaMalloc(&scale, 4));
  CK(cudaMalloc(&amax, 4));
  CK(cudaMalloc(&mu, rows * 4));
  CK(cudaMalloc(&rsigma, rows * 4));
  fill_random_bf16(x, n, 0.5f, 2.0f, 1);
  fill_random_bf16(dz, n, 0.0f, 1.0f, 2);
  fill_random_bf16(gamma, cols, 1.0f, 0.1f, 3);
  fill_random_bf16(beta, cols, 0.0f, 0.1f, 4);
  const float two = 2.0f;
  CK(cudaMemcpy(scale, &two, 4, cudaMemcpyHostToDevice));

  NormFwdParams f;
  f.input = x;
  f.dtype = DType::kBFloat16;
  f.rows = rows;
  f.cols = cols;
  f.gamma = gamma;
  f.beta = beta;
  f.out_fp8 = fp8;
  f.scale = scale;
  f.amax = amax;
  f.mu = mu;
  f.rsigma = rsigma;
  NormBwdParams b;
  b.dz = dz;
  b.x = x;
  b.dtype = DType::kBFloat16;
  b.rows = rows;
  b.cols = cols;
  b.mu = mu;
  b.rsigma = rsigma;
  b.gamma = gamma;
  b.dx = dx;
  b.dgamma = dgamma;
  b.dbeta = dbeta;

  const double copy_bytes = 2.0 * n * 2;
  const double fwd_bytes = n * 2.0 + n;
  const double bwd_bytes = 3.0 * n * 2;
  auto copy_op = [=] { CK(cudaMemcpyAsync(copy, x, n * 2, cudaMemcpyDeviceToDevice, st)); };
  std::vector<Variant> fwd = {{"copy", copy_bytes, copy_op},
                              {"library default", fwd_bytes, [=] { dispatch<T>(f, st); }}};
  // Copy-engine stages (0: each thread loads its row itself) x vectors per thread x budget.
  fwd.push_back({"4 vec, no stages, 2 blocks", fwd_bytes, [=] { dispatch<T, 2, 0>(f, st, 4); }});
  fwd.push_back({"4 vec, 2 stages, 2 blocks", fwd_bytes, [=] { dispatch<T, 2, 2>(f, st, 4); }});
  fwd.push_back({"4 vec, 3 stages, 2 blocks", fwd_bytes, [=] { dispatch<T, 2, 3>(f, st, 4); }});
  fwd.push_back({"4 vec, 2 stages, 1 block", fwd_bytes, [=] { dispatch<T, 1, 2>(f, st, 4); }});
  fwd.push_back({"2 vec, 2 stages, 2 blocks", fwd_bytes, [=] { dispatch<T, 2, 2>(f, st, 2); }});
  fwd.push_back({"8 vec, no stages", fwd_bytes, [=] { dispatch<T, 2, 0>(f, st, 8); }});
  fwd.push_back({"8 vec, 2 stages", fwd_bytes, [=] { dispatch<T, 2, 2, 2>(f, st, 8); }});
  std::vector<Variant> bwd = {{"copy", copy_bytes, copy_op},
                              {"library default", bwd_bytes, [=] { dispatch<T>(b, st); }}};
  bwd.push_back({"no stages, 512+ threads", bwd_bytes, [=] { dispatch<T, 0>(b, st, 512); }});
  bwd.push_back({"2 stages, 512+ threads", bwd_bytes, [=] { dispatch<T, 2>(b, st, 512); }});
  bwd.push_back({"3 stages, 512+ threads", bwd_bytes, [=] { dispatch<T, 3>(b, st, 512); }});
  bwd.push_back({"2 stages, 256+ threads", bwd_bytes, [=] { dispatch<T, 2>(b, st, 256); }});
  bwd.push_back({"2 stages, 1 block budget", bwd_bytes, [=] { dispatch<T, 2>(b, st, 512, 1); }});
  bwd.push_back({"2 stages, 2 blocks budget", bwd_bytes, [=] { dispatch<T, 2>(b, st, 512, 2); }});
  // The library's launch, but dgamma / dbeta added by a second kernel instead of the cooperative
  // grid's own tail (what a cooperative launch costs between calls).
  NormBwdParams apart = b;
  apart.cooperative_tail = false;
  bwd.push_back({"default, column sums apart", bwd_bytes, [=] { dispatch<T>(apart, st); }});
  if (dump != nullptr) {
    dump_outputs(rows, cols, f, b, st, dump);
    fwd.clear();
    bwd.clear();
  } else if (once) {
    for (int i = 0; i < 2; ++i) {
      fwd[1].run();
      bwd[1].run();
    }
    CK(cudaStreamSynchronize(st));
    fwd.clear();
    bwd.clear();
  }
  char title[128];
  std::snprintf(title, sizeof title, "LayerNorm + E4M3 cast forward, bf16 %ldx%ld", (long)rows,
                (long)cols);
  if (!fwd.empty()) time_table(title, fwd, st);
  std::snprintf(title, sizeof title, "LayerNorm backward, bf16 %ldx%ld", (long)rows, (long)cols);
  if (!bwd.empty()) time_table(title, bwd, st);
  for (void* p : std::initializer_list<void*>{x, dz, dx, copy, fp8, gamma, beta, dgamma, dbeta,
                                              scale, amax, mu, rsigma}) {
    CK(cudaFree(p));
  }
}

}  // namespace
}  // namespace fp8dp::cuda::norm

int main(int argc, char** argv) {
  const bool once = argc > 1 && std::string(argv[1]) == "--once";
  const char* dump = argc > 2 && std::string(argv[1]) == "--dump" ? argv[2] : nullptr;
  cudaStream_t st;
  FP8DP_CHECK_CUDA(cudaStreamCreate(&st));
  // The bandwidth target's shape (256 MiB), then the GPT block stack's (bench/gpt_block_gpu.py:
  // 4096 tokens at hidden 2048, 4096, 8192).
  fp8dp::cuda::norm::run_shape(16384, 8192, st, once, dump);
  fp8dp::cuda::norm::run_shape(4096, 2048, st, once, dump);
  fp8dp::cuda::norm::run_shape(4096, 4096, st, once, dump);
  fp8dp::cuda::norm::run_shape(4096, 8192, st, once, dump);
  FP8DP_CHECK_CUDA(cudaStreamDestroy(st));
  return 0;
}
