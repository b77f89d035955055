// Device helpers shared by the CUDA LayerNorm / RMSNorm kernels (norm_fwd.cu, norm_bwd.cu): 16-byte
// row vectors, sums over the threads of one row, and the launch geometry. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cuda/ptx>
#include <type_traits>

#include "common/cuda_check.h"
#include "fp8/cuda/cast_common.cuh"

namespace fp8dp::cuda::norm {

// Blocks have at most 512 threads, so the register-resident kernels get 128 registers per thread.
constexpr int kMaxBlock = 512;
// Blocks smaller than this hold several rows (one group of `tpr` threads per row).
constexpr int kMinBlock = 256;

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned(const void* p, uintptr_t n) {
  return p == nullptr || (reinterpret_cast<uintptr_t>(p) % n) == 0;
}

// One 16-byte piece of a row: 4 fp32 or 8 bf16 / fp16 elements.
template <typename T>
union Vec {
  static constexpr int kV = 16 / sizeof(T);
  uint4 u;
  T t[kV];
};

// The kernels are bound by their instruction stream, not by memory (ncu; docs/changelog.md), so the
// conversions between a vector and its floats work on 32-bit words: a bf16 pair widens with one
// shift and one mask (a 16-bit element access compiles to a byte permute and a multiply each) and
// rounds with one paired conversion; a Vec rebuilt element by element also went through local
// memory.

// The elements of `v` as floats, exactly (to_float's values, NaN signs included).
template <typename T>
__device__ __forceinline__ void unpack(const Vec<T>& v, float (&f)[Vec<T>::kV]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w[4] = {v.u.x, v.u.y, v.u.z, v.u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = __uint_as_float(w[k] << 16);
      f[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < Vec<T>::kV; ++j) f[j] = to_float(v.t[j]);
  }
}

// `z` rounded to T (from_float's bits, pairs converted together), as the vector `o` and back as
// floats in `zr`.
template <typename T>
__device__ __forceinline__ void round_pack(const float (&z)[Vec<T>::kV], Vec<T>& o,
                                           float (&zr)[Vec<T>::kV]) {
  constexpr int kV = Vec<T>::kV;
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int j = 0; j < kV; ++j) zr[j] = z[j];
    o.u = make_uint4(__float_as_uint(z[0]), __float_as_uint(z[1]), __float_as_uint(z[2]),
                     __float_as_uint(z[3]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        const __nv_bfloat162 p = __floats2bfloat162_rn(z[2 * k], z[2 * k + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(&p);
        zr[2 * k] = __uint_as_float(w[k] << 16);
        zr[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
      } else {
        const __half2 p = __floats2half2_rn(z[2 * k], z[2 * k + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(&p);
        zr[2 * k] = to_float(__low2half(p));
        zr[2 * k + 1] = to_float(__high2half(p));
      }
    }
    o.u = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// A thread's amax of rounded outputs (the bits of |x|, cast_common's abs_bits order), NaNs
// canonicalised once at the end instead of per element. bf16 keeps a pair of 16-bit maxima per
// word (|x| of a bf16 is its bits without the sign, in the same order): one mask and one paired
// max per two elements.
template <typename T>
struct VecAmax {
  uint32_t m = 0;
  // `in(j)`: whether element j lies in the row.
  template <typename In>
  __device__ __forceinline__ void fold(const Vec<T>& o, const float (&zr)[Vec<T>::kV], In in) {
#pragma unroll
    for (int j = 0; j < Vec<T>::kV; ++j) {
      if (in(j)) m = max(m, __float_as_uint(zr[j]) & 0x7FFFFFFFu);
    }
  }
  __device__ __forceinline__ bool nan() const { return m > 0x7F800000u; }
  __device__ __forceinline__ uint32_t bits() const { return nan() ? kQuietNaNBits : m; }
};

template <>
struct VecAmax<__nv_bfloat16> {
  uint32_t m2 = 0;  // two 16-bit maxima
  template <typename In>
  __device__ __forceinline__ void fold(const Vec<__nv_bfloat16>& o, const float (&)[8], In in) {
    const uint32_t w[4] = {o.u.x, o.u.y, o.u.z, o.u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t keep = (in(2 * k) ? 0x7FFFu : 0u) | (in(2 * k + 1) ? 0x7FFF0000u : 0u);
      m2 = __vmaxu2(m2, w[k] & keep);
    }
  }
  __device__ __forceinline__ bool nan() const { return __vcmpgtu2(m2, 0x7F807F80u) != 0; }
  __device__ __forceinline__ uint32_t bits() const {
    const uint32_t m = max(m2 & 0xFFFFu, m2 >> 16) << 16;
    return m > 0x7F800000u ? kQuietNaNBits : m;
  }
};

// Vector `vi` of a row: one 16-byte load when kVec (row start and cols aligned), else element-wise
// with zeros past the row end. kStream: the data is read once, so keep it out of the caches' way.
// The index type I is int where the vector lies in the registers' reach (the offset then costs one
// 32-bit multiply-add instead of 64-bit arithmetic), else int64_t.
template <typename T, bool kVec, bool kStream, typename I>
__device__ __forceinline__ void load_vec(Vec<T>& v, const T* row, I vi, int64_t cols) {
  constexpr int kV = Vec<T>::kV;
  if constexpr (kVec) {
    const uint4* p = reinterpret_cast<const uint4*>(row + vi * kV);
    v.u = kStream ? __ldcs(p) : __ldg(p);
  } else {
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const int64_t c = static_cast<int64_t>(vi) * kV + j;
      v.t[j] = c < cols ? row[c] : from_float<T>(0.0f);
    }
  }
}

template <typename T, bool kVec, typename I>
__device__ __forceinline__ void store_vec(const Vec<T>& v, T* row, I vi, int64_t cols) {
  constexpr int kV = Vec<T>::kV;
  if constexpr (kVec) {
    *reinterpret_cast<uint4*>(row + vi * kV) = v.u;
  } else {
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      const int64_t c = static_cast<int64_t>(vi) * kV + j;
      if (c < cols) row[c] = v.t[j];
    }
  }
}

// Whether element j of vector vi lies inside the row (always, for a vector that exists, when kVec).
template <typename T, bool kVec, typename I>
__device__ __forceinline__ bool in_row(I vi, int j, int64_t nvec, int64_t cols) {
  if constexpr (kVec) {
    return vi < nvec;
  } else {
    return static_cast<int64_t>(vi) * Vec<T>::kV + j < cols;
  }
}

// Sum of `v` over the `tpr` threads of this thread's row group (tpr a power of two; the groups
// tile the block, so a group of more than 32 threads is whole warps). Every thread of the block
// must call it, with the same tpr. The xor butterfly hands every lane the same bits (each step adds
// the same two numbers on both sides, and float addition is commutative). A group of several warps
// then adds the warps' partials with the same butterfly: lane l reads the partial of the group's
// warp l % nw, so every aligned run of nw lanes holds all of them and adds them in one fixed tree
// order. (Each thread adding all nw partials in turn cost 2 x ~35 instructions per row of the
// backward at 16 warps per row, 12% of its instructions; the tree costs a read and 4 steps.)
// `smem` holds one float per warp (per summed value). It may be written again only after the next
// __syncthreads of the block: callers alternate between two buffers (the next call's barrier then
// orders this call's reads before any new writes), which saves a barrier per call.
template <int kN>
__device__ __forceinline__ void group_sum(float (&v)[kN], int tpr, float (*smem)[32]) {
  if (tpr < kWarp) {
    for (int o = 1; o < tpr; o *= 2) {
#pragma unroll
      for (int k = 0; k < kN; ++k) v[k] += __shfl_xor_sync(0xFFFFFFFFu, v[k], o);
    }
    return;
  }
  // Whole warps: the same steps unrolled (a loop over a runtime width cost 3 instructions a step).
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
#pragma unroll
    for (int k = 0; k < kN; ++k) v[k] += __shfl_xor_sync(0xFFFFFFFFu, v[k], o);
  }
  if (tpr == kWarp) return;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kN; ++k) smem[k][warp] = v[k];
  }
  __syncthreads();
  const int nw = tpr / kWarp;                          // 2 .. kMaxBlock / kWarp, a power of two
  const int src = threadIdx.x / tpr * nw + lane % nw;  // the group's first warp + lane % nw
#pragma unroll
  for (int k = 0; k < kN; ++k) v[k] = smem[k][src];
#pragma unroll
  for (int o = 1; o < kMaxBlock / kWarp; o *= 2) {
    if (o < nw) {  // uniform across the block
#pragma unroll
      for (int k = 0; k < kN; ++k) v[k] += __shfl_xor_sync(0xFFFFFFFFu, v[k], o);
    }
  }
}

// Threads per row: the smallest power of two that leaves each thread at most `target` vectors of
// the row (at most kMaxBlock). Several rows share a block when a row needs fewer than kMinBlock.
inline int pick_tpr(int64_t nvec, int target) {
  int tpr = 1;
  while (tpr < kMaxBlock && ceil_div(nvec, tpr) > target) tpr *= 2;
  return tpr;
}

// cast_common's block_amax_commit for a block of any multiple of 32 threads (up to 1024): the
// block's max of the amax bits, then one atomicMax into *amax_bits. Every thread must call it.
__device__ __forceinline__ void block_amax_commit_any(uint32_t bits, unsigned int* amax_bits) {
  __shared__ uint32_t warp_res[32];
  bits = warp_max(bits);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) warp_res[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    bits = lane < static_cast<int>(blockDim.x) / kWarp ? warp_res[lane] : 0u;
    bits = warp_max(bits);
    if (lane == 0 && amax_bits != nullptr && bits != 0u) atomicMax(amax_bits, bits);
  }
}

