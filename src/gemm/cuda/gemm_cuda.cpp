// LibTorch layer of the cuBLASLt GEMM: checks GemmArgs, allocates the output and calls gemm_lt().
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/check.h"
#include "gemm/cuda/cublaslt_gemm.h"
#include "gemm/gemm.h"

namespace fp8dp {
namespace {

constexpr const char* kFn = "fp8dp.gemm";

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

GemmDType to_gemm(at::ScalarType t, const char* arg) {
  switch (t) {
    case at::kFloat: return GemmDType::kFloat32;
    case at::kBFloat16: return GemmDType::kBFloat16;
    case at::kHalf: return GemmDType::kFloat16;
    case at::kFloat8_e4m3fn: return GemmDType::kE4M3;
    case at::kFloat8_e5m2: return GemmDType::kE5M2;
    default:
      FP8DP_CHECK_ARG(false, kFn, ": argument '", arg,
                      "' must be float8_e4m3fn, float8_e5m2, float32, bfloat16 or float16, got ", t);
  }
}

// A 2-D operand whose rows are contiguous (stride(1) == 1) keeps its row stride as the leading
// dimension; anything else is made contiguous first.
at::Tensor rows_contiguous(const at::Tensor& t) {
  if (t.stride(1) == 1 && t.stride(0) >= t.size(1) && t.stride(0) > 0) return t;
  return t.contiguous();
}

void check_scale_inv(const at::Tensor& s, const at::Tensor& op, const char* arg) {
  FP8DP_CHECK_ARG(s.defined(), kFn, ": argument '", arg, "' is required for an FP8 operand");
  FP8DP_CHECK_ARG(s.scalar_type() == at::kFloat && s.numel() == 1, kFn, ": argument '", arg,
                  "' must be a float32 tensor with one element, got ", s.scalar_type(), " of shape ",
                  s.sizes());
  FP8DP_CHECK_ARG(s.device() == op.device(), kFn, ": argument '", arg, "' is on ", s.device(),
                  " but its operand is on ", op.device());
}

}  // namespace

at::Tensor gemm_cuda(const GemmArgs& args) {
  const at::Tensor& a0 = args.a;
  const at::Tensor& b0 = args.b;
  FP8DP_CHECK_ARG(a0.defined() && b0.defined(), kFn, ": arguments 'a' and 'b' are required");
  FP8DP_CHECK_ARG(a0.is_cuda() && b0.device() == a0.device(), kFn,
                  ": 'a' and 'b' must be on one CUDA device, got ", a0.device(), " and ",
                  b0.device());
  FP8DP_CHECK_ARG(a0.dim() == 2 && b0.dim() == 2, kFn, ": 'a' [m, k] and 'b' [n, k] must be 2-D, got ",
                  a0.sizes(), " and ", b0.sizes());
  const int64_t m = a0.size(0), k = a0.size(1), n = b0.size(0);
  FP8DP_CHECK_ARG(b0.size(1) == k, kFn, ": inner dimensions differ: 'a' is ", a0.sizes(),
                  " and 'b' is ", b0.sizes(), " (TN: out = a · bᵀ needs a [m, k] and b [n, k])");
  const bool fp8 = is_fp8(a0.scalar_type());
  FP8DP_CHECK_ARG(fp8 == is_fp8(b0.scalar_type()), kFn,
                  ": 'a' and 'b' must both be FP8 or both high precision, got ", a0.scalar_type(),
                  " and ", b0.scalar_type());
  if (fp8) {
    FP8DP_CHECK_ARG(!(a0.scalar_type() == at::kFloat8_e5m2 && b0.scalar_type() == at::kFloat8_e5m2),
                    kFn, ": FP8 GEMM of two float8_e5m2 operands is not supported by the tensor "
                         "cores; use float8_e4m3fn for one of them");
    // Hopper's FP8 tensor-core GEMM needs 16-element-aligned leading dimensions; checked here so
    // that no kernel is launched with a shape cuBLASLt would reject.
    FP8DP_CHECK_ARG(k % 16 == 0, kFn, ": FP8 GEMM needs the inner dimension k to be a multiple of "
                                      "16, got k=", k, " (a ", a0.sizes(), ", b ", b0.sizes(), ")");
    FP8DP_CHECK_ARG(n % 16 == 0, kFn, ": FP8 GEMM needs n (rows of 'b') to be a multiple of 16, got n=",
                    n);
    check_scale_inv(args.a_scale_inv, a0, "a_scale_inv");
    check_scale_inv(args.b_scale_inv, b0, "b_scale_inv");
  } else {
    FP8DP_CHECK_ARG(a0.scalar_type() == b0.scalar_type(), kFn,
                    ": high-precision 'a' and 'b' must share a dtype, got ", a0.scalar_type(), " and ",
                    b0.scalar_type());
    to_gemm(a0.scalar_type(), "a");
  }
  c10::cuda::CUDAGuard guard(a0.device());

  at::Tensor out = args.out;
  if (out.defined()) {
    FP8DP_CHECK_ARG(out.device() == a0.device(), kFn, ": 'out' is on ", out.device(),
                    " but the operands are on ", a0.device());
    FP8DP_CHECK_ARG(out.dim() == 2 && out.size(0) == m && out.size(1) == n, kFn,
                    ": 'out' must have shape [", m, ", ", n, "], got ", out.sizes());
    FP8DP_CHECK_ARG(out.stride(1) == 1 && out.stride(0) >= n, kFn,
                    ": 'out' must have contiguous rows, got strides ", out.strides());
  } else {
    FP8DP_CHECK_ARG(!args.accumulate, kFn, ": accumulate=True needs an 'out' tensor to add into");
    out = at::empty({m, n}, a0.options().dtype(args.out_dtype));
  }
  const at::ScalarType ot = out.scalar_type();
  FP8DP_CHECK_ARG(ot == at::kFloat || ot == at::kBFloat16 || ot == at::kHalf, kFn,
                  ": the output dtype must be float32, bfloat16 or float16, got ", ot);
  if (fp8) {
    FP8DP_CHECK_ARG(out.stride(0) % 16 == 0, kFn,
                    ": FP8 GEMM needs the row stride of 'out' to be a multiple of 16, got ",
                    out.stride(0));
  }

  at::Tensor bias;
  if (args.bias.defined()) {
    FP8DP_CHECK_ARG(args.bias.dim() == 1 && args.bias.size(0) == n, kFn,
                    ": 'bias' must have shape [", n, "], got ", args.bias.sizes());
    FP8DP_CHECK_ARG(args.bias.device() == a0.device(), kFn, ": 'bias' is on ", args.bias.device(),
                    " but the operands are on ", a0.device());
    // The BIAS epilogue reads the bias in the output's dtype.
    bias = args.bias.to(ot).contiguous();
  }
  if (m == 0 || n == 0) return out;
  if (k == 0) {  // empty sum: out = bias (or unchanged plus bias when accumulating)
    if (!args.accumulate) out.zero_();
    if (bias.defined()) out.add_(bias);
    return out;
  }

  const at::Tensor a = rows_contiguous(a0), b = rows_contiguous(b0);
  LtGemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a = a.data_ptr();
  p.a_type = to_gemm(a.scalar_type(), "a");
  p.lda = a.stride(0);
  p.b = b.data_ptr();
  p.b_type = to_gemm(b.scalar_type(), "b");
  p.ldb = b.stride(0);
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
  // cuBLASLt has no BIAS epilogue for FP8 inputs with an FP32 output (CUBLAS_STATUS_NOT_SUPPORTED on
  // the H200); there the bias is added by a separate kernel after the GEMM.
  const bool bias_after = bias.defined() && fp8 && ot == at::kFloat;
  if (bias.defined() && !bias_after) {
    p.bias = bias.data_ptr();
    p.bias_type = to_gemm(ot, "bias");
  }
  p.out = out.data_ptr();
  p.out_type = to_gemm(ot, "out");
  p.ldo = out.stride(0);
  p.accumulate = args.accumulate;
  p.fast_accum = fp8 && !args.use_split_accumulator;
  gemm_lt(p, c10::cuda::getCurrentCUDAStream().stream());
  if (bias_after) out.add_(bias);
  return out;
}

}  // namespace fp8dp
