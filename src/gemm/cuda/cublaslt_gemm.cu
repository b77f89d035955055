// cuBLASLt GEMM with cached plans and per-shape algorithm selection (see cublaslt_gemm.h).
// Row-major out[m, n] = a[m, k] · b[n, k]ᵀ is, in cuBLASLt's column-major terms, the [n, m] matrix
// b · aᵀ: so A := b (k x n, op T), B := a (k x m, op N), M = n, N = m, K = k. That is the "TN"
// layout Hopper's FP8 tensor cores require, and A's scale pointer is therefore b's scale_inv.
// A column-major b ([n, k] with columns ldb apart) is already n x k column-major for cuBLASLt, so A
// takes op N; a column-major a is m x k column-major, so B takes op T (high precision only).
// Block-scaled operands (Float8BlockScaling) take the same route with cuBLASLt's VEC128 /
// BLK128x128 scale modes, so they share the plan cache and the autotuner.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/cuda_check.h"
#include "gemm/cuda/cublaslt_gemm.h"

#if CUBLAS_VERSION >= 120900
#define FP8DP_HAVE_BLOCK_SCALED_GEMM 1
#endif

namespace fp8dp {
namespace {

// 32 MiB: what cuBLASLt's Hopper FP8 kernels ask for at the largest split-K / stream-K settings.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// The heuristic is asked for at most kMaxAlgos candidates; State::max_algos (default 8) of them.
constexpr int kMaxAlgos = 32;
// Each candidate is timed kTimedRounds times (kTimedReps calls each), the rounds interleaved across
// the candidates, and ranked by its median: one sequential sample per candidate let clock drift
// and a neighbour's tail pick a different kernel from run to run (seen on the H200: the same
// GPT-stack shapes took kernels 10% apart in two runs).
constexpr int kTimedReps = 3;
constexpr int kTimedRounds = 5;

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

// Largest power of two (<= 256) dividing the address: cuBLASLt picks kernels by operand alignment.
uint32_t alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

bool is_block(const LtGemmParams& p) {
  return p.a_scale_mode != LtScaleMode::kTensor || p.b_scale_mode != LtScaleMode::kTensor;
}

const char* scale_mode_name(LtScaleMode m) {
  switch (m) {
    case LtScaleMode::kVec128:
      return " in 1x128 tiles";
    case LtScaleMode::kBlock128x128:
      return " in 128x128 blocks";
    case LtScaleMode::kTensor:
      break;
  }
  return "";
}

std::string shape_of(const LtGemmParams& p) {
  using std::to_string;
  return "(GEMM m=" + to_string(p.m) + " n=" + to_string(p.n) + " k=" + to_string(p.k) +
         " a=" + dtype_name(p.a_type) + scale_mode_name(p.a_scale_mode) +
         " b=" + dtype_name(p.b_type) + scale_mode_name(p.b_scale_mode) +
         " out=" + dtype_name(p.out_type) + (p.a_col ? " a col-major" : "") +
         (p.b_col ? " b col-major" : "") + (p.bias ? " +bias" : "") + (p.c ? " +residual" : "") +
         (p.accumulate ? " accumulate" : "") + (p.fast_accum ? " fast_accum" : "") + ")";
}

struct Key {
  int device;
  int64_t m, n, k, lda, ldb, ldo;
  int a_type, b_type, out_type, bias_type, a_scale_mode, b_scale_mode;
  bool bias, accumulate, fast_accum, a_col, b_col;
  uint32_t align_a, align_b, align_out;
  // The residual (C != D): whether there is one, its row stride and alignment (0 without).
  bool residual;
  int64_t ldc;
  uint32_t align_c;
  auto tie() const {
    return std::tie(device, m, n, k, lda, ldb, ldo, a_type, b_type, out_type, bias_type,
                    a_scale_mode, b_scale_mode, bias, accumulate, fast_accum, a_col, b_col, align_a,
                    align_b, align_out, residual, ldc, align_c);
  }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  // lc: C's layout (the residual's, or out's when C is out); ld: D's (out's).
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  int pick = 0, candidates = 0;  // the chosen heuristic index, of how many offered
  std::string shape, config;     // shape_of() and the chosen configuration, for gemm_lt_plans()
  std::mutex mu;  // the scale / bias pointers are descriptor attributes, set per call
  ~Plan() {
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct State {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;
  std::map<Key, std::unique_ptr<Plan>> plans;  // null: cuBLASLt has no algorithm for the key
  bool autotune = [] {
    const char* e = std::getenv("FP8DP_GEMM_AUTOTUNE");
    return !(e != nullptr && std::strcmp(e, "0") == 0);
  }();
  int algo_override = -1;  // >= 0: new plans take that heuristic candidate, untimed
  // FP8DP_GEMM_CANDIDATES=n (1..kMaxAlgos) widens or narrows the autotuner's search for a whole
  // run (a training run's GEMMs are planned deep inside the layers, out of reach of
  // gemm_lt_set_candidates); anything else keeps the default of 8.
  int max_algos = [] {
    const char* e = std::getenv("FP8DP_GEMM_CANDIDATES");
    const int n = e != nullptr ? std::atoi(e) : 0;
    return n >= 1 && n <= kMaxAlgos ? n : 8;
  }();
  std::set<int> block_checked;  // devices whose block-scaling support check_block_runtime passed
};

State& state() {
  static State* s = new State();  // never destroyed: plans may outlive static teardown order
  return *s;
}

// Caller holds state().mu.
cublasLtHandle_t handle_for(int dev) {
  auto& h = state().handles[dev];
  if (h == nullptr)
    FP8DP_CHECK_CUBLAS(cublasLtCreate(&h), "(creating the handle of device ", dev, ")");
  return h;
}

// One workspace per (device, stream): GEMMs on one stream are ordered, so they can share it.
// The first GEMM on a stream allocates it, which a CUDA graph capture of that stream refuses
// (docs/cuda_graphs_design.md, B4): then the error says what to do instead of CUDA's "operation
// not permitted when stream is capturing".
void* workspace_for(int dev, cudaStream_t st) {
  void*& w = state().workspaces[{dev, st}];
  if (w != nullptr) return w;
  const cudaError_t e = cudaMalloc(&w, kWorkspaceBytes);
  if (e == cudaSuccess) return w;
  w = nullptr;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  const bool capturing =
      cudaStreamIsCapturing(st, &cap) != cudaSuccess || cap != cudaStreamCaptureStatusNone;
  (void)cudaGetLastError();
  FP8DP_CHECK(!capturing,
              "fp8dp: the first FP8 GEMM on this CUDA stream runs inside a CUDA graph capture, "
              "where its cuBLASLt workspace cannot be allocated (the capture is now invalid). Run "
              "the captured work once eagerly on the capture stream before capturing "
              "(torch.cuda.graph(g, stream=s) after a warm-up on s), or capture with "
              "fp8dp.make_graphed_callables, which warms up on its capture stream");
  FP8DP_CHECK_CUDA(e);
  return w;
}

#if defined(FP8DP_HAVE_BLOCK_SCALED_GEMM)
int32_t lt_scale_mode(LtScaleMode m) {
  return m == LtScaleMode::kBlock128x128 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                         : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
}
#endif

// Block scaling's limits, checked once per device before its first block-scaled plan. The loaded
// library may be older than the headers (a wheel's cuBLASLt next to a newer toolkit).
void check_block_runtime(int dev) {
  FP8DP_CHECK(gemm_lt_block_compiled(), "fp8dp was built against cuBLAS ", CUBLAS_VERSION,
              ", which has no block-scaled FP8 GEMM (needs >= 12.9): Float8BlockScaling is not "
              "available in this build; use DelayedScaling or Float8CurrentScaling");
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

// Messages are formatted only when a check fails (the macros evaluate their message arguments
// lazily), so the per-call path builds no strings.
void set_pointers(Plan& pl, const LtGemmParams& p) {
  if (is_fp8(p.a_type)) {
    FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                      &p.b_scale_inv, sizeof(p.b_scale_inv)),
                       shape_of(p));
    FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                      &p.a_scale_inv, sizeof(p.a_scale_inv)),
                       shape_of(p));
  }
  if (p.bias) {
    FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &p.bias, sizeof(p.bias)),
                       shape_of(p));
  }
}

