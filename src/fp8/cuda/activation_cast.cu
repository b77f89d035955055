// CUDA kernels of the activation + FP8 cast (activation_kernel.h). Same bytes, amax and dbias as
// activation_cpu: the activation is activation_math.h on both devices (IEEE-rounded operations
// only), each result is rounded to the high-precision dtype and widened back (exact) before the
// cast, and the cast is quantize_scaled, as in the quantize kernels: the hardware conversion, or
// the CPU's bit recipe once the thread has seen a NaN. dbias sums in the CPU's order (64-row chunks
// in row order, then the chunks in order), so it is bit-identical too. The high-precision result
// is written only when asked for (FP8 off): with FP8 on, nothing of size tokens × ffn but the FP8
// bytes is written. The kernels are bound by instruction issue (the activation's arithmetic), so
// inputs come in 16-byte loads where the layout allows (elements_vec).
//
// Two kernels. Row-major bytes alone (the forward's fc2 input, and the amax pass): a flat pass,
// eight neighbouring output elements per thread and step. With the transposed bytes or dbias (the
// backward's fc1 grad_output, and the forward when the wgrad needs the transpose): one tiled pass
// that writes the row-major bytes, transposes the tile through shared memory and sums each
// column's 64 rows, so the activation is computed once and h / da are read once (a dbias pass
// that recomputed it and a byte-transpose pass cost more: docs/changelog.md, 2026-12-04).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_scratch.h"
#include "fp8/activation_kernel.h"
#include "fp8/cuda/cast_common.cuh"

