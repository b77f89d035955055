// LibTorch layer of the block-scaled cuBLASLt GEMM (Float8BlockScaling): lays the per-tile scales
// out as cuBLASLt reads them (LtScaleMode, cublaslt_gemm.h), allocates the output and calls
// gemm_lt() with the block scale modes. The arguments were checked by check_gemm_args (gemm.cpp),
// pair rule included.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/check.h"
#include "common/tensor_checks.h"
#include "fp8/block_cast.h"
#include "gemm/block_gemm.h"
#include "gemm/cuda/cublaslt_gemm.h"

namespace fp8dp {
namespace {

constexpr const char* kFn = "fp8dp.gemm";

int64_t round_up4(int64_t v) { return (v + 3) / 4 * 4; }

// Our row-major [rows, ceil(k/128)] tile scales -> [ceil(k/128)][round_up(rows, 4)], rows
// contiguous (the padding is never read as a scale of a real row). One transposing copy when rows
// is a multiple of 4 (token counts and layer widths are), a zero fill and a copy otherwise.
at::Tensor tile_scales_for_lt(const at::Tensor& s) {
  const int64_t rows = s.size(0), kb = s.size(1);
  if (rows % 4 == 0) return s.t().contiguous();
  at::Tensor out = at::zeros({kb, round_up4(rows)}, s.options());
  out.narrow(1, 0, rows).copy_(s.t());
  return out;
}

// Our row-major [ceil(rows/128), ceil(k/128)] block scales -> rows padded to a multiple of 4: as
// they are when ceil(k/128) is a multiple of 4 (k a multiple of 512), no copy.
at::Tensor block_scales_for_lt(const at::Tensor& s) {
  const int64_t rb = s.size(0), kb = s.size(1);
  if (kb % 4 == 0) return s.contiguous();
  at::Tensor out = at::zeros({rb, round_up4(kb)}, s.options());
  out.narrow(1, 0, kb).copy_(s);
  return out;
}

}  // namespace

at::Tensor gemm_block_cuda_checked(const GemmArgs& args) {
  FP8DP_CHECK_ARG(gemm_lt_block_compiled(), kFn,
                  ": this build's cuBLAS has no block-scaled FP8 GEMM (needs cuBLAS >= 12.9); "
                  "Float8BlockScaling is not available, use DelayedScaling or "
                  "Float8CurrentScaling");
  const at::Tensor a = args.a.contiguous(), b = args.b.contiguous();
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  FP8DP_CHECK_ARG(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
                  kFn,
                  ": FP8 GEMM of two float8_e5m2 operands is not supported by the tensor cores; "
                  "use float8_e4m3fn for one of them");
  c10::cuda::CUDAGuard guard(a.device());
  const bool b_blocks =
      scale_granularity(b, args.b_scale_inv, kFn, "b_scale_inv") == ScaleGranularity::k128x128;

  at::Tensor out = args.out;
  if (!out.defined()) out = at::empty({m, n}, a.options().dtype(args.out_dtype));
  FP8DP_CHECK_ARG(out.stride(0) % 16 == 0, kFn,
                  ": FP8 GEMM needs the row stride of 'out' to be a multiple of 16, got ",
                  out.stride(0));
  if (m == 0 || n == 0) return out;
  if (k == 0) {
    if (!args.accumulate) out.zero_();
    if (args.bias.defined()) out.add_(args.bias.to(out.scalar_type()));
    if (args.residual.defined()) out.add_(args.residual);
    return out;
  }
  const at::Tensor sa = tile_scales_for_lt(args.a_scale_inv);
  const at::Tensor sb =
      b_blocks ? block_scales_for_lt(args.b_scale_inv) : tile_scales_for_lt(args.b_scale_inv);
  LtGemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a = a.data_ptr();
  p.a_type = to_dtype(a.scalar_type(), kFn, "operand 'a'");
  p.lda = a.stride(0);
  p.b = b.data_ptr();
  p.b_type = to_dtype(b.scalar_type(), kFn, "operand 'b'");
  p.ldb = b.stride(0);
  p.a_scale_inv = sa.data_ptr<float>();
  p.b_scale_inv = sb.data_ptr<float>();
  p.a_scale_mode = LtScaleMode::kVec128;
  p.b_scale_mode = b_blocks ? LtScaleMode::kBlock128x128 : LtScaleMode::kVec128;
  FP8DP_CHECK_ARG(p.lda % 16 == 0 && p.ldb % 16 == 0, kFn,
                  ": FP8 GEMM needs row strides that are multiples of 16, got ", p.lda, " and ",
                  p.ldb);
  const cudaStream_t st = c10::cuda::getCurrentCUDAStream().stream();
  auto write_to = [&](const at::Tensor& dst, bool accumulate) {
    p.out = dst.data_ptr();
    p.out_type = to_dtype(dst.scalar_type(), kFn, "'out'");
    p.ldo = dst.stride(0);
    p.accumulate = accumulate;
  };
  if (!args.bias.defined() && !args.residual.defined()) {
    write_to(out, args.accumulate);
    gemm_lt(p, st);
    return out;
  }
  // The forward's epilogues. A 16-bit output (the layers' case) with a bias of its dtype and/or a
  // residual (check_gemm_args: of out's dtype) takes cuBLASLt's BIAS epilogue and C (beta = 1,
  // C != D): both added to the FP32 accumulator and the sum rounded once, the CPU's numerics up to
  // the order of the FP32 additions (gemm.cpp). Where cuBLASLt has no such epilogue for the block
  // scale modes (an FP32 output: CUBLAS_STATUS_NOT_SUPPORTED on the H200), a bias of another dtype
  // (the epilogue would round it first), or an accumulated output: the GEMM writes FP32, the bias,
  // the residual or the old output are added in FP32 and the sum rounded once. (The residual took
  // that route until 12-06: an FP32 product written and read back, and two add kernels taking
  // 1.0 ms of the 4096 x 4 GPT stack's block step.)
  if (out.scalar_type() != at::kFloat && !args.accumulate &&
      (!args.bias.defined() || args.bias.scalar_type() == out.scalar_type())) {
    at::Tensor bias, residual;
    write_to(out, false);
    if (args.bias.defined()) {
      bias = args.bias.contiguous();
      p.bias = bias.data_ptr();
      p.bias_type = p.out_type;
    }
    if (args.residual.defined()) {  // C has its own layout; FP8 needs 16-element row strides
      residual = args.residual;
      if (m > 1 && residual.stride(0) % 16 != 0) residual = residual.contiguous();
      p.c = residual.data_ptr();
      p.ldc = m == 1 ? n : residual.stride(0);
    }
    if (gemm_lt_try(p, st)) return out;
    p.bias = nullptr;
    p.c = nullptr;
    p.ldc = 0;
  }
  const bool direct = out.scalar_type() == at::kFloat && !args.accumulate;
  const at::Tensor dst = direct ? out : at::empty({m, n}, a.options().dtype(at::kFloat));
  write_to(dst, false);
  gemm_lt(p, st);
  at::Tensor bias;
  if (args.bias.defined()) bias = args.bias.to(at::kFloat);
  const at::Tensor& residual = args.residual;  // check_gemm_args: never with accumulate
  if (direct) {
    if (bias.defined()) dst.add_(bias);
    if (residual.defined()) dst.add_(residual);
  } else if (args.accumulate) {  // (product + bias) + old output in FP32, rounded once
    dst.add_(bias);
    at::add_out(out, dst, out);
  } else if (residual.defined()) {  // (product + bias) + residual in FP32, rounded once
    if (bias.defined()) dst.add_(bias);
    at::add_out(out, dst, residual);
  } else {  // one pass: the FP32 sum is rounded to the output's dtype as it is written
    at::add_out(out, dst, bias);
  }
  return out;
}

}  // namespace fp8dp
