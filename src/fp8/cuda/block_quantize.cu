// CUDA block-scaled FP8 casts (block_quantize.h): the same bytes and scales as block_quantize_cpu.
// Three kernels, one per output layout; each tile's amax is reduced in the block that casts it, and
// its scale comes from the shared block_scale() (host + device), so CPU and GPU agree bit for bit:
//   rows:    one 128-thread block per 1x128 tile of a row (out, scale_inv)
//   columns: one 32 x 8 block per band of 128 rows x 32 columns: each column's 128 values are one
//            tile of the transpose (out_t, scale_inv_t), re-cast from the input
//   blocks:  one 256-thread block per 128x128 block (out and / or out_t share the block's scale)
// Correctness first: the column and block kernels write the transposed bytes one at a time
// (uncoalesced); a shared-memory transpose is the next step once the GPU benchmarks ask for it.
// Torch-free (compiled in CUDA compile-only CI builds too).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "fp8/block_quantize.h"
#include "fp8/cuda/cast_common.cuh"

namespace fp8dp {
namespace cuda {
namespace {

constexpr int kRowThreads = 128;    // one thread per element of a 1x128 tile
constexpr int kBlockThreads = 256;  // 64 elements of a 128x128 block per thread
constexpr int kColTile = 32;        // columns per block of the column kernel
constexpr int kColRows = 8;         // threads along the rows (16 rows each)

// Block-wide max of amax bits, returned to every thread (all threads must call it).
template <int kThreads>
__device__ __forceinline__ uint32_t block_max_all(uint32_t bits) {
  __shared__ uint32_t warp_res[kThreads / kWarp];
  __shared__ uint32_t result;
  bits = warp_max(bits);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) warp_res[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    uint32_t b = lane < kThreads / kWarp ? warp_res[lane] : 0u;
    b = warp_max(b);
    if (lane == 0) result = b;
  }
  __syncthreads();
  return result;
}

__device__ __forceinline__ float amax_from_bits(uint32_t b) {
  return b > 0x7F800000u ? __uint_as_float(kQuietNaNBits) : __uint_as_float(b);
}

template <Format F, typename T>
__global__ void __launch_bounds__(kRowThreads)
    rows_kernel(const T* __restrict__ in, uint8_t* __restrict__ out, float* __restrict__ scale_inv,
                int64_t rows, int64_t cols, bool p2, float eps) {
  const int64_t kb = ceil_blocks(cols);
  const int64_t r = blockIdx.x / kb, t = blockIdx.x % kb;
  const int64_t c = t * kBlockLen + threadIdx.x;
  const bool live = c < cols;
  const float v = live ? to_float(in[r * cols + c]) : 0.0f;
  const uint32_t m = block_max_all<kRowThreads>(live ? abs_bits(v) : 0u);
  const float s = block_scale(amax_from_bits(m), fp8_max(F), p2, eps);
  if (live) out[r * cols + c] = quantize_like_cpu<F>(v, s);
  if (threadIdx.x == 0) scale_inv[r * kb + t] = 1.0f / s;
}

template <Format F, typename T>
__global__ void __launch_bounds__(kColTile* kColRows)
    cols_kernel(const T* __restrict__ in, uint8_t* __restrict__ out_t,
                float* __restrict__ scale_inv_t, int64_t rows, int64_t cols, bool p2, float eps) {
  __shared__ uint32_t part[kColRows][kColTile];
  const int64_t col_tiles = (cols + kColTile - 1) / kColTile;
  const int64_t rb = blockIdx.x / col_tiles;
  const int64_t c = (blockIdx.x % col_tiles) * kColTile + threadIdx.x;
  const int64_t r0 = rb * kBlockLen, nr = rows - r0 < kBlockLen ? rows - r0 : kBlockLen;
  const bool live_c = c < cols;
  constexpr int kPer = kBlockLen / kColRows;
  float v[kPer];
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t r = threadIdx.y + i * kColRows;
    v[i] = live_c && r < nr ? to_float(in[(r0 + r) * cols + c]) : 0.0f;
    m = max(m, abs_bits(v[i]));
  }
  part[threadIdx.y][threadIdx.x] = m;
  __syncthreads();
  uint32_t all = 0;
#pragma unroll
  for (int y = 0; y < kColRows; ++y) all = max(all, part[y][threadIdx.x]);
  if (!live_c) return;
  const float s = block_scale(amax_from_bits(all), fp8_max(F), p2, eps);
  const int64_t kbt = ceil_blocks(rows);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t r = threadIdx.y + i * kColRows;
    if (r < nr) out_t[c * rows + r0 + r] = quantize_like_cpu<F>(v[i], s);
  }
  if (threadIdx.y == 0) scale_inv_t[c * kbt + rb] = 1.0f / s;
}

