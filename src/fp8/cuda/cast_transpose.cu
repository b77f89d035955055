// CUDA cast + transpose (+ dbias, + amax) through shared-memory tiles: one read of a [rows, cols]
// input gives the FP8 bytes in both layouts, amax and the column sums. Same bytes and amax as
// quantize_cpu (C7), see quantize_scaled in cast_common.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "common/cuda_check.h"
#include "fp8/cuda/cast_common.cuh"
#include "fp8/cuda/cast_transpose.h"
#include "fp8/cuda/cast_workspace.h"

namespace fp8dp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// 64-column tiles; with dbias a block may walk several tiles down its column strip so that its
// column sums cover more rows before they leave the block (fewer partial rows to combine).
constexpr int kTile = 64;
constexpr int kStripTiles = 4;

struct TileArgs {
  const void* in;
  int64_t rows, cols;
  const float* scale;
  uint8_t* out;    // [rows, cols] or null
  uint8_t* out_t;  // [cols, rows] or null
  bool vec_t;      // out_t aligned to 16 bytes and rows % 16 == 0: 16-byte transposed stores
  unsigned int* amax_bits;  // null: no amax
  // fused_amax_reset: blocks max into *amax_acc (zero on entry and exit) and count themselves in
  // *blocks_done (likewise); the last block writes amax_bits. Null: they max into amax_bits.
  unsigned int* amax_acc;
  unsigned int* blocks_done;
  float* scale_inv;
  int strip_tiles;      // tiles a block walks down its column strip
  int64_t strips;       // row strips (blocks per column strip)
  bool rows_fastest;    // blockIdx.x = row strip, blockIdx.y = column tile (else the other way)
  float* dbias_partial;  // [strips, cols] column sums of each strip (kDbias)
  // [column tiles] arrival counters, zero on entry and on exit: the last block of a column strip
  // writes dbias. Null: a second kernel does (dbias_finalize_kernel).
  unsigned int* strip_counters;
  float* dbias;  // [cols], with strip_counters
};

// Rows of a tile: four 16-byte loads per thread for every input dtype (64 rows of fp32, 128 of
// bf16 / fp16), so each thread keeps as many bytes in flight whatever the element size.
template <typename T>
__host__ __device__ constexpr int tile_rows() {
  return 4 * kThreads / (kTile / (16 / static_cast<int>(sizeof(T))));
}

// Adds the column strip's partial sums (rows 0..strips-1 of `partial`, columns c0..c0+63) into
// dbias. The block's kThreads / kTile thread groups each add every kGroups-th strip in strip order,
// then the groups are added in group order: a fixed order for the shape.
__device__ __forceinline__ void add_strip_partials(const float* partial, int64_t strips,
                                                   int64_t cols, int64_t c0, float* dbias,
                                                   float (&red)[kThreads / kWarp][kTile]) {
  constexpr int kGroups = kThreads / kTile;
  constexpr int kUnroll = 8;  // loads in flight per thread
  const int c = threadIdx.x % kTile, g = threadIdx.x / kTile;
  float s = 0.0f;
  if (c0 + c < cols) {
    const float* p = partial + c0 + c;
    for (int64_t i0 = g; i0 < strips; i0 += int64_t{kGroups} * kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = i0 + int64_t{j} * kGroups;
        // L2 loads: the partials were written by other blocks, possibly on other SMs.
        v[j] = i < strips ? __ldcg(p + i * cols) : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) s += v[j];
    }
  }
  red[g][c] = s;
  __syncthreads();
  if (threadIdx.x < kTile && c0 + threadIdx.x < cols) {
    float t = 0.0f;
#pragma unroll
    for (int k = 0; k < kGroups; ++k) t += red[k][threadIdx.x];
    dbias[c0 + threadIdx.x] = t;
  }
}

