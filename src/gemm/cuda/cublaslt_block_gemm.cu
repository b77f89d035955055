// cuBLASLt block-scaled FP8 GEMM (see cublaslt_block_gemm.h). Same operand mapping as
// cublaslt_gemm.cu: row-major out[m, n] = a · bᵀ is cuBLASLt's column-major [n, m] = b · aᵀ, so
// A := b (op T), B := a (op N), M = n, N = m; A's scale is b's, B's is a's. One descriptor set per
// call and the heuristic's first algorithm: correctness first (plan caching and autotuning as in
// cublaslt_gemm.cu are the next step once the H200 benchmarks ask for them).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "common/cuda_check.h"
#include "gemm/cuda/cublaslt_block_gemm.h"

namespace fp8dp {

#if CUBLAS_VERSION >= 120900
#define FP8DP_HAVE_BLOCK_SCALED_GEMM 1
#endif

bool gemm_lt_block_compiled() {
#if defined(FP8DP_HAVE_BLOCK_SCALED_GEMM)
  return true;
#else
  return false;
#endif
}

#if defined(FP8DP_HAVE_BLOCK_SCALED_GEMM)
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

cudaDataType_t to_cuda(DType t) {
  switch (t) {
    case DType::kFloat32:
      return CUDA_R_32F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat16:
      return CUDA_R_16F;
    case DType::kE4M3:
      return CUDA_R_8F_E4M3;
    case DType::kE5M2:
      return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}

std::string shape_of(const LtBlockGemmParams& p) {
  using std::to_string;
  return "(block-scaled GEMM m=" + to_string(p.m) + " n=" + to_string(p.n) +
         " k=" + to_string(p.k) + " a=" + dtype_name(p.a_type) +
         " in 1x128 tiles, b=" + dtype_name(p.b_type) +
         (p.b_blocks ? " in 128x128 blocks" : " in 1x128 tiles") +
         " out=" + dtype_name(p.out_type) + (p.accumulate ? " accumulate" : "") + ")";
}

struct State {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;
};

State& state() {
  static State* s = new State();  // never destroyed: handles outlive static destruction order
  return *s;
}

// RAII for the per-call descriptors.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

void check_runtime(int dev) {
  // The loaded library may be older than the headers (a wheel's cuBLASLt next to a newer toolkit).
  const size_t v = cublasLtGetVersion();
  FP8DP_CHECK(v >= 120900, "fp8dp: Float8BlockScaling's GEMMs need cuBLASLt >= 12.9 (its ",
              "VEC128 / BLK128x128 scale modes), but the loaded cuBLASLt is version ", v,
              "; use DelayedScaling or Float8CurrentScaling, or a newer CUDA toolkit");
  int major = 0;
  FP8DP_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  FP8DP_CHECK(major == 9, "fp8dp: Float8BlockScaling's GEMMs run on Hopper (compute capability ",
              "9.x), where cuBLASLt has its 1x128 / 128x128 FP32 scale modes; device ", dev,
              " has compute capability ", major, ".x; use DelayedScaling or Float8CurrentScaling");
}

}  // namespace

void gemm_lt_block(const LtBlockGemmParams& p, void* stream) {
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  int dev = 0;
  FP8DP_CHECK_CUDA(cudaGetDevice(&dev));
  cublasLtHandle_t h = nullptr;
  void* ws = nullptr;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    cublasLtHandle_t& hh = state().handles[dev];
    if (hh == nullptr) {
      check_runtime(dev);
      FP8DP_CHECK_CUBLAS(cublasLtCreate(&hh), "(creating the handle of device ", dev, ")");
    }
    h = hh;
    void*& w = state().workspaces[{dev, st}];
    if (w == nullptr) FP8DP_CHECK_CUDA(cudaMalloc(&w, kWorkspaceBytes));
    ws = w;
  }
  const std::string shape = shape_of(p);
  Descs d;
  FP8DP_CHECK_CUBLAS(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), shape);
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  FP8DP_CHECK_CUBLAS(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), shape);
  FP8DP_CHECK_CUBLAS(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), shape);
  // cuBLASLt's A is our b, its B our a (see the file comment).
  const int32_t mode_a = p.b_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                    : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int32_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                    &mode_a, sizeof(mode_a)),
                     shape);
  FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                    &mode_b, sizeof(mode_b)),
                     shape);
  FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                    &p.b_scale_inv, sizeof(p.b_scale_inv)),
                     shape);
  FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                    &p.a_scale_inv, sizeof(p.a_scale_inv)),
                     shape);
  FP8DP_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&d.a, to_cuda(p.b_type), p.k, p.n, p.ldb), shape);
  FP8DP_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&d.b, to_cuda(p.a_type), p.k, p.m, p.lda), shape);
  FP8DP_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&d.c, to_cuda(p.out_type), p.n, p.m, p.ldo), shape);
  FP8DP_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&d.pref), shape);
  FP8DP_CHECK_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &kWorkspaceBytes, sizeof(kWorkspaceBytes)),
      shape);
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  FP8DP_CHECK_CUBLAS(
      cublasLtMatmulAlgoGetHeuristic(h, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &heur, &found), shape);
  FP8DP_CHECK(found > 0, "fp8dp: cuBLASLt has no block-scaled FP8 kernel for ", shape,
              "; Float8BlockScaling needs shapes cuBLASLt supports on this device");
  const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
  FP8DP_CHECK_CUBLAS(cublasLtMatmul(h, d.op, &alpha, p.b, d.a, p.a, d.b, &beta, p.out, d.c, p.out,
                                    d.c, &heur.algo, ws, kWorkspaceBytes, st),
                     shape);
}

#else  // cuBLAS headers older than 12.9: no block-scaled modes to compile against

void gemm_lt_block(const LtBlockGemmParams&, void*) {
  FP8DP_CHECK(false, "fp8dp was built against cuBLAS ", CUBLAS_VERSION,
              ", which has no block-scaled FP8 GEMM (needs >= 12.9): Float8BlockScaling is not "
              "available in this build; use DelayedScaling or Float8CurrentScaling");
}

#endif

}  // namespace fp8dp
