// Tuning benchmark of the block-scaled cast (Float8BlockScaling): the transposed 1x128 tiles by one
// warp per column (the library's kernel) against one thread per column and half region
// (kThreadCols in block_quantize.cu: no shuffles, no transposed byte tile), for the layouts the
// Linear step casts: 1x128 tiles with the transpose (x; dy also with dbias), and the weight's
// 128x128 blocks for reference, next to a device-to-device copy of the input, interleaved. Bytes
// and scales of the two variants must agree exactly (checked; exit 1 otherwise); dbias adds the
// column in another order, so its largest difference relative to the column's sum of |x| is
// printed.
// Build (no torch needed):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -DFP8DP_WITH_CUDA=1 -I src -o build/block_variants dev/block_cast_variants.cu \
//        src/fp8/cuda/quantize.cu
// Run: build/block_variants   (one table per shape; exit 1 on a mismatch)
#include "fp8/cuda/block_quantize.cu"
#include "variant_timing.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace fp8dp::cuda {
namespace {

#define CK(x) FP8DP_CHECK_CUDA(x)

struct Buffers {
  uint8_t *out, *out_t;
  float *s, *s_t, *dbias;
};

Buffers alloc_buffers(int64_t rows, int64_t cols) {
  const int64_t n = rows * cols, kb = ceil_blocks(cols), kbt = ceil_blocks(rows);
  Buffers b;
  CK(cudaMalloc(&b.out, n));
  CK(cudaMalloc(&b.out_t, n));
  CK(cudaMalloc(&b.s, rows * kb * 4));
  CK(cudaMalloc(&b.s_t, cols * kbt * 4));
  CK(cudaMalloc(&b.dbias, cols * 4));
  return b;
}

void free_buffers(Buffers& b) {
  for (void* p : {static_cast<void*>(b.out), static_cast<void*>(b.out_t),
                  static_cast<void*>(b.s), static_cast<void*>(b.s_t), static_cast<void*>(b.dbias)})
    cudaFree(p);
}

BlockQuantizeParams params(const void* in, int64_t rows, int64_t cols, BlockShape shape,
                           const Buffers& b, bool dbias) {
  BlockQuantizeParams p;
  p.input = in;
  p.input_dtype = DType::kBFloat16;
  p.rows = rows;
  p.cols = cols;
  p.shape = shape;
  p.out = b.out;
  p.scale_inv = b.s;
  p.out_t = b.out_t;
  p.scale_inv_t = b.s_t;
  if (dbias) p.dbias = b.dbias;
  return p;
}

// The outputs of one launch, copied to the host.
std::vector<uint8_t> snapshot(const BlockQuantizeParams& p, int64_t kb, int64_t kbt) {
  const int64_t n = p.rows * p.cols;
  const int64_t ns = (p.shape == BlockShape::k1x128 ? p.rows * kb + p.cols * kbt : 2 * kb * kbt);
  std::vector<uint8_t> h(2 * n + 4 * ns + (p.dbias ? 4 * p.cols : 0));
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(h.data(), p.out, n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h.data() + n, p.out_t, n, cudaMemcpyDeviceToHost));
  const int64_t s1 = p.shape == BlockShape::k1x128 ? p.rows * kb : kb * kbt;
  CK(cudaMemcpy(h.data() + 2 * n, p.scale_inv, 4 * s1, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h.data() + 2 * n + 4 * s1, p.scale_inv_t, 4 * (ns - s1), cudaMemcpyDeviceToHost));
  if (p.dbias) CK(cudaMemcpy(h.data() + 2 * n + 4 * ns, p.dbias, 4 * p.cols, cudaMemcpyDeviceToHost));
  return h;
}

