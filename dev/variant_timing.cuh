// Timing harness of the torch-free kernel-variant benchmarks (dev/*_variants.cu): every variant
// runs a few times to warm up, then the variants take turns, kRounds rounds, each launch between
// two events on one stream, so clocks and caches drift over all of them alike; the median per
// variant is returned in milliseconds.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_check.h"

namespace fp8dp::dev {

struct Variant {
  std::string name;
  std::function<void()> run;
};

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

inline std::vector<float> time_variants(const std::vector<Variant>& vs, cudaStream_t st,
                                        int rounds = 15) {
  for (auto& v : vs)
    for (int w = 0; w < 3; ++w) v.run();
  FP8DP_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<std::vector<std::pair<cudaEvent_t, cudaEvent_t>>> ev(vs.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < vs.size(); ++i) {
      cudaEvent_t a, b;
      FP8DP_CHECK_CUDA(cudaEventCreate(&a));
      FP8DP_CHECK_CUDA(cudaEventCreate(&b));
      FP8DP_CHECK_CUDA(cudaEventRecord(a, st));
      vs[i].run();
      FP8DP_CHECK_CUDA(cudaEventRecord(b, st));
      ev[i].push_back({a, b});
    }
  }
  FP8DP_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms(vs.size());
  for (size_t i = 0; i < vs.size(); ++i) {
    std::vector<float> t;
    for (auto& [a, b] : ev[i]) {
      float x;
      FP8DP_CHECK_CUDA(cudaEventElapsedTime(&x, a, b));
      t.push_back(x);
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
    ms[i] = median(t);
  }
  return ms;
}

// One row of a variant table: the time, the bandwidth over the `bytes` the variant moves and its
// share of the copy's bandwidth.
inline void print_row(const std::string& name, float ms, double bytes, double copy_bw, int width) {
  const double bw = bytes / ms / 1e9;
  std::printf("  %-*s %8.1f us %6.2f TB/s %5.1f%%\n", width, name.c_str(), ms * 1e3, bw,
              100.0 * bw / copy_bw);
}

}  // namespace fp8dp::dev
