// Block-scaled GEMM helpers shared by the CPU path (gemm.cpp) and the CUDA entry.
#include "gemm/block_gemm.h"

#include "common/check.h"
#include "common/tensor_checks.h"
#include "fp8/block_cast.h"

namespace fp8dp {
namespace {

const char* granularity_name(ScaleGranularity g) {
  switch (g) {
    case ScaleGranularity::kTensor:
      return "per-tensor";
    case ScaleGranularity::k1x128:
      return "1x128 tiles";
    case ScaleGranularity::k128x128:
      return "128x128 blocks";
  }
  return "unknown";
}

}  // namespace

bool is_block_scaled(const GemmArgs& g) {
  return is_fp8(g.a.scalar_type()) && ((g.a_scale_inv.defined() && g.a_scale_inv.dim() == 2) ||
                                       (g.b_scale_inv.defined() && g.b_scale_inv.dim() == 2));
}

void check_block_scaled_pair(const GemmArgs& g, const char* fn) {
  const ScaleGranularity ga = scale_granularity(g.a, g.a_scale_inv, fn, "a_scale_inv");
  const ScaleGranularity gb = scale_granularity(g.b, g.b_scale_inv, fn, "b_scale_inv");
  // A one-row operand's 128x128 block is its 1x128 tile (scale_granularity reads it as a tile).
  FP8DP_CHECK_ARG(ga == ScaleGranularity::k1x128 && gb != ScaleGranularity::kTensor, fn,
                  ": a block-scaled FP8 GEMM takes operand 'a' in 1x128 tiles and operand 'b' in "
                  "1x128 tiles or 128x128 blocks (what cuBLASLt supports), got 'a' in ",
                  granularity_name(ga), " and 'b' in ", granularity_name(gb),
                  " (cast both with one Float8BlockScaling recipe)");
}

}  // namespace fp8dp