namespace fp8dp {
namespace cuda {
int sm_count();  // quantize.cu

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkRows = 64;  // the CPU's dbias chunk

struct Args {
  const void* h;
  const void* da;
  int64_t rows, cols, in_cols, out_cols;
  // Every row of h and da starts 16-byte aligned and cols % kVec == 0: a group of kVec outputs
  // inside the matrix loads its inputs with 16-byte loads (elements_vec), and no group straddles
  // SwiGLU's gate / up halves.
  bool vec_in;
};

// Output element (r, oc) of the activation (forward: a [rows, cols]) or of its derivative
// (backward: dh [rows, in_cols]), rounded to T and widened back.
template <typename T, Activation A, bool kBackward>
__device__ __forceinline__ float element(const Args& a, int64_t r, int64_t oc) {
  const T* h = static_cast<const T*>(a.h) + r * a.in_cols;
  float v;
  if constexpr (!kBackward) {
    if constexpr (A == Activation::kGelu) {
      v = act::gelu(to_float(h[oc]));
    } else {
      v = act::swiglu(to_float(h[oc]), to_float(h[a.cols + oc]));
    }
  } else {
    const T* da = static_cast<const T*>(a.da) + r * a.cols;
    if constexpr (A == Activation::kGelu) {
      v = act::mul(to_float(da[oc]), act::dgelu(to_float(h[oc])));
    } else {
      const int64_t c = oc < a.cols ? oc : oc - a.cols;
      float dgate, dup;
      act::dswiglu(to_float(da[c]), to_float(h[c]), to_float(h[a.cols + c]), dgate, dup);
      v = oc < a.cols ? dgate : dup;
    }
  }
  return to_float(from_float<T>(v));
}

constexpr int kVec = 8;

// kVec neighbouring inputs p[0 .. kVec), widened; p 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&f)[kVec]) {
  constexpr int kLoads = kVec * static_cast<int>(sizeof(T)) / 16;
  union {
    uint4 u[kLoads];
    T t[kVec];
  } x;
#pragma unroll
  for (int j = 0; j < kLoads; ++j) x.u[j] = reinterpret_cast<const uint4*>(p)[j];
#pragma unroll
  for (int j = 0; j < kVec; ++j) f[j] = to_float(x.t[j]);
}

// The kVec outputs (r, oc0 .. oc0 + kVec) of element(), all inside the matrix, with 16-byte loads
// (a.vec_in): one load instruction per operand instead of one per element and operand, and no
// bounds check per element. The same arithmetic as element(), so the same bits.
template <typename T, Activation A, bool kBackward>
__device__ __forceinline__ void elements_vec(const Args& a, int64_t r, int64_t oc0,
                                             float (&v)[kVec]) {
  const T* h = static_cast<const T*>(a.h) + r * a.in_cols;
  float x[kVec];
  if constexpr (!kBackward) {
    load_vec(h + oc0, x);
    if constexpr (A == Activation::kGelu) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = act::gelu(x[j]);
    } else {
      float up[kVec];
      load_vec(h + a.cols + oc0, up);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = act::swiglu(x[j], up[j]);
    }
  } else {
    const T* da = static_cast<const T*>(a.da) + r * a.cols;
    float g[kVec];
    if constexpr (A == Activation::kGelu) {
      load_vec(da + oc0, g);
      load_vec(h + oc0, x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = act::mul(g[j], act::dgelu(x[j]));
    } else {
      const bool gate = oc0 < a.cols;
      const int64_t c0 = gate ? oc0 : oc0 - a.cols;
      float up[kVec];
      load_vec(da + c0, g);
      load_vec(h + c0, x);
      load_vec(h + a.cols + c0, up);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float dgate, dup;
        act::dswiglu(g[j], x[j], up[j], dgate, dup);
        v[j] = gate ? dgate : dup;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = to_float(from_float<T>(v[j]));
}

// kVec high-precision results, one 16-byte store per 16 bytes (p 16-byte aligned).
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[kVec]) {
  constexpr int kStores = kVec * static_cast<int>(sizeof(T)) / 16;
  union {
    uint4 u[kStores];
    T t[kVec];
  } x;
#pragma unroll
  for (int j = 0; j < kVec; ++j) x.t[j] = from_float<T>(v[j]);
#pragma unroll
  for (int j = 0; j < kStores; ++j) reinterpret_cast<uint4*>(p)[j] = x.u[j];
}

// One pass over the output elements: high-precision result, FP8 bytes and amax, each optional.
// Each thread takes kVec neighbouring elements of a row (one index division per group, not per
// element: the 64-bit division cost more than the activation), and with `vec` (out_cols a multiple
// of kVec, out aligned) stores their FP8 bytes as one 8-byte word.

template <typename T, Activation A, bool kBackward, Format F>
__global__ void __launch_bounds__(kThreads)
    act_kernel(const Args a, T* __restrict__ out_hp, uint8_t* __restrict__ out,
               const float* __restrict__ scale_ptr, unsigned int* __restrict__ amax_bits,
               float* __restrict__ scale_inv, bool vec, bool vec_hp) {
  const float scale = scale_ptr != nullptr ? *scale_ptr : 1.0f;
  const int64_t per_row = (a.out_cols + kVec - 1) / kVec;
  const int64_t n = a.rows * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  uint32_t am = 0;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < n; g += stride) {
    const int64_t r = g / per_row, oc0 = (g - r * per_row) * kVec;
    const int live = static_cast<int>(a.out_cols - oc0 < kVec ? a.out_cols - oc0 : kVec);
    const int64_t i0 = r * a.out_cols + oc0;
    float v[kVec];
    if (a.vec_in && live == kVec) {
      elements_vec<T, A, kBackward>(a, r, oc0, v);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        v[j] = j < live ? element<T, A, kBackward>(a, r, oc0 + j) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) am = max(am, abs_bits(v[j]));
    if (out_hp != nullptr) {
      if (vec_hp && live == kVec) {  // vec_hp: out_cols % kVec == 0, out_hp 16-byte aligned
        store_vec(out_hp + i0, v);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (j < live) out_hp[i0 + j] = from_float<T>(v[j]);
      }
    }
    if (out != nullptr) {
      // The hardware conversion (quantize_scaled), or the CPU's bit recipe once a NaN was seen.
      uint8_t q[kVec];
      quantize_scaled<F, kVec>(v, scale, am == kQuietNaNBits, q);
      store_bytes8(out + i0, q, vec, live);  // vec: live == kVec
    }
  }
  block_amax_commit<kThreads>(am, amax_bits);
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
}

// dbias[oc] = the chunks' sums added in chunk order, rounded once to D.
template <typename D>
__global__ void __launch_bounds__(kThreads)
    chunk_total_kernel(const float* __restrict__ partial, int64_t chunks, int64_t cols,
                       D* __restrict__ dbias) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) s = __fadd_rn(s, partial[k * cols + c]);
  dbias[c] = from_float<D>(s);
}

