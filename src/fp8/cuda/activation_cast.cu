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
// bf16 inputs are looked up, not computed (activation_lut.h): the kernels copy the tables they
// need (16 or 32 KB) into shared memory once per block, and compute only the elements outside the
// tables' range; the tiled kernel then takes tiles in a loop (one block per tile would copy the
// tables once per 4,096 elements). The tables are filled once per device, outside any capture; a
// launch that finds them unfilled while its stream captures computes every element instead.
//
// Two kernels. Row-major bytes alone (the forward's fc2 input, and the amax pass): a flat pass,
// eight neighbouring output elements per thread and step. With the transposed bytes or dbias (the
// backward's fc1 grad_output, and the forward when the wgrad needs the transpose): one tiled pass
// that writes the row-major bytes, transposes the tile through shared memory and sums each
// column's 64 rows, so the activation is computed once and h / da are read once (a dbias pass
// that recomputed it and a byte-transpose pass cost more: docs/changelog.md, 2026-12-04).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/cuda_scratch.h"
#include "fp8/activation_kernel.h"
#include "fp8/activation_lut.h"
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

// A result as the CPU stores it in T (activation_cpu.cpp): every NaN as the positive quiet NaN,
// which c10 stores as 0x7FC0 in bf16 and 0x7E00 in half. The hardware conversions would give
// bf16 0x7FFF, and a NaN's sign differs between the devices (x86 makes -Inf * 0 a negative NaN,
// the GPU a positive one), which would reach the FP8 byte (0xFF against 0x7F).
template <typename T>
__device__ __forceinline__ T canonical_nan();
template <>
__device__ __forceinline__ float canonical_nan<float>() {
  return __uint_as_float(kQuietNaNBits);
}
template <>
__device__ __forceinline__ __nv_bfloat16 canonical_nan<__nv_bfloat16>() {
  return __ushort_as_bfloat16(0x7FC0);
}
template <>
__device__ __forceinline__ __half canonical_nan<__half>() {
  return __ushort_as_half(0x7E00);
}
template <typename T>
__device__ __forceinline__ T to_storage(float v) {
  return v != v ? canonical_nan<T>() : from_float<T>(v);
}
// v rounded to T and widened back (exact), NaN canonical.
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  return to_float(to_storage<T>(v));
}

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
  return rounded<T>(v);
}

constexpr int kVec = 8;

// ---------------------------------------------------------------- tables (activation_lut.h)
using act_lut::kLutSize;

// Every table of every device, filled by fill_lut_kernel; 16-byte aligned for the float4 copies.
__device__ __align__(16) float g_lut[act_lut::kFns * kLutSize];

__global__ void fill_lut_kernel(float* lut) {
  const uint32_t i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= act_lut::kFns * kLutSize) return;
  lut[i] = act_lut::eval(static_cast<act_lut::Fn>(i / kLutSize), act_lut::value(i % kLutSize));
}

// Work per block that amortises its copy of the tables (16 KB: as many bytes as 4,096 bf16
// inputs and outputs): 4 tiles of 64 x 64 outputs, or 8 groups of kVec per thread.
constexpr int64_t kLutTiles = 4;
constexpr int64_t kLutGroups = 8;

// The tables a kernel reads: GELU's or its derivative's; SiLU (forward); SiLU and SiLU'
// (backward), adjacent in g_lut.
template <Activation A, bool kBackward>
constexpr int lut_count() {
  return A == Activation::kSwiglu && kBackward ? 2 : 1;
}
template <Activation A, bool kBackward>
constexpr int lut_first() {
  return static_cast<int>(A == Activation::kGelu
                              ? (kBackward ? act_lut::Fn::kDgelu : act_lut::Fn::kGelu)
                              : act_lut::Fn::kSilu);
}
template <Activation A, bool kBackward>
constexpr int lut_bytes() {
  return lut_count<A, kBackward>() * static_cast<int>(kLutSize * sizeof(float));
}

extern __shared__ float4 lut_smem[];

// Copies the kernel's tables from g_lut (`all`) into shared memory; every thread of the block.
template <Activation A, bool kBackward>
__device__ __forceinline__ const float* load_lut(const float* __restrict__ all) {
  constexpr int kQuads = lut_bytes<A, kBackward>() / 16;
  const float4* src = reinterpret_cast<const float4*>(all + lut_first<A, kBackward>() * kLutSize);
  for (int i = threadIdx.x; i < kQuads; i += kThreads) lut_smem[i] = src[i];
  __syncthreads();
  return reinterpret_cast<const float*>(lut_smem);
}

