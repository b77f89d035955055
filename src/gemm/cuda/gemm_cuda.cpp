// LibTorch layer of the cuBLASLt GEMM: allocates the output and calls gemm_lt(). The arguments are
// checked once, by check_gemm_args (gemm.cpp); this file adds only cuBLASLt's own limits.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/check.h"
#include "common/tensor_checks.h"
#include "gemm/block_gemm.h"
#include "gemm/cuda/cublaslt_gemm.h"
#include "gemm/gemm.h"

namespace fp8dp {
namespace {

constexpr const char* kFn = "fp8dp.gemm";

// How an operand reaches cuBLASLt: rows contiguous (stride(1) == 1) keeps its row stride as the
// leading dimension; a high-precision operand whose columns are contiguous (a transpose view such
// as w.t()) goes in as column-major, read with a transposed op; anything else is copied first.
struct Operand {
  at::Tensor t;
  bool col = false;
  int64_t ld = 0;
};

Operand operand_layout(const at::Tensor& t, bool fp8) {
  if (t.stride(1) == 1 && t.stride(0) >= t.size(1) && t.stride(0) > 0)
    return {t, false, t.stride(0)};
  if (!fp8 && t.stride(0) == 1 && t.stride(1) >= t.size(0) && t.stride(1) > 0)
    return {t, true, t.stride(1)};
  at::Tensor c = t.contiguous();
  return {c, false, c.stride(0)};
}

}  // namespace

at::Tensor gemm_cuda(const GemmArgs& args) {
  const at::Tensor& a = args.a;
  const at::Tensor& b = args.b;
  // Before the general checks, so that a CPU operand is named as such rather than as a mismatch.
  if (a.defined() && b.defined()) {
    FP8DP_CHECK_ARG(a.is_cuda() && b.device() == a.device(), kFn,
                    ": 'a' and 'b' must be on one CUDA device, got ", a.device(), " and ",
                    b.device());
  }
  check_gemm_args(args, GemmStrides::kAny);
  return is_block_scaled(args) ? gemm_block_cuda_checked(args) : gemm_cuda_checked(args);
}

at::Tensor gemm_cuda_checked(const GemmArgs& args) {
  const at::Tensor& a0 = args.a;
  const at::Tensor& b0 = args.b;
  const int64_t m = a0.size(0), k = a0.size(1), n = b0.size(0);
  const bool fp8 = is_fp8(a0.scalar_type());
  FP8DP_CHECK_ARG(!(a0.scalar_type() == at::kFloat8_e5m2 && b0.scalar_type() == at::kFloat8_e5m2),
                  kFn,
                  ": FP8 GEMM of two float8_e5m2 operands is not supported by the tensor "
                  "cores; use float8_e4m3fn for one of them");
  c10::cuda::CUDAGuard guard(a0.device());

  at::Tensor out = args.out;
  if (!out.defined()) out = at::empty({m, n}, a0.options().dtype(args.out_dtype));
  const at::ScalarType ot = out.scalar_type();
  if (fp8) {
    // Hopper's FP8 tensor-core GEMM needs 16-element-aligned leading dimensions; checked here so
    // that no kernel is launched with a shape cuBLASLt would reject.
    FP8DP_CHECK_ARG(out.stride(0) % 16 == 0, kFn,
                    ": FP8 GEMM needs the row stride of 'out' to be a multiple of 16, got ",
                    out.stride(0));
  }

  at::Tensor bias;
  if (args.bias.defined()) {
    // The BIAS epilogue reads the bias in the output's dtype.
    bias = args.bias.to(ot).contiguous();
  }
  if (m == 0 || n == 0) return out;
  if (k == 0) {  // empty sum: out = bias (+ residual), or unchanged plus bias when accumulating
    if (!args.accumulate) out.zero_();
    if (bias.defined()) out.add_(bias);
    if (args.residual.defined()) out.add_(args.residual);
    return out;
  }

  const Operand a = operand_layout(a0, fp8), b = operand_layout(b0, fp8);
  LtGemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a = a.t.data_ptr();
  p.a_type = to_dtype(a.t.scalar_type(), kFn, "operand 'a'");
  p.lda = a.ld;
  p.a_col = a.col;
  p.b = b.t.data_ptr();
  p.b_type = to_dtype(b.t.scalar_type(), kFn, "operand 'b'");
  p.ldb = b.ld;
  p.b_col = b.col;
  at::Tensor a_si, b_si;
  if (fp8) {
    a_si = args.a_scale_inv.contiguous();
    b_si = args.b_scale_inv.contiguous();
    p.a_scale_inv = a_si.data_ptr<float>();
    p.b_scale_inv = b_si.data_ptr<float>();
    FP8DP_CHECK_ARG(p.lda % 16 == 0 && p.ldb % 16 == 0, kFn,
                    ": FP8 GEMM needs row strides that are multiples of 16, got ", p.lda, " and ",
                    p.ldb);
  }
  // cuBLASLt has no BIAS epilogue for FP8 inputs with an FP32 output (CUBLAS_STATUS_NOT_SUPPORTED
  // on the H200); there the bias is added by a separate kernel after the GEMM (with a residual:
  // onto the GEMM's product + residual, two FP32 roundings, within the FP32 summation bound).
  const bool bias_after = bias.defined() && fp8 && ot == at::kFloat;
  if (bias.defined() && !bias_after) {
    p.bias = bias.data_ptr();
    p.bias_type = to_dtype(ot, kFn, "'bias'");
  }
  p.out = out.data_ptr();
  p.out_type = to_dtype(ot, kFn, "'out'");
  p.ldo = out.stride(0);
  // The residual is the epilogue's C (check_gemm_args: out's dtype, rows contiguous, no overlap
  // with out). C has its own matrix layout in the plan, so a residual whose row stride differs from
  // out's goes in as it is; only under FP8 a row stride that is no multiple of 16 (the rule 'out'
  // follows above) needs a copy. One row: its stride is arbitrary and never read, n serves.
  at::Tensor residual;
  if (args.residual.defined()) {
    residual = args.residual;
    if (fp8 && m > 1 && residual.stride(0) % 16 != 0) residual = residual.contiguous();
    p.c = residual.data_ptr();
    p.ldc = m == 1 ? n : residual.stride(0);
  }
  p.accumulate = args.accumulate;
  p.fast_accum = fp8 && !args.use_split_accumulator;
  gemm_lt(p, c10::cuda::getCurrentCUDAStream().stream());
  if (bias_after) out.add_(bias);
  return out;
}

}  // namespace fp8dp
