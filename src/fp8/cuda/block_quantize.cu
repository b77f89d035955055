// CUDA block-scaled FP8 casts (block_quantize.h): the same bytes and scales as block_quantize_cpu.
// Three kernels, one per output layout; each tile's amax is reduced in the block that casts it, and
// its scale comes from the shared block_scale() (host + device), so CPU and GPU agree bit for bit:
//   rows:    one warp per 1x128 tile of a row (out, scale_inv): 4 neighbouring elements per lane,
//            read and written as one vector where the row allows it
//   columns: one 256-thread block per band of 128 rows x 64 columns, staged in shared memory;
//            each column's 128 values are one tile of the transpose (out_t, scale_inv_t), re-cast
//            from the input; one warp per column writes the tile's 128 bytes contiguously
//   blocks:  one 256-thread block per 128x128 block: the block's amax first, then out row by row
//            and out_t through the same shared-memory transpose, both with the block's one scale
// Every global read and write is coalesced. (The first versions wrote the transposes one byte per
// column: at 8192^3 the three casts of a Linear step took 4.0 ms of kernel time, now 0.95 ms;
// dev/profile_modules.py on the H200, 2026-12-03.)
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

constexpr int kThreads = 256;  // every kernel: 8 warps
constexpr int kWarps = kThreads / kWarp;
constexpr int kPerLane = kBlockLen / kWarp;  // 4 elements of a 128-long tile per lane
constexpr int kBandCols = 64;                // columns of a band staged in shared memory

// Block-wide max of amax bits, returned to every thread (all threads must call it).
__device__ __forceinline__ uint32_t block_max_all(uint32_t bits) {
  __shared__ uint32_t warp_res[kWarps];
  __shared__ uint32_t result;
  bits = warp_max(bits);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) warp_res[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    uint32_t b = lane < kWarps ? warp_res[lane] : 0u;
    b = warp_max(b);
    if (lane == 0) result = b;
  }
  __syncthreads();
  return result;
}

// (by value: std::min takes references, which device code cannot bind to these constants)
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float amax_from_bits(uint32_t b) {
  return b > 0x7F800000u ? __uint_as_float(kQuietNaNBits) : __uint_as_float(b);
}

// Four neighbouring elements, loaded as one vector.
template <typename T>
struct alignas(4 * sizeof(T)) Four {
  T v[4];
};

// One warp per 1x128 tile. vec: cols % 4 == 0 and both pointers aligned for 4-element vectors.
template <Format F, typename T>
__global__ void __launch_bounds__(kThreads)
    rows_kernel(const T* __restrict__ in, uint8_t* __restrict__ out, float* __restrict__ scale_inv,
                int64_t rows, int64_t cols, bool vec, bool p2, float eps) {
  const int64_t kb = ceil_blocks(cols);
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  if (tile >= rows * kb) return;  // the whole warp: no block-wide synchronisation below
  const int lane = threadIdx.x % kWarp;
  const int64_t r = tile / kb, t = tile % kb;
  const int64_t c0 = t * kBlockLen + lane * kPerLane;
  const T* src = in + r * cols + c0;
  float v[kPerLane];
  const bool full = c0 + kPerLane <= cols;
  if (vec && full) {
    const Four<T> f = *reinterpret_cast<const Four<T>*>(src);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = to_float(f.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = c0 + j < cols ? to_float(src[j]) : 0.0f;
  }
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) m = max(m, abs_bits(v[j]));
  const float s = block_scale(amax_from_bits(warp_max(m)), fp8_max(F), p2, eps);
  uint8_t* dst = out + r * cols + c0;
  if (vec && full) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      word |= static_cast<uint32_t>(quantize_like_cpu<F>(v[j], s)) << (8 * j);
    *reinterpret_cast<uint32_t*>(dst) = word;
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (c0 + j < cols) dst[j] = quantize_like_cpu<F>(v[j], s);
  }
  if (lane == 0) scale_inv[r * kb + t] = 1.0f / s;
}

// Rows [r0, r0 + nr) x columns [c0, c0 + nc) of `in` into tile (zeros outside): threads along the
// columns, so that each warp reads a row segment.
template <typename T>
__device__ __forceinline__ void stage_band(const T* __restrict__ in, int64_t cols, int64_t r0,
                                           int nr, int64_t c0, int nc,
                                           float (&tile)[kBlockLen][kBandCols + 1]) {
  const int tc = threadIdx.x % kBandCols, tr = threadIdx.x / kBandCols;
#pragma unroll 8
  for (int r = tr; r < kBlockLen; r += kThreads / kBandCols)
    tile[r][tc] = r < nr && tc < nc ? to_float(in[(r0 + r) * cols + c0 + tc]) : 0.0f;
}

// Column cc of the staged band, cast with scale s into out_t's row (c0 + cc), rows r0 .. r0 + nr:
// one warp, lane l writes rows l, l + 32, l + 64, l + 96 (each store 32 contiguous bytes).
template <Format F>
__device__ __forceinline__ void write_column(const float (&tile)[kBlockLen][kBandCols + 1], int cc,
                                             float s, uint8_t* __restrict__ dst, int nr) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int r = lane + j * kWarp;
    if (r < nr) dst[r] = quantize_like_cpu<F>(tile[r][cc], s);
  }
}

