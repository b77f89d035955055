// Tuning benchmark of the block-scaled cast (Float8BlockScaling): how many of the kernel's 8 row
// passes over a 128x128 region each thread loads before it uses them (kBatch in
// block_quantize.cu: 1, as the kernel was until 12-06, against 4, the default, and 8), so how many 16-byte
// loads each thread has in flight, for the layouts the
// Linear step casts: 1x128 tiles alone, with the transpose (x; dy also with dbias), and the
// weight's 128x128 blocks, next to a device-to-device copy of the input, interleaved. Every
// variant's bytes, scales and dbias must equal the library's exactly (the same arithmetic in the
// same order; checked, exit 1 otherwise).
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
                           const Buffers& b, bool transpose, bool dbias) {
  BlockQuantizeParams p;
  p.input = in;
  p.input_dtype = DType::kBFloat16;
  p.rows = rows;
  p.cols = cols;
  p.shape = shape;
  p.out = b.out;
  p.scale_inv = b.s;
  if (transpose) {
    p.out_t = b.out_t;
    p.scale_inv_t = b.s_t;
  }
  if (dbias) p.dbias = b.dbias;
  return p;
}

// The outputs of one launch, copied to the host (the transposed half only when it was cast).
std::vector<uint8_t> snapshot(const BlockQuantizeParams& p, int64_t kb, int64_t kbt) {
  const int64_t n = p.rows * p.cols;
  const bool tiles = p.shape == BlockShape::k1x128;
  const int64_t s1 = tiles ? p.rows * kb : kb * kbt, s2 = tiles ? p.cols * kbt : kb * kbt;
  std::vector<uint8_t> h(n + 4 * s1);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(h.data(), p.out, n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h.data() + n, p.scale_inv, 4 * s1, cudaMemcpyDeviceToHost));
  const auto append = [&h](const void* d, int64_t bytes) {
    const size_t at = h.size();
    h.resize(at + bytes);
    CK(cudaMemcpy(h.data() + at, d, bytes, cudaMemcpyDeviceToHost));
  };
  if (p.out_t != nullptr) {
    append(p.out_t, n);
    append(p.scale_inv_t, 4 * s2);
  }
  if (p.dbias != nullptr) append(p.dbias, 4 * p.cols);
  return h;
}

// Poison every output, so that a variant which writes nothing cannot match the reference.
void poison(const Buffers& b, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  CK(cudaMemset(b.out, 0xFF, n));
  CK(cudaMemset(b.out_t, 0xFF, n));
  CK(cudaMemset(b.s, 0xFF, rows * ceil_blocks(cols) * 4));
  CK(cudaMemset(b.s_t, 0xFF, cols * ceil_blocks(rows) * 4));
  CK(cudaMemset(b.dbias, 0xFF, cols * 4));
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
    bool transpose, dbias;
  };
  const Case cases[] = {{"1x128 rows only", BlockShape::k1x128, false, false},
                        {"1x128 + transpose", BlockShape::k1x128, true, false},
                        {"1x128 + transpose + dbias", BlockShape::k1x128, true, true},
                        {"128x128 both layouts", BlockShape::k128x128, true, false}};
  std::vector<dev::Variant> vs;
  vs.push_back({"copy", [&] {
                  CK(cudaMemcpyAsync(copy_dst, in, n * sizeof(T), cudaMemcpyDeviceToDevice, st));
                }});
  bool same = true;
  for (const Case& c : cases) {
    const BlockQuantizeParams p = params(in, rows, cols, c.shape, b, c.transpose, c.dbias);
    poison(b, rows, cols);
    launch<E, T, 1>(p, st);
    const auto ref = snapshot(p, kb, kbt);
    const auto check = [&](const char* what, void (*run)(const BlockQuantizeParams&, cudaStream_t)) {
      poison(b, rows, cols);
      run(p, st);
      if (snapshot(p, kb, kbt) != ref) {
        std::printf("MISMATCH: %s, %s: bytes, scales or dbias differ from kBatch 1\n", c.name, what);
        same = false;
      }
    };
    check("kBatch 4", launch<E, T, 4>);
    check("kBatch 8", launch<E, T, 8>);
    vs.push_back({std::string(c.name) + ", batch 1", [p, st] { launch<E, T, 1>(p, st); }});
    vs.push_back({std::string(c.name) + ", batch 4", [p, st] { launch<E, T, 4>(p, st); }});
    vs.push_back({std::string(c.name) + ", batch 8", [p, st] { launch<E, T, 8>(p, st); }});
  }
  const std::vector<float> ms = dev::time_variants(vs, st);
  const double copy_bw = 2.0 * n * sizeof(T) / ms[0] / 1e9;
  std::printf("\nbf16 %lldx%lld (%.0f MiB), copy %.2f TB/s\n", (long long)rows, (long long)cols,
              n * sizeof(T) / 1048576.0, copy_bw);
  for (size_t i = 1; i < vs.size(); ++i) {
    const Case& c = cases[(i - 1) / 3];
    const bool tiles = c.shape == BlockShape::k1x128;  // 128x128: one scale per block
    const double scales = tiles ? 4.0 * (rows * kb + (c.transpose ? cols * kbt : 0))
                                : 4.0 * kb * kbt * (c.transpose ? 2 : 1);
    const double bytes = n * sizeof(T) + (c.transpose ? 2.0 : 1.0) * n + scales +
                         (c.dbias ? 4.0 * cols : 0.0);
    dev::print_row(vs[i].name, ms[i], bytes, copy_bw, 46);
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
