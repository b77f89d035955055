// CUDA FP8 cast entry point and the flat kernel: quantize (+ amax) in one pass over the flat
// tensor; with a transposed output or dbias the tiled kernel of cast_transpose.cu runs instead.
// Same bytes and amax as quantize_cpu (C7): the scale is applied with an unfused multiply, the
// bf16/fp16 -> float widening is exact, and the conversion is either the hardware's saturating RNE
// or, around NaNs, quantize_one itself (quantize_scaled).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "fp8/cuda/cast_common.cuh"
#include "fp8/cuda/cast_transpose.h"
#include "fp8/quantize.h"

namespace fp8dp {
namespace cuda {

int sm_count() {
  // Cached per device: cudaDeviceGetAttribute is cheap but not free on every cast.
  static int cached[64] = {0};
  int dev = 0;
  FP8DP_CHECK_CUDA(cudaGetDevice(&dev));
  if (dev < 64 && cached[dev] > 0) return cached[dev];
  int n = 0;
  FP8DP_CHECK_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (dev < 64) cached[dev] = n;
  return n;
}

namespace {

constexpr int kThreads = 256;
// Flat path: 16 elements per thread and step, so every thread stores one 16-byte FP8 vector.
constexpr int kChunk = 16;

__global__ void write_scale_inv_kernel(const float* scale, float* scale_inv) {
  *scale_inv = 1.0f / *scale;
}

// ---------------------------------------------------------------- flat: quantize + amax
// kWrite = false is the amax-only pass: no conversion work at all.
template <Format F, typename T, bool kWrite>
__global__ void __launch_bounds__(kThreads)
    quantize_flat_kernel(const T* __restrict__ in, uint8_t* __restrict__ out, int64_t n,
                         bool vec, const float* __restrict__ scale_ptr,
                         unsigned int* __restrict__ amax_bits, float* __restrict__ scale_inv) {
  const float scale = *scale_ptr;
  uint32_t am = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    // 16-byte loads (4 fp32 or 8 bf16/fp16), all issued before the first use.
    constexpr int kPerLoad = 16 / sizeof(T);
    constexpr int kLoads = kChunk / kPerLoad;
    const int64_t chunks = n / kChunk;
    for (int64_t c = tid; c < chunks; c += stride) {
      union {
        uint4 u[kLoads];
        T t[kChunk];
      } x;
      const uint4* src = reinterpret_cast<const uint4*>(in + c * kChunk);
#pragma unroll
      for (int j = 0; j < kLoads; ++j) x.u[j] = __ldcs(src + j);
      float v[kChunk];
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        v[j] = to_float(x.t[j]);
        am = max(am, abs_bits(v[j]));
      }
      if constexpr (kWrite) {
        union {
          uint4 u;
          uint8_t b[kChunk];
        } q;
        quantize_scaled<F, kChunk>(v, scale, am == kQuietNaNBits, q.b);
        __stcs(reinterpret_cast<uint4*>(out + c * kChunk), q.u);
      }
    }
    done = chunks * kChunk;
  }
  for (int64_t i = done + tid; i < n; i += stride) {  // tail, or everything when unaligned
    const float v = to_float(in[i]);
    am = max(am, abs_bits(v));
    if constexpr (kWrite) out[i] = quantize_like_cpu<F>(v, scale);
  }
  block_amax_commit<kThreads>(am, amax_bits);
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <Format F, typename T>
void launch_flat(const QuantizeParams& p, cudaStream_t st) {
  const int64_t n = p.rows * p.cols;
  const bool vec = aligned16(p.input) && (p.out == nullptr || aligned16(p.out));
  const int64_t work = vec ? ceil_div(n, kChunk) : n;
  // Enough blocks to fill every multiprocessor several times; the grid-stride loop does the rest.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, kThreads),
                                                                 int64_t{sm_count()} * 8));
  auto kernel = p.out != nullptr ? quantize_flat_kernel<F, T, true> : quantize_flat_kernel<F, T, false>;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(
      static_cast<const T*>(p.input), p.out, n, vec, p.scale,
      reinterpret_cast<unsigned int*>(p.amax), p.scale_inv);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

template <Format F>
void dispatch_dtype(const QuantizeParams& p, cudaStream_t st) {
  switch (p.input_dtype) {
    case DType::kFloat32: return launch_flat<F, float>(p, st);
    case DType::kBFloat16: return launch_flat<F, __nv_bfloat16>(p, st);
    case DType::kFloat16: return launch_flat<F, __half>(p, st);
  }
  FP8DP_CHECK(false, "quantize_cuda: unknown input dtype ", static_cast<int>(p.input_dtype));
}

}  // namespace
}  // namespace cuda

void quantize_cuda(const QuantizeParams& p, void* stream) {
  quantize_cuda_with(p, stream, CastTransposeConfig{});
}

void quantize_cuda_with(const QuantizeParams& p, void* stream, const CastTransposeConfig& cfg) {
  FP8DP_CHECK_ARG(cfg.strip_tiles >= 0, "quantize_cuda: strip_tiles must be >= 0 (0 = auto), got ",
                  cfg.strip_tiles);
  FP8DP_CHECK_ARG(cfg.dbias_reduce == DbiasReduce::kLastBlock ||
                      cfg.dbias_reduce == DbiasReduce::kTwoPass ||
                      cfg.dbias_reduce == DbiasReduce::kTwoPassAlloc,
                  "quantize_cuda: unknown dbias_reduce ", static_cast<int>(cfg.dbias_reduce));
  FP8DP_CHECK(p.rows >= 0 && p.cols >= 0, "quantize_cuda: bad shape [", p.rows, ", ", p.cols, "]");
  FP8DP_CHECK(p.scale != nullptr, "quantize_cuda: scale pointer is null");
  FP8DP_CHECK(p.rows * p.cols == 0 || p.input != nullptr, "quantize_cuda: input pointer is null");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.rows * p.cols != 0 && (p.out_t != nullptr || p.dbias != nullptr)) {
    cuda::cast_transpose(p, stream, cfg);  // starts amax from zero itself
    return;
  }
  // The kernels merge block results with atomicMax, so amax starts at 0 (= amax of an empty input):
  // the result is written, never max-accumulated with what was there.
  if (p.amax != nullptr) FP8DP_CHECK_CUDA(cudaMemsetAsync(p.amax, 0, sizeof(float), st));
  if (p.rows * p.cols == 0) {
    if (p.scale_inv != nullptr) {
      cuda::write_scale_inv_kernel<<<1, 1, 0, st>>>(p.scale, p.scale_inv);
      FP8DP_CHECK_CUDA(cudaGetLastError());
    }
    if (p.dbias != nullptr && p.cols > 0) {
      FP8DP_CHECK_CUDA(cudaMemsetAsync(p.dbias, 0, static_cast<size_t>(p.cols) * 4, st));
    }
    return;
  }
  if (p.format == Format::kE4M3) {
    cuda::dispatch_dtype<Format::kE4M3>(p, st);
  } else {
    cuda::dispatch_dtype<Format::kE5M2>(p, st);
  }
}

}  // namespace fp8dp
