// CUDA LayerNorm / RMSNorm backward (norm_kernel.h), FP32 arithmetic. One group of threads per row,
// as in the forward: dz and x are read once into registers, the two row sums (of dxhat and of
// dxhat * xhat) are reduced over the group, and dx is written from the registers. Each thread
// always sees the same columns, so it keeps its share of dgamma / dbeta in registers across all
// the rows of its group; at the end every block writes one partial row, and the partial rows are
// added per column in a fixed order: by the same kernel after a grid-wide barrier (a cooperative
// launch), or by a second kernel. No atomics: the result depends only on the shape and the
// device's SM count (which fixes the grid), not on timing.
// On sm_90 the register kernels get dz and x through shared-memory stages that the copy engine
// fills ahead of the threads (norm_common.cuh).
// Rows too long for the registers re-read dz and x and accumulate their partial row in memory.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_scratch.h"
#include "fp8/cuda/cast_common.cuh"
#include "fp8/cuda/column_sum.cuh"
#include "norm/cuda/norm_common.cuh"
#include "norm/norm_kernel.h"

namespace fp8dp {
namespace cuda::norm {
namespace {

// Elements of its row a thread keeps in registers: dz, x and the two column accumulators make
// 4 x 24 values, which fits the 128 registers of a 512-thread block without spilling.
constexpr int kMaxElems = 24;

struct BwdArgs {
  const void* dz;
  const void* x;
  const float* mu;
  const float* rsigma;
  const void* gamma;
  void* dx;
  const void* dx_add;  // added to dx before rounding, or null (NormBwdParams::dx_add)
  float* dgamma_part;  // [blocks, cols]
  float* dbeta_part;   // [blocks, cols] or null
  void* dgamma;        // dgamma / dbeta [cols] when the kernel adds the partial rows itself (a
  void* dbeta;         // cooperative launch), else null
  int64_t rows, cols;
  float gshift;  // 1 with zero_centered_gamma, else 0
  bool rms;
  int tpr;  // threads per row
};

// gamma (+ 1 with zero_centered_gamma) of one vector as floats: the register kernels make them
// once per thread, since a thread sees the same columns in every row.
template <typename T, bool kVec, typename I>
__device__ __forceinline__ void gamma_plus(const BwdArgs& a, I vi, float (&gp)[Vec<T>::kV]) {
  Vec<T> gv;
  load_vec<T, kVec, false>(gv, static_cast<const T*>(a.gamma), vi, a.cols);
  unpack(gv, gp);
#pragma unroll
  for (int j = 0; j < Vec<T>::kV; ++j) gp[j] += a.gshift;
}

// The per-element terms of one vector: xhat, dxhat and dz as floats (out-of-row elements are zero
// in dz, so their terms vanish from every sum).
template <typename T>
__device__ __forceinline__ void terms(const Vec<T>& dzv, const Vec<T>& xv,
                                      const float (&gp)[Vec<T>::kV], float mu, float rs,
                                      float (&xhat)[Vec<T>::kV], float (&dxhat)[Vec<T>::kV],
                                      float (&dz)[Vec<T>::kV]) {
  float x[Vec<T>::kV];
  unpack(xv, x);
  unpack(dzv, dz);
#pragma unroll
  for (int j = 0; j < Vec<T>::kV; ++j) {
    xhat[j] = (x[j] - mu) * rs;
    dxhat[j] = dz[j] * gp[j];
  }
}

// dx of one vector from its terms into dx_row (this row of dx), plus dx_add's element at the same
// place when there is one, rounded once; and the terms added to the column sums dgv / dbv.
template <typename T, bool kVec, typename I>
__device__ __forceinline__ void finish_terms(const BwdArgs& a, const float (&xhat)[Vec<T>::kV],
                                             const float (&dxhat)[Vec<T>::kV],
                                             const float (&dz)[Vec<T>::kV], I vi, float rs,
                                             float m1, float m2, T* dx_row,
                                             float (&dgv)[Vec<T>::kV], float (&dbv)[Vec<T>::kV]) {
  constexpr int kV = Vec<T>::kV;
  Vec<T> o;
  float d[kV], dr[kV];
#pragma unroll
  for (int j = 0; j < kV; ++j) {
    d[j] = rs * (dxhat[j] - m1 - xhat[j] * m2);
    dgv[j] += dz[j] * xhat[j];
    dbv[j] += dz[j];
  }
  if (a.dx_add != nullptr) {  // the same offset in dx_add as in dx: both are [rows, cols]
    const T* add_row = static_cast<const T*>(a.dx_add) + (dx_row - static_cast<T*>(a.dx));
    Vec<T> av;
    load_vec<T, kVec, true>(av, add_row, vi, a.cols);
    float ad[kV];
    unpack(av, ad);
#pragma unroll
    for (int j = 0; j < kV; ++j) d[j] += ad[j];
  }
  round_pack<T>(d, o, dr);
  store_vec<T, kVec>(o, dx_row, vi, a.cols);
}

// The same from the vector's dz and x (its terms made again).
template <typename T, bool kVec, typename I>
__device__ __forceinline__ void finish_vec(const BwdArgs& a, const Vec<T>& dzv, const Vec<T>& xv,
                                           const float (&g)[Vec<T>::kV], I vi, float mu, float rs,
                                           float m1, float m2, T* dx_row, float (&dgv)[Vec<T>::kV],
                                           float (&dbv)[Vec<T>::kV]) {
  constexpr int kV = Vec<T>::kV;
  float xhat[kV], dxhat[kV], dz[kV];
  terms(dzv, xv, g, mu, rs, xhat, dxhat, dz);
  finish_terms<T, kVec>(a, xhat, dxhat, dz, vi, rs, m1, m2, dx_row, dgv, dbv);
}

// One row's dz and x as this thread's vectors (kN of them, zeros past the row and for a row past
// the end; zero bits are 0.0 in every dtype).
template <typename T, bool kVec, int kN>
__device__ __forceinline__ void load_row(Vec<T> (&dzb)[kN], Vec<T> (&xb)[kN], const BwdArgs& a,
                                         int64_t row, int t, int64_t nvec) {
  const bool live = row < a.rows;
  const T* dzr = static_cast<const T*>(a.dz) + (live ? row : 0) * a.cols;
  const T* xr = static_cast<const T*>(a.x) + (live ? row : 0) * a.cols;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int vi = t + i * a.tpr;
    if (live && vi < nvec) {
      load_vec<T, kVec, true>(dzb[i], dzr, vi, a.cols);
      load_vec<T, kVec, true>(xb[i], xr, vi, a.cols);
    } else {
      dzb[i].u = xb[i].u = make_uint4(0, 0, 0, 0);
    }
  }
}

// The same from the copy engine's stage (norm_common.cuh): the rpb rows of dz, then the rpb rows
// of x, of one row group.
template <typename T, int kN>
__device__ __forceinline__ void read_stage(Vec<T> (&dzb)[kN], Vec<T> (&xb)[kN],
                                           const uint8_t* stage, size_t half, const BwdArgs& a,
                                           int64_t row, int g, int t, int64_t nvec) {
  const bool live = row < a.rows;
  const size_t off = g * a.cols * sizeof(T);
  const uint4* dzs = reinterpret_cast<const uint4*>(stage + off);
  const uint4* xs = reinterpret_cast<const uint4*>(stage + half + off);
  if (live && nvec == static_cast<int64_t>(kN) * a.tpr) {  // no bounds checks (norm_fwd.cu)
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      dzb[i].u = dzs[t + i * a.tpr];
      xb[i].u = xs[t + i * a.tpr];
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int vi = t + i * a.tpr;
    const bool in = live && vi < nvec;
    dzb[i].u = in ? dzs[vi] : make_uint4(0, 0, 0, 0);
    xb[i].u = in ? xs[vi] : make_uint4(0, 0, 0, 0);
  }
}

// Thread 0: fetch row group `grp`'s dz and x into `stage` (each half `half` bytes) when it exists.
template <typename T>
__device__ __forceinline__ void fetch_group(const BwdArgs& a, int64_t grp, int rpb, uint8_t* stage,
                                            size_t half, uint64_t* bar) {
  const int64_t r0 = grp * rpb;
  if (r0 >= a.rows) return;
  const int64_t n = a.rows - r0 < rpb ? a.rows - r0 : rpb;
  const size_t off = static_cast<size_t>(r0 * a.cols);
  stage_fetch2(bar, stage, static_cast<const T*>(a.dz) + off, stage + half,
               static_cast<const T*>(a.x) + off, static_cast<uint32_t>(n * a.cols * sizeof(T)));
}

// After every block has written its partial rows (a grid-wide barrier: the launch is cooperative,
// and the grid is never larger than what is resident at once), the same blocks add them per
// column: tiles of 32 columns of dgamma, then of dbeta, spread over the grid's groups of
// kSumThreads threads. The same order of additions as column_sum_kernel, which this saves a launch
// of (the GPT block stack ran 16 of them per step). blockDim.x is a multiple of kSumThreads.
template <typename T>
__device__ __forceinline__ void add_parts(const BwdArgs& a) {
  cooperative_groups::this_grid().sync();
  __shared__ ColumnSumSlices slices[kMaxBlock / kSumThreads];
  const int groups = blockDim.x / kSumThreads;
  const int gi = threadIdx.x / kSumThreads, t = threadIdx.x % kSumThreads;
  const int64_t ctiles = ceil_div(a.cols, kSumCols);
  const int64_t tiles = (a.dbeta != nullptr ? 2 : 1) * ctiles;
  // The trip count is the same for every thread of the block (column_tile_sum's barrier).
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < tiles;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t tile = base + gi;
    const bool beta = tile >= ctiles;
    // A group without a tile sums no columns (c0 = cols) but keeps the barrier count.
    const int64_t c0 = tile < tiles ? (tile % ctiles) * kSumCols : a.cols;
    const float s =
        column_tile_sum(beta ? a.dbeta_part : a.dgamma_part, gridDim.x, a.cols, c0, t, slices[gi]);
    if (t < kSumCols && c0 + t < a.cols) {
      static_cast<T*>(beta ? a.dbeta : a.dgamma)[c0 + t] = from_float<T>(s);
    }
    __syncthreads();  // slices[gi] is written again by the next tile
  }
}

// kNV > 0: dz and x are held in registers, at most kNV vectors per thread; 0: re-read from memory.
// kMinBlocks: resident 512-thread blocks per SM the register budget must allow (a tuning choice,
// timings in docs/changelog.md).
// kStages > 0 (sm_90, kVec and kNV > 0 only): dz and x arrive through kStages shared-memory
// stages filled by the copy engine.
// Every block writes one partial row of dgamma / dbeta (its groups are added first, in group
// order, through shared memory), so the second kernel adds `blocks` rows, not `groups`.
// Dynamic shared memory: [cols] floats for that (rpb > 1), then kStages stages of 2 * rpb rows.
template <typename T, bool kVec, int kNV, int kMinBlocks, int kStages>
__global__ void __launch_bounds__(kMaxBlock, kMinBlocks) norm_bwd_kernel(const BwdArgs a) {
  constexpr int kV = Vec<T>::kV;
  constexpr bool kInRegs = kNV > 0;
  constexpr bool kStaged = kStages > 0;
  static_assert(!kStaged || (kVec && kInRegs), "staging needs whole vectors held in registers");
  constexpr int kN = kInRegs ? kNV : 1;
  __shared__ float red[2][2][32];  // group_sum buffers, used alternately
  __shared__ uint64_t bars[kStaged ? kStages : 1];
  extern __shared__ __align__(128) uint8_t dyn[];
  float* col_sum = reinterpret_cast<float*>(dyn);  // the block's groups added in order
  int phase = 0;
  const int tpr = a.tpr;
  const int rpb = blockDim.x / tpr;
  const int t = threadIdx.x % tpr;
  const int g = threadIdx.x / tpr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  const int64_t nvec = ceil_div(a.cols, kV);
  const float n = static_cast<float>(a.cols);
  float* dg_part = a.dgamma_part + static_cast<int64_t>(blockIdx.x) * a.cols;
  float* db_part =
      a.dbeta_part != nullptr ? a.dbeta_part + static_cast<int64_t>(blockIdx.x) * a.cols : nullptr;
  float dg[kN][kV], db[kN][kV];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int j = 0; j < kV; ++j) dg[i][j] = db[i][j] = 0.0f;
  }
  Vec<T> dzb[kN], xb[kN];
  // gamma_plus of this thread's vectors, made once when they fit next to the rest (16 floats:
  // the 24 of the 6-vector fp32 kernel spilled at 128 registers); else made per row.
  constexpr bool kHoist = kInRegs && kN * kV <= 16;
  float gp[kHoist ? kN : 1][kV];
  // The same bound: xhat and dxhat of the row stay in registers across its row sums, so the dx pass
  // does not widen x and dz and make them again (5 of its ~12 instructions per element); x's
  // vectors are then dead after the sums.
  constexpr bool kKeep = kHoist;
  float kxhat[kKeep ? kN : 1][kV], kdxhat[kKeep ? kN : 1][kV];
  if constexpr (kHoist) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int vi = t + i * tpr;
      if (vi < nvec) gamma_plus<T, kVec>(a, vi, gp[i]);
    }
  }
  // Stages start after col_sum, 128-byte aligned.
  const size_t half = static_cast<size_t>(rpb) * a.cols * sizeof(T);
  uint8_t* stages = dyn + (rpb > 1 ? (a.cols * sizeof(float) + 127) / 128 * 128 : 0);
  if constexpr (kStaged) {
    stage_init(bars, kStages);
    if (threadIdx.x == 0) {
      for (int st = 0; st < kStages; ++st) {
        fetch_group<T>(a, blockIdx.x + static_cast<int64_t>(st) * gridDim.x, rpb,
                       stages + st * 2 * half, half, &bars[st]);
      }
    }
  }
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rpb + g;
  int64_t k = 0;  // this block's row groups done
  for (int64_t row = first; row - g < a.rows; row += stride, ++k) {
    const bool live = row < a.rows;
    const int64_t off = (live ? row : 0) * a.cols;
    const T* dzr = static_cast<const T*>(a.dz) + off;
    const T* xr = static_cast<const T*>(a.x) + off;
    const float mu = live && !a.rms ? a.mu[row] : 0.0f;
    const float rs = live ? a.rsigma[row] : 0.0f;
    if constexpr (kStaged) {
      const int st = static_cast<int>(k % kStages);
      stage_wait(&bars[st], static_cast<uint32_t>((k / kStages) & 1));
      read_stage<T, kN>(dzb, xb, stages + st * 2 * half, half, a, row, g, t, nvec);
      __syncthreads();  // every thread has its copy: the stage may be refilled
      if (threadIdx.x == 0) {
        fetch_group<T>(a, blockIdx.x + (k + kStages) * gridDim.x, rpb, stages + st * 2 * half, half,
                       &bars[st]);
      }
    } else if constexpr (kInRegs) {
      load_row<T, kVec, kN>(dzb, xb, a, row, t, nvec);
    }
    float s[2] = {0.0f, 0.0f};  // sum of dxhat, sum of dxhat * xhat
    if constexpr (kInRegs) {
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const int vi = t + i * tpr;
        if (vi < nvec) {
          float g[kV], xhat[kV], dxhat[kV], dz[kV];
          if constexpr (kHoist) {
#pragma unroll
            for (int j = 0; j < kV; ++j) g[j] = gp[i][j];
          } else {
            gamma_plus<T, kVec>(a, vi, g);
          }
          terms(dzb[i], xb[i], g, mu, rs, xhat, dxhat, dz);
#pragma unroll
          for (int j = 0; j < kV; ++j) {
            s[0] += dxhat[j];
            s[1] += dxhat[j] * xhat[j];
            if constexpr (kKeep) {
              kxhat[i][j] = xhat[j];
              kdxhat[i][j] = dxhat[j];
            }
          }
        }
      }
    } else {
      for (int64_t vi = t; live && vi < nvec; vi += tpr) {
        load_vec<T, kVec, false>(dzb[0], dzr, vi, a.cols);
        load_vec<T, kVec, false>(xb[0], xr, vi, a.cols);
        float g[kV], xhat[kV], dxhat[kV], dz[kV];
        gamma_plus<T, kVec>(a, vi, g);
        terms(dzb[0], xb[0], g, mu, rs, xhat, dxhat, dz);
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          s[0] += dxhat[j];
          s[1] += dxhat[j] * xhat[j];
        }
      }
    }
    group_sum(s, tpr, red[phase]);
    phase ^= 1;
    const float m1 = a.rms ? 0.0f : s[0] / n;
    const float m2 = s[1] / n;
    T* dx_row = static_cast<T*>(a.dx) + (live ? row : 0) * a.cols;
    if constexpr (kInRegs) {
      if (live) {
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          const int vi = t + i * tpr;
          if (vi < nvec) {
            if constexpr (kKeep) {
              float dz[kV];
              unpack(dzb[i], dz);
              finish_terms<T, kVec>(a, kxhat[i], kdxhat[i], dz, vi, rs, m1, m2, dx_row, dg[i],
                                    db[i]);
            } else {
              float g[kV];
              gamma_plus<T, kVec>(a, vi, g);
              finish_vec<T, kVec>(a, dzb[i], xb[i], g, vi, mu, rs, m1, m2, dx_row, dg[i], db[i]);
            }
          }
        }
      }
    } else if (live) {
      // One group per block here (rpb == 1), so each column of the partial row has one owner.
      for (int64_t vi = t; vi < nvec; vi += tpr) {
        load_vec<T, kVec, false>(dzb[0], dzr, vi, a.cols);
        load_vec<T, kVec, false>(xb[0], xr, vi, a.cols);
        float g[kV], dgv[kV], dbv[kV];
#pragma unroll
        for (int j = 0; j < kV; ++j) dgv[j] = dbv[j] = 0.0f;
        gamma_plus<T, kVec>(a, vi, g);
        finish_vec<T, kVec>(a, dzb[0], xb[0], g, vi, mu, rs, m1, m2, dx_row, dgv, dbv);
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          const int64_t c = vi * kV + j;
          if (c < a.cols) {
            dg_part[c] += dgv[j];
            if (db_part != nullptr) db_part[c] += dbv[j];
          }
        }
      }
    }
  }
  if constexpr (kInRegs) {
    // The block's partial row: group 0's sums, then group 1's added, ... (fixed order).
    auto write_part = [&](const float (&v)[kN][kV], float* out) {
      if (rpb == 1) {
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          const int vi = t + i * tpr;
#pragma unroll
          for (int j = 0; j < kV; ++j) {
            const int64_t c = vi * kV + j;
            if (vi < nvec && c < a.cols) out[c] = v[i][j];
          }
        }
        return;
      }
      for (int k = 0; k < rpb; ++k) {
        if (g == k) {
#pragma unroll
          for (int i = 0; i < kN; ++i) {
            const int vi = t + i * tpr;
#pragma unroll
            for (int j = 0; j < kV; ++j) {
              const int64_t c = vi * kV + j;
              if (vi < nvec && c < a.cols) col_sum[c] = k == 0 ? v[i][j] : col_sum[c] + v[i][j];
            }
          }
        }
        __syncthreads();
      }
      for (int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) out[c] = col_sum[c];
      __syncthreads();  // col_sum is reused for dbeta
    };
    write_part(dg, dg_part);
    if (db_part != nullptr) write_part(db, db_part);
    if (a.dgamma != nullptr) add_parts<T>(a);
  }
}

