// CUDA / cuBLASLt / NCCL members of the FP8DP_CHECK family. Include only from CUDA builds.
#pragma once

#include <cuda_runtime.h>
// The cast kernels need only the CUDA runtime; cuBLASLt may be missing where CUDA sources are
// merely compile-checked (nvcc without the cuBLAS package), so its check exists only when its
// header does.
#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#define FP8DP_HAVE_CUBLASLT 1
#endif

#include "common/check.h"

#define FP8DP_CHECK_CUDA(expr)                                                                 \
  do {                                                                                         \
    cudaError_t _e = (expr);                                                                   \
    if (_e != cudaSuccess)                                                                     \
      ::fp8dp::detail::fail(__FILE__, __LINE__, #expr,                                         \
                            ::fp8dp::detail::concat("CUDA error ", cudaGetErrorName(_e), ": ", \
                                                    cudaGetErrorString(_e)));                  \
  } while (0)

#if defined(FP8DP_HAVE_CUBLASLT)
#define FP8DP_CHECK_CUBLAS(expr, ...)                                                 \
  do {                                                                                \
    cublasStatus_t _s = (expr);                                                       \
    if (_s != CUBLAS_STATUS_SUCCESS)                                                  \
      ::fp8dp::detail::fail(                                                          \
          __FILE__, __LINE__, #expr,                                                  \
          ::fp8dp::detail::concat("cuBLASLt error ", cublasLtGetStatusName(_s), ": ", \
                                  cublasLtGetStatusString(_s), " ", ##__VA_ARGS__));  \
  } while (0)
#endif

// FP8DP_CHECK_NCCL lives in comm/cuda/nccl_check.h (it needs nccl.h).
