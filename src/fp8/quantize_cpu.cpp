// CPU FP8 cast kernels: quantize (+ amax, + transpose, + dbias) in one pass, and dequantize.
//
// Vectorisation: the hot loops work on plain float arrays and keep the amax as the maximum of the
// magnitudes' bit patterns (an unsigned max, one instruction per vector). For non-negative floats
// the integer order is the float order and every NaN pattern lies above +Inf's, so the same
// reduction gives "NaN if any NaN, else +Inf if any Inf, else max |x|" with no separate NaN flag or
// branch.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/check.h"
#include "common/parallel.h"
#include "fp8/quantize.h"

namespace fp8dp {
namespace {

// Tile of the transposing / dbias path: 64 rows x 64 columns, so every transposed row segment is a
// 64-byte (cache line) store and the tile fits in L1 next to its input.
constexpr int64_t kTile = 64;
// Columns per task of that path: 4 KiB of FP32 per row read in one stream; the 64-row block of
// FP8 bytes (64 KiB) stays in L2 until it is transposed.
constexpr int64_t kBlockCols = 1024;
// Elements per task of the flat path: large enough that thread start-up is noise.
constexpr int64_t kGrain = 1 << 16;
// BF16 / FP16 inputs are widened to FP32 in blocks of this many elements (on the stack) first, so
// the quantize loop itself always sees floats.
constexpr int64_t kBlock = 1024;

inline uint32_t amax_bits_of(uint32_t a, uint32_t b) { return a > b ? a : b; }

inline float amax_from_bits(uint32_t bits) {
  return bits > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : bits_float(bits);
}

#if defined(__AVX2__)
// The portable loop below vectorises, but GCC widens every lane's result to bytes with extra masks
// and shuffles; written out for AVX2 the same arithmetic (fp8_code_of_magnitude, quantize_one) runs
// about 1.7x faster, which decides whether quantize keeps up with memory on this class of machine.
template <Format F>
inline __m256i quantize8_avx2(__m256 v, __m256 scale, __m256i& amax) {
  constexpr int kMant = F == Format::kE4M3 ? 3 : 2;
  constexpr int kBias = F == Format::kE4M3 ? 7 : 15;
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i min_exp = _mm256_set1_epi32((127 - kBias + 1) << 23);
  amax = _mm256_max_epu32(amax, _mm256_and_si256(_mm256_castps_si256(v), abs_mask));
  const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(v, scale));
  const __m256i mag = _mm256_and_si256(bits, abs_mask);
  const __m256i sign = _mm256_srli_epi32(_mm256_andnot_si256(abs_mask, bits), 24);
  const __m256i clamped = _mm256_min_epu32(mag, _mm256_set1_epi32(fp8_max_bits(F)));
  const __m256i e =
      _mm256_max_epu32(_mm256_and_si256(clamped, _mm256_set1_epi32(0x7F800000)), min_exp);
  const __m256i c = _mm256_add_epi32(e, _mm256_set1_epi32((23 - kMant) << 23));
  const __m256i sum =
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(clamped), _mm256_castsi256_ps(c)));
  __m256i code = _mm256_add_epi32(_mm256_sub_epi32(sum, c),
                                  _mm256_srli_epi32(_mm256_sub_epi32(e, min_exp), 23 - kMant));
  const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000));  // mag < 2^31
  code = _mm256_or_si256(code, _mm256_and_si256(nan, _mm256_set1_epi32(0x7F)));
  return _mm256_or_si256(code, sign);
}

// 32 floats -> 32 bytes per step; returns the number of elements done (a multiple of 32).
template <Format F>
inline int64_t quantize_floats_avx2(const float* in, uint8_t* out, float scale_f, int64_t n,
                                    uint32_t& amax_bits) {
  const __m256 scale = _mm256_set1_ps(scale_f);
  // packs interleave 128-bit lanes; this puts the 8 dwords of bytes back in element order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i amax = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = quantize8_avx2<F>(_mm256_loadu_ps(in + i), scale, amax);
    const __m256i b = quantize8_avx2<F>(_mm256_loadu_ps(in + i + 8), scale, amax);
    const __m256i c = quantize8_avx2<F>(_mm256_loadu_ps(in + i + 16), scale, amax);
    const __m256i d = quantize8_avx2<F>(_mm256_loadu_ps(in + i + 24), scale, amax);
    // every lane holds a value <= 0xFF, so the saturating packs are plain narrowing here
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), amax);
  for (uint32_t a : lanes) amax_bits = amax_bits_of(amax_bits, a);
  return i;
}
#endif

