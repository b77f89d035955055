// Tuning benchmark of LayerNormMLP's fused activation casts (the tiled kernel, act_tile_kernel):
// how far ahead each thread loads its inputs (kAhead in activation_cast.cu: 0, each pass's loads
// followed by their use; 1, a tile's two passes loaded first; 2, also the block's next tile's,
// into registers, while this one is computed; 3, the next tile's by cp.async into shared memory),
// for the casts of the 342M model's MLP at one micro-batch (bf16 16384 x 6144, the tables on) and
// of the GPT stack's at width 2048 (4096 x 8192): GELU forward (E4M3 bytes and their transpose)
// and GELU backward (E5M2 bytes, transpose and dbias), and SwiGLU's two at the Llama block's shape
// (bf16 8192 x 14336 outputs), next to a device-to-device copy of the input, interleaved. Every
// variant's bytes, amax, scale_inv and dbias must equal kAhead 0's exactly (the same arithmetic
// in the same order; checked, exit 1 otherwise).
// Build (no torch needed):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -DFP8DP_WITH_CUDA=1 -I src -o build/act_variants dev/act_cast_variants.cu \
//        src/fp8/cuda/quantize.cu
// Run: build/act_variants   (one table per case; exit 1 on a mismatch)
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fp8/cuda/activation_cast.cu"
#include "variant_timing.cuh"

