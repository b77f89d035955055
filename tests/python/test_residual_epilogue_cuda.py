"""The residual in the cuBLASLt epilogue (C = residual, beta = 1, D = out) against the CPU's GEMM and
a float64 reference; fp8dp.Linear(residual=) on CUDA against the CPU. GPU only; skips with the
reason otherwise.

Tolerances (test_gemm_cuda.py's derivation, with the residual's terms): FP8 x FP8 products are
exact; Hopper's FP8 tensor cores accumulate runs of c products in about 14 mantissa bits (c =
min(k, 128) with the split accumulator, c = k with fast accumulation), then in FP32. Both devices
add the bias and the residual in FP32 (two more roundings) and round once into the output. So each
device errs by at most (c 2^-14 + (k + 2) 2^-24) (sum|a||b| + |bias| + |residual|) + u_out |value|
(c = 0 on the CPU and for high-precision operands; u_out = 2^-8 bfloat16, 2^-24 float32), and
CUDA and CPU differ by at most the sum of their two errors. The residual is as large as the
product, so an epilogue that dropped it (beta = 0), read it with out's stride, or read out as C
misses by far more. test_residual_epilogue.py's test_residual_rounded_once runs on CUDA too.
"""

import copy

import pytest
import torch
from _linear_cases import gemm_operands

import fp8dp

_C = fp8dp._C
OK, REASON = fp8dp.cuda_available(return_reason=True)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=REASON)]

E4M3 = torch.float8_e4m3fn
ROUND = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def cuda(t):
    return None if t is None else t.cuda()


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fast"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("mnk", [(64, 48, 96), (256, 128, 512)], ids=str)
def test_gemm_residual_cuda_vs_cpu(kind, out_dtype, bias, split, strided, mnk):
    """FP8 with an FP32 output and a bias is the bias_after route (GEMM with C, then the bias);
    a strided residual (rows 16 elements further apart than out's) takes C's own layout."""
    m, n, k = mnk
    gen = torch.Generator().manual_seed(11)
    (a, sa, b, sb), (a64, b64) = gemm_operands(kind, m, n, k, gen)
    prod = a64 @ b64.T
    scale = float(prod.abs().mean()) + 1.0
    wide = (torch.randn(m, n + 16, generator=gen) * scale).to(out_dtype)
    res = wide[:, 8 : 8 + n] if strided else wide[:, :n].contiguous()
    bias_t = (torch.randn(n, generator=gen) * scale).to(out_dtype) if bias else None
    kw = dict(out_dtype=out_dtype, use_split_accumulator=split)
    cpu = _C.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, bias=bias_t, residual=res, **kw)
    res_gpu = wide.cuda()[:, 8 : 8 + n] if strided else res.cuda()
    assert res_gpu.stride(0) == (n + 16 if strided else n)
    gpu = _C._gemm_cuda(
        a.cuda(),
        b.cuda(),
        a_scale_inv=cuda(sa),
        b_scale_inv=cuda(sb),
        bias=cuda(bias_t),
        residual=res_gpu,
        **kw,
    ).cpu()
    ref = prod + res.double() + (bias_t.double() if bias else 0.0)
    absum = a64.abs() @ b64.abs().T + res.double().abs()
    if bias:
        absum = absum + bias_t.double().abs()
    c = (min(k, 128) if split else k) if kind == "fp8" else 0
    fp32 = (k + 2) * 2.0**-24 * absum
    u = ROUND[out_dtype]
    gpu_sum = c * 2.0**-14 * absum + fp32  # before the rounding into the output
    gpu_err = gpu_sum + u * (ref.abs() + gpu_sum)
    cpu_err = fp32 + u * (ref.abs() + fp32)
    for got, bound, what in (
        (gpu, gpu_err, "CUDA vs float64"),
        (gpu, gpu_err + cpu_err, "CUDA vs CPU"),
    ):
        want = ref if what == "CUDA vs float64" else cpu.double()
        worst = float(((got.double() - want).abs() / (bound + 1e-30)).max())
        assert worst <= 1.0, f"{what}: error {worst:.3f}x the bound"
    assert any("+residual" in p["shape"] for p in _C._gemm_plans())


