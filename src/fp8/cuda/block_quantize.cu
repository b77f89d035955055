// CUDA block-scaled FP8 casts (block_quantize.h): the same bytes and scales as block_quantize_cpu.
// One kernel for every layout: a 256-thread block takes a 128 x 128 region of the input, reads it
// once with 16-byte loads (8 elements per thread, 16 threads per row), and
//   1x128 tiles, row-major (out, scale_inv): each row's tile amax is reduced across its 16 threads
//            while the values are still in registers, and its 128 bytes are stored at once;
//   1x128 tiles of the transpose (out_t, scale_inv_t): the region is staged in shared memory in
//            the input's dtype; one warp per column reduces the column's 128 values (a tile of
//            the transpose) and writes its bytes into a second, transposed byte tile, which all
//            threads then store as 16-byte rows of out_t;
//   128x128 blocks: the region's amax (block-wide), then both layouts from the staged values with
//            the block's one scale;
//   dbias (with out_t): the warp that casts a column of the region also sums it, so the bias
//            gradient needs no second read of the input (it was an ATen column sum, one more pass
//            over dy per layer); the regions' sums are added in order by column_sum.cuh.
// Max is order-free and each byte comes from the shared block_scale() and quantize_scaled (the
// hardware's saturating conversion, which is quantize_one's clamp-then-round, or quantize_one
// itself where the tile or block holds a NaN), so CPU and GPU agree bit for bit. (Separate row /
// column kernels with scalar loads were slower: docs/changelog.md, 2026-12-03 and 2026-12-04.)
// Torch-free (compiled in CUDA compile-only CI builds too).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_scratch.h"
#include "fp8/block_quantize.h"
#include "fp8/cuda/cast_common.cuh"
#include "fp8/cuda/column_sum.cuh"