// kVec: input and out are 16-byte aligned and cols is a multiple of the vector width, so each
// thread's kV elements of a row are either all inside the matrix or all outside.
// kMinBlocks (resident blocks per SM the register budget must allow) is a tuning choice;
// bench/cast_transpose_variants.cu times the choices and the library launches the winner.
// kDbias: accumulate column sums (without it the adds and their registers are compiled out).
template <Format F, typename T, bool kVec, int kMinBlocks, bool kDbias>
__global__ void __launch_bounds__(kThreads, kMinBlocks) cast_transpose_kernel(const TileArgs a) {
  constexpr int kV = 16 / sizeof(T);     // elements per thread and row (one 16-byte load)
  constexpr int kTpr = kTile / kV;       // threads per tile row
  constexpr int kRpp = kThreads / kTpr;  // tile rows per pass
  constexpr int kRows = tile_rows<T>();  // tile rows
  constexpr int kPasses = kRows / kRpp;  // = 4
  constexpr int kSegs = kRows / 16;      // 16-byte segments per transposed row
  // +1 byte of padding per row: the transposed reads (16 rows of one column per thread) then fall
  // into different banks.
  __shared__ uint8_t tile[kRows][kTile + 1];

  const T* in = static_cast<const T*>(a.in);
  const float scale = *a.scale;
  const int tc = threadIdx.x % kTpr, tr = threadIdx.x / kTpr;
  const int64_t bx = a.rows_fastest ? blockIdx.y : blockIdx.x;  // column tile
  const int64_t by = a.rows_fastest ? blockIdx.x : blockIdx.y;  // row strip
  const int64_t c0 = bx * kTile;
  const int64_t col = c0 + tc * kV;
  const int64_t strip0 = by * a.strip_tiles * kRows;
  float csum[kV];
#pragma unroll
  for (int j = 0; j < kV; ++j) csum[j] = 0.0f;
  uint32_t am = 0;

  union Vec {
    uint4 u;
    T t[kV];
  };
  for (int t = 0; t < a.strip_tiles; ++t) {
    const int64_t r0 = strip0 + static_cast<int64_t>(t) * kRows;
    if (r0 >= a.rows) break;  // uniform across the block
    // The four 16-byte loads of the tile, issued together (zeros outside the matrix).
    Vec x[kPasses];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int64_t r = r0 + tr + p * kRpp;
      if constexpr (kVec) {
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
    // amax, column sums, conversion, row-major store, and the transposed store through smem.
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
        if constexpr (kDbias) csum[j] += v[j];
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
  }

  if constexpr (kDbias) {
    __shared__ float red[kThreads / kWarp][kTile];
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
      a.dbias_partial[by * a.cols + c0 + threadIdx.x] = s;
    }
    if (a.strip_counters != nullptr) {
      // "Last block done": the block's partial stores are ordered (barrier, then thread 0's
      // release fence) before it counts itself in; the block that brings the count to `strips`
      // acquires every other block's partials, adds them in strip order and leaves the counter at
      // zero for the next kernel on the stream. (The pattern of cooperative groups' grid sync.)
      __shared__ bool is_last;
      __syncthreads();  // also: every thread is done reading `red` before it is reused
      if (threadIdx.x == 0) {
        fence_acq_rel_gpu();
        const unsigned int before = atomicAdd(a.strip_counters + bx, 1u);
        is_last = before == static_cast<unsigned int>(a.strips - 1);
        if (is_last) fence_acq_rel_gpu();
      }
      __syncthreads();
      if (is_last) {  // uniform across the block
        add_strip_partials(a.dbias_partial, a.strips, a.cols, c0, a.dbias, red);
        if (threadIdx.x == 0) a.strip_counters[bx] = 0u;
      }
    }
  }
  if (a.blocks_done == nullptr) {
    block_amax_commit<kThreads>(am, a.amax_bits);
  } else {
    block_amax_commit<kThreads>(am, a.amax_acc);  // thread 0 does the block's atomicMax
    if (threadIdx.x == 0) {
      // Same "last block done" handshake as dbias, by the thread that did the atomicMax: the block
      // that completes the count sees every block's max, publishes it and clears both words.
      fence_acq_rel_gpu();
      const unsigned int blocks = gridDim.x * gridDim.y;
      if (atomicAdd(a.blocks_done, 1u) == blocks - 1) {
        fence_acq_rel_gpu();
        *a.amax_bits = atomicExch(a.amax_acc, 0u);
        *a.blocks_done = 0u;
      }
    }
  }
  if (a.scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    *a.scale_inv = 1.0f / scale;
  }
}

