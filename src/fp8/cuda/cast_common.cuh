// Device helpers shared by the CUDA cast kernels (and the norm kernels): element conversions, amax
// on float bits, block reduction.
// Torch-free (compiled in CUDA compile-only CI builds too).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "common/cuda_check.h"
#include "fp8/format.h"
#include "fp8/quantize.h"

namespace fp8dp::cuda {

constexpr int kWarp = 32;
// The canonical NaN the CPU kernels return (std::numeric_limits<float>::quiet_NaN()).
constexpr uint32_t kQuietNaNBits = 0x7FC00000u;

// Exact widening of one input element (all three conversions are exact, so CPU == GPU).
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
// The hardware half -> float conversion returns a positive NaN for every NaN; keep the sign as the
// CPU conversion does, so a negative half NaN still quantizes to 0xFF on both (seen on the H200).
__device__ __forceinline__ float to_float(__half v) {
  const float f = __half2float(v);
  const uint32_t sign = static_cast<uint32_t>(__half_as_ushort(v) & 0x8000u) << 16;
  return f != f ? __uint_as_float(kQuietNaNBits | sign) : f;
}

// The way back: a float rounded to nearest even into a storage type.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// amax is tracked as the bits of |x|: for non-negative floats the unsigned order of the bits is the
// numeric order, +Inf (0x7F800000) sorts above every finite value and every NaN above +Inf. So one
// unsigned max gives "NaN if any NaN, else Inf if any Inf, else max |x|", and atomicMax on the bits
// merges blocks. NaNs are canonicalised so the result's bits equal the CPU's quiet NaN.
__device__ __forceinline__ uint32_t abs_bits(float v) {
  const uint32_t a = __float_as_uint(v) & 0x7FFFFFFFu;
  return a > 0x7F800000u ? kQuietNaNBits : a;
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Block-wide max of every thread's amax bits, then one atomic per block into *amax_bits (which the
// host zeroed before the launch). Must be reached by every thread of the block.
template <int kThreads>
__device__ __forceinline__ void block_amax_commit(uint32_t bits, unsigned int* amax_bits) {
  __shared__ uint32_t warp_res[kThreads / kWarp];
  bits = warp_max(bits);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) warp_res[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    bits = lane < kThreads / kWarp ? warp_res[lane] : 0u;
    bits = warp_max(bits);
    if (lane == 0 && amax_bits != nullptr && bits != 0u) atomicMax(amax_bits, bits);
  }
}

// Storage types of the input dtypes.
template <DType D>
struct InputType;
template <>
struct InputType<DType::kFloat32> {
  using T = float;
};
template <>
struct InputType<DType::kBFloat16> {
  using T = __nv_bfloat16;
};
template <>
struct InputType<DType::kFloat16> {
  using T = __half;
};

// quantize_one<F>(v * scale) with the CPU kernels' result for NaN: 0x7F with v's sign bit. On the
// GPU the sign of a NaN does not survive arithmetic (the multiply, and the min / max instructions
// the clamp compiles to, return a positive NaN), while on the CPU it does; so NaN is decided on
// the input. (Seen on the H200: a negative NaN gave 0x7F on the GPU, 0xFF on the CPU.)
template <Format F>
__device__ __forceinline__ uint8_t quantize_like_cpu(float v, float scale) {
  const uint8_t q = quantize_one<F>(__fmul_rn(v, scale));
  return v != v ? static_cast<uint8_t>(0x7Fu | ((__float_as_uint(v) >> 24) & 0x80u)) : q;
}

// Quantizes K inputs (K even) times scale into FP8 bytes. On sm_89+ the hardware conversion
// (cvt.rn.satfinite, two values per instruction) does the work: round-to-nearest-even with
// saturation of every non-NaN value, Inf included, is exactly quantize_one's clamp-then-round. The
// one difference is NaN (the hardware writes one positive NaN, quantize_one keeps the sign), so a
// caller that has seen a NaN passes `exact` and gets the bit recipe of the CPU kernels instead.
template <Format F, int K>
__device__ __forceinline__ void quantize_scaled(const float (&v)[K], float scale, bool exact,
                                                uint8_t (&q)[K]) {
  static_assert(K % 2 == 0, "pairs");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (!exact) {
#pragma unroll
    for (int j = 0; j < K; j += 2) {
      const float lo = __fmul_rn(v[j], scale), hi = __fmul_rn(v[j + 1], scale);
      uint16_t r;
      if constexpr (F == Format::kE4M3) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
      } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
      }
      q[j] = static_cast<uint8_t>(r & 0xFFu);
      q[j + 1] = static_cast<uint8_t>(r >> 8);
    }
    return;
  }
