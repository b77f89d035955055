"""Float8BlockScaling on CUDA: the CUDA casts give the CPU casts' bytes and scales bit for
bit; the cuBLASLt block-scaled GEMM agrees with the float64 product of the dequantized operands
within the Hopper accumulation bound (_linear_cases.accumulation_error: per 128-wide K chunk the
tensor cores' ~2^-14 accumulator, then FP32); a Linear under the recipe agrees with its CPU run.
Skipped without CUDA (the reason from fp8dp.cuda_available).
"""

import itertools

import pytest
import torch
from _block_ref import dequant_blocks, dequant_rows
from _linear_cases import accumulation_error

import fp8dp
from fp8dp import _C

CUDA_OK, CUDA_REASON = fp8dp.cuda_available(return_reason=True)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON or "no CUDA")]

FMT = {"E4M3": _C.Format.E4M3, "E5M2": _C.Format.E5M2}
TILE, BLOCK = _C.BlockShape.TILE_1x128, _C.BlockShape.BLOCK_128x128
# A quiet NaN with the sign bit set, as the signed integer of each dtype's width.
NEG_NAN_BITS = {
    torch.float32: (torch.int32, -0x400000),  # 0xFFC00000
    torch.bfloat16: (torch.int16, -0x40),  # 0xFFC0
    torch.float16: (torch.int16, -0x200),  # 0xFE00
}