// Per-kernel cache of resident_blocks: one per launch-function instantiation (a static there).
using OccupancyCache = std::atomic<int>[kMaxBlock / kWarp + 1];

// Resident blocks per SM of `kernel` at `block` threads, asked once per kernel and block size
// (`cache` belongs to this kernel): it depends only on the kernel's resources and the
// architecture (one per process), and `smem` (dynamic shared memory per block), which the caller
// keeps fixed per kernel.
template <typename Kernel>
int resident_blocks(Kernel kernel, int block, OccupancyCache& cache, size_t smem = 0) {
  std::atomic<int>& c = cache[block / kWarp];
  int n = c.load(std::memory_order_relaxed);
  if (n == 0) {
    FP8DP_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block, smem));
    c.store(n, std::memory_order_relaxed);
  }
  return n;
}

inline int block_for(int tpr) { return tpr > kMinBlock ? tpr : kMinBlock; }

// ---------------------------------------------------------------- rows staged by the copy engine
// A row-wise kernel that loads its row, reduces it and only then loads the next one keeps the
// memory busy for a fraction of each row's time (the norm kernels ran at ~42% of copy bandwidth).
// On sm_90 the bulk-copy engine (cp.async.bulk, completion counted on an mbarrier) fetches the
// next row groups into shared memory while the threads reduce the current one, without holding
// registers for them (a register prefetch cost the occupancy it needed and lost 5-30%).
// Protocol: thread 0 initialises the barriers (stage_init, then a block barrier) and issues every
// fetch; every thread waits for a stage with the parity of its use count (use k of stage s waits
// for parity (k / stages) & 1), copies its part into registers, and the block passes a
// __syncthreads before thread 0 refills that stage.

