// Raw-pointer cuBLASLt GEMM below LibTorch: out[m, n] = a[m, k] · b[n, k]ᵀ (row-major, "TN"),
// high precision, or FP8 with per-tensor, per-1x128-tile or per-128x128-block scales
// (Float8BlockScaling), with the BIAS epilogue, beta = 1 accumulation and a residual (C != D). One
// plan cache and one autotuner for every kind. Torch-free: the LibTorch layer (gemm_cuda.cpp,
// block_gemm_cuda.cpp) checks tensors and calls gemm_lt().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace fp8dp {

// How an FP8 operand's scale_inv pointer is read. kTensor: one float. The block-scaled modes
// (cuBLAS >= 12.9 on Hopper; TransformerEngine's "GEMM-ready" layouts, whose padding keeps every
// row 16-byte aligned), for an operand [rows, k] row-major:
//   kVec128 (1x128 tiles):       [ceil(k/128)][round_up(rows, 4)] floats, rows contiguous
//   kBlock128x128:               [ceil(rows/128)][round_up(ceil(k/128), 4)] floats
// Supported pairs: a in tiles with b in tiles or blocks, or both per tensor.
enum class LtScaleMode : uint8_t { kTensor, kVec128, kBlock128x128 };

struct LtGemmParams {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // [m, k], rows lda elements apart (a_col: columns lda apart)
  DType a_type = DType::kBFloat16;
  int64_t lda = 0;
  const void* b = nullptr;  // [n, k], rows ldb elements apart (b_col: columns ldb apart)
  DType b_type = DType::kBFloat16;
  int64_t ldb = 0;
  // Column-major operand (high precision only: FP8 on Hopper is TN): read with a transposed op, so
  // a transpose view (w.t(), dy.t()) needs no copy.
  bool a_col = false, b_col = false;
  const float* a_scale_inv = nullptr;  // device floats (FP8 only): a's dequantization factor(s)
  const float* b_scale_inv = nullptr;
  LtScaleMode a_scale_mode = LtScaleMode::kTensor, b_scale_mode = LtScaleMode::kTensor;
  const void* bias = nullptr;  // [n] of bias_type, or null
  DType bias_type = DType::kBFloat16;
  void* out = nullptr;  // [m, n], rows ldo elements apart
  DType out_type = DType::kBFloat16;
  int64_t ldo = 0;
  // The residual, or null: out = a·bᵀ (+ bias) + c, cuBLASLt's C with beta = 1 and C != D, summed
  // in FP32 and rounded once. [m, n] of out_type, rows ldc elements apart (C gets its own matrix
  // layout, so c need not share out's stride). Not with accumulate, and never out itself.
  const void* c = nullptr;
  int64_t ldc = 0;
  bool accumulate = false;  // out += a·bᵀ (beta = 1)
  bool fast_accum = false;  // FP8: tensor-core accumulation without periodic FP32 promotion
};

// Runs the GEMM on `stream` (a cudaStream_t) on the current device. The first call for a shape
// (dims, strides, dtypes, epilogue, residual, pointer alignment) builds and caches the cuBLASLt
// descriptors, asks the heuristic for up to 8 algorithms (see gemm_lt_set_candidates) and, unless
// autotuning is off or the stream is being captured into a graph, times each on the call's operands
// and keeps the fastest. Every cuBLASLt failure throws fp8dp::Error naming the status and the
// shape. Block-scaled modes are refused (fp8dp::Error naming the reason) where the build's cuBLAS,
// the loaded cuBLASLt (< 12.9) or the device (compute capability other than 9.x) has none.
void gemm_lt(const LtGemmParams& p, void* stream);

// gemm_lt(), except that a shape cuBLASLt offers no algorithm for (CUBLAS_STATUS_NOT_SUPPORTED or
// no candidate; remembered per shape) returns false and launches nothing, so that the caller can
// take another route (an epilogue cuBLASLt lacks for some scale modes).
bool gemm_lt_try(const LtGemmParams& p, void* stream);

// Compiled against a cuBLAS with the block-scaled modes (CUBLAS_VERSION >= 120900).
bool gemm_lt_block_compiled();

// Autotuning switch (default on; the environment variable FP8DP_GEMM_AUTOTUNE=0 turns it off).
// Only affects shapes not cached yet.
void gemm_lt_set_autotune(bool on);

// Candidate selection for plans built from now on: the heuristic is asked for up to max_algos
// (1..32, default 8, or FP8DP_GEMM_CANDIDATES from the environment) algorithms, and
// algo_override >= 0 takes that candidate without timing (-1,
// the default: autotune as above). For benchmarks that rank the candidates by other measures
// (energy per call, sustained time); throws when the override is out of range.
void gemm_lt_set_candidates(int max_algos, int algo_override);

// One cached plan: its shape (as error messages write it), the heuristic index it uses, how many
// candidates the heuristic offered, and the algorithm's configuration ids.
struct LtPlanInfo {
  std::string shape;
  int pick = 0, candidates = 0;
  std::string config;
};
std::vector<LtPlanInfo> gemm_lt_plans();

// Cached plans (for tests and benchmarks; shapes without an algorithm do not count) and dropping
// them.
int64_t gemm_lt_cache_size();
void gemm_lt_clear_cache();

}  // namespace fp8dp