template <Format F, typename T>
__global__ void __launch_bounds__(kThreads)
    cols_kernel(const T* __restrict__ in, uint8_t* __restrict__ out_t,
                float* __restrict__ scale_inv_t, int64_t rows, int64_t cols, bool p2, float eps) {
  __shared__ float tile[kBlockLen][kBandCols + 1];  // +1: the column reads hit 32 banks
  const int64_t bands = (cols + kBandCols - 1) / kBandCols;
  const int64_t rb = blockIdx.x / bands;
  const int64_t r0 = rb * kBlockLen, c0 = (blockIdx.x % bands) * kBandCols;
  const int nr = static_cast<int>(min64(kBlockLen, rows - r0));
  const int nc = static_cast<int>(min64(kBandCols, cols - c0));
  stage_band(in, cols, r0, nr, c0, nc, tile);
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  const int64_t kbt = ceil_blocks(rows);
  for (int cc = threadIdx.x / kWarp; cc < nc; cc += kWarps) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) m = max(m, abs_bits(tile[lane + j * kWarp][cc]));
    const float s = block_scale(amax_from_bits(warp_max(m)), fp8_max(F), p2, eps);
    write_column<F>(tile, cc, s, out_t + (c0 + cc) * rows + r0, nr);
    if (lane == 0) scale_inv_t[(c0 + cc) * kbt + rb] = 1.0f / s;
  }
}

template <Format F, typename T>
__global__ void __launch_bounds__(kThreads)
    blocks_kernel(const T* __restrict__ in, uint8_t* __restrict__ out,
                  float* __restrict__ scale_inv, uint8_t* __restrict__ out_t,
                  float* __restrict__ scale_inv_t, int64_t rows, int64_t cols, bool p2, float eps) {
  __shared__ float tile[kBlockLen][kBandCols + 1];
  const int64_t kb = ceil_blocks(cols), kbt = ceil_blocks(rows);
  const int64_t rb = blockIdx.x / kb, t = blockIdx.x % kb;
  const int64_t r0 = rb * kBlockLen, c0 = t * kBlockLen;
  const int nr = static_cast<int>(min64(kBlockLen, rows - r0));
  const int nc = static_cast<int>(min64(kBlockLen, cols - c0));
  // thread: column c0 + cc, rows ry, ry + 2, ...: each warp reads 32 neighbours of a row
  const int cc = threadIdx.x % kBlockLen, ry = threadIdx.x / kBlockLen;
  uint32_t m = 0;
  if (cc < nc) {
#pragma unroll 8
    for (int r = ry; r < nr; r += kThreads / kBlockLen)
      m = max(m, abs_bits(to_float(in[(r0 + r) * cols + c0 + cc])));
  }
  const float s = block_scale(amax_from_bits(block_max_all(m)), fp8_max(F), p2, eps);
  if (out != nullptr && cc < nc) {  // the second read of the block comes from the cache
#pragma unroll 8
    for (int r = ry; r < nr; r += kThreads / kBlockLen)
      out[(r0 + r) * cols + c0 + cc] =
          quantize_like_cpu<F>(to_float(in[(r0 + r) * cols + c0 + cc]), s);
  }
  if (out_t != nullptr) {
    for (int half = 0; half * kBandCols < nc; ++half) {
      const int64_t hc = c0 + half * kBandCols;
      const int hn = static_cast<int>(min64(kBandCols, nc - half * kBandCols));
      __syncthreads();  // the previous half's reads of tile are done
      stage_band(in, cols, r0, nr, hc, hn, tile);
      __syncthreads();
      for (int c = threadIdx.x / kWarp; c < hn; c += kWarps)
        write_column<F>(tile, c, s, out_t + (hc + c) * rows + r0, nr);
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
  const auto check_grid = [](int64_t grid) {
    FP8DP_CHECK(grid < (int64_t{1} << 31), "block_quantize_cuda: too many tiles: ", grid);
    return static_cast<unsigned>(grid);
  };
  if (p.shape == BlockShape::k1x128) {
    if (p.out != nullptr) {
      const uintptr_t a = reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(p.out);
      const bool vec = p.cols % 4 == 0 && a % (4 * sizeof(T)) == 0;
      rows_kernel<F, T><<<check_grid((p.rows * kb + kWarps - 1) / kWarps), kThreads, 0, st>>>(
          in, p.out, p.scale_inv, p.rows, p.cols, vec, p.power_2_scale, p.amax_epsilon);
      FP8DP_CHECK_CUDA(cudaGetLastError());
    }
    if (p.out_t != nullptr) {
      const int64_t bands = (p.cols + kBandCols - 1) / kBandCols;
      cols_kernel<F, T><<<check_grid(kbt * bands), kThreads, 0, st>>>(
          in, p.out_t, p.scale_inv_t, p.rows, p.cols, p.power_2_scale, p.amax_epsilon);
      FP8DP_CHECK_CUDA(cudaGetLastError());
    }
    return;
  }
  blocks_kernel<F, T><<<check_grid(kbt * kb), kThreads, 0, st>>>(in, p.out, p.scale_inv, p.out_t,
                                                                 p.scale_inv_t, p.rows, p.cols,
                                                                 p.power_2_scale, p.amax_epsilon);
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
