// Tuning benchmark of the cast-transpose kernel: times its variants (resident-block target,
// prefetch of the next tile, tiles per block) against each other and against a device-to-device
// copy of the same input, interleaved, on E4M3 output with and without dbias.
// Build (no torch needed):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I src \
//        -o build/ct_variants dev/cast_transpose_variants.cu
// Run: build/ct_variants   (prints one table per shape; the library launches the winner)
#include "fp8/cuda/quantize.cu"
#include "variant_timing.cuh"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace fp8dp::cuda {
namespace {

#define CK(x) FP8DP_CHECK_CUDA(x)

using dev::Variant;

template <typename T>
void bench_shape(int64_t rows, int64_t cols, const char* dtype) {
  const int64_t n = rows * cols;
  std::vector<uint16_t> host(n * sizeof(T) / 2);
  uint32_t state = 12345;
  for (auto& h : host) {  // random finite values: a small LCG over sign, exponent and mantissa
    state = state * 1664525u + 1013904223u;
    h = static_cast<uint16_t>((state >> 16) & 0xBFFF);
  }
  void *in, *copy_dst;
  uint8_t *out, *out_t;
  float *scal, *dbias;
  CK(cudaMalloc(&in, n * sizeof(T)));
  CK(cudaMalloc(&copy_dst, n * sizeof(T)));
  CK(cudaMalloc(&out, n));
  CK(cudaMalloc(&out_t, n));
  CK(cudaMalloc(&scal, 64));
  CK(cudaMalloc(&dbias, cols * 4));
  CK(cudaMemcpy(in, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  const float one = 1.0f;
  CK(cudaMemcpy(scal, &one, 4, cudaMemcpyHostToDevice));
  QuantizeParams p;
  p.input = in;
  p.input_dtype = sizeof(T) == 4 ? DType::kFloat32 : DType::kBFloat16;
  p.rows = rows;
  p.cols = cols;
  p.scale = scal;
  p.out = out;
  p.out_t = out_t;
  p.amax = scal + 1;
  p.scale_inv = scal + 2;
  cudaStream_t st = nullptr;
  std::vector<Variant> vs;
  vs.push_back({"copy", [&] { CK(cudaMemcpyAsync(copy_dst, in, n * sizeof(T), cudaMemcpyDeviceToDevice, st)); }});
  vs.push_back({"library", [&] { QuantizeParams q = p; quantize_cuda(q, st); }});
  vs.push_back({"library+dbias", [&] { QuantizeParams q = p; q.dbias = dbias; quantize_cuda(q, st); }});
  auto add = [&](auto launcher, const char* tag) {
    for (int strip : {0, 1, 2, 4}) {
      for (bool db : {false, true}) {
        std::string name = std::string(tag) + " strip=" + (strip ? std::to_string(strip) : "auto") +
                           (db ? " +dbias" : "");
        vs.push_back({name, [&, launcher, strip, db] {
                        QuantizeParams q = p;
                        q.dbias = db ? dbias : nullptr;
                        CK(cudaMemsetAsync(q.amax, 0, 4, st));
                        launcher(q, st, strip);
                      }});
      }
    }
  };
  using E = std::integral_constant<Format, Format::kE4M3>;
  add([](const QuantizeParams& q, cudaStream_t s, int k) { launch_tiled<E::value, T, 1, false>(q, s, k); }, "mb1");
  add([](const QuantizeParams& q, cudaStream_t s, int k) { launch_tiled<E::value, T, 1, true>(q, s, k); }, "mb1 pf");
  add([](const QuantizeParams& q, cudaStream_t s, int k) { launch_tiled<E::value, T, 5, false>(q, s, k); }, "mb5");
  add([](const QuantizeParams& q, cudaStream_t s, int k) { launch_tiled<E::value, T, 6, false>(q, s, k); }, "mb6");
  add([](const QuantizeParams& q, cudaStream_t s, int k) { launch_tiled<E::value, T, 6, true>(q, s, k); }, "mb6 pf");
  add([](const QuantizeParams& q, cudaStream_t s, int k) { launch_tiled<E::value, T, 8, false>(q, s, k); }, "mb8");

  const std::vector<float> ms = dev::time_variants(vs, st);
  const double copy_bw = 2.0 * n * sizeof(T) / ms[0] / 1e9;
  std::printf("\n%s %lldx%lld (%.0f MiB), copy %.2f TB/s\n", dtype, (long long)rows, (long long)cols,
              n * sizeof(T) / 1048576.0, copy_bw);
  for (size_t i = 1; i < vs.size(); ++i) {
    const bool db = vs[i].name.find("dbias") != std::string::npos;
    dev::print_row(vs[i].name, ms[i], n * sizeof(T) + 2.0 * n + (db ? 4.0 * cols : 0.0), copy_bw,
                   26);
  }
  cudaFree(in);
  cudaFree(copy_dst);
  cudaFree(out);
  cudaFree(out_t);
  cudaFree(scal);
  cudaFree(dbias);
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