// Launch choices: kNV vectors per thread kept in registers (or 0: the memory path), kMinBlocks
// (norm_bwd_kernel) and the block size (rows per block = block / tpr).
// The kernel adds the partial rows itself where p.cooperative_tail (the default) asks for it and
// the device allows a cooperative launch; else a second kernel does.
template <typename T, bool kVec, int kNV, int kMinBlocks, int kStages = 0>
void launch(const NormBwdParams& p, BwdArgs a, int block, cudaStream_t st) {
  auto kernel = norm_bwd_kernel<T, kVec, kNV, kMinBlocks, kStages>;
  const int64_t rpb = block / a.tpr;
  const auto align128 = [](size_t b) { return (b + 127) / 128 * 128; };
  const size_t col_bytes =
      kNV > 0 && rpb > 1 ? align128(static_cast<size_t>(p.cols) * sizeof(float)) : 0;
  // A stage: dz and x of rpb rows, at most kNV vectors of 16 bytes per thread each.
  const size_t stage_max = size_t{kStages} * 2 * block * kNV * 16;
  const size_t smem = col_bytes + stage_max;
  // As many resident blocks as fit, and no more: the grid-stride loop covers the other rows, and
  // every block costs a partial row of dgamma / dbeta to write and add up. The occupancy is asked
  // for the most shared memory a block of several rows can take (kNV x 256 threads x kV columns,
  // plus the stages), so that one cached answer holds for every row length.
  static OccupancyCache cache;  // static storage: zero-initialised
  const size_t smem_max =
      (kNV > 0 ? align128(size_t{kNV} * 256 * Vec<T>::kV * sizeof(float)) : 0) + stage_max;
  static SmemAllowed smem_allowed;
  allow_smem(kernel, smem_max, smem_allowed);
  const int per_sm = resident_blocks(kernel, block, cache, smem_max);
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>(ceil_div(p.rows, rpb), int64_t{sm_count()} * std::max(per_sm, 1)));
  const int64_t nparts = p.dbeta != nullptr ? 2 : 1;
  const size_t part_bytes = static_cast<size_t>(blocks * p.cols) * sizeof(float);
  // Stream-ordered scratch (common/cuda_scratch.h), as the cast kernels' dbias partial sums.
  float* part = fp8dp::cuda::scratch_alloc<float>(nparts * part_bytes / sizeof(float), st);
  a.dgamma_part = part;
  a.dbeta_part = p.dbeta != nullptr ? part + blocks * p.cols : nullptr;
  // The memory path adds into its partial rows; the register path writes them whole.
  if (kNV == 0) FP8DP_CHECK_CUDA(cudaMemsetAsync(part, 0, nparts * part_bytes, st));
  // The register path adds the partial rows itself (add_parts) when the device can launch all its
  // blocks as one cooperative grid: `blocks` never exceeds what is resident at once.
  if (p.cooperative_tail && kNV > 0 && block % kSumThreads == 0 && has_cooperative_launch()) {
    a.dgamma = p.dgamma;
    a.dbeta = p.dbeta;
    void* args[] = {&a};
    FP8DP_CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel),
                                                 dim3(static_cast<unsigned>(blocks)), dim3(block),
                                                 args, smem, st));
    fp8dp::cuda::scratch_free(part, st);
    return;
  }
  kernel<<<static_cast<unsigned>(blocks), block, smem, st>>>(a);
  FP8DP_CHECK_CUDA(cudaGetLastError());
  // dgamma / dbeta[c] = sum over blocks of the partial rows, in a fixed order, rounded once to T.
  launch_column_sums(ColumnSums<T>{{a.dgamma_part, a.dbeta_part},
                                   {static_cast<T*>(p.dgamma), static_cast<T*>(p.dbeta)},
                                   blocks,
                                   p.cols},
                     static_cast<int>(nparts), st);
  fp8dp::cuda::scratch_free(part, st);
}