// The tables of the current device, filled on first use; null (compute instead) while the stream
// captures a graph before they were filled, since the fill synchronises.
const float* lut_tables(cudaStream_t st) {
  constexpr int kMaxDevices = 64;
  static std::atomic<const float*> ready[kMaxDevices];
  static std::mutex fill_mutex;
  int dev = 0;
  FP8DP_CHECK_CUDA(cudaGetDevice(&dev));
  if (dev >= kMaxDevices) return nullptr;
  if (const float* t = ready[dev].load(std::memory_order_acquire)) return t;
  std::lock_guard<std::mutex> lock(fill_mutex);
  if (const float* t = ready[dev].load(std::memory_order_acquire)) return t;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &status) != cudaSuccess || status != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return nullptr;
  }
  // The fill synchronises: relaxed capture mode for this thread, so that a capture another thread
  // runs in global mode is not invalidated by it (restored on every exit).
  struct RelaxedCapture {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode); }
    ~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode); }
  } relaxed;
  void* p = nullptr;
  FP8DP_CHECK_CUDA(cudaGetSymbolAddress(&p, g_lut));
  constexpr unsigned kBlocks = (act_lut::kFns * kLutSize + kThreads - 1) / kThreads;
  fill_lut_kernel<<<kBlocks, kThreads, 0, st>>>(static_cast<float*>(p));
  FP8DP_CHECK_CUDA(cudaGetLastError());
  // Once: later launches on any stream must find the tables written.
  FP8DP_CHECK_CUDA(cudaStreamSynchronize(st));
  ready[dev].store(static_cast<const float*>(p), std::memory_order_release);
  return static_cast<const float*>(p);
}

// Resident blocks of a kernel on the whole device (the tiled kernel's grid when it loops).
template <auto Kernel>
int resident_blocks(int dynamic_smem) {
  static std::atomic<int> per_sm{0};
  int n = per_sm.load(std::memory_order_relaxed);
  if (n == 0) {
    FP8DP_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, reinterpret_cast<const void*>(Kernel), kThreads, dynamic_smem));
    n = n > 0 ? n : 1;
    per_sm.store(n, std::memory_order_relaxed);
  }
  return n * sm_count();
}

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

// One looked-up value per element of x (kVec widened bf16 values); `miss` gets bit j where x[j]
// lies outside the table, and v[j] is then left for the caller to compute.
__device__ __forceinline__ uint32_t look_up(const float* __restrict__ lut, const float (&x)[kVec],
                                            float (&v)[kVec]) {
  uint32_t miss = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    bool in;
    v[j] = lut[act_lut::slot(x[j], in)];
    miss |= (in ? 0u : 1u) << j;
  }
  return miss;
}