namespace fp8dp {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / kWarp;
constexpr int kDim = static_cast<int>(kBlockLen);        // 128: the region is kDim x kDim
constexpr int kVec = 8;                                  // elements per thread and load
constexpr int kThreadsPerRow = kDim / kVec;              // 16: one row's tile is half a warp
constexpr int kRowsPerPass = kThreads / kThreadsPerRow;  // 16
constexpr int kPasses = kDim / kRowsPerPass;             // 8
constexpr int kQtStride = kDim + 16;  // bytes per row of the transposed byte tile (16-aligned)
constexpr int kSegs = kDim / 16;      // 16-byte segments per transposed row

// Elements per staged row: the padding makes the column reads (lane l: rows l, l + 32, l + 64,
// l + 96) fall into 32 different banks: 129 words per row for FP32, 65 for 16-bit dtypes.
template <typename T>
constexpr int staged_row() {
  return kDim + (sizeof(T) == 4 ? 1 : 2);
}

template <typename T>
constexpr size_t smem_bytes() {
  return size_t{kDim} * staged_row<T>() * sizeof(T) + size_t{kDim} * kQtStride;
}

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

// Eight neighbouring elements as 16-byte loads (one for 16-bit dtypes, two for FP32).
template <typename T>
union Eight {
  uint4 u[kVec * sizeof(T) / 16];
  T t[kVec];
};

struct CastArgs {
  int64_t rows, cols;
  uint8_t* out;        // row-major bytes or null
  float* scale_inv;    // their scales
  uint8_t* out_t;      // transposed bytes or null
  float* scale_inv_t;  // their scales
  bool vec_in;         // cols % 8 == 0 and the input 16-byte aligned: 16-byte loads
  bool vec_out;        // cols % 8 == 0 and out 8-byte aligned: 8-byte stores
  bool vec_t;          // rows % 16 == 0 and out_t 16-byte aligned: 16-byte transposed stores
  bool p2;
  float eps;
  float* dbias_partial;  // [ceil(rows/128), cols] column sums of each region, or null
};

// kBlocks: one scale per 128x128 block (weights); else 1x128 tiles in each direction.
// kBatch: how many of the region's 8 row passes each thread loads before it uses any of them;
// a batch's loads are in flight at once. One pass at a time left each thread one 16-byte load per
// memory round trip. Measured (dev/block_cast_variants.cu, one H100, 2026-12-06, bf16 8192 x
// 8192): 4 takes the 1x128 cast with its transpose from 172 to 155 us and the 128x128 blocks from
// 124 to 110 us; 8 gains less (164, 115 us: 60 registers, fewer resident warps). The arithmetic
// and its order do not change with kBatch.
template <Format F, typename T, bool kBlocks, int kBatch = 4>
__global__ void __launch_bounds__(kThreads)
    block_cast_kernel(const T* __restrict__ in, const CastArgs a) {
  static_assert(kPasses % kBatch == 0, "kBatch must divide the region's passes");
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int S = staged_row<T>();
  T* tile = reinterpret_cast<T*>(smem);
  uint8_t* qt = smem + size_t{kDim} * S * sizeof(T);
  const int64_t kb = ceil_blocks(a.cols), kbt = ceil_blocks(a.rows);
  const int64_t rb = blockIdx.x / kb, t = blockIdx.x % kb;
  const int64_t r0 = rb * kDim, c0 = t * kDim;
  const int nr = static_cast<int>(min64(kDim, a.rows - r0));
  const int nc = static_cast<int>(min64(kDim, a.cols - c0));
  const int tc = threadIdx.x % kThreadsPerRow, tr = threadIdx.x / kThreadsPerRow;
  const int cb = tc * kVec;  // this thread's first column in the region
  const int live = nc - cb >= kVec ? kVec : (nc > cb ? nc - cb : 0);
  const bool stage = kBlocks || a.out_t != nullptr;
  // A whole region on the vector path (uniform across the block): its loads need no guards, so
  // the compiler can issue a batch's loads back to back.
  const bool whole = a.vec_in && nr == kDim && nc == kDim;
  uint32_t block_m = 0;
  for (int p0 = 0; p0 < kPasses; p0 += kBatch) {
    Eight<T> x[kBatch];
    if (whole) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const T* src = in + (r0 + tr + (p0 + i) * kRowsPerPass) * a.cols + c0 + cb;
#pragma unroll
        for (int k = 0; k < static_cast<int>(kVec * sizeof(T) / 16); ++k)
          x[i].u[k] = __ldcs(reinterpret_cast<const uint4*>(src) + k);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int lr = tr + (p0 + i) * kRowsPerPass;
        const bool row_in = lr < nr;
        const T* src = in + (r0 + lr) * a.cols + c0 + cb;
        if (row_in && a.vec_in && live == kVec) {
#pragma unroll
          for (int k = 0; k < static_cast<int>(kVec * sizeof(T) / 16); ++k)
            x[i].u[k] = __ldcs(reinterpret_cast<const uint4*>(src) + k);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) x[i].t[j] = row_in && j < live ? src[j] : T(0.0f);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int lr = tr + (p0 + i) * kRowsPerPass;
      const bool row_in = lr < nr;
      uint32_t m = 0;
      float v[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        v[j] = to_float(x[i].t[j]);  // zero outside the matrix: no effect on any amax
        m = max(m, abs_bits(v[j]));
      }
      if (stage) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) tile[lr * S + cb + j] = x[i].t[j];
      }
      if constexpr (kBlocks) {
        block_m = max(block_m, m);
      } else if (a.out != nullptr) {
        // The row's tile amax across its 16 threads (xor offsets < 16 stay in the half-warp).
#pragma unroll
        for (int o = kThreadsPerRow / 2; o > 0; o /= 2)
          m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        const float s = block_scale(amax_from_bits(m), fp8_max(F), a.p2, a.eps);
        if (row_in) {
          uint8_t q[kVec];
          quantize_scaled<F, kVec>(v, s, m == kQuietNaNBits, q);
          if (live > 0) store_bytes8(a.out + (r0 + lr) * a.cols + c0 + cb, q, a.vec_out, live);
          if (tc == 0) a.scale_inv[(r0 + lr) * kb + t] = 1.0f / s;
        }
      }
    }
  }
  float bs = 1.0f;         // kBlocks: the block's scale
  bool block_nan = false;  // kBlocks: a NaN in the block (the CPU's recipe for its bytes)
  if constexpr (kBlocks) {
    const uint32_t bm = block_max_all(block_m);
    block_nan = bm == kQuietNaNBits;
    bs = block_scale(amax_from_bits(bm), fp8_max(F), a.p2, a.eps);
    if (threadIdx.x == 0) {
      if (a.scale_inv != nullptr) a.scale_inv[rb * kb + t] = 1.0f / bs;
      if (a.scale_inv_t != nullptr) a.scale_inv_t[t * kbt + rb] = 1.0f / bs;
    }
    if (a.out != nullptr) {  // each thread re-reads what it staged: no wait for the others
      for (int p = 0; p < kPasses; ++p) {
        const int lr = tr + p * kRowsPerPass;
        if (lr >= nr || live == 0) continue;
        float w[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) w[j] = to_float(tile[lr * S + cb + j]);
        uint8_t q[kVec];
        quantize_scaled<F, kVec>(w, bs, block_nan, q);
        store_bytes8(a.out + (r0 + lr) * a.cols + c0 + cb, q, a.vec_out, live);
      }
    }
  }
  if (a.out_t == nullptr) return;  // uniform across the block
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  for (int c = threadIdx.x / kWarp; c < nc; c += kWarps) {
    float v[4];
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = to_float(tile[(lane + j * kWarp) * S + c]);  // rows past nr were staged as zeros
      m = max(m, abs_bits(v[j]));
    }
    if (a.dbias_partial != nullptr) {  // the column's sum over the region, in a fixed order
      float sum = (v[0] + v[1]) + (v[2] + v[3]);
#pragma unroll
      for (int o = kWarp / 2; o > 0; o /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
      if (lane == 0) a.dbias_partial[rb * a.cols + c0 + c] = sum;
    }
    float s = bs;
    bool nan = block_nan;
    if constexpr (!kBlocks) {
      const uint32_t cm = warp_max(m);
      nan = cm == kQuietNaNBits;
      s = block_scale(amax_from_bits(cm), fp8_max(F), a.p2, a.eps);
      if (lane == 0) a.scale_inv_t[(c0 + c) * kbt + rb] = 1.0f / s;
    }
    uint8_t q[4];
    quantize_scaled<F, 4>(v, s, nan, q);
#pragma unroll
    for (int j = 0; j < 4; ++j) qt[c * kQtStride + lane + j * kWarp] = q[j];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kDim * kSegs / kThreads; ++k) {
    const int idx = threadIdx.x + k * kThreads;
    const int c = idx / kSegs, seg = (idx % kSegs) * 16;
    if (c >= nc || seg >= nr) continue;
    uint8_t* dst = a.out_t + (c0 + c) * a.rows + r0 + seg;
    const uint8_t* src = qt + c * kQtStride + seg;
    if (a.vec_t) {  // rows % 16 == 0: the segment lies inside the matrix
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int i = 0; i < 16 && seg + i < nr; ++i) dst[i] = src[i];
    }
  }
}