#endif
#pragma unroll
  for (int j = 0; j < K; ++j) q[j] = quantize_like_cpu<F>(v[j], scale);
}

// quantize_scaled with the bytes packed four to a word (element 4k + i in byte i of word k, the
// order they have in memory): the packing is one byte permute per pair of conversions instead of
// the byte extractions and shifts of assembling the words from a byte array.
template <Format F, int K>
__device__ __forceinline__ void quantize_words(const float (&v)[K], float scale, bool exact,
                                               uint32_t (&w)[K / 4]) {
  static_assert(K % 4 == 0, "whole words");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (!exact) {
#pragma unroll
    for (int k = 0; k < K / 4; ++k) {
      uint16_t r[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float lo = __fmul_rn(v[4 * k + 2 * h], scale);
        const float hi = __fmul_rn(v[4 * k + 2 * h + 1], scale);
        if constexpr (F == Format::kE4M3) {
          asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r[h]) : "f"(hi), "f"(lo));
        } else {
          asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r[h]) : "f"(hi), "f"(lo));
        }
      }
      asm("mov.b32 %0, {%1, %2};" : "=r"(w[k]) : "h"(r[0]), "h"(r[1]));
    }
    return;
  }
#endif
#pragma unroll
  for (int k = 0; k < K / 4; ++k) {
    w[k] = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[k] |= static_cast<uint32_t>(quantize_like_cpu<F>(v[4 * k + i], scale)) << (8 * i);
    }
  }
}

// Eight FP8 bytes of one thread's row segment: one 8-byte store when `vec` (dst 8-byte aligned,
// all eight inside the row), else the first `live` byte by byte.
__device__ __forceinline__ void store_bytes8(uint8_t* dst, const uint8_t (&q)[8], bool vec,
                                             int live) {
  if (vec) {
    uint2 w{0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < 4)
        w.x |= uint32_t{q[j]} << (8 * j);
      else
        w.y |= uint32_t{q[j]} << (8 * (j - 4));
    }
    *reinterpret_cast<uint2*>(dst) = w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < live) dst[j] = q[j];
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Multiprocessors of the current device (for grid-stride grids).
int sm_count();

// The largest dynamic shared memory allowed so far to one kernel, per device (devices 0-63).
struct SmemAllowed {
  std::atomic<size_t> bytes[64] = {};
};

// Opts a kernel into `bytes` of dynamic shared memory (above the default 48 KiB; static shared
// memory counts towards the same 48 KiB), once per device and size: cudaFuncSetAttribute acts on
// the current device only, so a process that launches the kernel on a second GPU allows it there
// again. `allowed` is one per kernel; 0 bytes asks for nothing. Devices past 63 ask every time.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes, SmemAllowed& allowed) {
  if (bytes == 0) return;
  int dev = 0;
  FP8DP_CHECK_CUDA(cudaGetDevice(&dev));
  std::atomic<size_t>* slot = dev < 64 ? &allowed.bytes[dev] : nullptr;
  if (slot != nullptr && slot->load(std::memory_order_relaxed) >= bytes) return;
  FP8DP_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  if (slot == nullptr) return;
  size_t cur = slot->load(std::memory_order_relaxed);
  while (cur < bytes && !slot->compare_exchange_weak(cur, bytes, std::memory_order_relaxed)) {
  }
}

}  // namespace fp8dp::cuda
