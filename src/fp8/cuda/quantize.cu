// CUDA FP8 cast kernels: quantize (+ amax) in one pass over the flat tensor, and cast + transpose
// (+ dbias, + amax) through shared-memory tiles. Same bytes and amax as quantize_cpu (C7): the
// scale is applied with an unfused multiply, the bf16/fp16 -> float widening is exact, and the
// conversion is either the hardware's saturating RNE or, around NaNs, quantize_one itself
// (quantize_scaled).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/cuda_scratch.h"
#include "fp8/cuda/cast_common.cuh"
#include "fp8/cuda/column_sum.cuh"
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
// Tiled path: 64-column tiles; a block walks up to kStripTiles tiles down one column strip so that
// its column sums (dbias) cover 256 rows before they leave the block.
constexpr int kTile = 64;
constexpr int kStripTiles = 4;

__global__ void write_scale_inv_kernel(const float* scale, float* scale_inv) {
  *scale_inv = scale_inverse(*scale);
}

// ---------------------------------------------------------------- flat: quantize + amax
// kWrite = false is the amax-only pass: no conversion work at all.
template <Format F, typename T, bool kWrite>
__global__ void __launch_bounds__(kThreads)
    quantize_flat_kernel(const T* __restrict__ in, uint8_t* __restrict__ out, int64_t n, bool vec,
                         const float* __restrict__ scale_ptr, unsigned int* __restrict__ amax_bits,
                         float* __restrict__ scale_inv) {
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
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    *scale_inv = scale_inverse(scale);
}

// ---------------------------------------------------------------- tiled: cast + transpose + dbias
struct TileArgs {
  const void* in;
  int64_t rows, cols;
  const float* scale;
  uint8_t* out;    // [rows, cols] or null
  uint8_t* out_t;  // [cols, rows] or null
  bool vec_t;      // out_t aligned to 16 bytes and rows % 16 == 0: 16-byte transposed stores
  unsigned int* amax_bits;
  float* scale_inv;
  float* dbias_partial;  // [gridDim.y, cols] column sums of each strip, or null
  int strip_tiles;       // tiles a block walks down its column strip
};

// The kStrided kernels' arguments: where the input lies (`in` is unused). A type of its own, so
// that the dense kernels' parameter block stays as small as it was: at twice the size, nvcc
// addressed it through a generic pointer and the dense kernel spilled.
struct StridedTileArgs : TileArgs {
  StridedParts strided;
};

template <bool kStrided>
using TileArgsOf = std::conditional_t<kStrided, StridedTileArgs, TileArgs>;

// Rows of a tile: four 16-byte loads per thread for every input dtype (64 rows of fp32, 128 of
// bf16 / fp16), so each thread keeps as many bytes in flight whatever the element size.
template <typename T>
__host__ __device__ constexpr int tile_rows() {
  return 4 * kThreads / (kTile / (16 / static_cast<int>(sizeof(T))));
}

// The first of the thread's kV columns c in part a.strided: the part's pointer plus c's (i2, i3)
// offset. Fixed for the whole kernel (a thread's columns do not change from tile to tile), so the
// strided loads add only a row offset per pass. d3 is a multiple of kV, so the thread's kV
// elements share one (i2, i3 .. i3 + kV - 1) row segment. Each thread finds its own part, so a
// tile may straddle two parts (d2 * d3 need not be a multiple of the tile width: the GPT test
// shapes' 2 heads of 16 are 32 columns a part).
template <typename T>
__device__ __forceinline__ const T* strided_column_base(const StridedParts& s, int64_t c) {
  const int64_t part_cols = s.d2 * s.d3;
  const int64_t part = c / part_cols, k = c - part * part_cols;
  const int64_t i2 = k / s.d3;
  return static_cast<const T*>(s.ptr[part]) + i2 * s.stride[2] + (k - i2 * s.d3);
}