// The activation's factor of each of kVec inputs x (a widened T each): GELU (forward) or its
// derivative (backward); for SwiGLU, silu (forward, and the up half's backward) or silu' (the
// gate half's backward, `gate`). With kLut (bf16 only) it is looked up in the tables in shared
// memory (`lut`) and computed only for the inputs they miss (rare: the branch is taken by few
// warps); a table entry is the computation's result, so the bits are the same either way. GELU's
// forward table holds its outputs already rounded to T, so its misses are rounded here too.
template <typename T, Activation A, bool kBackward, bool kLut>
__device__ __forceinline__ void factors(const float* __restrict__ lut, bool gate,
                                        const float (&x)[kVec], float (&f)[kVec]) {
  static_assert(!kLut || std::is_same_v<T, __nv_bfloat16>, "tables are for bf16 inputs only");
  auto compute = [gate](float xi) {
    if constexpr (A == Activation::kGelu) {
      if constexpr (kBackward) return act::dgelu(xi);
      return kLut ? rounded<T>(act::gelu(xi)) : act::gelu(xi);
    } else {
      return kBackward && gate ? act::dsilu(xi) : act::silu(xi);
    }
  };
  if constexpr (kLut) {
    // SiLU' follows SiLU in shared memory (load_lut).
    const bool second = A == Activation::kSwiglu && kBackward && gate;
    const uint32_t miss = look_up(second ? lut + kLutSize : lut, x, f);
    if (miss != 0) {
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        if (miss & (1u << j)) f[j] = compute(x[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) f[j] = compute(x[j]);
  }
}

// kVec neighbouring inputs as they lie in memory: one 16-byte word for 16-bit dtypes, two for
// FP32.
template <typename T>
union Raw {
  uint4 u[kVec * sizeof(T) / 16];
  T t[kVec];
};

// The inputs of one group of kVec outputs (load_group): h's, SwiGLU's up half's, and the
// backward's da; a member the activation does not read is never loaded (and compiled away).
template <typename T>
struct GroupIn {
  Raw<T> x, up, g;
};

template <typename T>
__device__ __forceinline__ void load_raw(const T* p, Raw<T>& r) {
#pragma unroll
  for (int j = 0; j < static_cast<int>(kVec * sizeof(T) / 16); ++j)
    r.u[j] = reinterpret_cast<const uint4*>(p)[j];
}

template <typename T>
__device__ __forceinline__ void widen(const Raw<T>& r, float (&f)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) f[j] = to_float(r.t[j]);
}

// Whether the group of outputs starting at oc0 reads SwiGLU's gate half (its backward writes
// both halves: the gate's gradient in [0, cols), the up half's in [cols, 2 cols)).
template <Activation A, bool kBackward>
__device__ __forceinline__ bool gate_group(const Args& a, int64_t oc0) {
  return !(A == Activation::kSwiglu && kBackward) || oc0 < a.cols;
}

// Calls f(op, p, raw) for each input operand of the group (r, oc0 .. oc0 + kVec): op numbers it
// (h, SwiGLU's up half, da: 0, 1, 2; da is 1 for GELU), p is its first element, raw the member of
// `in` it belongs in. An operand the activation does not read is skipped (and compiled away).
template <typename T, Activation A, bool kBackward, typename F>
__device__ __forceinline__ void group_operands(const Args& a, int64_t r, int64_t oc0,
                                               GroupIn<T>& in, F&& f) {
  const T* h = static_cast<const T*>(a.h) + r * a.in_cols;
  const bool gate = gate_group<A, kBackward>(a, oc0);
  const int64_t c0 = gate ? oc0 : oc0 - a.cols;  // the input column of the group
  f(0, h + c0, in.x);
  if constexpr (A == Activation::kSwiglu) {
    if (!kBackward || gate) f(1, h + a.cols + c0, in.up);
  }
  if constexpr (kBackward)
    f(A == Activation::kSwiglu ? 2 : 1, static_cast<const T*>(a.da) + r * a.cols + c0, in.g);
}

// The loads of elements_vec for the group (r, oc0 .. oc0 + kVec), all inside the matrix, 16-byte
// aligned (a.vec_in): one load instruction per operand instead of one per element and operand.
template <typename T, Activation A, bool kBackward>
__device__ __forceinline__ void load_group(const Args& a, int64_t r, int64_t oc0, GroupIn<T>& in) {
  group_operands<T, A, kBackward>(a, r, oc0, in,
                                  [](int, const T* p, Raw<T>& raw) { load_raw(p, raw); });
}

// ---------------------------------------------------------------- staging (kAhead 3)
// act_tile_kernel's kAhead 3: the inputs of the block's next tile, copied into shared memory by
// cp.async while this tile is computed: the copies hold no registers, so the whole next tile is in
// flight during the arithmetic, the transpose and the stores of this one (which the register
// variants, kAhead 1 and 2, leave idle or pay for in occupancy). Each thread copies and later reads
// only its own slots, so a slot needs no barrier: cp.async.wait_group orders the thread's own
// copies before its reads. Slots: [stage 2][pass][operand][16-byte chunk][thread], 16-byte words,
// conflict-free.
template <Activation A, bool kBackward>
constexpr int stage_operands() {  // h (the gate half for SwiGLU), SwiGLU's up half, da
  return 1 + (A == Activation::kSwiglu ? 1 : 0) + (kBackward ? 1 : 0);
}
template <typename T>
constexpr int raw_chunks() {
  return static_cast<int>(kVec * sizeof(T) / 16);
}

__device__ __forceinline__ void cp_async16(uint4* smem, const uint4* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
  *smem = *gmem;  // before sm_80: a plain copy (still correct, nothing overlaps)
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits for every committed group of this thread but the latest one.
__device__ __forceinline__ void cp_async_wait_all_but_last() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
#endif
}

// Operand `op`'s chunks of this thread's group, at slot base `st` (one stage and pass).
template <typename T>
__device__ __forceinline__ void stage_raw(const T* p, uint4* st, int op) {
#pragma unroll
  for (int j = 0; j < raw_chunks<T>(); ++j)
    cp_async16(st + (op * raw_chunks<T>() + j) * kThreads + threadIdx.x,
               reinterpret_cast<const uint4*>(p) + j);
}
template <typename T>
__device__ __forceinline__ void unstage_raw(const uint4* st, int op, Raw<T>& r) {
#pragma unroll
  for (int j = 0; j < raw_chunks<T>(); ++j)
    r.u[j] = st[(op * raw_chunks<T>() + j) * kThreads + threadIdx.x];
}

// load_group's operands, copied asynchronously into the slots at `st` (stage_group) and read back
// from them once they arrived (unstage_group): the same operands, so the same bits.
template <typename T, Activation A, bool kBackward>
__device__ __forceinline__ void stage_group(const Args& a, int64_t r, int64_t oc0, uint4* st) {
  GroupIn<T> unused;
  group_operands<T, A, kBackward>(a, r, oc0, unused,
                                  [st](int op, const T* p, Raw<T>&) { stage_raw(p, st, op); });
}
template <typename T, Activation A, bool kBackward>
__device__ __forceinline__ void unstage_group(const Args& a, int64_t oc0, const uint4* st,
                                              GroupIn<T>& in) {
  group_operands<T, A, kBackward>(
      a, 0, oc0, in, [st](int op, const T*, Raw<T>& raw) { unstage_raw(st, op, raw); });
}

// The kVec outputs of element() from the activation's factors f (factors()) and, as the
// activation needs them, SwiGLU's up values and the backward's da values g. The same operations
// as element() (act::swiglu = silu(g) up; act::dswiglu's d gate = (da up) silu'(g), d up = da
// silu(g)), so the same bits. A group lies in one half of SwiGLU's backward output (cols % kVec
// == 0), so it needs one of the two (`gate`).
template <typename T, Activation A, bool kBackward, bool kLut>
__device__ __forceinline__ void combine(bool gate, const float (&f)[kVec], const float (&up)[kVec],
                                        const float (&g)[kVec], float (&v)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    if constexpr (!kBackward) {
      v[j] = A == Activation::kGelu ? f[j] : act::mul(f[j], up[j]);
    } else if constexpr (A == Activation::kGelu) {
      v[j] = act::mul(g[j], f[j]);
    } else {
      v[j] = gate ? act::mul(act::mul(g[j], up[j]), f[j]) : act::mul(g[j], f[j]);
    }
  }
  // Rounded to T (GELU's forward from the tables already is).
  if constexpr (!(kLut && A == Activation::kGelu && !kBackward)) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = rounded<T>(v[j]);
  }
}