// D = out. C is the residual (beta = 1, out of place), or out itself: beta = 1 accumulates into
// it, beta = 0 ignores it.
cublasStatus_t matmul(cublasLtHandle_t h, Plan& pl, const LtGemmParams& p, void* out,
                      const cublasLtMatmulAlgo_t* algo, void* ws, cudaStream_t st) {
  const float alpha = 1.0f, beta = (p.accumulate || p.c != nullptr) ? 1.0f : 0.0f;
  const void* c = p.c != nullptr ? p.c : out;
  return cublasLtMatmul(h, pl.op, &alpha, p.b, pl.la, p.a, pl.lb, &beta, c, pl.lc, out, pl.ld, algo,
                        ws, kWorkspaceBytes, st);
}

// Times every heuristic candidate (after one warm-up) and returns the index of the fastest by
// median, or -1 when none of them runs. With accumulate the candidates write a scratch copy so that
// `out` is not summed into repeatedly. That copy comes from cudaMallocAsync's default pool on
// purpose, not from the keep-everything scratch pool (common/cuda_scratch.h): it is as large as
// `out` (a whole main_grad, 256 MB at 8192 x 8192), needed once per shape, and best handed back at
// the next synchronize. A residual needs no copy: C != D, so nothing is accumulated into, and every
// run writes the same `out` from the unchanged residual.
int pick_fastest(cublasLtHandle_t h, Plan& pl, const LtGemmParams& p,
                 const cublasLtMatmulHeuristicResult_t* res, int count, void* ws, cudaStream_t st) {
  void* target = p.out;
  const size_t out_bytes = static_cast<size_t>(p.m) * p.ldo * dtype_size(p.out_type);
  if (p.accumulate) {
    FP8DP_CHECK_CUDA(cudaMallocAsync(&target, out_bytes, st));
    FP8DP_CHECK_CUDA(cudaMemsetAsync(target, 0, out_bytes, st));
  }
  std::vector<int> ok;  // candidates that run
  for (int i = 0; i < count; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    if (matmul(h, pl, p, target, &res[i].algo, ws, st) == CUBLAS_STATUS_SUCCESS) ok.push_back(i);
  }
  // Events: one pair per (round, candidate), read after the last round.
  std::vector<cudaEvent_t> ev(2 * kTimedRounds * ok.size());
  for (auto& e : ev) FP8DP_CHECK_CUDA(cudaEventCreate(&e));
  for (int r = 0; r < kTimedRounds; ++r) {
    for (size_t j = 0; j < ok.size(); ++j) {
      const size_t k = 2 * (r * ok.size() + j);
      FP8DP_CHECK_CUDA(cudaEventRecord(ev[k], st));
      for (int rep = 0; rep < kTimedReps; ++rep) matmul(h, pl, p, target, &res[ok[j]].algo, ws, st);
      FP8DP_CHECK_CUDA(cudaEventRecord(ev[k + 1], st));
    }
  }
  FP8DP_CHECK_CUDA(cudaStreamSynchronize(st));
  int best = ok.empty() ? -1 : ok[0];
  float best_ms = std::numeric_limits<float>::infinity();
  for (size_t j = 0; j < ok.size(); ++j) {
    std::array<float, kTimedRounds> ms{};
    for (int r = 0; r < kTimedRounds; ++r) {
      const size_t k = 2 * (r * ok.size() + j);
      FP8DP_CHECK_CUDA(cudaEventElapsedTime(&ms[r], ev[k], ev[k + 1]));
    }
    std::nth_element(ms.begin(), ms.begin() + kTimedRounds / 2, ms.end());
    if (ms[kTimedRounds / 2] < best_ms) best_ms = ms[kTimedRounds / 2], best = ok[j];
  }
  for (auto& e : ev) FP8DP_CHECK_CUDA(cudaEventDestroy(e));
  if (p.accumulate) FP8DP_CHECK_CUDA(cudaFreeAsync(target, st));
  return best;
}