// kVec: input and out are 16-byte aligned and cols is a multiple of the vector width, so each
// thread's kV elements of a row are either all inside the matrix or all outside.
// kMinBlocks (resident blocks per SM the register budget must allow) and kPrefetch (issue the next
// tile's loads before converting this one) are tuning choices; the library launches the one that
// was fastest (see launch_tiled and kCtMinBlocks).
// kStrided: the input is a.strided (quantize.h's StridedParts) instead of the row-major a.in. Only
// the load addresses differ, so the bytes, amax and dbias (same grid, same summation order) are
// those of the materialized matrix; the dense kernels (kStrided = false) compile as before.
template <Format F, typename T, bool kVec, int kMinBlocks, bool kPrefetch, bool kStrided = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    cast_transpose_kernel(const TileArgsOf<kStrided> a) {
  static_assert(!kStrided || kVec, "strided parts are read with 16-byte loads only");
  constexpr int kV = 16 / sizeof(T);     // elements per thread and row (one 16-byte load)
  constexpr int kTpr = kTile / kV;       // threads per tile row
  constexpr int kRpp = kThreads / kTpr;  // tile rows per pass
  constexpr int kRows = tile_rows<T>();  // tile rows
  constexpr int kPasses = kRows / kRpp;  // = 4
  constexpr int kSegs = kRows / 16;      // 16-byte segments per transposed row
  // +1 byte of padding per row: the transposed reads (16 rows of one column per thread) then fall
  // into different banks.
  __shared__ uint8_t tile[kRows][kTile + 1];
  __shared__ float red[kThreads / kWarp][kTile];

  const T* in = static_cast<const T*>(a.in);
  const float scale = *a.scale;
  const int tc = threadIdx.x % kTpr, tr = threadIdx.x / kTpr;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t col = c0 + tc * kV;
  const int64_t strip0 = static_cast<int64_t>(blockIdx.y) * a.strip_tiles * kRows;
  // kStrided: this thread's column base (null past the last column; never read there).
  [[maybe_unused]] const T* scol = nullptr;
  if constexpr (kStrided) {
    if (col < a.cols) scol = strided_column_base<T>(a.strided, col);
  }
  float csum[kV];
#pragma unroll
  for (int j = 0; j < kV; ++j) csum[j] = 0.0f;
  uint32_t am = 0;

  union Vec {
    uint4 u;
    T t[kV];
  };
  // The four 16-byte loads of one tile, issued together (zeros outside the matrix).
  auto load_tile = [&](Vec(&x)[kPasses], int64_t r0) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int64_t r = r0 + tr + p * kRpp;
      if constexpr (kStrided) {
        // (i0, i1) = divmod(r, d1) in 32 bits: rows < 2^31 on this path (at most 65535 strips of
        // at most 512 rows, launch_tiled), and a 64-bit division is a long subroutine.
        if (r < a.rows && col < a.cols) {
          const uint32_t d1 = static_cast<uint32_t>(a.strided.d1);
          const uint32_t i0 = static_cast<uint32_t>(r) / d1;
          const uint32_t i1 = static_cast<uint32_t>(r) - i0 * d1;
          x[p].u = __ldcs(reinterpret_cast<const uint4*>(scol + i0 * a.strided.stride[0] +
                                                         i1 * a.strided.stride[1]));
        } else {
          x[p].u = make_uint4(0, 0, 0, 0);
        }
      } else if constexpr (kVec) {
        x[p].u = (r < a.rows && col < a.cols)
                     ? __ldcs(reinterpret_cast<const uint4*>(in + r * a.cols + col))
                     : make_uint4(0, 0, 0, 0);
      } else {
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          x[p].t[j] = (r < a.rows && col + j < a.cols) ? in[r * a.cols + col + j] : T(0.0f);
        }
      }
    }
  };
  // amax, column sums, conversion, row-major store, and the transposed store through shared memory.
  auto process_tile = [&](const Vec(&x)[kPasses], int64_t r0) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int lr = tr + p * kRpp;
      const int64_t r = r0 + lr;
      union {
        uint8_t b[kV];
        uint32_t w[kV / 4];
      } q;
      float v[kV];
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        v[j] = to_float(x[p].t[j]);  // zero outside the matrix: no effect on sums / amax
        am = max(am, abs_bits(v[j]));
        csum[j] += v[j];
      }
      quantize_scaled<F, kV>(v, scale, am == kQuietNaNBits, q.b);