// Whether `pred` holds for the value of attribute `Attr` of the current device, asked once per
// device (the launch paths ask it on every call).
template <cudaDeviceAttr Attr, typename Pred>
bool device_has(Pred pred) {
  static std::atomic<int> cached[64];  // 0 unknown, 1 no, 2 yes
  int dev = 0;
  FP8DP_CHECK_CUDA(cudaGetDevice(&dev));
  if (dev < 64 && cached[dev].load(std::memory_order_relaxed) != 0) return cached[dev] == 2;
  int value = 0;
  FP8DP_CHECK_CUDA(cudaDeviceGetAttribute(&value, Attr, dev));
  const bool yes = pred(value);
  if (dev < 64) cached[dev].store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
}

// Whether the current device has the bulk-copy engine (sm_90+).
inline bool has_bulk_copy() {
  return device_has<cudaDevAttrComputeCapabilityMajor>([](int major) { return major >= 9; });
}

// Whether the current device can launch cooperative grids (grid-wide barriers).
inline bool has_cooperative_launch() {
  return device_has<cudaDevAttrCooperativeLaunch>([](int coop) { return coop != 0; });
}

// Thread 0 initialises `n` barriers (one arrival each: the fetch's arrive.expect_tx); every
// thread must call it before the first fetch or wait.
__device__ __forceinline__ void stage_init(uint64_t* bars, int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    for (int i = 0; i < n; ++i) ::cuda::ptx::mbarrier_init(&bars[i], 1);
    // Make the initialised barriers visible to the copy engine (the async proxy).
    ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  }
  __syncthreads();
#else
  __trap();  // launched only where has_bulk_copy()
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Thread 0, before refilling a stage: the threads' reads of it (generic proxy, ordered before this
// by the block barrier) must be ordered before the copy engine's writes (async proxy) too; without
// this fence the H200 intermittently handed some rows stale bytes (LayerNorm backward, 1 run in 6).
// Then the arrival that announces `bytes` more to come on the barrier (asm volatile with the sink
// operand: the library's form returns a state, and an unused non-volatile result may be moved).
__device__ __forceinline__ void stage_announce(uint64_t* bar, uint32_t bytes) {
  ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_shared);
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;"
               :
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(bytes)
               : "memory");
}
#endif

// Thread 0: copy `bytes` (a multiple of 16; src and dst 16-byte aligned) into shared memory; the
// barrier's current phase completes when they have arrived.
__device__ __forceinline__ void stage_fetch(uint64_t* bar, void* dst, const void* src,
                                            uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  stage_announce(bar, bytes);
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, dst, src, bytes,
                             bar);
#endif
}

// Thread 0: two copies of `bytes` each that complete one barrier phase together (the backward's
// dz and x).
__device__ __forceinline__ void stage_fetch2(uint64_t* bar, void* dst0, const void* src0,
                                             void* dst1, const void* src1, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  stage_announce(bar, 2 * bytes);
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, dst0, src0,
                             bytes, bar);
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, dst1, src1,
                             bytes, bar);
#endif
}

__device__ __forceinline__ void stage_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  while (!::cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
#endif
}

}  // namespace fp8dp::cuda::norm
