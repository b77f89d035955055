// Raw-pointer cuBLASLt block-scaled FP8 GEMM (Float8BlockScaling) below LibTorch: row-major
// out[m, n] = a[m, k] · b[n, k]ᵀ with FP32 scales per 1x128 tile (a; b too, or per 128x128 block
// of b), beta = 1 accumulation optional. Torch-free: block_gemm_cuda.cpp checks tensors, lays the
// scales out as cuBLASLt wants them and calls gemm_lt_block().
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace fp8dp {

// Scale layouts cuBLASLt reads (Hopper, cuBLAS >= 12.9), for an operand [rows, k] row-major:
//   1x128 tiles (VEC128_32F):      [ceil(k/128)][round_up(rows, 4)] floats, rows contiguous
//   128x128 blocks (BLK128x128_32F): [ceil(rows/128)][round_up(ceil(k/128), 4)] floats
// (TransformerEngine's "GEMM-ready" layouts; the padding keeps every row 16-byte aligned.)
struct LtBlockGemmParams {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // [m, k], rows lda elements apart
  DType a_type = DType::kE4M3;
  int64_t lda = 0;
  const void* b = nullptr;  // [n, k], rows ldb elements apart
  DType b_type = DType::kE4M3;
  int64_t ldb = 0;
  const float* a_scale_inv = nullptr;  // 1x128 tiles, layout above
  const float* b_scale_inv = nullptr;  // 1x128 tiles or 128x128 blocks (b_blocks)
  bool b_blocks = false;
  void* out = nullptr;  // [m, n], rows ldo elements apart
  DType out_type = DType::kBFloat16;
  int64_t ldo = 0;
  bool accumulate = false;  // out += a·bᵀ (beta = 1)
};

// Compiled against a cuBLAS with the block-scaled modes (CUBLAS_VERSION >= 120900).
bool gemm_lt_block_compiled();

// Runs the GEMM on `stream` (a cudaStream_t) on the current device. Refuses (fp8dp::Error naming
// the reason) where the build's cuBLAS, the loaded cuBLASLt (< 12.9) or the device (compute
// capability other than 9.x) has no block-scaled FP8 GEMM, and where cuBLASLt offers no algorithm
// for the shape.
void gemm_lt_block(const LtBlockGemmParams& p, void* stream);

}  // namespace fp8dp