// The library's launch: kNV = 2 or 3 vectors (whichever the row needs), blocks of at least 512
// threads (fewer partial rows; 256 for short rows, see default_min_block). On sm_90, dz and x come
// through 2 copy-engine stages with a register budget for 1 resident block (128 registers, no
// spills); elsewhere the budget allows 2 blocks from 512 vectors per row up, 1 below.
// Why: on the H200 the staged launch was the fastest at every measured shape, and the cooperative
// tail beat a second column-sum kernel (docs/changelog.md, 2026-12-02). kStages: the copy-engine
// stages of the register kernels on an sm_90+ device with whole vectors.
template <typename T, bool kVec, int kMinBlocks, int kStages>
void launch_nv(const NormBwdParams& p, const BwdArgs& a, int64_t per_thread, int block,
               cudaStream_t st) {
  constexpr int kV = Vec<T>::kV;
  constexpr int kNV = kMaxElems / kV;  // 3 vectors of bf16 / fp16, 6 of fp32
  constexpr bool kCanStage = kVec && kStages > 0;
  const bool staged = kCanStage && has_bulk_copy();
  if (per_thread <= 2 && kNV > 2) {
    if (staged) return launch<T, kVec, 2, kMinBlocks, kCanStage ? kStages : 0>(p, a, block, st);
    return launch<T, kVec, 2, kMinBlocks>(p, a, block, st);
  }
  if (per_thread <= kNV) {
    if (staged) return launch<T, kVec, kNV, kMinBlocks, kCanStage ? kStages : 0>(p, a, block, st);
    return launch<T, kVec, kNV, kMinBlocks>(p, a, block, st);
  }
  launch<T, kVec, 0, kMinBlocks>(p, a, block, st);
}