// ---------------------------------------------------------------- tiled: one pass for all outputs
// A block takes a tile of kTileRows x kTileCols outputs. kTileRows is the CPU's dbias chunk, so a
// tile's column sums are exactly the chunk sums partial[chunk, oc] that chunk_sums_kernel wrote
// (a sequential FP32 sum of the chunk's rows in row order, starting from 0): bit-identical dbias.
constexpr int kTileRows = static_cast<int>(kChunkRows);
constexpr int kTileCols = 64;
constexpr int kTpr = kTileCols / kVec;     // threads per tile row (8)
constexpr int kRpp = kThreads / kTpr;      // tile rows per pass (32)
constexpr int kPasses = kTileRows / kRpp;  // 2
constexpr int kSegs = kTileRows / 16;      // 16-byte segments per transposed row (4)
static_assert(kSegs * kTileCols == kThreads, "one transposed segment per thread");

struct TileOut {
  uint8_t* out;          // [rows, out_cols] or null
  uint8_t* out_t;        // [out_cols, rows] or null
  bool vec;              // out 8-byte aligned and out_cols % kVec == 0: one 8-byte store per thread
  bool vec_t;            // out_t 16-byte aligned and rows % 16 == 0: 16-byte transposed stores
  float* dbias_partial;  // [ceil(rows / 64), out_cols] chunk sums, or null
};