// The kVec outputs of element() from load_group's inputs.
template <typename T, Activation A, bool kBackward, bool kLut>
__device__ __forceinline__ void compute_group(const Args& a, int64_t oc0, const GroupIn<T>& in,
                                              float (&v)[kVec], const float* __restrict__ lut) {
  const bool gate = gate_group<A, kBackward>(a, oc0);
  float x[kVec], f[kVec], up[kVec], g[kVec];
  widen(in.x, x);
  factors<T, A, kBackward, kLut>(lut, gate, x, f);
  if constexpr (A == Activation::kSwiglu) {
    if (!kBackward || gate) widen(in.up, up);
  }
  if constexpr (kBackward) widen(in.g, g);
  combine<T, A, kBackward, kLut>(gate, f, up, g, v);
}

// The kVec outputs (r, oc0 .. oc0 + kVec) of element(), all inside the matrix, with 16-byte loads
// (a.vec_in), each load followed by its use (load_group + compute_group load all first).
template <typename T, Activation A, bool kBackward, bool kLut>
__device__ __forceinline__ void elements_vec(const Args& a, int64_t r, int64_t oc0,
                                             float (&v)[kVec], const float* __restrict__ lut) {
  const T* h = static_cast<const T*>(a.h) + r * a.in_cols;
  const bool gate = gate_group<A, kBackward>(a, oc0);
  const int64_t c0 = gate ? oc0 : oc0 - a.cols;  // the input column of the group
  float x[kVec], f[kVec], up[kVec], g[kVec];
  load_vec(h + c0, x);
  factors<T, A, kBackward, kLut>(lut, gate, x, f);
  if constexpr (A == Activation::kSwiglu) {
    if (!kBackward || gate) load_vec(h + a.cols + c0, up);
  }
  if constexpr (kBackward) load_vec(static_cast<const T*>(a.da) + r * a.cols + c0, g);
  combine<T, A, kBackward, kLut>(gate, f, up, g, v);
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
  for (int j = 0; j < kVec; ++j) x.t[j] = to_storage<T>(v[j]);
#pragma unroll
  for (int j = 0; j < kStores; ++j) reinterpret_cast<uint4*>(p)[j] = x.u[j];
}

// One pass over the output elements: high-precision result, FP8 bytes and amax, each optional.
// Each thread takes kVec neighbouring elements of a row (one index division per group, not per
// element: the 64-bit division cost more than the activation), and with `vec` (out_cols a multiple
// of kVec, out aligned) stores their FP8 bytes as one 8-byte word.

template <typename T, Activation A, bool kBackward, Format F, bool kLut>
__global__ void __launch_bounds__(kThreads)
    act_kernel(const Args a, T* __restrict__ out_hp, uint8_t* __restrict__ out,
               const float* __restrict__ scale_ptr, unsigned int* __restrict__ amax_bits,
               float* __restrict__ scale_inv, bool vec, bool vec_hp,
               const float* __restrict__ lut_all) {
  const float* lut = nullptr;
  if constexpr (kLut) lut = load_lut<A, kBackward>(lut_all);
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
      elements_vec<T, A, kBackward, kLut>(a, r, oc0, v, lut);
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
          if (j < live) out_hp[i0 + j] = to_storage<T>(v[j]);
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
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    *scale_inv = scale_inverse(scale);
}