#pragma unroll
      for (int j = 0; j < kV; ++j) tile[lr][tc * kV + j] = q.b[j];
      if (a.out != nullptr && r < a.rows) {
        uint8_t* dst = a.out + r * a.cols + col;
        if constexpr (kVec) {
          if (col < a.cols) {
            if constexpr (kV == 4) {
              *reinterpret_cast<uint32_t*>(dst) = q.w[0];
            } else {
              *reinterpret_cast<uint2*>(dst) = make_uint2(q.w[0], q.w[1]);
            }
          }
        } else {
#pragma unroll
          for (int j = 0; j < kV; ++j) {
            if (col + j < a.cols) dst[j] = q.b[j];
          }
        }
      }
    }
    if (a.out_t != nullptr) {
      __syncthreads();
      // Each transposed row (tile column) is kSegs 16-byte segments of 16 tile rows.
#pragma unroll
      for (int k = 0; k < kSegs * kTile / kThreads; ++k) {
        const int idx = threadIdx.x + k * kThreads;
        const int oc = idx / kSegs, seg = (idx % kSegs) * 16;
        const int64_t orow = c0 + oc;
        const int64_t rbeg = r0 + seg;
        if (orow < a.cols && rbeg < a.rows) {
          union {
            uint4 u;
            uint8_t b[16];
          } o;
#pragma unroll
          for (int i = 0; i < 16; ++i) o.b[i] = tile[seg + i][oc];
          uint8_t* dst = a.out_t + orow * a.rows + rbeg;
          if (a.vec_t) {  // rows % 16 == 0, so rbeg < rows means all 16 are inside
            *reinterpret_cast<uint4*>(dst) = o.u;
          } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) {  // constant indices keep `o` in registers
              if (rbeg + i < a.rows) dst[i] = o.b[i];
            }
          }
        }
      }
      __syncthreads();
    }
  };

  if constexpr (kPrefetch) {
    Vec x[kPasses], nx[kPasses];
    load_tile(x, strip0);
    for (int t = 0; t < a.strip_tiles; ++t) {
      const int64_t r0 = strip0 + static_cast<int64_t>(t) * kRows;
      if (r0 >= a.rows) break;  // uniform across the block
      if (t + 1 < a.strip_tiles) load_tile(nx, r0 + kRows);
      process_tile(x, r0);
#pragma unroll
      for (int p = 0; p < kPasses; ++p) x[p] = nx[p];
    }
  } else {
    for (int t = 0; t < a.strip_tiles; ++t) {
      const int64_t r0 = strip0 + static_cast<int64_t>(t) * kRows;
      if (r0 >= a.rows) break;  // uniform across the block
      Vec x[kPasses];
      load_tile(x, r0);
      process_tile(x, r0);
    }
  }

  if (a.dbias_partial != nullptr) {
    // Fixed-order reduction of the strip's column sums: lanes of a warp that share columns first
    // (xor-shuffle tree), then the warps in index order. Deterministic for a given shape.
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      float v = csum[j];
#pragma unroll
      for (int o = kTpr; o < kWarp; o *= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
      if (lane < kTpr) red[warp][tc * kV + j] = v;
    }
    __syncthreads();
    if (threadIdx.x < kTile && c0 + threadIdx.x < a.cols) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kThreads / kWarp; ++w) s += red[w][threadIdx.x];
      a.dbias_partial[static_cast<int64_t>(blockIdx.y) * a.cols + c0 + threadIdx.x] = s;
    }
  }
  block_amax_commit<kThreads>(am, a.amax_bits);
  if (a.scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    *a.scale_inv = scale_inverse(scale);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <Format F, typename T>
void launch_flat(const QuantizeParams& p, cudaStream_t st) {
  const int64_t n = p.rows * p.cols;
  const bool vec = aligned16(p.input) && (p.out == nullptr || aligned16(p.out));
  const int64_t work = vec ? ceil_div(n, kChunk) : n;
  // Enough blocks to fill every multiprocessor several times; the grid-stride loop does the rest.
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, kThreads), int64_t{sm_count()} * 8));
  auto kernel =
      p.out != nullptr ? quantize_flat_kernel<F, T, true> : quantize_flat_kernel<F, T, false>;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(
      static_cast<const T*>(p.input), p.out, n, vec, p.scale,
      reinterpret_cast<unsigned int*>(p.amax), p.scale_inv);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

// Tuning choices of the cast-transpose kernel: a register budget for 5 resident blocks per SM was
// fastest or tied everywhere, and prefetching the next tile costs the registers that occupancy
// needs (timings: docs/changelog.md, 2026-11-30).
constexpr int kCtMinBlocks = 5;
constexpr bool kCtPrefetch = false;