template <Format F, typename T, bool kBlocks, int kBatch>
void launch_cast(const BlockQuantizeParams& p, const CastArgs& a, cudaStream_t st) {
  static SmemAllowed smem_done;
  const int64_t grid = ceil_blocks(p.rows) * ceil_blocks(p.cols);
  FP8DP_CHECK(grid < (int64_t{1} << 31), "block_quantize_cuda: too many 128x128 regions: ", grid);
  auto kernel = block_cast_kernel<F, T, kBlocks, kBatch>;
  // Row tiles alone need no staging (and so no shared memory beyond the reductions').
  const size_t smem = (kBlocks || p.out_t != nullptr) ? smem_bytes<T>() : 0;
  if (smem > 48 * 1024) allow_smem(kernel, smem, smem_done);
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, st>>>(static_cast<const T*>(p.input), a);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

template <Format F, typename T, int kBatch = 4>
void launch(const BlockQuantizeParams& p, cudaStream_t st) {
  const auto addr = [](const void* q) { return reinterpret_cast<uintptr_t>(q); };
  CastArgs a{p.rows,
             p.cols,
             p.out,
             p.scale_inv,
             p.out_t,
             p.scale_inv_t,
             p.cols % kVec == 0 && addr(p.input) % 16 == 0,
             p.out != nullptr && p.cols % kVec == 0 && addr(p.out) % 8 == 0,
             p.out_t != nullptr && p.rows % 16 == 0 && addr(p.out_t) % 16 == 0,
             p.power_2_scale,
             p.amax_epsilon,
             nullptr};
  const int64_t regions = ceil_blocks(p.rows);  // row regions: one partial row of dbias each
  if (p.dbias != nullptr)
    a.dbias_partial = scratch_alloc<float>(static_cast<size_t>(regions * p.cols), st);
  if (p.shape == BlockShape::k1x128) {
    launch_cast<F, T, false, kBatch>(p, a, st);
  } else {
    launch_cast<F, T, true, kBatch>(p, a, st);
  }
  if (p.dbias != nullptr) {
    launch_column_sums<float>(
        ColumnSums<float>{{a.dbias_partial, nullptr}, {p.dbias, nullptr}, regions, p.cols}, 1, st);
    scratch_free(a.dbias_partial, st);
  }
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
  FP8DP_CHECK(p.dbias == nullptr || p.out_t != nullptr,
              "block_quantize_cuda: dbias needs the transposed output");
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