// n contiguous floats -> n FP8 bytes (when kWrite); returns the max of |in[i]|'s bit patterns.
template <Format F, bool kWrite>
inline uint32_t quantize_floats(const float* __restrict in, uint8_t* __restrict out, float scale,
                                int64_t n) {
  uint32_t amax = 0;
  int64_t i = 0;
#if defined(__AVX2__)
  if constexpr (kWrite) i = quantize_floats_avx2<F>(in, out, scale, n, amax);
#endif
  for (; i < n; ++i) {
    const float v = in[i];
    const uint32_t mag = float_bits(v) & 0x7FFFFFFFu;
    amax = mag > amax ? mag : amax;
    if constexpr (kWrite) out[i] = quantize_one<F>(v * scale);
  }
  return amax;
}

template <typename T>
inline void widen(const T* __restrict in, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

// n floats stored as `dtype`, each rounded once to nearest even (c10's conversions, as the CUDA
// kernels' from_float).
void store_floats(const float* in, int64_t n, void* out, DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      std::copy_n(in, n, static_cast<float*>(out));
      return;
    case DType::kBFloat16:
      std::copy_n(in, n, static_cast<c10::BFloat16*>(out));
      return;
    case DType::kFloat16:
      std::copy_n(in, n, static_cast<c10::Half*>(out));
      return;
    default:
      break;
  }
  FP8DP_CHECK(false, "quantize_cpu: no dbias output of dtype ", dtype_name(dtype));
}

// Any input dtype: floats are used in place, narrower types widened block by block.
template <Format F, bool kWrite, typename T>
uint32_t quantize_span(const T* in, uint8_t* out, float scale, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return quantize_floats<F, kWrite>(in, out, scale, n);
  } else {
    std::array<float, kBlock> buf;
    uint32_t amax = 0;
    for (int64_t i = 0; i < n; i += kBlock) {
      const int64_t m = std::min(kBlock, n - i);
      widen(in + i, buf.data(), m);
      amax = amax_bits_of(
          amax, quantize_floats<F, kWrite>(buf.data(), kWrite ? out + i : nullptr, scale, m));
    }
    return amax;
  }
}

// Flat path (no transpose, no dbias): row-major bytes and/or amax.
template <Format F, typename T>
uint32_t quantize_flat(const QuantizeParams& p, float scale) {
  const T* in = static_cast<const T*>(p.input);
  const int64_t n = p.rows * p.cols;
  return parallel_reduce(
      int64_t{0}, n, kGrain, uint32_t{0},
      [&](int64_t b, int64_t e, uint32_t) {
        return p.out ? quantize_span<F, true>(in + b, p.out + b, scale, e - b)
                     : quantize_span<F, false>(in + b, nullptr, scale, e - b);
      },
      amax_bits_of);
}

// Transpose of an h x w byte tile (row stride ls) into dst (row stride ld).
inline void transpose_tile_scalar(const uint8_t* __restrict tile, int64_t ls, int64_t h, int64_t w,
                                  uint8_t* __restrict dst, int64_t ld) {
  for (int64_t c = 0; c < w; ++c) {
    uint8_t* d = dst + c * ld;
    for (int64_t r = 0; r < h; ++r) d[r] = tile[r * ls + c];
  }
}

