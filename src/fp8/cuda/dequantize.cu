// CUDA FP8 dequantize: out = decode(byte) * scale_inv, written as fp32 / bf16 / fp16 with
// round-to-nearest-even, the same arithmetic as dequantize_cpu (float product, then one rounding).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "fp8/cuda/cast_common.cuh"
#include "fp8/quantize.h"

namespace fp8dp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 16;  // one 16-byte FP8 load per thread and step

__device__ __forceinline__ void from_float(float v, float* o) { *o = v; }
__device__ __forceinline__ void from_float(float v, __nv_bfloat16* o) {
  *o = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void from_float(float v, __half* o) { *o = __float2half_rn(v); }

template <Format F, typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ in, T* __restrict__ out, int64_t n, bool vec,
                      const float* __restrict__ scale_inv_ptr) {
  const float s = *scale_inv_ptr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    constexpr int kStores = kChunk * sizeof(T) / 16;
    const int64_t chunks = n / kChunk;
    for (int64_t c = tid; c < chunks; c += stride) {
      union {
        uint4 u;
        uint8_t b[kChunk];
      } x;
      x.u = __ldcs(reinterpret_cast<const uint4*>(in + c * kChunk));
      union {
        uint4 u[kStores];
        T t[kChunk];
      } y;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) from_float(__fmul_rn(fp8_decode(x.b[j], F), s), &y.t[j]);
      uint4* dst = reinterpret_cast<uint4*>(out + c * kChunk);
#pragma unroll
      for (int j = 0; j < kStores; ++j) __stcs(dst + j, y.u[j]);
    }
    done = chunks * kChunk;
  }
  for (int64_t i = done + tid; i < n; i += stride)
    from_float(__fmul_rn(fp8_decode(in[i], F), s), &out[i]);
}

template <Format F, typename T>
void launch(const DequantizeParams& p, cudaStream_t st) {
  const bool vec = aligned16(p.input) && aligned16(p.out);
  const int64_t work = vec ? (p.numel + kChunk - 1) / kChunk : p.numel;
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>((work + kThreads - 1) / kThreads, int64_t{sm_count()} * 8));
  dequantize_kernel<F, T><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(
      p.input, static_cast<T*>(p.out), p.numel, vec, p.scale_inv);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

template <Format F>
void dispatch(const DequantizeParams& p, cudaStream_t st) {
  switch (p.out_dtype) {
    case DType::kFloat32:
      return launch<F, float>(p, st);
    case DType::kBFloat16:
      return launch<F, __nv_bfloat16>(p, st);
    case DType::kFloat16:
      return launch<F, __half>(p, st);
    default:
      break;
  }
  FP8DP_CHECK(false, "dequantize_cuda: no kernel for output dtype ", dtype_name(p.out_dtype));
}

}  // namespace
}  // namespace cuda

void dequantize_cuda(const DequantizeParams& p, void* stream) {
  FP8DP_CHECK(p.scale_inv != nullptr, "dequantize_cuda: scale_inv pointer is null");
  FP8DP_CHECK(p.numel >= 0, "dequantize_cuda: numel must be >= 0, got ", p.numel);
  if (p.numel == 0) return;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.format == Format::kE4M3) {
    cuda::dispatch<Format::kE4M3>(p, st);
  } else {
    cuda::dispatch<Format::kE5M2>(p, st);
  }
}

}  // namespace fp8dp
