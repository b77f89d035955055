// CUDA LayerNorm / RMSNorm forward fused with the FP8 cast (norm_kernel.h). One group of threads
// per row (a part of a warp up to a 512-thread block, chosen from cols). The row is read once into
// registers as 16-byte vectors; the mean and then the variance are taken from those registers
// (two passes over the registers: no cancellation of E[x^2] - E[x]^2, exact enough for any offset);
// the output pass writes z in the activation dtype and / or its FP8 bytes. Rows too long for the
// registers (more than 512 x 8 vectors) take the same three passes from global memory instead.
// On sm_90 the 4-vector kernel gets its rows through shared-memory stages that the copy engine
// fills ahead of the threads (norm_common.cuh), so the next rows are in flight during a row's
// reductions; the arithmetic is the same.
//
// Same FP8 bytes as norm_fwd_cpu for the same z: z is rounded to the activation dtype first (RNE,
// as c10's conversions), the scale is applied with an unfused multiply and the conversion is the
// hardware's saturating RNE or, around NaNs, quantize_one itself (cast_common's quantize_scaled).
// z itself can differ from the CPU's in the last bits: the row sums are added in another order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "fp8/cuda/cast_common.cuh"
#include "norm/cuda/norm_common.cuh"
#include "norm/norm_kernel.h"