#if defined(__SSE2__)
// Full 64 x 64 tiles in 8 x 8 blocks: three rounds of byte / word / dword interleaves turn 8 rows
// of 8 bytes into 8 columns, instead of 64 single-byte loads and stores. Blocks go down one column
// strip at a time, so each 64-byte destination row is completed while it is still in cache.
inline void transpose_tile_full(const uint8_t* __restrict tile, int64_t ls, uint8_t* __restrict dst,
                                int64_t ld) {
  for (int64_t c = 0; c < kTile; c += 8) {
    for (int64_t r = 0; r < kTile; r += 8) {
      __m128i row[8];
      for (int i = 0; i < 8; ++i) {
        row[i] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + (r + i) * ls + c));
      }
      const __m128i t0 = _mm_unpacklo_epi8(row[0], row[1]);
      const __m128i t1 = _mm_unpacklo_epi8(row[2], row[3]);
      const __m128i t2 = _mm_unpacklo_epi8(row[4], row[5]);
      const __m128i t3 = _mm_unpacklo_epi8(row[6], row[7]);
      const __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1);
      const __m128i u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
      const __m128i cols[4] = {_mm_unpacklo_epi32(u0, u2), _mm_unpackhi_epi32(u0, u2),
                               _mm_unpacklo_epi32(u1, u3), _mm_unpackhi_epi32(u1, u3)};
      for (int j = 0; j < 4; ++j) {  // each holds two destination rows of 8 bytes
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + (c + 2 * j) * ld + r), cols[j]);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + (c + 2 * j + 1) * ld + r),
                         _mm_unpackhi_epi64(cols[j], cols[j]));
      }
    }
  }
}
#endif

inline void transpose_tile(const uint8_t* __restrict tile, int64_t ls, int64_t h, int64_t w,
                           uint8_t* __restrict dst, int64_t ld) {
#if defined(__SSE2__)
  if (h == kTile && w == kTile) return transpose_tile_full(tile, ls, dst, ld);
#endif
  transpose_tile_scalar(tile, ls, h, w, dst, ld);
}

// Transposing / dbias path. The work is a grid of blocks of 64 rows x up to kBlockCols columns.
// A task quantizes its block row by row (the vectorised loop above; long contiguous reads that the
// prefetcher follows, where 64-column tiles would touch a new page every row) into a block buffer,
// copies each row to `out`, then transposes the buffer 64 x 64 tile by tile into `out_t`. Column
// sums go, in row order, into a partial per 64-row chunk; the partials are then added in chunk
// order, so dbias does not depend on how the blocks were spread over threads.
template <Format F, typename T>
uint32_t quantize_tiled(const QuantizeParams& p, float scale) {
  const T* in = static_cast<const T*>(p.input);
  const int64_t rows = p.rows, cols = p.cols;
  const int64_t nrc = (rows + kTile - 1) / kTile;            // row chunks
  const int64_t ncb = (cols + kBlockCols - 1) / kBlockCols;  // column blocks
  std::vector<float> partial(p.dbias ? static_cast<size_t>(nrc * cols) : 0);
  std::vector<uint32_t> block_amax(static_cast<size_t>(nrc * ncb), 0u);
  parallel_for(0, nrc * ncb, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> block(static_cast<size_t>(kTile * kBlockCols));
    std::vector<float> row_f(std::is_same_v<T, float> ? 0 : kBlockCols);
    std::vector<float> sums(kBlockCols);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rc = t / ncb, cb = t % ncb;
      const int64_t r0 = rc * kTile, c0 = cb * kBlockCols;
      const int64_t h = std::min(kTile, rows - r0), w = std::min(kBlockCols, cols - c0);
      std::fill_n(sums.data(), w, 0.0f);
      uint32_t amax = 0;
      for (int64_t r = 0; r < h; ++r) {
        const T* src = in + (r0 + r) * cols + c0;
        const float* v;
        if constexpr (std::is_same_v<T, float>) {
          v = src;
        } else {
          widen(src, row_f.data(), w);
          v = row_f.data();
        }
        uint8_t* q = block.data() + r * kBlockCols;
        amax = amax_bits_of(amax, quantize_floats<F, true>(v, q, scale, w));
        if (p.out) std::memcpy(p.out + (r0 + r) * cols + c0, q, static_cast<size_t>(w));
        if (p.dbias) {
          float* __restrict s = sums.data();
          for (int64_t c = 0; c < w; ++c) s[c] += v[c];
        }
      }
      if (p.out_t) {
        for (int64_t c = 0; c < w; c += kTile) {
          transpose_tile(block.data() + c, kBlockCols, h, std::min(kTile, w - c),
                         p.out_t + (c0 + c) * rows + r0, rows);
        }
      }
      if (p.dbias) std::copy_n(sums.data(), w, partial.data() + rc * cols + c0);
      block_amax[t] = amax;
    }
  });
  if (p.dbias) {
    std::vector<float> dbias(static_cast<size_t>(cols), 0.0f);
    for (int64_t rc = 0; rc < nrc; ++rc) {
      const float* s = partial.data() + rc * cols;
      for (int64_t c = 0; c < cols; ++c) dbias[c] += s[c];
    }
    store_floats(dbias.data(), cols, p.dbias, p.dbias_dtype);
  }
  uint32_t amax = 0;
  for (uint32_t a : block_amax) amax = amax_bits_of(amax, a);
  return amax;
}

