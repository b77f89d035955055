// Launch choices of the CUDA cast + transpose (+ dbias) path. quantize_cuda uses the defaults;
// the tuning benchmark (bench/cast_transpose_variants.cu) and the CPU-vs-CUDA tests run the others.
// Free of CUDA and torch headers.
#pragma once

#include "fp8/quantize.h"

namespace fp8dp {

// How the per-strip column sums of dbias become dbias. Every choice adds the partial sums of a
// column in an order fixed by the shape (never by which block finished first), so dbias is
// deterministic.
enum class DbiasReduce : int {
  // The last block to finish a column strip (per-strip arrival counter) adds the strips' partials;
  // one kernel, partials and counters in a per-(device, stream) workspace kept across calls.
  kLastBlock = 0,
  // A second kernel adds the partials; partials in the same cached workspace.
  kTwoPass = 1,
  // A second kernel, partials in a stream-ordered allocation made and freed on every call.
  kTwoPassAlloc = 2,
};

struct CastTransposeConfig {
  // Default: one kernel, no allocation (see DbiasReduce).
  DbiasReduce dbias_reduce = DbiasReduce::kLastBlock;
  // Row tiles a block walks down its column strip, keeping its column sums in registers; 0 = one
  // tile without dbias (most parallelism), with dbias a count chosen from the grid size.
  int strip_tiles = 0;
  // false: blockIdx.x walks the column tiles (concurrent blocks read whole input rows). true: it
  // walks the row strips of one column strip, so column strips finish one after another and their
  // dbias finalize overlaps the rest of the grid (concurrent blocks write whole transposed rows).
  bool rows_fastest = false;
  // true: the kernel starts amax from zero itself (max into a zeroed workspace word, the last block
  // of the grid publishes it and clears the word), saving the memset launched before the kernel.
  // false: amax is zeroed with cudaMemsetAsync before the kernel.
  bool fused_amax_reset = true;
};

#if defined(FP8DP_WITH_CUDA)
// quantize_cuda with explicit launch choices (quantize_cuda(p, s) == quantize_cuda_with(p, s, {})).
// Output bytes and amax do not depend on cfg; dbias agrees within the FP32 summation bound.
void quantize_cuda_with(const QuantizeParams& p, void* stream, const CastTransposeConfig& cfg);

namespace cuda {
// The tiled path of quantize_cuda_with (p.out_t or p.dbias set, rows * cols > 0); writes amax
// without a prior zeroing.
void cast_transpose(const QuantizeParams& p, void* stream, const CastTransposeConfig& cfg);
}  // namespace cuda
#endif

}  // namespace fp8dp
