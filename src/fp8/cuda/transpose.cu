// FP8 byte transpose [rows, cols] -> [cols, rows] through shared-memory tiles: the transposed copy
// of the input that the fused norm + FP8 cast writes row-major (the weight-gradient GEMM needs it
// K-contiguous, and Hopper's FP8 GEMM is TN only). A strided element-wise copy reads one byte per
// thread from rows far apart and reaches a fraction of the bandwidth this gets with 16-byte loads
// and stores.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"
#include "fp8/quantize.h"

namespace fp8dp {
namespace cuda {
namespace {

constexpr int kTile = 64;      // 64 x 64 bytes per block
constexpr int kThreads = 256;  // each thread moves 16 bytes in and 16 bytes out

// Needs rows % 16 == 0, cols % 16 == 0 and 16-byte aligned pointers (the host checks).
__global__ void __launch_bounds__(kThreads)
    transpose_bytes_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out, int64_t rows,
                           int64_t cols) {
  // +16 bytes per row: threads that read one column of the tile hit different banks.
  __shared__ __align__(16) uint8_t tile[kTile][kTile + 16];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tr = threadIdx.x / (kTile / 16), tc = (threadIdx.x % (kTile / 16)) * 16;
  // Load: thread (tr, tc) reads row r0 + tr, bytes c0 + tc .. + 15.
  if (r0 + tr < rows && c0 + tc < cols) {
    *reinterpret_cast<uint4*>(&tile[tr][tc]) =
        __ldg(reinterpret_cast<const uint4*>(in + (r0 + tr) * cols + c0 + tc));
  }
  __syncthreads();
  // Store: thread (tr, tc) writes output row c0 + tr (input column), bytes r0 + tc .. + 15.
  if (c0 + tr < cols && r0 + tc < rows) {
    union {
      uint4 u;
      uint8_t b[16];
    } v;
#pragma unroll
    for (int j = 0; j < 16; ++j) v.b[j] = tile[tc + j][tr];
    *reinterpret_cast<uint4*>(out + (c0 + tr) * rows + r0 + tc) = v.u;
  }
}

}  // namespace
}  // namespace cuda

bool transpose_bytes_cuda_supported(int64_t rows, int64_t cols, const void* in, const void* out) {
  return rows % 16 == 0 && cols % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(out) % 16 == 0;
}

void transpose_bytes_cuda(const uint8_t* in, uint8_t* out, int64_t rows, int64_t cols,
                          void* stream) {
  FP8DP_CHECK(transpose_bytes_cuda_supported(rows, cols, in, out),
              "transpose_bytes_cuda: needs rows and cols multiples of 16 and 16-byte aligned "
              "pointers, got [",
              rows, ", ", cols, "]");
  if (rows == 0 || cols == 0) return;
  const int64_t gy = (rows + cuda::kTile - 1) / cuda::kTile;
  FP8DP_CHECK(gy <= 65535, "transpose_bytes_cuda: too many rows (", rows, ")");
  const dim3 grid(static_cast<unsigned>((cols + cuda::kTile - 1) / cuda::kTile),
                  static_cast<unsigned>(gy));
  cuda::transpose_bytes_kernel<<<grid, cuda::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      in, out, rows, cols);
  FP8DP_CHECK_CUDA(cudaGetLastError());
}

}  // namespace fp8dp