def test_residual_gemm_errors_cuda():
    a, b = torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda")
    out = torch.zeros(16, 16, device="cuda")
    with pytest.raises(ValueError, match=r"'residual' overlaps 'out' in memory"):
        _C._gemm_cuda(a, b, out=out, residual=out)
    with pytest.raises(ValueError, match=r"'residual' cannot be combined with accumulate=True"):
        _C._gemm_cuda(a, b, out=out, accumulate=True, residual=torch.zeros_like(out))
    with pytest.raises(ValueError, match=r"'residual' is on cpu but the operands are on cuda"):
        _C._gemm_cuda(a, b, residual=torch.zeros(16, 16))


def mode_recipe(mode):
    return {
        "off": None,
        "delayed": fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID),
        "current": fp8dp.Float8CurrentScaling(fp8_format=fp8dp.Format.HYBRID),
        "block": fp8dp.Float8BlockScaling(),
    }[mode]


@pytest.mark.parametrize("mode", ["off", "delayed", "current", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_residual_cuda_vs_cpu(mode, dtype):
    """The same Linear (deep copies) on both devices, one forward and backward with a residual.
    The FP8 casts are bit-exact across devices (C7), so the GEMMs see the same operands and the
    outputs differ by the two devices' GEMM errors (module docstring; fprop takes fast
    accumulation under FP8, c = k, and block scaling promotes every 128-wide chunk, c = 128),
    bounded with |q(v)| <= 1.25 |v| + 2^-18 max|v| for the FP8 operands. On CUDA the residual's
    gradient is grad_output itself and x's and the weight's gradients are those of the unfused
    layer on the same device, bit for bit (the backward is unchanged)."""
    k, n = 256, 128
    torch.manual_seed(0)
    lin = fp8dp.Linear(k, n, params_dtype=dtype)
    lin_gpu = copy.deepcopy(lin).cuda()
    twin_gpu = copy.deepcopy(lin).cuda()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, k, generator=gen).to(dtype)
    res = (torch.randn(4, 16, n, generator=gen) * 4).to(dtype)
    g = torch.randn(4, 16, n, generator=gen).to(dtype)
    r = mode_recipe(mode)
    ys, grads = [], []
    for m, dev, fused in ((lin, "cpu", True), (lin_gpu, "cuda", True), (twin_gpu, "cuda", False)):
        xi = x.to(dev).clone().requires_grad_(True)
        ri = res.to(dev).clone().requires_grad_(True)
        with fp8dp.fp8_autocast(enabled=r is not None, fp8_recipe=r):
            y = m(xi, residual=ri) if fused else ri + m(xi)
        y.backward(g.to(dev))
        ys.append(y.detach().cpu())
        grads.append((xi.grad.cpu(), m.weight.grad.cpu(), m.bias.grad.cpu(), ri.grad.cpu()))
    x64, w64 = x.double().reshape(-1, k), lin.weight.detach().double()
    if mode == "off":
        c, qa, qw = 0, x64.abs(), w64.abs()
    else:
        c = 128 if mode == "block" else k
        qa = 1.25 * x64.abs() + 2.0**-18 * x64.abs().max()
        qw = 1.25 * w64.abs() + 2.0**-18 * w64.abs().max()
    absum = qa @ qw.T + res.double().reshape(-1, n).abs() + lin.bias.detach().double().abs()
    u = ROUND[dtype]
    y_cpu, y_gpu = ys[0].double().reshape(-1, n), ys[1].double().reshape(-1, n)
    bound = (c * 2.0**-14 + 2 * (k + 2) * 2.0**-24) * absum + u * (y_cpu.abs() + y_gpu.abs())
    bound = bound * (1 + 2.0**-6) + 1e-30
    worst = float(((y_gpu - y_cpu).abs() / bound).max())
    assert worst <= 1.0, f"CUDA vs CPU: error {worst:.3f}x the bound"
    assert torch.equal(grads[1][3], g)
    for a, b, what in zip(grads[1][:3], grads[2][:3], ("x", "weight", "bias")):
        assert torch.equal(a, b), what