// The algorithm's configuration as cuBLASLt numbers it (ids of cublasLtMatmulTile_t,
// cublasLtMatmulStages_t, cublasLtClusterShape_t), so that two picks can be told apart.
std::string describe(const cublasLtMatmulHeuristicResult_t& r) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t a) -> int64_t {
    uint32_t v = 0;  // every attribute read here is at most 32 bits wide
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&r.algo, a, &v, sizeof(v), &written) !=
        CUBLAS_STATUS_SUCCESS)
      return -1;
    return v;
  };
  using std::to_string;
  return "algo " + to_string(get(CUBLASLT_ALGO_CONFIG_ID)) + " tile " +
         to_string(get(CUBLASLT_ALGO_CONFIG_TILE_ID)) + " stages " +
         to_string(get(CUBLASLT_ALGO_CONFIG_STAGES_ID)) + " splitk " +
         to_string(get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) + " swizzle " +
         to_string(get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)) + " cluster " +
         to_string(get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)) + " waves " +
         to_string(r.wavesCount);
}

std::unique_ptr<Plan> build_plan(cublasLtHandle_t h, const LtGemmParams& p, void* ws,
                                 cudaStream_t st, bool autotune, int max_algos, int algo_override) {
  auto pl = std::make_unique<Plan>();
  FP8DP_CHECK_CUBLAS(cublasLtMatmulDescCreate(&pl->op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                     shape_of(p));
  const cublasOperation_t ta = p.b_col ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t tb = p.a_col ? CUBLAS_OP_T : CUBLAS_OP_N;
  FP8DP_CHECK_CUBLAS(
      cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
      shape_of(p));
  FP8DP_CHECK_CUBLAS(
      cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
      shape_of(p));
  if (is_fp8(p.a_type) && !is_block(p)) {
    const int8_t fast = p.fast_accum ? 1 : 0;
    FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                      &fast, sizeof(fast)),
                       shape_of(p));
  }