namespace fp8dp {
namespace cuda::norm {
namespace {

// Vectors of its row a thread holds in registers: kernels exist for up to 4 and up to 8; longer
// rows are read from global memory three times (kNV = 0). The launch aims at 4 vectors per thread
// and gives the 4-vector kernel a register budget for 2 resident 512-thread blocks per SM (64
// registers). Why: the kernel is bound by its instruction stream and the two block-wide sums per
// row, not by its loads; this launch was the fastest or tied at the GPT shapes, and prefetching, 8
// vectors per thread or copy-engine stages did not beat it (timings: docs/changelog.md).
constexpr int kTargetVec = 4;
constexpr int kMinBlocks4 = 2;
// Shared-memory stages of the copy-engine path (sm_90; 0 turns it off).
constexpr int kFwdStages = 2;

struct FwdArgs {
  const void* x;
  const void* gamma;
  const void* beta;  // or null
  void* out;         // or null
  uint8_t* out_fp8;  // or null
  const float* scale;
  float* scale_inv;         // or null: 1 / scale, written by one thread
  unsigned int* amax_bits;  // or null; zeroed before the launch
  float* mu;                // or null
  float* rsigma;            // or null
  int64_t rows, cols;
  float eps;
  bool zero_centered_gamma;  // gamma is stored minus 1 (the kernels' kShift)
  bool rms;
  Format format;
  int tpr;  // threads per row
};

// z of the elements of one vector, rounded to T; writes out / out_fp8 and folds |z| into amax.
// kShift: zero-centred gamma (1 is added to it); a compile-time choice, because an add of a
// runtime 0 cost one instruction per element of the output pass (8 of its ~115 per vector).
template <typename T, bool kVec, bool kShift>
__device__ __forceinline__ void emit(const FwdArgs& a, const Vec<T>& xv, int64_t row, int64_t vi,
                                     int64_t nvec, float mu, float rs, float scale,
                                     VecAmax<T>& am) {
  constexpr int kV = Vec<T>::kV;
  Vec<T> gv, o;
  float x[kV], g[kV], z[kV], zr[kV];
  load_vec<T, kVec, false>(gv, static_cast<const T*>(a.gamma), vi, a.cols);
  unpack(xv, x);
  unpack(gv, g);
#pragma unroll
  for (int j = 0; j < kV; ++j) {
    x[j] = (x[j] - mu) * rs;  // xhat
    if constexpr (kShift) g[j] += 1.0f;
  }
  if (a.beta != nullptr) {
    Vec<T> bv;
    float b[kV];
    load_vec<T, kVec, false>(bv, static_cast<const T*>(a.beta), vi, a.cols);
    unpack(bv, b);
    // The CPU kernel's expression in its order, the last product and the add in one rounding (a
    // fused multiply-add; the CPU rounds the product first, a difference inside the z bound of
    // tests/python/test_norm_cuda.py). Earlier builds left it to the compiler, which fused it
    // for 7 of the 8 elements of a bf16 vector.
#pragma unroll
    for (int j = 0; j < kV; ++j) z[j] = __fmaf_rn(x[j], g[j], b[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kV; ++j) z[j] = x[j] * g[j];
  }
  round_pack<T>(z, o, zr);
  am.fold(o, zr, [&](int j) { return in_row<T, kVec>(vi, j, nvec, a.cols); });
  if (a.out != nullptr) store_vec<T, kVec>(o, static_cast<T*>(a.out) + row * a.cols, vi, a.cols);
  if (a.out_fp8 != nullptr) {
    uint32_t q[kV / 4];
    if (a.format == Format::kE4M3) {
      quantize_words<Format::kE4M3, kV>(zr, scale, am.nan(), q);
    } else {
      quantize_words<Format::kE5M2, kV>(zr, scale, am.nan(), q);
    }
    uint8_t* dst = a.out_fp8 + row * a.cols + vi * kV;
    if constexpr (kVec) {
      if constexpr (kV == 4) {
        *reinterpret_cast<uint32_t*>(dst) = q[0];
      } else {
        *reinterpret_cast<uint2*>(dst) = make_uint2(q[0], q[1]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        if (vi * kV + j < a.cols) dst[j] = static_cast<uint8_t>(q[j / 4] >> (8 * (j % 4)));
      }
    }
  }
}

// This thread's vectors of one row (zeros past the row and for a row past the end: zero bits are
// 0.0 in all three dtypes).
template <typename T, bool kVec, int kN>
__device__ __forceinline__ void load_row(Vec<T> (&buf)[kN], const FwdArgs& a, int64_t row, int t,
                                         int64_t nvec) {
  const bool live = row < a.rows;
  const T* xr = static_cast<const T*>(a.x) + (live ? row : 0) * a.cols;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int64_t vi = t + static_cast<int64_t>(i) * a.tpr;
    if (live && vi < nvec) {
      load_vec<T, kVec, true>(buf[i], xr, vi, a.cols);
    } else {
      buf[i].u = make_uint4(0, 0, 0, 0);
    }
  }
}

// Rows staged by the copy engine (norm_common.cuh): stage s of this block holds the rpb
// consecutive rows of one row group (one contiguous bulk copy); thread g * tpr + t reads its
// vectors of row g. Rows past the end read as zeros.
template <typename T, int kN>
__device__ __forceinline__ void read_stage(Vec<T> (&buf)[kN], const uint8_t* stage,
                                           const FwdArgs& a, int64_t row, int g, int t,
                                           int64_t nvec) {
  const bool live = row < a.rows;
  const uint4* src = reinterpret_cast<const uint4*>(stage + g * a.cols * sizeof(T));
  // The common case (every GPT width): the row is exactly kN vectors per thread, so no vector
  // needs a bounds check or a zero fill (they cost ~30 of the ~80 instructions of a row's head).
  if (live && nvec == static_cast<int64_t>(kN) * a.tpr) {
#pragma unroll
    for (int i = 0; i < kN; ++i) buf[i].u = src[t + i * a.tpr];
    return;
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int64_t vi = t + static_cast<int64_t>(i) * a.tpr;
    buf[i].u = live && vi < nvec ? src[vi] : make_uint4(0, 0, 0, 0);
  }
}

// Thread 0: fetch row group `grp` (rows grp * rpb ...) into `stage` when it exists.
template <typename T>
__device__ __forceinline__ void fetch_group(const FwdArgs& a, int64_t grp, int rpb, uint8_t* stage,
                                            uint64_t* bar) {
  const int64_t r0 = grp * rpb;
  if (r0 >= a.rows) return;
  const int64_t n = a.rows - r0 < rpb ? a.rows - r0 : rpb;
  const size_t row_bytes = static_cast<size_t>(a.cols) * sizeof(T);
  stage_fetch(bar, stage, static_cast<const T*>(a.x) + r0 * a.cols,
              static_cast<uint32_t>(n * row_bytes));
}

// kVec: every row pointer is 16-byte aligned and cols a multiple of the vector width.
// kNV > 0: the row is held in registers, at most kNV vectors per thread; 0: re-read from memory.
// kMinBlocks: resident 512-thread blocks per SM the register budget must allow (a tuning choice,
// timings in docs/changelog.md).
// kStages > 0 (sm_90, kVec and kNV > 0 only): the row groups arrive through kStages shared-memory
// stages filled by the copy engine (dynamic shared memory: kStages * rpb * cols * sizeof(T)).
// kShift: zero-centred gamma (emit).
template <typename T, bool kVec, int kNV, int kMinBlocks, int kStages, bool kShift>
__global__ void __launch_bounds__(kMaxBlock, kMinBlocks) norm_fwd_kernel(const FwdArgs a) {
  constexpr int kV = Vec<T>::kV;
  constexpr bool kInRegs = kNV > 0;
  constexpr bool kStaged = kStages > 0;
  static_assert(!kStaged || (kVec && kInRegs), "staging needs whole vectors held in registers");
  constexpr int kMaxVec = kInRegs ? kNV : 1;
  __shared__ float red[2][1][32];  // group_sum buffers, used alternately
  __shared__ uint64_t bars[kStaged ? kStages : 1];
  extern __shared__ __align__(128) uint8_t stages[];
  int phase = 0;
  const int tpr = a.tpr;
  const int rpb = blockDim.x / tpr;
  const int t = threadIdx.x % tpr;
  const int g = threadIdx.x / tpr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  const int64_t nvec = ceil_div(a.cols, kV);
  const size_t stage_bytes = static_cast<size_t>(rpb) * a.cols * sizeof(T);
  const float scale = a.out_fp8 != nullptr ? *a.scale : 1.0f;
  if (a.scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    *a.scale_inv = scale_inverse(*a.scale);
  const float n = static_cast<float>(a.cols);
  VecAmax<T> am;
  Vec<T> buf[kMaxVec];
  if constexpr (kStaged) {
    stage_init(bars, kStages);
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) {
        fetch_group<T>(a, blockIdx.x + static_cast<int64_t>(s) * gridDim.x, rpb,
                       stages + s * stage_bytes, &bars[s]);
      }
    }
  }
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rpb + g;
  // Grid-stride over groups of rpb rows; the trip count is uniform across the block, which the
  // __syncthreads inside group_sum needs.
  int64_t k = 0;  // this block's row groups done
  for (int64_t row = first; row - g < a.rows; row += stride, ++k) {
    const bool live = row < a.rows;
    const T* xr = static_cast<const T*>(a.x) + (live ? row : 0) * a.cols;
    if constexpr (kStaged) {
      const int s = static_cast<int>(k % kStages);
      stage_wait(&bars[s], static_cast<uint32_t>((k / kStages) & 1));
      read_stage<T, kMaxVec>(buf, stages + s * stage_bytes, a, row, g, t, nvec);
      __syncthreads();  // every thread has its copy: the stage may be refilled
      if (threadIdx.x == 0) {
        fetch_group<T>(a, blockIdx.x + (k + kStages) * gridDim.x, rpb, stages + s * stage_bytes,
                       &bars[s]);
      }
    } else if constexpr (kInRegs) {
      load_row<T, kVec, kMaxVec>(buf, a, row, t, nvec);
    }
    float s[1] = {0.0f};
    float mu = 0.0f;
    if (!a.rms) {
      if constexpr (kInRegs) {
#pragma unroll
        for (int i = 0; i < kMaxVec; ++i) {
          float f[kV];
          unpack(buf[i], f);
#pragma unroll
          for (int j = 0; j < kV; ++j) s[0] += f[j];  // zeros past the end
        }
      } else {
        for (int64_t vi = t; live && vi < nvec; vi += tpr) {
          load_vec<T, kVec, false>(buf[0], xr, vi, a.cols);
          float f[kV];
          unpack(buf[0], f);
#pragma unroll
          for (int j = 0; j < kV; ++j) s[0] += f[j];
        }
      }
      group_sum(s, tpr, red[phase]);
      phase ^= 1;
      mu = s[0] / n;
    }
    float ss[1] = {0.0f};
    if constexpr (kInRegs) {
#pragma unroll
      for (int i = 0; i < kMaxVec; ++i) {
        const int64_t vi = t + static_cast<int64_t>(i) * tpr;
        float f[kV];
        unpack(buf[i], f);
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          const float d = f[j] - mu;
          if (in_row<T, kVec>(vi, j, nvec, a.cols)) ss[0] += d * d;
        }
      }
    } else {
      for (int64_t vi = t; live && vi < nvec; vi += tpr) {
        load_vec<T, kVec, false>(buf[0], xr, vi, a.cols);
        float f[kV];
        unpack(buf[0], f);
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          const float d = f[j] - mu;
          if (in_row<T, kVec>(vi, j, nvec, a.cols)) ss[0] += d * d;
        }
      }
    }
    group_sum(ss, tpr, red[phase]);
    phase ^= 1;
    const float rs = 1.0f / sqrtf(ss[0] / n + a.eps);  // IEEE sqrt and division, as on the CPU
    if (live) {
      if (t == 0 && a.mu != nullptr) a.mu[row] = mu;
      if (t == 0 && a.rsigma != nullptr) a.rsigma[row] = rs;
      if constexpr (kInRegs) {
#pragma unroll
        for (int i = 0; i < kMaxVec; ++i) {
          const int64_t vi = t + static_cast<int64_t>(i) * tpr;
          if (vi < nvec) emit<T, kVec, kShift>(a, buf[i], row, vi, nvec, mu, rs, scale, am);
        }
      } else {
        for (int64_t vi = t; vi < nvec; vi += tpr) {
          load_vec<T, kVec, false>(buf[0], xr, vi, a.cols);
          emit<T, kVec, kShift>(a, buf[0], row, vi, nvec, mu, rs, scale, am);
        }
      }
    }
  }
  block_amax_commit_any(am.bits(), a.amax_bits);
}

template <typename T, bool kVec, int kNV, int kMinBlocks, int kStages, bool kShift>
void launch_kernel(const FwdArgs& a, int block, cudaStream_t st) {
  auto kernel = norm_fwd_kernel<T, kVec, kNV, kMinBlocks, kStages, kShift>;
  // Staged: kStages stages of the largest row group a kNV-vector launch of this block size can
  // have (block * kNV vectors of 16 bytes), so that the shared memory, and with it the occupancy
  // answer, depends on the block size only.
  const size_t smem = kStages > 0 ? size_t{kStages} * block * kNV * 16 : 0;
  static SmemAllowed smem_allowed;
  allow_smem(kernel, smem, smem_allowed);
  // As many resident blocks as fit, and no more: the grid-stride loop covers the remaining rows,
  // and fewer blocks mean fewer amax atomics. The occupancy answer is cached per block size (it
  // depends on the kernel's registers and the architecture only; one architecture per process).
  static OccupancyCache cache;  // static storage: zero-initialised
  const int per_sm = resident_blocks(kernel, block, cache, smem);
  const int64_t rpb = block / a.tpr;
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>(ceil_div(a.rows, rpb), int64_t{sm_count()} * std::max(per_sm, 1)));
  kernel<<<static_cast<unsigned>(blocks), block, smem, st>>>(a);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

template <typename T, bool kVec, int kNV, int kMinBlocks, int kStages = 0>
void launch(const FwdArgs& a, int block, cudaStream_t st) {
  if (a.zero_centered_gamma)
    return launch_kernel<T, kVec, kNV, kMinBlocks, kStages, true>(a, block, st);
  launch_kernel<T, kVec, kNV, kMinBlocks, kStages, false>(a, block, st);
}

// kMinBlocks is the 4-vector kernel's budget; the 8-vector kernel keeps 128 registers (it would
// spill hundreds of bytes at 64), the memory path 1 block.
// kStages applies to the 4-vector kernel, kStages8 to the 8-vector one, with whole vectors on an
// sm_90+ device.
template <typename T, bool kVec, int kMinBlocks, int kStages, int kStages8>
void launch_nv(const FwdArgs& a, int64_t per_thread, int block, cudaStream_t st) {
  if (per_thread <= 4) {
    if constexpr (kVec && kStages > 0) {
      if (has_bulk_copy()) return launch<T, kVec, 4, kMinBlocks, kStages>(a, block, st);
    }
    return launch<T, kVec, 4, kMinBlocks>(a, block, st);
  }
  if (per_thread <= 8) {
    if constexpr (kVec && kStages8 > 0) {
      if (has_bulk_copy()) return launch<T, kVec, 8, 1, kStages8>(a, block, st);
    }
    return launch<T, kVec, 8, 1>(a, block, st);
  }
  launch<T, kVec, 0, 1>(a, block, st);
}

// The library launches the defaults; `target`, kMinBlocks, kStages and kStages8 exist for the
// tuning benchmark.
template <typename T, int kMinBlocks = kMinBlocks4, int kStages = kFwdStages, int kStages8 = 0>
void dispatch(const NormFwdParams& p, cudaStream_t st, int target = kTargetVec) {
  constexpr int kV = Vec<T>::kV;
  FwdArgs a{p.input,
            p.gamma,
            p.beta,
            p.out,
            p.out_fp8,
            p.scale,
            p.scale_inv,
            reinterpret_cast<unsigned int*>(p.amax),
            p.mu,
            p.rsigma,
            p.rows,
            p.cols,
            p.eps,
            p.zero_centered_gamma,
            p.rms,
            p.format,
            1};
  const int64_t nvec = ceil_div(p.cols, kV);
  a.tpr = pick_tpr(nvec, target);
  const int block = block_for(a.tpr);
  // 16-byte vectors need every row to start on a 16-byte boundary (cols % kV == 0 and aligned base
  // pointers); the FP8 row then starts on a kV-byte boundary, the width of its stores.
  const bool vec = p.cols % kV == 0 && aligned(p.input, 16) && aligned(p.gamma, 16) &&
                   aligned(p.beta, 16) && aligned(p.out, 16) && aligned(p.out_fp8, kV);
  const int64_t per_thread = ceil_div(nvec, a.tpr);
  if (vec) {
    launch_nv<T, true, kMinBlocks, kStages, kStages8>(a, per_thread, block, st);
  } else {
    launch_nv<T, false, kMinBlocks, kStages, kStages8>(a, per_thread, block, st);
  }
}

void dispatch_dtype(const NormFwdParams& p, cudaStream_t st) {
  switch (p.dtype) {
    case DType::kFloat32:
      return dispatch<float>(p, st);
    case DType::kBFloat16:
      return dispatch<__nv_bfloat16>(p, st);
    case DType::kFloat16:
      return dispatch<__half>(p, st);
    default:
      break;
  }
  FP8DP_CHECK(false, "norm_fwd_cuda: no kernel for dtype ", dtype_name(p.dtype));
}

}  // namespace
}  // namespace cuda::norm

void norm_fwd_cuda(const NormFwdParams& p, void* stream) {
  FP8DP_CHECK(p.rows >= 0 && p.cols > 0, "norm_fwd_cuda: bad shape [", p.rows, ", ", p.cols, "]");
  FP8DP_CHECK(p.rows == 0 || (p.input != nullptr && p.gamma != nullptr),
              "norm_fwd_cuda: input or gamma is null");
  FP8DP_CHECK(p.out_fp8 == nullptr || p.scale != nullptr, "norm_fwd_cuda: out_fp8 needs a scale");
  FP8DP_CHECK(p.scale_inv == nullptr || p.scale != nullptr,
              "norm_fwd_cuda: scale_inv needs a scale");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  // Blocks merge their amax with atomicMax on the bits, so it starts at 0 (the amax of no rows).
  if (p.amax != nullptr && !p.amax_accumulate)
    FP8DP_CHECK_CUDA(cudaMemsetAsync(p.amax, 0, sizeof(float), st));
  // No rows: the kernel still writes scale_inv (one block, no row).
  if (p.rows == 0 && p.scale_inv == nullptr) return;
  cuda::norm::dispatch_dtype(p, st);
}

}  // namespace fp8dp