template <typename T, Activation A, bool kBackward, Format F, bool kDbias>
__global__ void __launch_bounds__(kThreads)
    act_tile_kernel(const Args a, const TileOut o, const float* __restrict__ scale_ptr,
                    unsigned int* __restrict__ amax_bits, float* __restrict__ scale_inv) {
  // +1 byte / float of padding per row: the column-wise reads below fall into different banks.
  __shared__ uint8_t tile[kTileRows][kTileCols + 1];
  __shared__ float vals[kDbias ? kTileRows : 1][kTileCols + 1];
  // No scale with dbias alone (activation_cuda allows it): cast nothing, as the CPU's 1.0.
  const float scale = scale_ptr != nullptr ? *scale_ptr : 1.0f;
  const int tc = threadIdx.x % kTpr, tr = threadIdx.x / kTpr;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t oc0 = c0 + tc * kVec;
  const int live =
      static_cast<int>(a.out_cols - oc0 >= kVec ? kVec : (a.out_cols > oc0 ? a.out_cols - oc0 : 0));
  uint32_t am = 0;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int lr = tr + p * kRpp;
    const int64_t r = r0 + lr;
    const bool row_in = r < a.rows;
    float v[kVec];
    if (a.vec_in && row_in && live == kVec) {
      elements_vec<T, A, kBackward>(a, r, oc0, v);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j)  // zero outside the matrix: no effect on amax; never stored
        v[j] = (row_in && j < live) ? element<T, A, kBackward>(a, r, oc0 + j) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) am = max(am, abs_bits(v[j]));
    uint8_t q[kVec];
    quantize_scaled<F, kVec>(v, scale, am == kQuietNaNBits, q);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      tile[lr][tc * kVec + j] = q[j];
      if constexpr (kDbias) vals[lr][tc * kVec + j] = v[j];
    }
    if (o.out != nullptr && row_in && live > 0)
      store_bytes8(o.out + r * a.out_cols + oc0, q, o.vec, live);  // o.vec: live == kVec
  }
  __syncthreads();
  if (o.out_t != nullptr) {
    // Transposed row c0 + oc (an output column) holds the tile's 64 rows: 4 segments of 16 bytes.
    const int oc = threadIdx.x / kSegs, seg = (threadIdx.x % kSegs) * 16;
    const int64_t orow = c0 + oc, rbeg = r0 + seg;
    if (orow < a.out_cols && rbeg < a.rows) {
      union {
        uint4 u;
        uint8_t b[16];
      } t;
#pragma unroll
      for (int i = 0; i < 16; ++i) t.b[i] = tile[seg + i][oc];
      uint8_t* dst = o.out_t + orow * a.rows + rbeg;
      if (o.vec_t) {  // rows % 16 == 0, so rbeg < rows means all 16 are inside
        *reinterpret_cast<uint4*>(dst) = t.u;
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i)  // constant indices keep `t` in registers
          if (rbeg + i < a.rows) dst[i] = t.b[i];
      }
    }
  }
  if constexpr (kDbias) {
    if (threadIdx.x < kTileCols && c0 + threadIdx.x < a.out_cols) {
      const int64_t live_rows = a.rows - r0 < kTileRows ? a.rows - r0 : kTileRows;
      float sum = 0.0f;
      for (int64_t i = 0; i < live_rows; ++i) sum = __fadd_rn(sum, vals[i][threadIdx.x]);
      o.dbias_partial[static_cast<int64_t>(blockIdx.y) * a.out_cols + c0 + threadIdx.x] = sum;
    }
  }
  block_amax_commit<kThreads>(am, amax_bits);
  if (scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    *scale_inv = 1.0f / scale;
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * 8;
  return static_cast<int>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

template <typename T, Activation A, bool kBackward, bool kDbias>
void launch_tiled(const ActParams& p, const Args& a, cudaStream_t st) {
  const int64_t chunks = (p.rows + kTileRows - 1) / kTileRows;
  FP8DP_CHECK(chunks <= 65535, "activation_cuda: the transposed / dbias path supports up to ",
              65535 * kChunkRows, " rows, got ", p.rows);
  TileOut o{
      p.out, p.out_t,
      p.out != nullptr && a.out_cols % kVec == 0 && reinterpret_cast<uintptr_t>(p.out) % 8 == 0,
      p.out_t != nullptr && aligned16(p.out_t) && p.rows % 16 == 0, nullptr};
  if (kDbias) o.dbias_partial = scratch_alloc<float>(static_cast<size_t>(chunks * a.out_cols), st);
  auto* amax_bits = reinterpret_cast<unsigned int*>(p.amax);
  const dim3 grid(static_cast<unsigned>((a.out_cols + kTileCols - 1) / kTileCols),
                  static_cast<unsigned>(chunks));
  if (p.format == Format::kE4M3) {
    act_tile_kernel<T, A, kBackward, Format::kE4M3, kDbias>
        <<<grid, kThreads, 0, st>>>(a, o, p.scale, amax_bits, p.scale_inv);
  } else {
    act_tile_kernel<T, A, kBackward, Format::kE5M2, kDbias>
        <<<grid, kThreads, 0, st>>>(a, o, p.scale, amax_bits, p.scale_inv);
  }
  FP8DP_CHECK_CUDA(cudaGetLastError());
  if (!kDbias) return;
  // dbias[oc] = the chunk sums added in chunk order, as the CPU adds them.
  const unsigned g2 = static_cast<unsigned>((a.out_cols + kThreads - 1) / kThreads);
  switch (p.dbias_dtype) {
    case DType::kFloat32:
      chunk_total_kernel<<<g2, kThreads, 0, st>>>(o.dbias_partial, chunks, a.out_cols,
                                                  static_cast<float*>(p.dbias));
      break;
    case DType::kBFloat16:
      chunk_total_kernel<<<g2, kThreads, 0, st>>>(o.dbias_partial, chunks, a.out_cols,
                                                  static_cast<__nv_bfloat16*>(p.dbias));
      break;
    case DType::kFloat16:
      chunk_total_kernel<<<g2, kThreads, 0, st>>>(o.dbias_partial, chunks, a.out_cols,
                                                  static_cast<__half*>(p.dbias));
      break;
    default:
      FP8DP_CHECK(false, "activation_cuda: no dbias output of dtype ", dtype_name(p.dbias_dtype));
  }
  FP8DP_CHECK_CUDA(cudaGetLastError());
  scratch_free(o.dbias_partial, st);
}

template <typename T, Activation A, bool kBackward>
void launch(const ActParams& p, cudaStream_t st) {
  // kVec elements of any input dtype (2 or 4 bytes) are a whole number of 16-byte words, so
  // cols % kVec == 0 keeps every row start (and SwiGLU's up half) as aligned as the base.
  const Args a{
      p.input,
      p.grad,
      p.rows,
      p.cols,
      p.in_cols(),
      p.out_cols(),
      p.cols % kVec == 0 && aligned16(p.input) && (p.grad == nullptr || aligned16(p.grad))};
  if (p.amax != nullptr && !p.amax_accumulate)
    FP8DP_CHECK_CUDA(cudaMemsetAsync(p.amax, 0, sizeof(float), st));
  if (p.out_t != nullptr || p.dbias != nullptr) {
    FP8DP_CHECK(p.out_hp == nullptr,
                "activation_cuda: the high-precision result is not written with the transposed "
                "bytes or dbias");
    return p.dbias != nullptr ? launch_tiled<T, A, kBackward, true>(p, a, st)
                              : launch_tiled<T, A, kBackward, false>(p, a, st);
  }
  auto* amax_bits = reinterpret_cast<unsigned int*>(p.amax);
  T* out_hp = static_cast<T*>(p.out_hp);
  const int64_t groups = p.rows * ((a.out_cols + kVec - 1) / kVec);
  const bool vec = a.out_cols % kVec == 0 && reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
  const bool vec_hp = a.out_cols % kVec == 0 && aligned16(out_hp);
  const int act_grid = grid_for(groups);
  if (p.format == Format::kE4M3) {
    act_kernel<T, A, kBackward, Format::kE4M3><<<act_grid, kThreads, 0, st>>>(
        a, out_hp, p.out, p.scale, amax_bits, p.scale_inv, vec, vec_hp);
  } else {
    act_kernel<T, A, kBackward, Format::kE5M2><<<act_grid, kThreads, 0, st>>>(
        a, out_hp, p.out, p.scale, amax_bits, p.scale_inv, vec, vec_hp);
  }
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void dispatch_act(const ActParams& p, cudaStream_t st) {
  if (p.act == Activation::kGelu) {
    return p.backward ? launch<T, Activation::kGelu, true>(p, st)
                      : launch<T, Activation::kGelu, false>(p, st);
  }
  return p.backward ? launch<T, Activation::kSwiglu, true>(p, st)
                    : launch<T, Activation::kSwiglu, false>(p, st);
}

}  // namespace
}  // namespace cuda

void activation_cuda(const ActParams& p, void* stream) {
  FP8DP_CHECK(p.scale != nullptr || (p.out == nullptr && p.out_t == nullptr),
              "activation_cuda: an FP8 output needs a scale");
  auto st = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32:
      return cuda::dispatch_act<float>(p, st);
    case DType::kBFloat16:
      return cuda::dispatch_act<__nv_bfloat16>(p, st);
    case DType::kFloat16:
      return cuda::dispatch_act<__half>(p, st);
    default:
      FP8DP_CHECK(false, "activation_cuda: no kernel for input dtype ", dtype_name(p.dtype));
  }
}

}  // namespace fp8dp