template <Format F, typename T>
uint32_t quantize_dispatch_path(const QuantizeParams& p, float scale) {
  return (p.out_t || p.dbias) ? quantize_tiled<F, T>(p, scale) : quantize_flat<F, T>(p, scale);
}

template <Format F>
uint32_t quantize_dispatch_dtype(const QuantizeParams& p, float scale) {
  switch (p.input_dtype) {
    case DType::kFloat32:
      return quantize_dispatch_path<F, float>(p, scale);
    case DType::kBFloat16:
      return quantize_dispatch_path<F, c10::BFloat16>(p, scale);
    case DType::kFloat16:
      return quantize_dispatch_path<F, c10::Half>(p, scale);
    default:
      break;
  }
  FP8DP_CHECK(false, "quantize_cpu: no kernel for input dtype ", dtype_name(p.input_dtype));
}

template <typename T>
void dequantize_typed(const DequantizeParams& p, const std::array<float, 256>& lut) {
  T* out = static_cast<T*>(p.out);
  parallel_for(0, p.numel, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = static_cast<T>(lut[p.input[i]]);
  });
}

}  // namespace

const char* format_name(Format f) { return f == Format::kE4M3 ? "E4M3" : "E5M2"; }

void quantize_cpu(const QuantizeParams& p) {
  FP8DP_CHECK(p.rows >= 0 && p.cols >= 0, "quantize_cpu: bad shape [", p.rows, ", ", p.cols, "]");
  FP8DP_CHECK(p.scale != nullptr, "quantize_cpu: scale pointer is null");
  FP8DP_CHECK(p.strided.n == 0,
              "quantize_cpu: strided parts input (QuantizeParams::strided) is read by the CUDA "
              "kernel only; on the CPU pass the materialized row-major input (quantize_parts in "
              "fp8/cast.h does)");
  FP8DP_CHECK(p.rows * p.cols == 0 || p.input != nullptr, "quantize_cpu: input pointer is null");
  const float scale = *p.scale;
  const uint32_t amax = p.format == Format::kE4M3
                            ? quantize_dispatch_dtype<Format::kE4M3>(p, scale)
                            : quantize_dispatch_dtype<Format::kE5M2>(p, scale);
  if (p.amax) {
    // The bits of amaxes (>= 0, NaN above +Inf) order like their values: the CUDA kernels' merge.
    *p.amax = amax_from_bits(p.amax_accumulate ? amax_bits_of(amax, float_bits(*p.amax)) : amax);
  }
  if (p.scale_inv) *p.scale_inv = scale_inverse(scale);
}

void dequantize_cpu(const DequantizeParams& p) {
  FP8DP_CHECK(p.numel >= 0, "dequantize_cpu: bad numel ", p.numel);
  FP8DP_CHECK(p.scale_inv != nullptr, "dequantize_cpu: scale_inv pointer is null");
  // 256 possible inputs: decode each once, then the kernel is a table lookup.
  std::array<float, 256> lut;
  const float s = *p.scale_inv;
  for (int i = 0; i < 256; ++i) lut[i] = fp8_decode(static_cast<uint8_t>(i), p.format) * s;
  switch (p.out_dtype) {
    case DType::kFloat32:
      return dequantize_typed<float>(p, lut);
    case DType::kBFloat16:
      return dequantize_typed<c10::BFloat16>(p, lut);
    case DType::kFloat16:
      return dequantize_typed<c10::Half>(p, lut);
    default:
      break;
  }
  FP8DP_CHECK(false, "dequantize_cpu: no kernel for output dtype ", dtype_name(p.out_dtype));
}

}  // namespace fp8dp