template <Format F, typename T>
__global__ void __launch_bounds__(kBlockThreads)
    blocks_kernel(const T* __restrict__ in, uint8_t* __restrict__ out,
                  float* __restrict__ scale_inv, uint8_t* __restrict__ out_t,
                  float* __restrict__ scale_inv_t, int64_t rows, int64_t cols, bool p2, float eps) {
  const int64_t kb = ceil_blocks(cols), kbt = ceil_blocks(rows);
  const int64_t rb = blockIdx.x / kb, t = blockIdx.x % kb;
  const int64_t r0 = rb * kBlockLen, c0 = t * kBlockLen;
  const int64_t nr = rows - r0 < kBlockLen ? rows - r0 : kBlockLen;
  const int64_t nc = cols - c0 < kBlockLen ? cols - c0 : kBlockLen;
  // thread: column c0 + (threadIdx.x % 128), rows (threadIdx.x / 128) + 2 i
  constexpr int kPer = kBlockLen * kBlockLen / kBlockThreads;
  const int64_t cc = threadIdx.x % kBlockLen;
  const int64_t ry = threadIdx.x / kBlockLen;
  float v[kPer];
  uint32_t m = 0;
#pragma unroll 8
  for (int i = 0; i < kPer; ++i) {
    const int64_t r = ry + 2 * i;
    v[i] = cc < nc && r < nr ? to_float(in[(r0 + r) * cols + c0 + cc]) : 0.0f;
    m = max(m, abs_bits(v[i]));
  }
  const uint32_t all = block_max_all<kBlockThreads>(m);
  const float s = block_scale(amax_from_bits(all), fp8_max(F), p2, eps);
  if (cc < nc) {
#pragma unroll 8
    for (int i = 0; i < kPer; ++i) {
      const int64_t r = ry + 2 * i;
      if (r >= nr) continue;
      const uint8_t q = quantize_like_cpu<F>(v[i], s);
      if (out != nullptr) out[(r0 + r) * cols + c0 + cc] = q;
      if (out_t != nullptr) out_t[(c0 + cc) * rows + r0 + r] = q;
    }
  }
  if (threadIdx.x == 0) {
    if (scale_inv != nullptr) scale_inv[rb * kb + t] = 1.0f / s;
    if (scale_inv_t != nullptr) scale_inv_t[t * kbt + rb] = 1.0f / s;
  }
}

