// CUDA kernels of the activation + FP8 cast (activation_kernel.h). Same bytes, amax and dbias as
// activation_cpu: the activation is activation_math.h on both devices (IEEE-rounded operations
// only), each result is rounded to the high-precision dtype and widened back (exact) before the
// cast, and the cast is quantize_like_cpu, the conversion the quantize kernels use. dbias sums in
// the CPU's order (64-row chunks in row order, then the chunks in order), so it is bit-identical
// too. The high-precision result is written only when asked for (FP8 off): with FP8 on, nothing of
// size tokens × ffn but the FP8 bytes is written.
//
// Eight neighbouring output elements per thread and step; the transpose is a second pass over the
// FP8 bytes (transpose_bytes_cuda), dbias a column pass that recomputes the activation. A tiled
// transpose fused into the main pass is the tuning left to do.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_scratch.h"
#include "fp8/activation_kernel.h"
#include "fp8/cuda/cast_common.cuh"
#include "fp8/quantize.h"

namespace fp8dp {
namespace cuda {
int sm_count();  // quantize.cu

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkRows = 64;  // the CPU's dbias chunk

struct Args {
  const void* h;
  const void* da;
  int64_t rows, cols, in_cols, out_cols;
};

// Output element (r, oc) of the activation (forward: a [rows, cols]) or of its derivative
// (backward: dh [rows, in_cols]), rounded to T and widened back.
template <typename T, Activation A, bool kBackward>
__device__ __forceinline__ float element(const Args& a, int64_t r, int64_t oc) {
  const T* h = static_cast<const T*>(a.h) + r * a.in_cols;
  float v;
  if constexpr (!kBackward) {
    if constexpr (A == Activation::kGelu) {
      v = act::gelu(to_float(h[oc]));
    } else {
      v = act::swiglu(to_float(h[oc]), to_float(h[a.cols + oc]));
    }
  } else {
    const T* da = static_cast<const T*>(a.da) + r * a.cols;
    if constexpr (A == Activation::kGelu) {
      v = act::mul(to_float(da[oc]), act::dgelu(to_float(h[oc])));
    } else {
      const int64_t c = oc < a.cols ? oc : oc - a.cols;
      float dgate, dup;
      act::dswiglu(to_float(da[c]), to_float(h[c]), to_float(h[a.cols + c]), dgate, dup);
      v = oc < a.cols ? dgate : dup;
    }
  }
  return to_float(from_float<T>(v));
}

// One pass over the output elements: high-precision result, FP8 bytes and amax, each optional.
// Each thread takes kVec neighbouring elements of a row (one index division per group, not per
// element: the 64-bit division cost more than the activation), and with `vec` (out_cols a multiple
// of kVec, out aligned) stores their FP8 bytes as one 8-byte word.
constexpr int kVec = 8;

template <typename T, Activation A, bool kBackward, Format F>
__global__ void __launch_bounds__(kThreads)
    act_kernel(const Args a, T* __restrict__ out_hp, uint8_t* __restrict__ out,
               const float* __restrict__ scale_ptr, unsigned int* __restrict__ amax_bits,
               float* __restrict__ scale_inv, bool vec) {
  const float scale = scale_ptr != nullptr ? *scale_ptr : 1.0f;
  const int64_t per_row = (a.out_cols + kVec - 1) / kVec;
  const int64_t n = a.rows * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  uint32_t am = 0;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < n; g += stride) {
    const int64_t r = g / per_row, oc0 = (g - r * per_row) * kVec;
    const int live = static_cast<int>(a.out_cols - oc0 < kVec ? a.out_cols - oc0 : kVec);
    const int64_t i0 = r * a.out_cols + oc0;
    float v[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      v[j] = j < live ? element<T, A, kBackward>(a, r, oc0 + j) : 0.0f;
      am = max(am, abs_bits(v[j]));
    }
    if (out_hp != nullptr) {
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        if (j < live) out_hp[i0 + j] = from_float<T>(v[j]);
    }
    if (out != nullptr) {
      if (vec) {  // live == kVec
        uint2 w{0u, 0u};
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const uint32_t q = quantize_like_cpu<F>(v[j], scale);
          if (j < 4)
            w.x |= q << (8 * j);
          else
            w.y |= q << (8 * (j - 4));
        }
        *reinterpret_cast<uint2*>(out + i0) = w;
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (j < live) out[i0 + j] = quantize_like_cpu<F>(v[j], scale);
      }
    }
  }
  block_amax_commit<kThreads>(am, amax_bits);
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
}

// Column sums of each 64-row chunk, in row order: partial[chunk, oc].
template <typename T, Activation A, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    chunk_sums_kernel(const Args a, float* __restrict__ partial) {
  const int64_t oc = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (oc >= a.out_cols) return;
  const int64_t r0 = chunk * kChunkRows;
  const int64_t r1 = min(a.rows, r0 + kChunkRows);
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s = __fadd_rn(s, element<T, A, kBackward>(a, r, oc));
  partial[chunk * a.out_cols + oc] = s;
}

// dbias[oc] = the chunks' sums added in chunk order, rounded once to D.
template <typename D>
__global__ void __launch_bounds__(kThreads)
    chunk_total_kernel(const float* __restrict__ partial, int64_t chunks, int64_t cols,
                       D* __restrict__ dbias) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) s = __fadd_rn(s, partial[k * cols + c]);
  dbias[c] = from_float<D>(s);
}

