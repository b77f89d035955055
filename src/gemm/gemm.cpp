// GEMM front end: the argument checks of every device (check_gemm_args), and the CPU path.
// The CPU path dequantizes FP8 operands exactly (decode(byte) * scale_inv is exact in FP32 unless
// it underflows), multiplies in FP32 and applies the epilogues in FP32, so its result is the one an
// FP8 tensor-core GEMM with FP32 accumulation computes, up to the order of the FP32 additions.
#include "gemm/gemm.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include "common/check.h"
#include "common/tensor_checks.h"
#include "fp8/block_cast.h"
#include "fp8/cast.h"
#include "gemm/block_gemm.h"

namespace fp8dp {
namespace {

constexpr const char* kFn = "fp8dp.gemm";

// name: "a" or "b"; what: "operand 'a'" or "operand 'b'" (literals: the check runs on every GEMM).
void check_operand(const at::Tensor& t, const at::Tensor& scale_inv, const char* name,
                   const char* what, const char* scale_name, GemmStrides strides) {
  FP8DP_CHECK_ARG(t.defined(), kFn, ": operand '", name, "' is undefined");
  FP8DP_CHECK_ARG(t.dim() == 2, kFn, ": operand '", name, "' must be 2-D, got shape ", t.sizes());
  to_dtype(t.scalar_type(), kFn, what);
  if (strides == GemmStrides::kContiguous && !t.is_contiguous()) {
    FP8DP_CHECK_ARG(!is_fp8(t.scalar_type()), kFn, ": FP8 operand '", name,
                    "' must be row-major contiguous (TN layout), got strides ", t.strides());
    FP8DP_CHECK_ARG(t.t().is_contiguous(), kFn, ": operand '", name,
                    "' must be row-major contiguous or the transpose of a contiguous tensor, got "
                    "shape ",
                    t.sizes(), " and strides ", t.strides());
  }
  if (is_fp8(t.scalar_type())) {
    FP8DP_CHECK_ARG(scale_inv.defined(), kFn, ": operand '", name, "' is FP8 but '", scale_name,
                    "' is undefined ('", scale_name,
                    "' is required for an FP8 operand: float32 with one element, or per-block "
                    "scales)");
    // One element (per tensor), or a 2-D layout of 1x128 tiles / 128x128 blocks (block_cast.h).
    scale_granularity(t, scale_inv, kFn, scale_name);
  }
}

// The residual is the epilogue's C: read in the output's dtype (cuBLASLt's C and D share a type),
// with its own row stride, so that any tensor whose rows are contiguous goes in without a copy.
void check_residual(const GemmArgs& g, int64_t m, int64_t n) {
  const at::Tensor& r = g.residual;
  FP8DP_CHECK_ARG(!g.accumulate, kFn,
                  ": 'residual' cannot be combined with accumulate=True (accumulate already adds "
                  "'out' as the epilogue's C matrix; add the residual into 'out' beforehand)");
  FP8DP_CHECK_ARG(r.dim() == 2 && r.size(0) == m && r.size(1) == n, kFn,
                  ": 'residual' must have shape [", m, ", ", n, "] (the output's), got ",
                  r.sizes());
  const at::ScalarType ot = g.out.defined() ? g.out.scalar_type() : g.out_dtype;
  to_high_precision_dtype(r.scalar_type(), kFn, "'residual'");
  FP8DP_CHECK_ARG(r.scalar_type() == ot, kFn, ": 'residual' must have the output's dtype ", ot,
                  " (the sum is rounded once into it), got ", r.scalar_type());
  FP8DP_CHECK_ARG(r.device() == g.a.device(), kFn, ": 'residual' is on ", r.device(),
                  " but the operands are on ", g.a.device());
  // Size-1 dimensions may carry any stride; only the real ones must describe contiguous rows.
  FP8DP_CHECK_ARG((n == 1 || r.stride(1) == 1) && (m == 1 || r.stride(0) >= n), kFn,
                  ": 'residual' must have contiguous rows (stride(1) == 1, stride(0) >= ", n,
                  "), got strides ", r.strides());
  if (g.out.defined()) {
    // The GPU writes D while it reads C tile by tile: overlapping memory would read rows already
    // written. accumulate=True is the in-place form.
    const at::MemOverlapStatus o = at::get_overlap_status(g.out, r);
    FP8DP_CHECK_ARG(o != at::MemOverlapStatus::Full && o != at::MemOverlapStatus::Partial, kFn,
                    ": 'residual' overlaps 'out' in memory; pass a separate output, or add "
                    "into 'out' with accumulate=True");
  }
}

}  // namespace

void check_gemm_args(const GemmArgs& g, GemmStrides strides) {
  check_operand(g.a, g.a_scale_inv, "a", "operand 'a'", "a_scale_inv", strides);
  check_operand(g.b, g.b_scale_inv, "b", "operand 'b'", "b_scale_inv", strides);
  FP8DP_CHECK_ARG(g.a.device() == g.b.device(), kFn, ": operands on different devices: a on ",
                  g.a.device(), ", b on ", g.b.device());
  const bool fp8 = is_fp8(g.a.scalar_type());
  FP8DP_CHECK_ARG(fp8 == is_fp8(g.b.scalar_type()), kFn,
                  ": operands must be both FP8 or both high precision, got a ", g.a.scalar_type(),
                  " and b ", g.b.scalar_type());
  if (!fp8) {
    FP8DP_CHECK_ARG(g.a.scalar_type() == g.b.scalar_type(), kFn,
                    ": high-precision operands must share a dtype, got a ", g.a.scalar_type(),
                    " and b ", g.b.scalar_type());
  }
  const int64_t m = g.a.size(0), k = g.a.size(1), n = g.b.size(0);
  FP8DP_CHECK_ARG(g.b.size(1) == k, kFn, ": inner dimensions differ: a is [", m, ", ", k,
                  "] and b is [", n, ", ", g.b.size(1), "] (out = a · bᵀ needs equal k)");
  if (fp8) {
    // FP8 tensor cores need 16-byte aligned K and N; the CPU applies the same rule so that a model
    // that runs here also runs on a GPU.
    FP8DP_CHECK_ARG(k % 16 == 0, kFn,
                    ": FP8 GEMM needs the inner dimension k to be a multiple of 16, got k=", k,
                    " (a [", m, ", ", k, "], b [", n, ", ", k, "])");
    FP8DP_CHECK_ARG(n % 16 == 0, kFn,
                    ": FP8 GEMM needs the output dimension n to be a multiple of 16, got n=", n,
                    " (a [", m, ", ", k, "], b [", n, ", ", k, "])");
    if (is_block_scaled(g)) check_block_scaled_pair(g, kFn);
  }
  if (g.bias.defined()) {
    FP8DP_CHECK_ARG(g.bias.dim() == 1 && g.bias.size(0) == n, kFn, ": 'bias' must have shape [", n,
                    "], got ", g.bias.sizes());
    to_high_precision_dtype(g.bias.scalar_type(), kFn, "'bias'");
    FP8DP_CHECK_ARG(g.bias.device() == g.a.device(), kFn, ": 'bias' is on ", g.bias.device(),
                    " but the operands are on ", g.a.device());
  }
  FP8DP_CHECK_ARG(!g.accumulate || g.out.defined(), kFn,
                  ": accumulate=True needs an 'out' tensor of shape [", m, ", ", n,
                  "] to accumulate into");
  if (g.out.defined()) {
    FP8DP_CHECK_ARG(g.out.dim() == 2 && g.out.size(0) == m && g.out.size(1) == n, kFn,
                    ": 'out' must have shape [", m, ", ", n, "], got ", g.out.sizes());
    if (strides == GemmStrides::kAny) {
      FP8DP_CHECK_ARG(g.out.stride(1) == 1 && g.out.stride(0) >= n, kFn,
                      ": 'out' must have contiguous rows, got strides ", g.out.strides());
    } else {
      FP8DP_CHECK_ARG(g.out.is_contiguous(), kFn, ": 'out' must be contiguous");
    }
    to_high_precision_dtype(g.out.scalar_type(), kFn, "'out'");
    FP8DP_CHECK_ARG(g.out.device() == g.a.device(), kFn, ": 'out' is on ", g.out.device(),
                    " but the operands are on ", g.a.device());
  } else {
    to_high_precision_dtype(g.out_dtype, kFn, "'out_dtype'");
  }
  if (!fp8 && g.a.scalar_type() == at::kFloat) {
    // cuBLASLt's type table has float32 x float32 only into float32 (the H100 answered "no
    // algorithm" for a bfloat16 output with a residual, 12-06); the CPU applies the same rule so
    // that what runs here also runs on a GPU. fp8dp's layers never ask for it: their outputs have
    // their inputs' dtype, and their weight gradients go to float32 or the weight's dtype.
    const at::ScalarType ot = g.out.defined() ? g.out.scalar_type() : g.out_dtype;
    FP8DP_CHECK_ARG(ot == at::kFloat, kFn,
                    ": float32 operands need a float32 output (out_dtype or 'out'), got ", ot,
                    "; cast the operands to ", ot, " or take a float32 output and convert it");
  }
  if (g.residual.defined()) check_residual(g, m, n);
}

namespace {

// Row-major FP32: a column-major operand is copied here, so that the CPU result is the same bytes
// whichever layout the caller passed.
// Block-scaled operands (Float8BlockScaling) are dequantized per tile / block, then multiplied in
// FP32 like every other operand: the hardware's per-128-K-chunk scaling gives the same sum up to
// the order of the FP32 additions (see block_gemm.h for the error bound).
at::Tensor to_fp32(const at::Tensor& t, const at::Tensor& scale_inv) {
  if (!is_fp8(t.scalar_type())) return t.to(at::kFloat).contiguous();
  if (scale_granularity(t, scale_inv, kFn, "scale_inv") != ScaleGranularity::kTensor)
    return block_dequantize(t, scale_inv, at::kFloat);
  return dequantize(t, scale_inv, at::kFloat);
}

at::Tensor gemm_cpu(const GemmArgs& g) {
  FP8DP_CHECK_ARG(g.a.is_cpu(), kFn, ": no GEMM for device ", g.a.device(), " in this build");
  at::Tensor r = at::mm(to_fp32(g.a, g.a_scale_inv), to_fp32(g.b, g.b_scale_inv).t());
  if (g.bias.defined()) r.add_(g.bias.to(at::kFloat));
  // The residual joins the FP32 sum before the one rounding into the output, as cuBLASLt's
  // epilogue sums alpha·AB, beta·C (beta = 1) and the bias in FP32 before it converts to D.
  if (g.residual.defined()) r.add_(g.residual.to(at::kFloat));
  if (!g.out.defined()) return r.to(g.out_dtype);
  if (g.accumulate) {
    // beta = 1: out + a·bᵀ in FP32, rounded once into out's dtype (what the GPU epilogue does).
    if (g.out.scalar_type() == at::kFloat) {
      g.out.add_(r);
    } else {
      g.out.copy_(r.add_(g.out.to(at::kFloat)));
    }
  } else {
    g.out.copy_(r);
  }
  return g.out;
}

}  // namespace

at::Tensor gemm(const GemmArgs& args) {
  check_gemm_args(args, GemmStrides::kContiguous);
#if defined(FP8DP_WITH_CUDA)
  if (args.a.is_cuda())
    return is_block_scaled(args) ? gemm_block_cuda_checked(args) : gemm_cuda_checked(args);
#endif
  return gemm_cpu(args);
}

}  // namespace fp8dp