bool bench_shape(int64_t rows, int64_t cols) {
  using T = __nv_bfloat16;
  const int64_t n = rows * cols, kb = ceil_blocks(cols), kbt = ceil_blocks(rows);
  std::vector<uint16_t> host(n);
  uint32_t state = 12345;
  for (auto& h : host) {  // finite bf16 values of every sign and a wide range of exponents
    state = state * 1664525u + 1013904223u;
    h = static_cast<uint16_t>((state >> 16) & 0xBFFF);
  }
  std::vector<double> abs_col_sum(cols, 1e-30);  // per column, for the dbias comparison
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = uint32_t{host[i]} << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    abs_col_sum[i % cols] += std::fabs(f);
  }
  void *in, *copy_dst;
  CK(cudaMalloc(&in, n * sizeof(T)));
  CK(cudaMalloc(&copy_dst, n * sizeof(T)));
  CK(cudaMemcpy(in, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  Buffers b = alloc_buffers(rows, cols);
  cudaStream_t st = nullptr;
  constexpr Format E = Format::kE4M3;
  struct Case {
    const char* name;
    BlockShape shape;
    bool dbias;
  };
  const Case cases[] = {{"1x128 + transpose", BlockShape::k1x128, false},
                        {"1x128 + transpose + dbias", BlockShape::k1x128, true},
                        {"128x128 both layouts", BlockShape::k128x128, false}};
  std::vector<dev::Variant> vs;
  vs.push_back({"copy", [&] {
                  CK(cudaMemcpyAsync(copy_dst, in, n * sizeof(T), cudaMemcpyDeviceToDevice, st));
                }});
  bool same = true;
  for (const Case& c : cases) {
    const BlockQuantizeParams p = params(in, rows, cols, c.shape, b, c.dbias);
    launch<E, T, false>(p, st);
    auto ref = snapshot(p, kb, kbt);
    if (c.shape == BlockShape::k1x128) {
      launch<E, T, true>(p, st);
      auto got = snapshot(p, kb, kbt);
      const size_t nd = c.dbias ? 4 * cols : 0;  // dbias last: compared with a tolerance
      if (!std::equal(ref.begin(), ref.end() - nd, got.begin())) {
        std::printf("MISMATCH: %s, bytes or scales of the two variants differ\n", c.name);
        same = false;
      }
      if (c.dbias) {
        double worst = 0.0;
        for (int64_t j = 0; j < cols; ++j) {
          float x, y;
          std::memcpy(&x, ref.data() + ref.size() - nd + 4 * j, 4);
          std::memcpy(&y, got.data() + got.size() - nd + 4 * j, 4);
          worst = std::max(worst, std::fabs(double{x} - double{y}) / abs_col_sum[j]);
        }
        std::printf("%s: dbias of the two variants, largest |difference| / sum |x| = %.2e\n",
                    c.name, worst);
      }
      vs.push_back({std::string(c.name) + ", warp per column", [p, st] { launch<E, T, false>(p, st); }});
      vs.push_back({std::string(c.name) + ", thread per column", [p, st] { launch<E, T, true>(p, st); }});
    } else {
      vs.push_back({std::string(c.name), [p, st] { launch<E, T, false>(p, st); }});
    }
  }
  const std::vector<float> ms = dev::time_variants(vs, st);
  const double copy_bw = 2.0 * n * sizeof(T) / ms[0] / 1e9;
  std::printf("\nbf16 %lldx%lld (%.0f MiB), copy %.2f TB/s\n", (long long)rows, (long long)cols,
              n * sizeof(T) / 1048576.0, copy_bw);
  for (size_t i = 1; i < vs.size(); ++i) {
    const bool tiles = vs[i].name.rfind("1x128", 0) == 0;  // 128x128: one scale per block
    const bool db = vs[i].name.find("dbias") != std::string::npos;
    const double scales = tiles ? 4.0 * (rows * kb + cols * kbt) : 8.0 * kb * kbt;
    dev::print_row(vs[i].name, ms[i], n * sizeof(T) + 2.0 * n + scales + (db ? 4.0 * cols : 0.0),
                   copy_bw, 46);
  }
  free_buffers(b);
  cudaFree(in);
  cudaFree(copy_dst);
  return same;
}

}  // namespace
}  // namespace fp8dp::cuda

int main() {
  using fp8dp::cuda::bench_shape;
  bool ok = bench_shape(8192, 8192);  // the Linear 8192^3 step's x, dy and weight
  ok &= bench_shape(16384, 1536);     // the 342M model's activations
  ok &= bench_shape(4096, 14336);     // a Llama-style FFN activation
  return ok ? 0 : 1;
}