// dbias[oc] = the chunks' sums added in chunk order, rounded once to D. The order is the CPU's
// (one sequential FP32 chain per column), so the work per column cannot be split; what can be
// spread is the loading. A block of kThreads threads takes kTotalCols columns: its threads load
// kTotalRound chunks at a time into shared memory (kTotalRound / kTotalSlices independent loads per
// thread in flight), then one warp adds them in order. One thread per column walking the chunks
// through global memory (the kernel until 12-06) was a chain of L2 / DRAM round trips on 24 blocks
// for 6,144 columns, about as long as the tiled pass it followed took to sum the tiles.
constexpr int kTotalCols = 32;
constexpr int kTotalSlices = kThreads / kTotalCols;  // 8
constexpr int kTotalRound = 128;                     // chunks per round: 8,192 rows
template <typename D>
__global__ void __launch_bounds__(kThreads)
    chunk_total_kernel(const float* __restrict__ partial, int64_t chunks, int64_t cols,
                       D* __restrict__ dbias) {
  __shared__ float part[kTotalRound][kTotalCols + 1];
  const int tx = threadIdx.x % kTotalCols, ty = threadIdx.x / kTotalCols;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTotalCols + tx;
  float s = 0.0f;  // the column's sum, in warp 0
  for (int64_t k0 = 0; k0 < chunks; k0 += kTotalRound) {
    const int64_t n = chunks - k0 < kTotalRound ? chunks - k0 : kTotalRound;
    constexpr int kPer = kTotalRound / kTotalSlices;  // loads per thread and round (16)
    float v[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {  // all issued before any is stored
      const int k = ty + j * kTotalSlices;
      v[j] = c < cols && k < n ? partial[(k0 + k) * cols + c] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) part[ty + j * kTotalSlices][tx] = v[j];
    __syncthreads();
    if (ty == 0) {
#pragma unroll 8
      for (int k = 0; k < n; ++k) s = __fadd_rn(s, part[k][tx]);
    }
    __syncthreads();  // the next round overwrites part
  }
  if (ty == 0 && c < cols) dbias[c] = from_float<D>(s);
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

// Dynamic shared memory of kAhead 3's slots: two stages of a tile's inputs (32 KB for GELU's
// backward in bf16: as much as its table and its tile together).
template <typename T, Activation A, bool kBackward>
constexpr int stage_bytes() {
  return 2 * kPasses * stage_operands<A, kBackward>() * raw_chunks<T>() * kThreads * 16;
}

struct TileOut {
  uint8_t* out;          // [rows, out_cols] or null
  uint8_t* out_t;        // [out_cols, rows] or null
  bool vec;              // out 8-byte aligned and out_cols % kVec == 0: one 8-byte store per thread
  bool vec_t;            // out_t 16-byte aligned and rows % 16 == 0: 16-byte transposed stores
  float* dbias_partial;  // [ceil(rows / 64), out_cols] chunk sums, or null
};

// Tiles t = blockIdx.x, blockIdx.x + gridDim.x, ... of the (row band, column band) grid, row
// bands outer: one tile per block (grid = tiles) when computing, a loop over tiles (grid = the
// resident blocks) with the tables, so that each block copies them once.
// kAhead, for a tile wholly inside the matrix on the vector path ("whole"): 0, each pass's loads
// are followed by their use (one group's loads per memory round trip, the kernel until 12-06);
// 1, the tile's kPasses groups are loaded before any is used; 2, also the block's next whole
// tile's groups, before this tile's results are computed. More loads in flight, more registers
// (fewer resident blocks); 3, the next whole tile's groups copied into shared memory by cp.async
// (stage_group) while this one is computed, no registers held: dynamic shared memory after the
// tables, stage_bytes. dev/act_cast_variants.cu times the four. The arithmetic and its order
// are the same in all of them.
template <typename T, Activation A, bool kBackward, Format F, bool kDbias, bool kLut,
          int kAhead = 0>
__global__ void __launch_bounds__(kThreads)
    act_tile_kernel(const Args a, const TileOut o, const float* __restrict__ scale_ptr,
                    unsigned int* __restrict__ amax_bits, float* __restrict__ scale_inv,
                    const float* __restrict__ lut_all, int64_t col_tiles, int64_t tiles) {
  // +1 byte / float of padding per row: the column-wise reads below fall into different banks.
  __shared__ uint8_t tile[kTileRows][kTileCols + 1];
  __shared__ float vals[kDbias ? kTileRows : 1][kTileCols + 1];
  const float* lut = nullptr;
  if constexpr (kLut) lut = load_lut<A, kBackward>(lut_all);
  // No scale with dbias alone (activation_cuda allows it): cast nothing, as the CPU's 1.0.
  const float scale = scale_ptr != nullptr ? *scale_ptr : 1.0f;
  const int tc = threadIdx.x % kTpr, tr = threadIdx.x / kTpr;
  uint32_t am = 0;
  // Tile t's first row and column; whether it lies wholly inside the matrix on the vector path
  // (the same answer in every thread of the block).
  const auto origin = [&](int64_t t, int64_t& r0, int64_t& c0) {
    const int64_t band = t / col_tiles;
    r0 = band * kTileRows;
    c0 = (t - band * col_tiles) * kTileCols;
  };
  const auto whole = [&](int64_t t) {
    int64_t r0, c0;
    origin(t, r0, c0);
    return a.vec_in && r0 + kTileRows <= a.rows && c0 + kTileCols <= a.out_cols;
  };
  const auto load_tile = [&](int64_t t, GroupIn<T>(&in)[kPasses]) {
    int64_t r0, c0;
    origin(t, r0, c0);
#pragma unroll
    for (int p = 0; p < kPasses; ++p)
      load_group<T, A, kBackward>(a, r0 + tr + p * kRpp, c0 + tc * kVec, in[p]);
  };
  // kAhead 3: the slots after the tables in dynamic shared memory, stage 0 then 1.
  uint4* slots = reinterpret_cast<uint4*>(lut_smem) + (kLut ? lut_bytes<A, kBackward>() / 16 : 0);
  constexpr int kStageWords = stage_bytes<T, A, kBackward>() / 32;  // one stage, 16-byte words
  constexpr int kPassWords = kStageWords / kPasses;
  const auto stage_tile = [&](int64_t t, int s) {
    int64_t r0, c0;
    origin(t, r0, c0);
#pragma unroll
    for (int p = 0; p < kPasses; ++p)
      stage_group<T, A, kBackward>(a, r0 + tr + p * kRpp, c0 + tc * kVec,
                                   slots + s * kStageWords + p * kPassWords);
  };
  int stage = 0;  // the slots of tile t
  if (kAhead == 3) {
    if (blockIdx.x < tiles && whole(blockIdx.x)) stage_tile(blockIdx.x, 0);
    cp_async_commit();  // a group per tile, empty or not: wait_group counts them
  }
  GroupIn<T> next[kPasses];  // kAhead 2: the inputs of the block's next tile, when it is whole
  bool next_loaded = false;
  if (kAhead == 2 && blockIdx.x < tiles && whole(blockIdx.x)) {
    load_tile(blockIdx.x, next);
    next_loaded = true;
  }
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {  // the same count in every thread
    int64_t r0, c0;
    origin(t, r0, c0);
    const int64_t band = r0 / kTileRows;  // the dbias chunk
    const int64_t oc0 = c0 + tc * kVec;
    const int live = static_cast<int>(
        a.out_cols - oc0 >= kVec ? kVec : (a.out_cols > oc0 ? a.out_cols - oc0 : 0));
    // Pass p's kVec results v: amax, bytes, the staged tile (and dbias values).
    const auto finish = [&](int p, float (&v)[kVec]) {
      const int lr = tr + p * kRpp;
      const int64_t r = r0 + lr;
      const bool row_in = r < a.rows;
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
    };
    // A whole tile's results from its inputs (the register and staged variants).
    const auto finish_tile = [&](const GroupIn<T>(&in)[kPasses]) {
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        float v[kVec];
        compute_group<T, A, kBackward, kLut>(a, oc0, in[p], v, lut);
        finish(p, v);
      }
    };
    if (kAhead == 2 && next_loaded) {  // this tile is whole and its inputs are in registers
      GroupIn<T> in[kPasses];
#pragma unroll
      for (int p = 0; p < kPasses; ++p) in[p] = next[p];
      const int64_t tn = t + gridDim.x;
      next_loaded = tn < tiles && whole(tn);
      if (next_loaded) load_tile(tn, next);
      finish_tile(in);
    } else if (kAhead == 3 && whole(t)) {
      const int64_t tn = t + gridDim.x;
      if (tn < tiles && whole(tn)) stage_tile(tn, stage ^ 1);
      cp_async_commit();
      cp_async_wait_all_but_last();  // tile t's copies have arrived
      GroupIn<T> in[kPasses];
#pragma unroll
      for (int p = 0; p < kPasses; ++p)
        unstage_group<T, A, kBackward>(a, oc0, slots + stage * kStageWords + p * kPassWords, in[p]);
      finish_tile(in);
    } else if (kAhead == 1 && whole(t)) {
      GroupIn<T> in[kPasses];
      load_tile(t, in);
      finish_tile(in);
    } else {
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        const int64_t r = r0 + tr + p * kRpp;
        const bool row_in = r < a.rows;
        float v[kVec];
        if (a.vec_in && row_in && live == kVec) {
          elements_vec<T, A, kBackward, kLut>(a, r, oc0, v, lut);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j)  // zero outside the matrix: no effect on amax; not stored
            v[j] = (row_in && j < live) ? element<T, A, kBackward>(a, r, oc0 + j) : 0.0f;
        }
        finish(p, v);
      }
      if (kAhead == 2) {  // the next tile's inputs, if it is whole (this one was not)
        const int64_t tn = t + gridDim.x;
        next_loaded = tn < tiles && whole(tn);
        if (next_loaded) load_tile(tn, next);
      }
      if (kAhead == 3) {  // the same for the slots
        const int64_t tn = t + gridDim.x;
        if (tn < tiles && whole(tn)) stage_tile(tn, stage ^ 1);
        cp_async_commit();
      }
    }
    if (kAhead == 3) stage ^= 1;
    __syncthreads();
    if (o.out_t != nullptr) {
      // Transposed row c0 + oc (an output column) holds the tile's 64 rows: 4 segments of 16 bytes.
      const int oc = threadIdx.x / kSegs, seg = (threadIdx.x % kSegs) * 16;
      const int64_t orow = c0 + oc, rbeg = r0 + seg;
      if (orow < a.out_cols && rbeg < a.rows) {
        union {
          uint4 u;
          uint8_t b[16];
        } tb;
#pragma unroll
        for (int i = 0; i < 16; ++i) tb.b[i] = tile[seg + i][oc];
        uint8_t* dst = o.out_t + orow * a.rows + rbeg;
        if (o.vec_t) {  // rows % 16 == 0, so rbeg < rows means all 16 are inside
          *reinterpret_cast<uint4*>(dst) = tb.u;
        } else {
#pragma unroll
          for (int i = 0; i < 16; ++i)  // constant indices keep `tb` in registers
            if (rbeg + i < a.rows) dst[i] = tb.b[i];
        }
      }
    }
    if constexpr (kDbias) {
      if (threadIdx.x < kTileCols && c0 + threadIdx.x < a.out_cols) {
        const int64_t live_rows = a.rows - r0 < kTileRows ? a.rows - r0 : kTileRows;
        float sum = 0.0f;
        for (int64_t i = 0; i < live_rows; ++i) sum = __fadd_rn(sum, vals[i][threadIdx.x]);
        o.dbias_partial[band * a.out_cols + c0 + threadIdx.x] = sum;
      }
    }
    __syncthreads();  // the next tile writes tile / vals
  }
  block_amax_commit<kThreads>(am, amax_bits);
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    *scale_inv = scale_inverse(scale);
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * 8;
  return static_cast<int>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