// dbias[c] = sum over strips, in strip order (the two-pass reductions).
__global__ void dbias_finalize_kernel(const float* __restrict__ partial, int64_t strips,
                                      int64_t cols, float* __restrict__ dbias) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  // Sixteen independent loads in flight per step; the adds stay in strip order (deterministic).
  constexpr int kUnroll = 16;
  float s = 0.0f;
  for (int64_t i0 = 0; i0 < strips; i0 += kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) v[j] = i0 + j < strips ? partial[(i0 + j) * cols + c] : 0.0f;
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) s += v[j];
  }
  dbias[c] = s;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Tuning choices, from bench/cast_transpose_variants.cu on the H200 (BENCHMARKS.md): a register
// budget for 5 resident blocks per SM was fastest or tied everywhere (6 and 8 forced spills or too
// few registers and lost up to 30%). With dbias the column sums (8 floats per thread for 16-bit
// inputs) make the 48-register budget of 5 blocks spill (ptxas: 44 bytes, two words stored and
// reloaded per tile, L1-resident); 4 blocks (64 registers) spill nothing but hold 20% fewer loads
// in flight. The variants benchmark times both; until it has run on the H200, 5 as without dbias.
constexpr int kCtMinBlocks = 5;
constexpr int kCtMinBlocksDbias = 5;

// Tiles per block with dbias: kStripTiles, or fewer when the grid would have under ~32 blocks per
// SM, so that mid-size tensors still spread over enough waves.
int auto_strip_tiles(int64_t rows, int64_t cols, int rows_per_tile) {
  const int64_t tiles = ceil_div(rows, rows_per_tile) * ceil_div(cols, kTile);
  const int64_t per = tiles / (int64_t{sm_count()} * 32);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(per, kStripTiles)));
}

// The residency targets are template parameters for the tuning benchmark, which includes this file.
template <Format F, typename T, int kMinBlocks = kCtMinBlocks,
          int kMinBlocksDbias = kCtMinBlocksDbias>