#if defined(FP8DP_HAVE_BLOCK_SCALED_GEMM)
  if (is_block(p)) {
    // cuBLASLt's A is our b, its B our a (see the file comment). Block-scaled kernels promote each
    // 128-wide K chunk into FP32 by construction: FAST_ACCUM does not apply.
    const int32_t mode_a = lt_scale_mode(p.b_scale_mode), mode_b = lt_scale_mode(p.a_scale_mode);
    FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                      &mode_a, sizeof(mode_a)),
                       shape_of(p));
    FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                      &mode_b, sizeof(mode_b)),
                       shape_of(p));
  }
#endif
  if (p.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bt = to_cuda(p.bias_type);
    FP8DP_CHECK_CUBLAS(
        cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)),
        shape_of(p));
    FP8DP_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                      &bt, sizeof(bt)),
                       shape_of(p));
  }
  FP8DP_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&pl->la, to_cuda(p.b_type), p.b_col ? p.n : p.k,
                                                p.b_col ? p.k : p.n, p.ldb),
                     shape_of(p));
  FP8DP_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&pl->lb, to_cuda(p.a_type), p.a_col ? p.m : p.k,
                                                p.a_col ? p.k : p.m, p.lda),
                     shape_of(p));
  // C and D share a type; C's leading dimension is the residual's row stride when there is one.
  FP8DP_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&pl->lc, to_cuda(p.out_type), p.n, p.m,
                                                p.c != nullptr ? p.ldc : p.ldo),
                     shape_of(p));
  FP8DP_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&pl->ld, to_cuda(p.out_type), p.n, p.m, p.ldo),
                     shape_of(p));

  // The block-scaled modes are validated against their scale pointers when the heuristic is
  // asked (H200, cuBLASLt 13.0: INVALID_VALUE for every block GEMM while they were still null), so
  // the pointers go in first; set_pointers runs again per call.
  set_pointers(*pl, p);
  cublasLtMatmulPreference_t pref = nullptr;
  FP8DP_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref), shape_of(p));
  const uint64_t ws_bytes = kWorkspaceBytes;
  const uint32_t al_a = alignment(p.b), al_b = alignment(p.a);
  const uint32_t al_c = alignment(p.c != nullptr ? p.c : p.out), al_d = alignment(p.out);
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes));
  // Block-scaled plans keep cuBLASLt's default alignment preference (256 bytes), as the
  // GPU-verified block path before the shared plan cache did; the pointers' alignment is still
  // part of the plan key.
  if (s == CUBLAS_STATUS_SUCCESS && !is_block(p))
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                             &al_a, sizeof(al_a));
  if (s == CUBLAS_STATUS_SUCCESS && !is_block(p))
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                             &al_b, sizeof(al_b));
  if (s == CUBLAS_STATUS_SUCCESS && !is_block(p))
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                             &al_c, sizeof(al_c));
  if (s == CUBLAS_STATUS_SUCCESS && !is_block(p))
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                             &al_d, sizeof(al_d));
  cublasLtMatmulHeuristicResult_t res[kMaxAlgos] = {};
  int count = 0;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulAlgoGetHeuristic(h, pl->op, pl->la, pl->lb, pl->lc, pl->ld, pref, max_algos,
                                       res, &count);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  // A block-scaled plan with the BIAS epilogue or a residual (C) is the one optional route
  // (gemm_lt_try): cuBLASLt refuses unsupported scale-mode combinations with INVALID_VALUE as well
  // as NOT_SUPPORTED, and the caller's fallback (no epilogue, FP32 output, the add after) still
  // reports its own status loudly, so either status means "no algorithm" here.
  const bool optional_route = (p.bias != nullptr || p.c != nullptr) && is_block(p);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && count == 0) ||
      (optional_route && s == CUBLAS_STATUS_INVALID_VALUE))
    return nullptr;  // the caller says so (gemm_lt) or takes another route (gemm_lt_try)
  FP8DP_CHECK_CUBLAS(s, "while asking for algorithms ", shape_of(p));

  set_pointers(*pl, p);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  FP8DP_CHECK_CUDA(cudaStreamIsCapturing(st, &cap));
  FP8DP_CHECK_ARG(algo_override < count, "gemm_lt: algo_override must be below the ", count,
                  " candidates cuBLASLt offers for ", shape_of(p), ", got ", algo_override);
  const int pick = algo_override >= 0 ? algo_override
                   : (autotune && count > 1 && cap == cudaStreamCaptureStatusNone)
                       ? pick_fastest(h, *pl, p, res, count, ws, st)
                       : 0;
  if (pick < 0) return nullptr;  // every candidate failed to run: no algorithm after all
  pl->algo = res[pick].algo;
  pl->pick = pick;
  pl->candidates = count;
  pl->config = describe(res[pick]);
  pl->shape = shape_of(p);
  return pl;
}

}  // namespace