// dbias[c] = the sum over strips of the partial rows, in strip order, stored as dbias_dtype.
void launch_dbias_sums(const float* partial, int64_t strips, const QuantizeParams& p,
                       cudaStream_t st) {
  switch (p.dbias_dtype) {
    case DType::kFloat32:
      return launch_column_sums(
          ColumnSums<float>{
              {partial, nullptr}, {static_cast<float*>(p.dbias), nullptr}, strips, p.cols},
          1, st);
    case DType::kBFloat16:
      return launch_column_sums(
          ColumnSums<__nv_bfloat16>{
              {partial, nullptr}, {static_cast<__nv_bfloat16*>(p.dbias), nullptr}, strips, p.cols},
          1, st);
    case DType::kFloat16:
      return launch_column_sums(
          ColumnSums<__half>{
              {partial, nullptr}, {static_cast<__half*>(p.dbias), nullptr}, strips, p.cols},
          1, st);
    default:
      break;
  }
  FP8DP_CHECK(false, "quantize_cuda: no dbias output of dtype ", dtype_name(p.dbias_dtype));
}

// Tiles per block: kStripTiles, or fewer when the grid would have under ~32 blocks per SM, so that
// mid-size tensors still spread over enough waves (a 64 MiB tensor is only ~1.5 waves otherwise).
int auto_strip_tiles(int64_t rows, int64_t cols, int rows_per_tile) {
  const int64_t tiles = ceil_div(rows, rows_per_tile) * ceil_div(cols, kTile);
  const int64_t per = tiles / (int64_t{sm_count()} * 32);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(per, kStripTiles)));
}

// strip_tiles <= 0 picks: one tile per block without dbias (most parallelism, nothing to combine),
// auto_strip_tiles with dbias (fewer strips = fewer partial sums to write and combine). The
// variant parameters exist for the tuning benchmark.
template <Format F, typename T, int kMinBlocks = kCtMinBlocks, bool kPrefetch = kCtPrefetch>
void launch_tiled(const QuantizeParams& p, cudaStream_t st, int strip_tiles = 0) {
  constexpr int64_t kV = 16 / sizeof(T);
  constexpr int kRowsPerTile = tile_rows<T>();
  if (strip_tiles <= 0) {
    strip_tiles = p.dbias != nullptr ? auto_strip_tiles(p.rows, p.cols, kRowsPerTile) : 1;
  }
  const int64_t strip_rows = int64_t{kRowsPerTile} * strip_tiles;
  const int64_t strips = ceil_div(p.rows, strip_rows);
  FP8DP_CHECK(strips <= 65535, "quantize_cuda: transpose/dbias path supports up to ",
              65535 * strip_rows, " rows, got ", p.rows);
  TileArgs a{p.input,
             p.rows,
             p.cols,
             p.scale,
             p.out,
             p.out_t,
             p.out_t != nullptr && aligned16(p.out_t) && p.rows % 16 == 0,
             reinterpret_cast<unsigned int*>(p.amax),
             p.scale_inv,
             nullptr,
             strip_tiles};
  if (p.dbias != nullptr) {
    // Stream-ordered scratch for the per-strip sums (strips * cols floats).
    a.dbias_partial = scratch_alloc<float>(static_cast<size_t>(strips * p.cols), st);
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(p.cols, kTile)), static_cast<unsigned>(strips));
  const bool vec = aligned16(p.input) && (p.out == nullptr || aligned16(p.out)) && p.cols % kV == 0;
  if (p.strided.n > 0) {  // quantize_cuda checked quantize_cuda_strided_supported
    StridedTileArgs sa;
    static_cast<TileArgs&>(sa) = a;
    sa.strided = p.strided;
    cast_transpose_kernel<F, T, true, kMinBlocks, kPrefetch, true><<<grid, kThreads, 0, st>>>(sa);
  } else if (vec) {
    cast_transpose_kernel<F, T, true, kMinBlocks, kPrefetch><<<grid, kThreads, 0, st>>>(a);
  } else {
    // The element-wise fallback needs more registers; a residency target would make it spill.
    cast_transpose_kernel<F, T, false, 1, kPrefetch><<<grid, kThreads, 0, st>>>(a);
  }
  FP8DP_CHECK_CUDA(cudaGetLastError());
  if (p.dbias != nullptr) {
    // dbias[c] = sum over strips, in strip order. 64-thread blocks: enough of them to spread a few
    // thousand columns over every SM.
    launch_dbias_sums(a.dbias_partial, strips, p, st);
    scratch_free(a.dbias_partial, st);
  }
}