template <typename T, bool kVec, int kStages>
void launch_budget(const NormBwdParams& p, const BwdArgs& a, int64_t nvec, int64_t per_thread,
                   int block, int min_blocks, cudaStream_t st) {
  if (min_blocks == 0) {
    const bool staged = kVec && kStages > 0 && has_bulk_copy();
    min_blocks = !staged && nvec >= 512 ? 2 : 1;
  }
  min_blocks == 2 ? launch_nv<T, kVec, 2, kStages>(p, a, per_thread, block, st)
                  : launch_nv<T, kVec, 1, kStages>(p, a, per_thread, block, st);
}

// Shared-memory stages of the copy-engine path (sm_90; 0 turns it off).
constexpr int kBwdStages = 2;

// Threads per block at least, for rows of `tpr` threads: 256 for rows of up to 128 threads (two
// resident blocks per SM then share it, so one block's row sums and barriers overlap the other's
// work), else 512: faster for bf16 rows of 2048 columns, slower at 4096 (docs/changelog.md).
inline int default_min_block(int tpr) { return tpr <= 128 ? kMinBlock : kMaxBlock; }

// min_block (threads per block at least; 0: default_min_block), min_blocks (the register budget;
// 0: the rule above) and kStages exist for the tuning benchmark.
template <typename T, int kStages = kBwdStages>
void dispatch(const NormBwdParams& p, cudaStream_t st, int min_block = 0, int min_blocks = 0) {
  constexpr int kV = Vec<T>::kV;
  constexpr int kNV = kMaxElems / kV;
  BwdArgs a{
      p.dz,    p.x,     p.mu,    p.rsigma, p.gamma, p.dx,   p.dx_add,
      nullptr, nullptr, nullptr, nullptr,  p.rows,  p.cols, p.zero_centered_gamma ? 1.0f : 0.0f,
      p.rms,   1};
  const int64_t nvec = ceil_div(p.cols, kV);
  a.tpr = pick_tpr(nvec, kNV);
  const int64_t per_thread = ceil_div(nvec, a.tpr);
  // The memory path keeps one row per block (its partial row has one owner per column).
  if (min_block == 0) min_block = default_min_block(a.tpr);
  const int block = per_thread <= kNV ? std::max(a.tpr, min_block) : block_for(a.tpr);
  const bool vec = p.cols % kV == 0 && aligned(p.dz, 16) && aligned(p.x, 16) &&
                   aligned(p.gamma, 16) && aligned(p.dx, 16) &&
                   (p.dx_add == nullptr || aligned(p.dx_add, 16));
  if (vec) {
    launch_budget<T, true, kStages>(p, a, nvec, per_thread, block, min_blocks, st);
  } else {
    launch_budget<T, false, kStages>(p, a, nvec, per_thread, block, min_blocks, st);
  }
}

}  // namespace
}  // namespace cuda::norm