// Launches Kernel (an act_tile_kernel) with the tables (lut non-null) or without.
// kStaged: the kernel's kAhead is 3 (its slots follow the tables in dynamic shared memory).
template <auto Kernel, typename T, Activation A, bool kBackward, bool kStaged>
void launch_tile_kernel(const Args& a, const TileOut& o, const ActParams& p, const float* lut,
                        int64_t col_tiles, int64_t tiles, cudaStream_t st) {
  int blocks = static_cast<int>(tiles < INT32_MAX ? tiles : INT32_MAX);  // more: loop over tiles
  int smem = 0;
  if (lut != nullptr || kStaged) {
    // Each block copies the tables (and stages its next tile: that needs a loop too): kLutTiles
    // tiles per block where there are enough, not fewer blocks than SMs, not more than fit at
    // once.
    static SmemAllowed smem_done;  // with dbias, SwiGLU's tables pass 48 KB
    smem = (lut != nullptr ? lut_bytes<A, kBackward>() : 0) +
           (kStaged ? stage_bytes<T, A, kBackward>() : 0);
    allow_smem(Kernel, static_cast<size_t>(smem), smem_done);
    const int64_t want = (tiles + kLutTiles - 1) / kLutTiles;
    const int64_t floor = want > sm_count() ? want : sm_count();
    const int64_t resident = resident_blocks<Kernel>(smem);
    const int64_t g = floor < resident ? floor : resident;
    blocks = static_cast<int>(tiles < g ? tiles : g);
  }
  Kernel<<<blocks, kThreads, smem, st>>>(a, o, p.scale, reinterpret_cast<unsigned int*>(p.amax),
                                         p.scale_inv, lut, col_tiles, tiles);
}