namespace {

// Runs the GEMM with its cached plan (built, and autotuned, on the first call for the key). Returns
// false, launching nothing, when cuBLASLt has no algorithm for it.
bool run_gemm(const LtGemmParams& p, void* stream) {
  FP8DP_CHECK(p.m > 0 && p.n > 0 && p.k > 0, "gemm_lt: empty shape ", shape_of(p));
  FP8DP_CHECK(p.a && p.b && p.out, "gemm_lt: null operand pointer ", shape_of(p));
  FP8DP_CHECK(!is_fp8(p.a_type) || (p.a_scale_inv && p.b_scale_inv),
              "gemm_lt: FP8 operands need both scale_inv pointers ", shape_of(p));
  FP8DP_CHECK(!is_fp8(p.a_type) || (!p.a_col && !p.b_col),
              "gemm_lt: FP8 operands must be row-major (Hopper's FP8 GEMM is TN only) ",
              shape_of(p));
  FP8DP_CHECK(p.c == nullptr || (!p.accumulate && p.c != p.out && p.ldc >= p.n),
              "gemm_lt: a residual needs accumulate off, a pointer other than out's and ldc >= n, "
              "got ldc=",
              p.ldc, " ", shape_of(p));
  FP8DP_CHECK(!is_block(p) || (is_fp8(p.a_type) && p.a_scale_mode == LtScaleMode::kVec128 &&
                               p.b_scale_mode != LtScaleMode::kTensor && !p.fast_accum),
              "gemm_lt: a block-scaled GEMM takes FP8 'a' in 1x128 tiles and 'b' in tiles or "
              "blocks, without fast accumulation ",
              shape_of(p));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  int dev = 0;
  FP8DP_CHECK_CUDA(cudaGetDevice(&dev));
  const Key key{dev,
                p.m,
                p.n,
                p.k,
                p.lda,
                p.ldb,
                p.ldo,
                static_cast<int>(p.a_type),
                static_cast<int>(p.b_type),
                static_cast<int>(p.out_type),
                p.bias ? static_cast<int>(p.bias_type) : -1,
                static_cast<int>(p.a_scale_mode),
                static_cast<int>(p.b_scale_mode),
                p.bias != nullptr,
                p.accumulate,
                p.fast_accum && is_fp8(p.a_type),
                p.a_col,
                p.b_col,
                alignment(p.a),
                alignment(p.b),
                alignment(p.out),
                p.c != nullptr,
                p.c != nullptr ? p.ldc : int64_t{0},
                p.c != nullptr ? alignment(p.c) : uint32_t{0}};
  State& S = state();
  Plan* plan = nullptr;
  cublasLtHandle_t h = nullptr;
  void* ws = nullptr;
  {
    // Held while a new plan is autotuned: tuning happens once per shape, and other threads asking
    // for the same shape must wait for its result rather than tune it again.
    std::lock_guard<std::mutex> lock(S.mu);
    auto it = S.plans.find(key);
    if (it == S.plans.end()) {
      if (is_block(p) && S.block_checked.insert(dev).second) {
        try {
          check_block_runtime(dev);
        } catch (...) {
          S.block_checked.erase(dev);  // refuse every call alike, not only the first
          throw;
        }
      }
      h = handle_for(dev);
      ws = workspace_for(dev, st);
      it = S.plans.emplace(key, build_plan(h, p, ws, st, S.autotune, S.max_algos, S.algo_override))
               .first;
    } else {
      h = handle_for(dev);
      ws = workspace_for(dev, st);
    }
    plan = it->second.get();
  }
  if (plan == nullptr) return false;
  std::lock_guard<std::mutex> lock(plan->mu);
  set_pointers(*plan, p);
  FP8DP_CHECK_CUBLAS(matmul(h, *plan, p, p.out, &plan->algo, ws, st), shape_of(p));
  return true;
}

}  // namespace

