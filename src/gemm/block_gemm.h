// Block-scaled FP8 GEMMs (fp8dp.Float8BlockScaling): telling them apart, and the cuBLASLt entry.
//
// gemm() takes them through the same GemmArgs: an FP8 operand whose scale_inv is 2-D carries one
// FP32 scale per 1x128 tile or per 128x128 block of its [rows, k] (block_cast.h). Supported pairs,
// those the Linear layer's three GEMMs need (and those cuBLASLt has on Hopper): a in 1x128 tiles,
// b in 1x128 tiles (wgrad) or 128x128 blocks (fprop, dgrad).
//
// Numerics. The CPU path (gemm.cpp) dequantizes each operand per tile (decode(byte) * scale_inv:
// one FP32 rounding, none with power-of-two scales) and multiplies in FP32. The hardware computes
// each 128-wide K chunk's FP8 products, accumulates them in FP32, scales the chunk's partial sum by
// sa[m, chunk] * sb[n, chunk] and adds it to an FP32 accumulator. Both equal the exact product of
// the dequantized operands up to FP32 rounding, |error| <= gamma_(k+2) * sum_k |a_mk| |b_nk| with
// gamma_j = j u / (1 - j u), u = 2^-24 (the standard summation bound; +2 for the scale products),
// so CPU and GPU agree within twice that bound.
#pragma once

#include <ATen/core/Tensor.h>

#include "gemm/gemm.h"

namespace fp8dp {

// True when either FP8 operand has block scales (a 2-D scale_inv, block_cast.h). Arguments that
// check_gemm_args has passed.
bool is_block_scaled(const GemmArgs& args);

// Refuses a block-scaled pair that the GEMMs do not support (see above), naming both layouts.
// Called by gemm() on every device, so a model that runs on the CPU runs on a GPU.
void check_block_scaled_pair(const GemmArgs& args, const char* fn);

#if defined(FP8DP_WITH_CUDA)
// cuBLASLt's block-scaled FP8 GEMM (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F /
// _BLK128x128_32F, cuBLAS >= 12.9 and compute capability 9.x): refuses clearly where the build
// or the device has no such mode. Arguments that check_gemm_args has passed. A residual is
// cuBLASLt's C where it offers that epilogue for the scale modes (a 16-bit output), else added
// after the GEMM; either way summed in FP32 and rounded once.
at::Tensor gemm_block_cuda_checked(const GemmArgs& args);
#endif

}  // namespace fp8dp