void launch_tiled(const QuantizeParams& p, cudaStream_t st, const CastTransposeConfig& cfg) {
  constexpr int64_t kV = 16 / sizeof(T);
  constexpr int kRowsPerTile = tile_rows<T>();
  const bool db = p.dbias != nullptr;
  const int strip_tiles = cfg.strip_tiles > 0 ? cfg.strip_tiles
                          : db                  ? auto_strip_tiles(p.rows, p.cols, kRowsPerTile)
                                                : 1;
  const int64_t strips = ceil_div(p.rows, int64_t{kRowsPerTile} * strip_tiles);
  const int64_t col_tiles = ceil_div(p.cols, kTile);
  // gridDim.y is limited to 65535; gridDim.x (2^31 - 1) never binds here.
  FP8DP_CHECK((cfg.rows_fastest ? col_tiles : strips) <= 65535,
              "quantize_cuda: the transpose/dbias grid needs <= 65535 ",
              cfg.rows_fastest ? "column tiles" : "row strips", ", got shape [", p.rows, ", ",
              p.cols, "] with ", strip_tiles, " tiles of ", kRowsPerTile, " x ", kTile,
              " per block");
  TileArgs a{p.input,
             p.rows,
             p.cols,
             p.scale,
             p.out,
             p.out_t,
             p.out_t != nullptr && aligned16(p.out_t) && p.rows % 16 == 0,
             reinterpret_cast<unsigned int*>(p.amax),
             nullptr,
             nullptr,
             p.scale_inv,
             strip_tiles,
             strips,
             cfg.rows_fastest,
             nullptr,
             nullptr,
             nullptr};
  // Workspace counters: [0] amax accumulator, [kBlocksDone] arrival count of the grid (on another
  // 128-byte line, so the two single-address atomics of every block go to different lines), then
  // one arrival count per column strip.
  constexpr size_t kBlocksDone = 32, kStripCounters = 64;
  const bool fuse_amax = cfg.fused_amax_reset && p.amax != nullptr;
  const bool last = db && cfg.dbias_reduce == DbiasReduce::kLastBlock;
  const bool cached_partials = db && cfg.dbias_reduce != DbiasReduce::kTwoPassAlloc;
  const size_t partial_floats = static_cast<size_t>(strips * p.cols);
  // Held until the kernels are enqueued (see cast_workspace).
  std::unique_lock<std::mutex> lock;
  if (fuse_amax || cached_partials) {
    const size_t counters =
        last ? kStripCounters + static_cast<size_t>(col_tiles) : fuse_amax ? kStripCounters : 0;
    const CastWorkspace ws =
        cast_workspace(st, cached_partials ? partial_floats : 0, counters, lock);
    if (fuse_amax) {
      a.amax_acc = ws.counters;
      a.blocks_done = ws.counters + kBlocksDone;
    }
    if (cached_partials) a.dbias_partial = ws.partial;
    if (last) {
      a.strip_counters = ws.counters + kStripCounters;
      a.dbias = p.dbias;
    }
  }
  if (p.amax != nullptr && !fuse_amax) {
    FP8DP_CHECK_CUDA(cudaMemsetAsync(p.amax, 0, sizeof(float), st));
  }
  if (db && cfg.dbias_reduce == DbiasReduce::kTwoPassAlloc) {
    FP8DP_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&a.dbias_partial),
                                     partial_floats * sizeof(float), st));
  }
  const dim3 grid = cfg.rows_fastest
                        ? dim3(static_cast<unsigned>(strips), static_cast<unsigned>(col_tiles))
                        : dim3(static_cast<unsigned>(col_tiles), static_cast<unsigned>(strips));
  const bool vec = aligned16(p.input) && (p.out == nullptr || aligned16(p.out)) && p.cols % kV == 0;
  // The element-wise fallback (!vec) needs more registers; a residency target would make it spill.
  if (vec && db) {
    cast_transpose_kernel<F, T, true, kMinBlocksDbias, true><<<grid, kThreads, 0, st>>>(a);
  } else if (vec) {
    cast_transpose_kernel<F, T, true, kMinBlocks, false><<<grid, kThreads, 0, st>>>(a);
  } else if (db) {
    cast_transpose_kernel<F, T, false, 1, true><<<grid, kThreads, 0, st>>>(a);
  } else {
    cast_transpose_kernel<F, T, false, 1, false><<<grid, kThreads, 0, st>>>(a);
  }
  FP8DP_CHECK_CUDA(cudaGetLastError());
  if (db && a.strip_counters == nullptr) {
    // 64-thread blocks: enough of them to spread a few thousand columns over every SM.
    dbias_finalize_kernel<<<static_cast<unsigned>(ceil_div(p.cols, 64)), 64, 0, st>>>(
        a.dbias_partial, strips, p.cols, p.dbias);
    FP8DP_CHECK_CUDA(cudaGetLastError());
    if (cfg.dbias_reduce == DbiasReduce::kTwoPassAlloc) {
      FP8DP_CHECK_CUDA(cudaFreeAsync(a.dbias_partial, st));
    }
  }
}

template <Format F>
void dispatch_dtype(const QuantizeParams& p, cudaStream_t st, const CastTransposeConfig& cfg) {
  switch (p.input_dtype) {
    case DType::kFloat32: return launch_tiled<F, float>(p, st, cfg);
    case DType::kBFloat16: return launch_tiled<F, __nv_bfloat16>(p, st, cfg);
    case DType::kFloat16: return launch_tiled<F, __half>(p, st, cfg);
  }
  FP8DP_CHECK(false, "quantize_cuda: unknown input dtype ", static_cast<int>(p.input_dtype));
}

}  // namespace

void cast_transpose(const QuantizeParams& p, void* stream, const CastTransposeConfig& cfg) {
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.format == Format::kE4M3) {
    dispatch_dtype<Format::kE4M3>(p, st, cfg);
  } else {
    dispatch_dtype<Format::kE5M2>(p, st, cfg);
  }
}

}  // namespace cuda
}  // namespace fp8dp
