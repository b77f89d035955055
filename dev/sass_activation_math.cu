// One element of each activation of src/fp8/activation_math.h per thread, and one 8-element group
// of bf16 GELU outputs with its E4M3 cast as the kernels do it (one 16-byte load, the bf16 rounding,
// the amax, quantize_scaled): kernels to count SASS instructions of, not to run.
//   python3 dev/sass_count.py dev/sass_activation_math.cu
// The activation kernels are bound by instruction issue, so these counts are what their speed
// follows (docs/changelog.md, 2026-12-05).
#include <cuda_bf16.h>

#include <cstdint>

#include "fp8/activation_lut.h"
#include "fp8/activation_math.h"
#include "fp8/cuda/cast_common.cuh"

namespace fp8dp::cuda {

__global__ void sass_gelu(const float* x, float* y) {
  const int i = threadIdx.x;
  y[i] = act::gelu(x[i]);
}

__global__ void sass_dgelu(const float* x, const float* g, float* y) {
  const int i = threadIdx.x;
  y[i] = act::mul(g[i], act::dgelu(x[i]));
}

__global__ void sass_swiglu(const float* x, const float* u, float* y) {
  const int i = threadIdx.x;
  y[i] = act::swiglu(x[i], u[i]);
}

__global__ void sass_dswiglu(const float* x, const float* u, const float* g, float* dx, float* du) {
  const int i = threadIdx.x;
  act::dswiglu(g[i], x[i], u[i], dx[i], du[i]);
}

// Eight bf16 inputs of group g (one 16-byte load), and the group's E4M3 cast and amax stored.
union Group8 {
  uint4 u;
  __nv_bfloat16 t[8];
};
__device__ __forceinline__ Group8 load_group8(const __nv_bfloat16* h, int64_t g) {
  Group8 x;
  x.u = reinterpret_cast<const uint4*>(h)[g];
  return x;
}
__device__ __forceinline__ void store_group8(const float (&v)[8], uint32_t am, float scale,
                                             uint2* out, unsigned* amax) {
  union {
    uint2 u;
    uint8_t b[8];
  } q;
  quantize_scaled<Format::kE4M3, 8>(v, scale, am == kQuietNaNBits, q.b);
  *out = q.u;
  *amax = am;
}

__global__ void sass_gelu_group8_e4m3(const __nv_bfloat16* h, float scale, uint2* out,
                                      unsigned* amax) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const Group8 x = load_group8(h, g);
  float v[8];
  uint32_t am = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = to_float(from_float<__nv_bfloat16>(act::gelu(to_float(x.t[j]))));
    am = max(am, abs_bits(v[j]));
  }
  store_group8(v, am, scale, out + g, amax + g);
}

// The same group with GELU looked up in a shared-memory table (activation_lut.h), as the kernels
// do for bf16 inputs. `_hit` is the path of a group whose 8 inputs all lie in the table (what
// almost every group takes); the other kernel has the computed fallback too.
template <bool kFallback>
__device__ __forceinline__ void gelu_group8_lut(const __nv_bfloat16* h, const float* lut_g,
                                                float scale, uint2* out, unsigned* amax) {
  __shared__ float lut[act_lut::kLutSize];
  for (int i = threadIdx.x; i < static_cast<int>(act_lut::kLutSize); i += blockDim.x)
    lut[i] = lut_g[i];
  __syncthreads();
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const Group8 x = load_group8(h, g);
  float v[8], xf[8];
  uint32_t am = 0, miss = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    xf[j] = to_float(x.t[j]);
    bool in;
    v[j] = lut[act_lut::slot(xf[j], in)];  // gelu(x) rounded to bf16 (activation_lut.h)
    miss |= (in ? 0u : 1u) << j;
  }
  if (kFallback && miss != 0) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (miss & (1u << j)) v[j] = to_float(from_float<__nv_bfloat16>(act::gelu(xf[j])));
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) am = max(am, abs_bits(v[j]));
  store_group8(v, am, scale, out + g, amax + g);
}

__global__ void sass_gelu_group8_e4m3_lut_hit(const __nv_bfloat16* h, const float* lut,
                                              float scale, uint2* out, unsigned* amax) {
  gelu_group8_lut<false>(h, lut, scale, out, amax);
}

__global__ void sass_gelu_group8_e4m3_lut(const __nv_bfloat16* h, const float* lut, float scale,
                                          uint2* out, unsigned* amax) {
  gelu_group8_lut<true>(h, lut, scale, out, amax);
}

}  // namespace fp8dp::cuda