// out [cols, rows] <- in [rows, cols] for the shapes transpose_bytes_cuda does not take.
__global__ void transpose_naive_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out,
                                       int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / cols, c = i - r * cols;
    out[c * rows + r] = in[i];
  }
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * 8;
  return static_cast<int>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

template <typename T, Activation A, bool kBackward>
void launch(const ActParams& p, cudaStream_t st) {
  const Args a{p.input, p.grad, p.rows, p.cols, p.in_cols(), p.out_cols()};
  const int64_t n = p.rows * a.out_cols;
  // The row-major bytes: asked for, or scratch for the transpose.
  uint8_t* out = p.out;
  const bool scratch_out = p.out_t != nullptr && out == nullptr;
  if (scratch_out) out = scratch_alloc<uint8_t>(static_cast<size_t>(n), st);
  if (p.amax != nullptr && !p.amax_accumulate)
    FP8DP_CHECK_CUDA(cudaMemsetAsync(p.amax, 0, sizeof(float), st));
  auto* amax_bits = reinterpret_cast<unsigned int*>(p.amax);
  T* out_hp = static_cast<T*>(p.out_hp);
  const int64_t groups = p.rows * ((a.out_cols + kVec - 1) / kVec);
  const bool vec = a.out_cols % kVec == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  const int act_grid = grid_for(groups);
  if (p.format == Format::kE4M3) {
    act_kernel<T, A, kBackward, Format::kE4M3>
        <<<act_grid, kThreads, 0, st>>>(a, out_hp, out, p.scale, amax_bits, p.scale_inv, vec);
  } else {
    act_kernel<T, A, kBackward, Format::kE5M2>
        <<<act_grid, kThreads, 0, st>>>(a, out_hp, out, p.scale, amax_bits, p.scale_inv, vec);
  }
  const int grid = grid_for(n);
  FP8DP_CHECK_CUDA(cudaGetLastError());
  if (p.out_t != nullptr) {
    if (transpose_bytes_cuda_supported(p.rows, a.out_cols, out, p.out_t)) {
      transpose_bytes_cuda(out, p.out_t, p.rows, a.out_cols, st);
    } else {
      transpose_naive_kernel<<<grid, kThreads, 0, st>>>(out, p.out_t, p.rows, a.out_cols);
      FP8DP_CHECK_CUDA(cudaGetLastError());
    }
  }
  if (scratch_out) scratch_free(out, st);
  if (p.dbias != nullptr) {
    const int64_t chunks = (p.rows + kChunkRows - 1) / kChunkRows;
    FP8DP_CHECK(chunks <= 65535, "activation_cuda: dbias supports up to ", 65535 * kChunkRows,
                " rows, got ", p.rows);
    float* partial = scratch_alloc<float>(static_cast<size_t>(chunks * a.out_cols), st);
    const dim3 g1(static_cast<unsigned>((a.out_cols + kThreads - 1) / kThreads),
                  static_cast<unsigned>(chunks));
    chunk_sums_kernel<T, A, kBackward><<<g1, kThreads, 0, st>>>(a, partial);
    FP8DP_CHECK_CUDA(cudaGetLastError());
    const unsigned g2 = static_cast<unsigned>((a.out_cols + kThreads - 1) / kThreads);
    switch (p.dbias_dtype) {
      case DType::kFloat32:
        chunk_total_kernel<<<g2, kThreads, 0, st>>>(partial, chunks, a.out_cols,
                                                    static_cast<float*>(p.dbias));
        break;
      case DType::kBFloat16:
        chunk_total_kernel<<<g2, kThreads, 0, st>>>(partial, chunks, a.out_cols,
                                                    static_cast<__nv_bfloat16*>(p.dbias));
        break;
      case DType::kFloat16:
        chunk_total_kernel<<<g2, kThreads, 0, st>>>(partial, chunks, a.out_cols,
                                                    static_cast<__half*>(p.dbias));
        break;
      default:
        FP8DP_CHECK(false, "activation_cuda: no dbias output of dtype ", dtype_name(p.dbias_dtype));
    }
    FP8DP_CHECK_CUDA(cudaGetLastError());
    scratch_free(partial, st);
  }
}

template <typename T>
void dispatch_act(const ActParams& p, cudaStream_t st) {
  if (p.act == Activation::kGelu) {
    return p.backward ? launch<T, Activation::kGelu, true>(p, st)
                      : launch<T, Activation::kGelu, false>(p, st);
  }
  return p.backward ? launch<T, Activation::kSwiglu, true>(p, st)
                    : launch<T, Activation::kSwiglu, false>(p, st);
}

}  // namespace
}  // namespace cuda

void activation_cuda(const ActParams& p, void* stream) {
  FP8DP_CHECK(p.scale != nullptr || (p.out == nullptr && p.out_t == nullptr),
              "activation_cuda: an FP8 output needs a scale");
  auto st = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32:
      return cuda::dispatch_act<float>(p, st);
    case DType::kBFloat16:
      return cuda::dispatch_act<__nv_bfloat16>(p, st);
    case DType::kFloat16:
      return cuda::dispatch_act<__half>(p, st);
    default:
      FP8DP_CHECK(false, "activation_cuda: no kernel for input dtype ", dtype_name(p.dtype));
  }
}

}  // namespace fp8dp
