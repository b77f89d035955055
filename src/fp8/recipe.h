// FP8 recipes and the fp8_autocast state that the C++ modules read at forward time.
#pragma once

#include <cmath>
#include <cstdint>

#include "fp8/format.h"
#include "fp8/scaling.h"

namespace fp8dp {

// kBlock: DeepSeek-style block scaling (fp8dp.Float8BlockScaling): one FP32 scale per 1x128 tile of
// activations and gradients (along the GEMM's reduction dimension) and per 128x128 block of
// weights, each from that tile's own amax (src/fp8/block_cast.h); no history, no scaling state.
enum class RecipeKind : int { kDelayed = 0, kCurrent = 1, kBlock = 2 };

// How a block-scaled cast turns a tile's amax into its scale (TransformerEngine's QParams):
// scale = fp8_max / max(amax, amax_epsilon), rounded down to a power of two when power_2_scale.
struct BlockQParams {
  bool power_2_scale = true;
  float amax_epsilon = 0.0f;
};

// The largest margin that still casts a tensor's own amax to a normal E4M3 number:
// log2(448 / 2^-6) = 14.807. Past it the whole forward cast underflows (fp8dp.recipe.MAX_MARGIN).
inline const double kMaxMargin = std::log2(448.0) + 6.0;

// Python's recipe.DelayedScaling / Float8CurrentScaling validate and convert into this.
struct Recipe {
  RecipeKind kind = RecipeKind::kDelayed;
  Format fwd_format = Format::kE4M3;  // input and weight
  Format bwd_format = Format::kE5M2;  // gradients (HYBRID); E4M3 recipes use E4M3 here too
  int64_t amax_history_len = 1024;    // delayed only
  AmaxAlgo amax_compute_algo = AmaxAlgo::kMax;
  float margin = 0.0f;  // in [0, kMaxMargin]
  // Accumulation of the FP8 GEMMs on CUDA: split (FP32-promoted partial sums, exact) or fast (the
  // tensor cores' own accumulator, faster and coarser). TransformerEngine's defaults: fast in
  // fprop, split in dgrad and wgrad. The CPU GEMM always accumulates in FP32 (gemm.h).
  bool split_accumulator_fprop = false;
  bool split_accumulator_dgrad = true;
  bool split_accumulator_wgrad = true;
  // GEMMs in the parameters' precision instead of FP8 (TransformerEngine's
  // override_linear_precision (fprop, dgrad, wgrad)): each such GEMM takes the unquantized
  // operands (x or norm(x), W, dy); the others stay FP8. The casts still run and record their
  // amaxes, so delayed scaling's history and the ranks' agreement (C9) do not depend on it.
  // Per-tensor recipes only; Linear and LayerNormLinear (LayerNormMLP refuses it).
  bool fprop_high_precision = false;
  bool dgrad_high_precision = false;
  bool wgrad_high_precision = false;
  // kBlock only: scale rules of the three cast roles (input, weight, grad_output).
  BlockQParams block_inp, block_weight, block_grad;
};

struct AutocastState {
  bool enabled = false;
  Recipe recipe;
};

// A process-wide stack: fp8_autocast contexts nest, the innermost wins, and exit restores the outer
// one. Modules copy the state at forward time, because backward may run on another thread.
void autocast_enter(bool enabled, const Recipe& recipe);
void autocast_exit();
AutocastState autocast_current();
int64_t autocast_depth();

}  // namespace fp8dp