void gemm_lt(const LtGemmParams& p, void* stream) {
  // The hint names what cuBLASLt asks of this kind of GEMM: FP8 and block-scaled GEMMs have
  // shape and format rules; a high-precision GEMM has none of those, so its hint is the type
  // table (check_gemm_args refuses the combinations known to lack a kernel before this).
  const char* hint =
      is_block(p) ? " (Float8BlockScaling needs shapes cuBLASLt's block-scaled kernels support on "
                    "this device: k and n multiples of 16, 16-byte aligned operands)"
      : is_fp8(p.a_type) ? " (FP8 needs k and n multiples of 16, 16-byte aligned operands, and "
                           "not both e5m2)"
                         : " (a high-precision GEMM: cuBLASLt's type table has no kernel for "
                           "these operand, output and bias dtypes on this device)";
  FP8DP_CHECK(run_gemm(p, stream), "cuBLASLt has no algorithm for ", shape_of(p), hint);
}

bool gemm_lt_try(const LtGemmParams& p, void* stream) { return run_gemm(p, stream); }

bool gemm_lt_block_compiled() {
#if defined(FP8DP_HAVE_BLOCK_SCALED_GEMM)
  return true;
#else
  return false;
#endif
}

void gemm_lt_set_autotune(bool on) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().autotune = on;
}

void gemm_lt_set_candidates(int max_algos, int algo_override) {
  FP8DP_CHECK_ARG(max_algos >= 1 && max_algos <= kMaxAlgos,
                  "gemm_lt_set_candidates: max_algos must be in [1, ", kMaxAlgos, "], got ",
                  max_algos);
  FP8DP_CHECK_ARG(
      algo_override >= -1 && algo_override < max_algos,
      "gemm_lt_set_candidates: algo_override must be -1 (autotune) or in [0, max_algos = ",
      max_algos, "), got ", algo_override);
  std::lock_guard<std::mutex> lock(state().mu);
  state().max_algos = max_algos;
  state().algo_override = algo_override;
}

std::vector<LtPlanInfo> gemm_lt_plans() {
  std::lock_guard<std::mutex> lock(state().mu);
  std::vector<LtPlanInfo> out;
  for (const auto& [key, plan] : state().plans)
    if (plan) out.push_back({plan->shape, plan->pick, plan->candidates, plan->config});
  return out;
}

int64_t gemm_lt_cache_size() {
  std::lock_guard<std::mutex> lock(state().mu);
  int64_t n = 0;
  for (const auto& [key, plan] : state().plans) n += plan != nullptr;
  return n;
}

void gemm_lt_clear_cache() {
  std::lock_guard<std::mutex> lock(state().mu);
  state().plans.clear();
}

}  // namespace fp8dp