template <Format F, typename T>
void launch(const BlockQuantizeParams& p, cudaStream_t st) {
  const T* in = static_cast<const T*>(p.input);
  const int64_t kb = ceil_blocks(p.cols), kbt = ceil_blocks(p.rows);
  if (p.shape == BlockShape::k1x128) {
    if (p.out != nullptr) {
      const int64_t grid = p.rows * kb;
      FP8DP_CHECK(grid < (int64_t{1} << 31), "block_quantize_cuda: too many tiles: ", grid);
      rows_kernel<F, T><<<static_cast<unsigned>(grid), kRowThreads, 0, st>>>(
          in, p.out, p.scale_inv, p.rows, p.cols, p.power_2_scale, p.amax_epsilon);
      FP8DP_CHECK_CUDA(cudaGetLastError());
    }
    if (p.out_t != nullptr) {
      const int64_t grid = kbt * ((p.cols + kColTile - 1) / kColTile);
      FP8DP_CHECK(grid < (int64_t{1} << 31), "block_quantize_cuda: too many tiles: ", grid);
      cols_kernel<F, T><<<static_cast<unsigned>(grid), dim3(kColTile, kColRows), 0, st>>>(
          in, p.out_t, p.scale_inv_t, p.rows, p.cols, p.power_2_scale, p.amax_epsilon);
      FP8DP_CHECK_CUDA(cudaGetLastError());
    }
    return;
  }
  const int64_t grid = kbt * kb;
  blocks_kernel<F, T><<<static_cast<unsigned>(grid), kBlockThreads, 0, st>>>(
      in, p.out, p.scale_inv, p.out_t, p.scale_inv_t, p.rows, p.cols, p.power_2_scale,
      p.amax_epsilon);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

template <Format F>
void dispatch_input(const BlockQuantizeParams& p, cudaStream_t st) {
  switch (p.input_dtype) {
    case DType::kFloat32:
      return launch<F, float>(p, st);
    case DType::kBFloat16:
      return launch<F, __nv_bfloat16>(p, st);
    case DType::kFloat16:
      return launch<F, __half>(p, st);
    default:
      break;
  }
  FP8DP_CHECK(false, "block_quantize_cuda: no kernel for input dtype ", dtype_name(p.input_dtype));
}

template <Format F, typename T>
__global__ void block_dequantize_kernel(const uint8_t* __restrict__ in, T* __restrict__ out,
                                        const float* __restrict__ scale_inv, int64_t rows,
                                        int64_t cols, bool tile) {
  const int64_t n = rows * cols, kb = ceil_blocks(cols);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / cols, c = i % cols;
    const int64_t si = tile ? r * kb + c / kBlockLen : (r / kBlockLen) * kb + c / kBlockLen;
    out[i] = from_float<T>(__fmul_rn(fp8_decode(in[i], F), scale_inv[si]));
  }
}

template <Format F, typename T>
void launch_dequantize(const BlockDequantizeParams& p, cudaStream_t st) {
  const int64_t n = p.rows * p.cols;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, sm_count() * 8));
  block_dequantize_kernel<F, T><<<static_cast<unsigned>(blocks), 256, 0, st>>>(
      p.input, static_cast<T*>(p.out), p.scale_inv, p.rows, p.cols, p.shape == BlockShape::k1x128);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

template <Format F>
void dispatch_output(const BlockDequantizeParams& p, cudaStream_t st) {
  switch (p.out_dtype) {
    case DType::kFloat32:
      return launch_dequantize<F, float>(p, st);
    case DType::kBFloat16:
      return launch_dequantize<F, __nv_bfloat16>(p, st);
    case DType::kFloat16:
      return launch_dequantize<F, __half>(p, st);
    default:
      break;
  }
  FP8DP_CHECK(false, "block_dequantize_cuda: no kernel for output dtype ", dtype_name(p.out_dtype));
}

}  // namespace
}  // namespace cuda

void block_quantize_cuda(const BlockQuantizeParams& p, void* stream) {
  FP8DP_CHECK(p.rows >= 0 && p.cols >= 0, "block_quantize_cuda: bad shape");
  FP8DP_CHECK((p.out == nullptr) == (p.scale_inv == nullptr) &&
                  (p.out_t == nullptr) == (p.scale_inv_t == nullptr),
              "block_quantize_cuda: every FP8 output needs its scale_inv and vice versa");
  if (p.rows == 0 || p.cols == 0 || (p.out == nullptr && p.out_t == nullptr)) return;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.format == Format::kE4M3) {
    cuda::dispatch_input<Format::kE4M3>(p, st);
  } else {
    cuda::dispatch_input<Format::kE5M2>(p, st);
  }
}

void block_dequantize_cuda(const BlockDequantizeParams& p, void* stream) {
  FP8DP_CHECK(p.scale_inv != nullptr, "block_dequantize_cuda: scale_inv pointer is null");
  if (p.rows == 0 || p.cols == 0) return;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.format == Format::kE4M3) {
    cuda::dispatch_output<Format::kE4M3>(p, st);
  } else {
    cuda::dispatch_output<Format::kE5M2>(p, st);
  }
}

}  // namespace fp8dp