// Strided parts always take the tiled kernel: the flat one walks the input as one flat array.
template <Format F, typename T>
void launch(const QuantizeParams& p, cudaStream_t st) {
  if (p.out_t != nullptr || p.dbias != nullptr || p.strided.n > 0) {
    launch_tiled<F, T>(p, st);
  } else {
    launch_flat<F, T>(p, st);
  }
}

template <Format F>
void dispatch_dtype(const QuantizeParams& p, cudaStream_t st) {
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
  FP8DP_CHECK(false, "quantize_cuda: no kernel for input dtype ", dtype_name(p.input_dtype));
}

}  // namespace
}  // namespace cuda

bool quantize_cuda_strided_supported(const QuantizeParams& p) {
  const StridedParts& s = p.strided;
  if (s.n < 1 || s.n > 4) return false;
  if (p.input_dtype != DType::kFloat32 && p.input_dtype != DType::kBFloat16 &&
      p.input_dtype != DType::kFloat16) {
    return false;
  }
  const int64_t kv = 16 / static_cast<int64_t>(dtype_size(p.input_dtype));  // elements per load
  if (s.d1 < 1 || s.d2 < 1 || s.d3 < 1) return false;
  if (p.rows % s.d1 != 0 || p.cols != s.n * s.d2 * s.d3) return false;  // not the logical shape
  // Every 16-byte load inside one part's (i2, i3 .. i3 + kv - 1) row segment, and aligned.
  if (s.d3 % kv != 0) return false;
  for (int64_t st : s.stride) {
    if (st < 0 || st % kv != 0) return false;
  }
  for (int i = 0; i < s.n; ++i) {
    if (!cuda::aligned16(s.ptr[i])) return false;
  }
  if (p.out != nullptr && !cuda::aligned16(p.out)) return false;
  // launch_tiled's grid: at most 65535 strips of at least one tile. This also keeps rows below
  // 2^31, which the kernel's 32-bit row divmod needs.
  const int64_t tile_rows = 4 * cuda::kThreads / (cuda::kTile / kv);
  return p.rows <= 65535 * tile_rows;
}

void quantize_cuda(const QuantizeParams& p, void* stream) {
  FP8DP_CHECK(p.rows >= 0 && p.cols >= 0, "quantize_cuda: bad shape [", p.rows, ", ", p.cols, "]");
  FP8DP_CHECK(p.dbias == nullptr || p.dbias_dtype == DType::kFloat32 ||
                  p.dbias_dtype == DType::kBFloat16 || p.dbias_dtype == DType::kFloat16,
              "quantize_cuda: no dbias output of dtype ", dtype_name(p.dbias_dtype));
  FP8DP_CHECK(p.scale != nullptr, "quantize_cuda: scale pointer is null");
  FP8DP_CHECK(p.rows * p.cols == 0 || p.input != nullptr || p.strided.n > 0,
              "quantize_cuda: input pointer is null");
  FP8DP_CHECK(p.strided.n == 0 || quantize_cuda_strided_supported(p),
              "quantize_cuda: strided parts input not supported for this layout (n=", p.strided.n,
              ", d1=", p.strided.d1, ", d2=", p.strided.d2, ", d3=", p.strided.d3, ", strides=[",
              p.strided.stride[0], ", ", p.strided.stride[1], ", ", p.strided.stride[2],
              ", 1], rows=", p.rows, ", cols=", p.cols, ", ", dtype_name(p.input_dtype),
              "); materialize the input instead");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  // The kernels merge block results with atomicMax on the bits (a valid max for amaxes >= 0, NaN
  // above all), so a written amax starts at 0 (= amax of an empty input); an accumulated one keeps
  // what is there and the blocks merge into it.
  if (p.amax != nullptr && !p.amax_accumulate)
    FP8DP_CHECK_CUDA(cudaMemsetAsync(p.amax, 0, sizeof(float), st));
  if (p.rows * p.cols == 0) {
    if (p.scale_inv != nullptr) {
      cuda::write_scale_inv_kernel<<<1, 1, 0, st>>>(p.scale, p.scale_inv);
      FP8DP_CHECK_CUDA(cudaGetLastError());
    }
    if (p.dbias != nullptr && p.cols > 0) {  // zero bits are 0.0 in every dtype
      FP8DP_CHECK_CUDA(
          cudaMemsetAsync(p.dbias, 0, static_cast<size_t>(p.cols) * dtype_size(p.dbias_dtype), st));
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