void norm_bwd_cuda(const NormBwdParams& p, void* stream) {
  FP8DP_CHECK(p.rows >= 0 && p.cols > 0, "norm_bwd_cuda: bad shape [", p.rows, ", ", p.cols, "]");
  FP8DP_CHECK(p.gamma != nullptr && p.dgamma != nullptr, "norm_bwd_cuda: gamma or dgamma is null");
  FP8DP_CHECK(p.rows == 0 || (p.dz != nullptr && p.x != nullptr && p.rsigma != nullptr &&
                              p.dx != nullptr && (p.rms || p.mu != nullptr)),
              "norm_bwd_cuda: dz, x, rsigma, dx or (LayerNorm) mu is null");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.rows == 0) {  // sums over no rows; zero bits are 0.0 in every dtype
    const size_t bytes = static_cast<size_t>(p.cols) * dtype_size(p.dtype);
    FP8DP_CHECK_CUDA(cudaMemsetAsync(p.dgamma, 0, bytes, st));
    if (p.dbeta != nullptr) FP8DP_CHECK_CUDA(cudaMemsetAsync(p.dbeta, 0, bytes, st));
    return;
  }
  switch (p.dtype) {
    case DType::kFloat32:
      return cuda::norm::dispatch<float>(p, st);
    case DType::kBFloat16:
      return cuda::norm::dispatch<__nv_bfloat16>(p, st);
    case DType::kFloat16:
      return cuda::norm::dispatch<__half>(p, st);
    default:
      break;
  }
  FP8DP_CHECK(false, "norm_bwd_cuda: no kernel for dtype ", dtype_name(p.dtype));
}

}  // namespace fp8dp