def data(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-10, 6, (rows, 1), generator=g)
    )
    x[:, :: max(1, cols // 3)] *= 1000
    return x


# Vector paths: 16-byte loads need cols % 8 == 0, 16-byte transposed stores rows % 16 == 0
# ((256, 384), (384, 200)); the others take the element-wise edges.
@pytest.mark.parametrize(
    "shape", [(1, 16), (3, 130), (129, 128), (200, 300), (1000, 4096), (256, 384), (384, 200)]
)
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("p2", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_casts_match_cpu(shape, fmt, p2, dtype):
    x = data(*shape, seed=1).clamp(-6e4, 6e4).to(dtype)
    x[0, 0] = float("nan") if shape[1] > 1 else x[0, 0]
    # A negative NaN keeps its sign in the CPU's bytes (0xFF) where the hardware conversion writes
    # 0x7F: the kernels must take the CPU's recipe for a tile or block that holds a NaN.
    if shape[1] > 2:  # set through the bits: a float assignment may drop a NaN's sign
        ints, bits = NEG_NAN_BITS[dtype]
        x.view(ints)[0, 1] = bits
        assert torch.isnan(x[0, 1]) and torch.signbit(x[0, 1])
    for kind, transpose in itertools.product((TILE, BLOCK), (True, False)):
        c = _C.block_quantize(x, FMT[fmt], kind, power_2_scale=p2, transpose=transpose)
        g = _C.block_quantize(x.cuda(), FMT[fmt], kind, power_2_scale=p2, transpose=transpose)
        for name in ("data", "data_t") if transpose else ("data",):
            assert torch.equal(
                getattr(g, name).cpu().view(torch.uint8), getattr(c, name).view(torch.uint8)
            ), f"{name} ({kind})"
        assert torch.equal(g.scale_inv.cpu(), c.scale_inv)
        if transpose:
            assert torch.equal(g.scale_inv_t.cpu(), c.scale_inv_t)
        d = _C.block_dequantize(g.data, g.scale_inv, torch.float32)
        # x[0, 0] is NaN, and NaN != NaN under torch.equal: exact, with NaN where NaN.
        ref = _C.block_dequantize(c.data, c.scale_inv, torch.float32)
        torch.testing.assert_close(d.cpu(), ref, rtol=0, atol=0, equal_nan=True)


# (1000, 4096): a multiple of 128 in neither rows nor the region count's power of two; (3, 130) a
# region shorter than 128 rows; (384, 200) the vector transposed stores.
@pytest.mark.parametrize("shape", [(3, 130), (129, 128), (1000, 4096), (384, 200)])
@pytest.mark.parametrize("dbias_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_dbias_fused(shape, dbias_dtype):
    """With the transpose (the grad_output's cast) the CUDA kernel sums each region's columns and
    column_sum.cuh adds the regions: against the float64 sum within FP32 summation over `rows`
    terms (gamma_rows sum|x|) plus one rounding to the dbias dtype. The bits depend on the shape
    alone: a second call gives the same bytes. Without the transpose the ATen sum runs, the same
    bound."""
    rows, cols = shape
    x = data(rows, cols, seed=7).to(torch.bfloat16)
    want = x.double().sum(0)
    eps = 2.0**-8 if dbias_dtype == torch.bfloat16 else 2.0**-24
    bound = rows * 2.0**-24 * x.double().abs().sum(0) + eps * want.abs()
    for transpose in (True, False):
        g = _C.block_quantize(
            x.cuda(), FMT["E5M2"], TILE, transpose=transpose, dbias=True, dbias_dtype=dbias_dtype
        )
        assert g.dbias.dtype == dbias_dtype and g.dbias.shape == (cols,)
        err = (g.dbias.cpu().double() - want).abs()
        assert torch.all(err <= bound), f"transpose={transpose}: max excess {(err - bound).max()}"
        again = _C.block_quantize(
            x.cuda(), FMT["E5M2"], TILE, transpose=transpose, dbias=True, dbias_dtype=dbias_dtype
        )
        assert torch.equal(again.dbias, g.dbias)
        c = _C.block_quantize(x, FMT["E5M2"], TILE, transpose=transpose)
        assert torch.equal(g.data.cpu().view(torch.uint8), c.data.view(torch.uint8))


@pytest.mark.parametrize("b_kind", ["tile", "block"])
@pytest.mark.parametrize(
    "mnk", [(256, 256, 256), (512, 384, 640), (128, 144, 4096), (128, 128, 144)], ids=str
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bias_dtype", ["float32", "out"])
def test_cuda_gemm_within_bound(b_kind, mnk, out_dtype, bias_dtype):
    """bias_dtype "out" with a BF16 output is the layers' forward: cuBLASLt's BIAS epilogue where
    it has one for the block scale modes; the other cases add the bias in FP32 after the GEMM.
    K = 144 (added 12-05, not yet run on a GPU): a last 1x128 tile of 16 elements, which the CPU
    path and the casts take; whether cuBLASLt's VEC128 modes do is what this case finds out."""
    m, n, k = mnk
    a, b = data(m, k, seed=2), torch.randn(n, k) * 0.1
    qa = _C.block_quantize(a.cuda(), FMT["E4M3"], TILE)
    qb = _C.block_quantize(b.cuda(), FMT["E4M3"], TILE if b_kind == "tile" else BLOCK)
    bias = torch.randn(n).to(out_dtype if bias_dtype == "out" else torch.float32)
    got = _C.gemm(
        qa.data, qb.data, qa.scale_inv, qb.scale_inv, bias=bias.cuda(), out_dtype=out_dtype
    ).cpu()
    a64 = dequant_rows(qa.data.cpu().view(torch.uint8), qa.scale_inv.cpu(), "E4M3")
    deq = dequant_rows if b_kind == "tile" else dequant_blocks
    b64 = deq(qb.data.cpu().view(torch.uint8), qb.scale_inv.cpu(), "E4M3")
    ref = a64 @ b64.T + bias.double()
    out_u = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-24
    bound = accumulation_error(k, "cuda") * (a64.abs() @ b64.abs().T) + out_u * ref.abs()
    assert torch.all((got.double() - ref).abs() <= bound)
    # beta = 1 into an FP32 buffer (fused main_grad)
    acc = torch.randn(m, n).cuda()
    before = acc.double().cpu()
    _C.gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out=acc, accumulate=True)
    ref_acc = before + a64 @ b64.T
    bound = accumulation_error(k, "cuda") * (a64.abs() @ b64.abs().T) + 2.0**-23 * ref_acc.abs()
    assert torch.all((acc.cpu().double() - ref_acc).abs() <= bound)


@pytest.mark.parametrize("b_kind", ["tile", "block"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_cuda_gemm_residual_within_bound(b_kind, out_dtype, bias, strided):
    """out = a·bᵀ (+ bias) + residual under block scales. A BF16 output takes cuBLASLt's C
    (beta = 1, C != D) in the same plan as the GEMM: the plan's name says "+residual" (before
    12-06 it was an FP32 product plus two adds). An FP32 output adds it after the GEMM. Either way
    the sum is FP32, rounded once: the bound is the accumulation error over sum|a||b| plus the
    FP32 additions of bias and residual, plus one output rounding of |ref|. The residual is as
    large as the product, so an epilogue that dropped it, read it with out's stride or read out
    as C misses by far more. A strided residual (rows 16 elements further apart than out's) takes
    C's own layout."""
    m, n, k = 256, 384, 640
    a, b = data(m, k, seed=5), torch.randn(n, k) * 0.1
    qa = _C.block_quantize(a.cuda(), FMT["E4M3"], TILE)
    qb = _C.block_quantize(b.cuda(), FMT["E4M3"], TILE if b_kind == "tile" else BLOCK)
    a64 = dequant_rows(qa.data.cpu().view(torch.uint8), qa.scale_inv.cpu(), "E4M3")
    deq = dequant_rows if b_kind == "tile" else dequant_blocks
    b64 = deq(qb.data.cpu().view(torch.uint8), qb.scale_inv.cpu(), "E4M3")
    prod = a64 @ b64.T
    g = torch.Generator().manual_seed(6)
    scale = float(prod.abs().mean()) + 1.0
    wide = (torch.randn(m, n + 16, generator=g) * scale).to(out_dtype).cuda()
    res = wide[:, 8 : 8 + n] if strided else wide[:, :n].contiguous()
    assert res.stride(0) == (n + 16 if strided else n)
    bias_t = (torch.randn(n, generator=g) * scale).to(out_dtype) if bias else None
    _C._gemm_clear_cache()
    got = _C.gemm(
        qa.data,
        qb.data,
        qa.scale_inv,
        qb.scale_inv,
        bias=None if bias_t is None else bias_t.cuda(),
        residual=res,
        out_dtype=out_dtype,
    ).cpu()
    ref = prod + res.cpu().double() + (bias_t.double() if bias else 0.0)
    absum = a64.abs() @ b64.abs().T
    adds = res.cpu().double().abs() + (bias_t.double().abs() if bias else 0.0)
    out_u = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-24
    bound = (
        accumulation_error(k, "cuda") * absum + 3 * 2.0**-24 * (absum + adds) + out_u * ref.abs()
    )
    err = (got.double() - ref).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max()}"
    # Dropping the residual would miss by |residual|, far above the bound.
    assert float(((got.double() - (ref - res.cpu().double())).abs() - bound).max()) > 0
    plans = [pl["shape"] for pl in _C._gemm_plans()]
    if out_dtype == torch.bfloat16:
        assert any("+residual" in sh for sh in plans), plans
    else:
        assert not any("+residual" in sh for sh in plans), plans


def test_block_gemm_plans_are_cached_per_shape():
    """The block-scaled GEMM shares gemm_lt's plan cache: a second call of one shape builds no plan
    (no descriptors, no heuristic, no autotuning), another shape or scale mode builds one, and each
    plan names its operands' scale layout."""
    a, b = data(256, 512, seed=3), torch.randn(384, 512) * 0.1
    qa = _C.block_quantize(a.cuda(), FMT["E4M3"], TILE)
    qt = _C.block_quantize(b.cuda(), FMT["E4M3"], TILE)
    qb = _C.block_quantize(b.cuda(), FMT["E4M3"], BLOCK)
    _C._gemm_clear_cache()
    first = _C.gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out_dtype=torch.bfloat16)
    again = _C.gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out_dtype=torch.bfloat16)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert _C._gemm_cache_size() == 1
    (plan,) = _C._gemm_plans()
    assert "in 1x128 tiles" in plan["shape"] and "in 128x128 blocks" in plan["shape"], plan
    _C.gemm(qa.data, qt.data, qa.scale_inv, qt.scale_inv, out_dtype=torch.bfloat16)
    assert _C._gemm_cache_size() == 2


def test_cuda_linear_matches_cpu():
    """A Linear under Float8BlockScaling: the CUDA run's outputs and gradients are the CPU run's
    within the difference of the two GEMMs' accumulation (both cast bit-identically)."""
    torch.manual_seed(3)
    cpu = fp8dp.Linear(384, 256, bias=True)
    gpu = fp8dp.Linear(384, 256, bias=True, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x, dy = torch.randn(512, 384), torch.randn(512, 256)
    outs = []
    for m, dev in ((cpu, "cpu"), (gpu, "cuda")):
        xr = x.to(dev).detach().requires_grad_(True)  # a leaf on each device
        with fp8dp.fp8_autocast(fp8_recipe=fp8dp.Float8BlockScaling()):
            y = m(xr)
        y.backward(dy.to(dev))
        outs.append((y.detach().cpu(), xr.grad.cpu(), m.weight.grad.cpu(), m.bias.grad.cpu()))
    for name, c, g, k in zip(("y", "dx", "dW", "db"), outs[0], outs[1], (384, 256, 512, 512)):
        scale = c.abs().max()
        assert (c - g).abs().max() <= 2 * accumulation_error(k, "cuda") * k * scale, name