template <typename T, Activation A, bool kBackward, bool kDbias, int kAhead>
void launch_tiled(const ActParams& p, const Args& a, const float* lut, cudaStream_t st) {
  const int64_t chunks = (p.rows + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (a.out_cols + kTileCols - 1) / kTileCols;
  TileOut o{
      p.out, p.out_t,
      p.out != nullptr && a.out_cols % kVec == 0 && reinterpret_cast<uintptr_t>(p.out) % 8 == 0,
      p.out_t != nullptr && aligned16(p.out_t) && p.rows % 16 == 0, nullptr};
  if (kDbias) o.dbias_partial = scratch_alloc<float>(static_cast<size_t>(chunks * a.out_cols), st);
  const int64_t tiles = chunks * col_tiles;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (lut != nullptr) {
      if (p.format == Format::kE4M3) {
        launch_tile_kernel<act_tile_kernel<T, A, kBackward, Format::kE4M3, kDbias, true, kAhead>, T,
                           A, kBackward, kAhead == 3>(a, o, p, lut, col_tiles, tiles, st);
      } else {
        launch_tile_kernel<act_tile_kernel<T, A, kBackward, Format::kE5M2, kDbias, true, kAhead>, T,
                           A, kBackward, kAhead == 3>(a, o, p, lut, col_tiles, tiles, st);
      }
    }
  }
  if (lut == nullptr) {
    if (p.format == Format::kE4M3) {
      launch_tile_kernel<act_tile_kernel<T, A, kBackward, Format::kE4M3, kDbias, false, kAhead>, T,
                         A, kBackward, kAhead == 3>(a, o, p, nullptr, col_tiles, tiles, st);
    } else {
      launch_tile_kernel<act_tile_kernel<T, A, kBackward, Format::kE5M2, kDbias, false, kAhead>, T,
                         A, kBackward, kAhead == 3>(a, o, p, nullptr, col_tiles, tiles, st);
    }
  }
  FP8DP_CHECK_CUDA(cudaGetLastError());
  if (!kDbias) return;
  // dbias[oc] = the chunk sums added in chunk order, as the CPU adds them.
  const unsigned g2 = static_cast<unsigned>((a.out_cols + kTotalCols - 1) / kTotalCols);
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

// kAhead: act_tile_kernel's; 1 in the library, the fastest of 0-2 in dev/act_cast_variants.cu on
// an H100 (12-06). 3 (cp.async staging), same harness, H100, 12-07: level with 1 on the GELU
// forward at 16384 x 6144, 3% faster on the SwiGLU backward, 3-5% slower on the other four
// (bench/results/act_variants_kahead3_h100.txt), so 1 stays.
template <typename T, Activation A, bool kBackward, int kAhead = 1>
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
  // The tables serve elements_vec, so only where it runs (a.vec_in).
  const float* lut = nullptr;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (p.lut && a.vec_in) lut = lut_tables(st);
  }
  if (p.out_t != nullptr || p.dbias != nullptr) {
    FP8DP_CHECK(p.out_hp == nullptr,
                "activation_cuda: the high-precision result is not written with the transposed "
                "bytes or dbias");
    return p.dbias != nullptr ? launch_tiled<T, A, kBackward, true, kAhead>(p, a, lut, st)
                              : launch_tiled<T, A, kBackward, false, kAhead>(p, a, lut, st);
  }
  auto* amax_bits = reinterpret_cast<unsigned int*>(p.amax);
  T* out_hp = static_cast<T*>(p.out_hp);
  const int64_t groups = p.rows * ((a.out_cols + kVec - 1) / kVec);
  const bool vec = a.out_cols % kVec == 0 && reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
  const bool vec_hp = a.out_cols % kVec == 0 && aligned16(out_hp);
  const int act_grid = grid_for(groups);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (lut != nullptr) {
      // Each block copies the tables (16 or 32 KB): at least kLutGroups groups per thread where
      // there are enough, not fewer blocks than SMs, not more than fit at once (one wave).
      const int64_t want = (groups + kThreads * kLutGroups - 1) / (kThreads * kLutGroups);
      const int64_t floor = want > sm_count() ? want : sm_count();
      const int smem = lut_bytes<A, kBackward>();
      auto go = [&](auto kernel, int resident) {
        const int64_t cap = floor < resident ? floor : resident;
        const int grid = act_grid < cap ? act_grid : static_cast<int>(cap);
        kernel<<<grid, kThreads, smem, st>>>(a, out_hp, p.out, p.scale, amax_bits, p.scale_inv, vec,
                                             vec_hp, lut);
        FP8DP_CHECK_CUDA(cudaGetLastError());
      };
      constexpr auto k4 = act_kernel<T, A, kBackward, Format::kE4M3, true>;
      constexpr auto k5 = act_kernel<T, A, kBackward, Format::kE5M2, true>;
      if (p.format == Format::kE4M3) {
        go(k4, resident_blocks<k4>(smem));
      } else {
        go(k5, resident_blocks<k5>(smem));
      }
      return;
    }
  }
  if (p.format == Format::kE4M3) {
    act_kernel<T, A, kBackward, Format::kE4M3, false><<<act_grid, kThreads, 0, st>>>(
        a, out_hp, p.out, p.scale, amax_bits, p.scale_inv, vec, vec_hp, nullptr);
  } else {
    act_kernel<T, A, kBackward, Format::kE5M2, false><<<act_grid, kThreads, 0, st>>>(
        a, out_hp, p.out, p.scale, amax_bits, p.scale_inv, vec, vec_hp, nullptr);
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
