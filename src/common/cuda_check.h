// CUDA / cuBLASLt / NCCL members of the FP8DP_CHECK family. Include only from CUDA builds.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "common/check.h"

#define FP8DP_CHECK_CUDA(expr)                                                             \
  do {                                                                                     \
    cudaError_t _e = (expr);                                                               \
    if (_e != cudaSuccess)                                                                 \
      ::fp8dp::detail::fail(__FILE__, __LINE__, #expr,                                     \
                            ::fp8dp::detail::concat("CUDA error ", cudaGetErrorName(_e), ": ", \
                                                    cudaGetErrorString(_e)));              \
  } while (0)

#define FP8DP_CHECK_CUBLAS(expr, ...)                                                        \
  do {                                                                                       \
    cublasStatus_t _s = (expr);                                                              \
    if (_s != CUBLAS_STATUS_SUCCESS)                                                         \
      ::fp8dp::detail::fail(__FILE__, __LINE__, #expr,                                       \
                            ::fp8dp::detail::concat("cuBLASLt error ", cublasLtGetStatusName(_s), \
                                                    ": ", cublasLtGetStatusString(_s), " ",  \
                                                    ##__VA_ARGS__));                         \
  } while (0)

// FP8DP_CHECK_NCCL lives in comm/cuda/nccl_check.h (it needs nccl.h).