namespace fp8dp::cuda {
namespace {

#define CK(x) FP8DP_CHECK_CUDA(x)

using T = __nv_bfloat16;

struct Case {
  const char* name;
  Activation act;
  bool backward, dbias;
  int64_t rows, cols;  // cols: the activation's output columns (ffn)
};

// The library's launch with act_tile_kernel's kAhead, on the default stream.
template <int kAhead>
void launch_variant(const ActParams& p) {
  if (p.act == Activation::kGelu) {
    p.backward ? launch<T, Activation::kGelu, true, kAhead>(p, nullptr)
               : launch<T, Activation::kGelu, false, kAhead>(p, nullptr);
  } else {
    p.backward ? launch<T, Activation::kSwiglu, true, kAhead>(p, nullptr)
               : launch<T, Activation::kSwiglu, false, kAhead>(p, nullptr);
  }
}

// Device buffers of one case and the ActParams that point at them.
struct Buffers {
  void *h = nullptr, *da = nullptr, *copy_dst = nullptr, *dbias = nullptr;
  uint8_t *out = nullptr, *out_t = nullptr;
  float *scale = nullptr, *amax = nullptr, *scale_inv = nullptr;
  ActParams p;
  int64_t in_bytes = 0, out_elems = 0;
};

Buffers make(const Case& c) {
  Buffers b;
  ActParams& p = b.p;
  p.act = c.act;
  p.backward = c.backward;
  p.dtype = DType::kBFloat16;
  p.rows = c.rows;
  p.cols = c.cols;
  p.format = c.backward ? Format::kE5M2 : Format::kE4M3;
  const int64_t in_elems = c.rows * p.in_cols();
  b.out_elems = c.rows * p.out_cols();
  b.in_bytes = (in_elems + (c.backward ? c.rows * c.cols : 0)) * int64_t{sizeof(T)};
  std::vector<uint16_t> host(in_elems);
  uint32_t state = 12345;
  for (auto& v : host) {  // bf16 values uniform in [-6, 6), where pre-activations lie: inside
    // the tables' range (2^-12 <= |x| < 16) but for the few tiny ones, which are computed
    state = state * 1664525u + 1013904223u;
    const float f = static_cast<float>(state >> 8) * (12.0f / 16777216.0f) - 6.0f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  // in_bytes, not in_elems: the copy baseline moves the backward's second input too (from here).
  CK(cudaMalloc(&b.h, b.in_bytes));
  CK(cudaMemcpy(b.h, host.data(), in_elems * sizeof(T), cudaMemcpyHostToDevice));
  p.input = b.h;
  if (c.backward) {
    host.resize(c.rows * c.cols);
    CK(cudaMalloc(&b.da, host.size() * sizeof(T)));
    CK(cudaMemcpy(b.da, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    p.grad = b.da;
  }
  if (c.dbias) {
    CK(cudaMalloc(&b.dbias, p.out_cols() * sizeof(float)));
    p.dbias = b.dbias;
  }
  CK(cudaMalloc(&b.copy_dst, b.in_bytes));
  CK(cudaMalloc(&b.out, b.out_elems));
  CK(cudaMalloc(&b.out_t, b.out_elems));
  CK(cudaMalloc(&b.scale, 3 * sizeof(float)));
  b.amax = b.scale + 1;
  b.scale_inv = b.scale + 2;
  const float s = 8.0f;
  CK(cudaMemcpy(b.scale, &s, sizeof(float), cudaMemcpyHostToDevice));
  p.scale = b.scale;
  p.out = b.out;
  p.out_t = b.out_t;
  p.amax = b.amax;
  p.scale_inv = b.scale_inv;
  return b;
}

void release(Buffers& b) {
  for (void* q : {b.h, b.da, b.copy_dst, b.dbias, static_cast<void*>(b.out),
                  static_cast<void*>(b.out_t), static_cast<void*>(b.scale)})
    if (q != nullptr) cudaFree(q);
}

// Every output of one launch, copied to the host; the outputs are poisoned first, so that a
// variant which writes nothing cannot match.
template <int kAhead>
std::vector<uint8_t> run_and_read(const Buffers& b) {
  const ActParams& p = b.p;
  CK(cudaMemset(b.out, 0xFF, b.out_elems));
  CK(cudaMemset(b.out_t, 0xFF, b.out_elems));
  CK(cudaMemset(b.amax, 0xFF, 2 * sizeof(float)));
  if (b.dbias) CK(cudaMemset(b.dbias, 0xFF, p.out_cols() * sizeof(float)));
  launch_variant<kAhead>(p);
  CK(cudaDeviceSynchronize());
  const int64_t nd = b.dbias ? p.out_cols() * 4 : 0;
  std::vector<uint8_t> h(2 * b.out_elems + 8 + nd);
  CK(cudaMemcpy(h.data(), b.out, b.out_elems, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h.data() + b.out_elems, b.out_t, b.out_elems, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h.data() + 2 * b.out_elems, b.amax, 8, cudaMemcpyDeviceToHost));
  if (nd) CK(cudaMemcpy(h.data() + 2 * b.out_elems + 8, b.dbias, nd, cudaMemcpyDeviceToHost));
  return h;
}

bool bench(const Case& c) {
  Buffers b = make(c);
  const auto ref = run_and_read<0>(b);
  bool same = true;
  if (run_and_read<1>(b) != ref) {
    std::printf("MISMATCH: %s, kAhead 1 differs from kAhead 0\n", c.name);
    same = false;
  }
  if (run_and_read<2>(b) != ref) {
    std::printf("MISMATCH: %s, kAhead 2 differs from kAhead 0\n", c.name);
    same = false;
  }
  if (run_and_read<3>(b) != ref) {
    std::printf("MISMATCH: %s, kAhead 3 differs from kAhead 0\n", c.name);
    same = false;
  }
  const ActParams p = b.p;
  std::vector<dev::Variant> vs;
  vs.push_back({"copy of the input", [&b] {
                  CK(cudaMemcpyAsync(b.copy_dst, b.h, b.in_bytes, cudaMemcpyDeviceToDevice));
                }});
  vs.push_back({"kAhead 0 (each pass loads, then uses)", [p] { launch_variant<0>(p); }});
  vs.push_back({"kAhead 1 (the tile's passes loaded first)", [p] { launch_variant<1>(p); }});
  vs.push_back({"kAhead 2 (and the next tile's, ahead)", [p] { launch_variant<2>(p); }});
  vs.push_back({"kAhead 3 (next tile by cp.async to smem)", [p] { launch_variant<3>(p); }});
  const std::vector<float> ms = dev::time_variants(vs, nullptr);
  const double copy_bw = 2.0 * b.in_bytes / ms[0] / 1e9;
  std::printf("\n%s: bf16 %lld x %lld, copy %.2f TB/s\n", c.name, (long long)c.rows,
              (long long)c.cols, copy_bw);
  // Bytes each variant must move: the inputs, the FP8 bytes twice (row-major and transposed),
  // dbias.
  const double bytes =
      static_cast<double>(b.in_bytes) + 2.0 * b.out_elems + (b.dbias ? 4.0 * p.out_cols() : 0.0);
  for (size_t i = 1; i < vs.size(); ++i) dev::print_row(vs[i].name, ms[i], bytes, copy_bw, 44);
  release(b);
  return same;
}

}  // namespace
}  // namespace fp8dp::cuda

int main() {
  using fp8dp::Activation;
  using fp8dp::cuda::bench;
  bool ok = true;
  ok &= bench({"GELU forward (E4M3 + transpose)", Activation::kGelu, false, false, 16384, 6144});
  ok &= bench(
      {"GELU backward (E5M2 + transpose + dbias)", Activation::kGelu, true, true, 16384, 6144});
  // The GPT stack's MLP at width 2048 (bench/gpt_block_gpu.py: 4096 tokens, ffn 8192).
  ok &= bench(
      {"GELU forward, 2048 stack (E4M3 + transpose)", Activation::kGelu, false, false, 4096, 8192});
  ok &= bench({"GELU backward, 2048 stack (E5M2 + transpose + dbias)", Activation::kGelu, true,
               true, 4096, 8192});
  ok &=
      bench({"SwiGLU forward (E4M3 + transpose)", Activation::kSwiglu, false, false, 8192, 14336});
  ok &=
      bench({"SwiGLU backward (E5M2 + transpose)", Activation::kSwiglu, true, false, 8192, 14336});
  return ok ? 0 : 1;
}
