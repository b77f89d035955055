"""Float8BlockScaling: the recipe, the block-scaled casts and the block-scaled GEMM.

Casts are compared byte for byte, and scales bit for bit, with the float64 reference of
_block_ref.py (independent: per-tile Python loops, torch's own float8 conversion). The GEMM is
compared with the float64 product of the reference-dequantized operands within the FP32 summation
bound gamma_(k+2) |a|·|b|ᵀ (block_gemm.h derives it).

Evidence that these tests catch a broken mechanism (mutations run on 2026-12-03, then reverted):
1. Power-of-two rounding dropped (block_quantize_cpu.cpp: block_scale(..., false, ...) in place
   of p.power_2_scale): 36 of 88 fail: all 30 test_cast_bytes_and_scales[*-p2-*] ("bytes differ
   (BlockShape.TILE_1x128)"), test_power_2_scales_are_powers_of_two, test_transpose_is_recast[*],
   test_special_tiles, test_block_dequantize[*] (no longer exact).
2. Scale index with floor instead of ceil (quantize_band: kb = cols / 128, so a partial last tile
   is skipped and scale_inv rows are misaligned): 56 of 88 fail, every shape whose columns are not
   a multiple of 128 (1x16, 3x130, 200x300, 130x257) in test_cast_bytes_and_scales, and
   test_block_dequantize[*]; the 129x128 cases pass, as they should.
3. 1x128 transpose taken from data's bytes instead of a re-cast (out_t[c, r] = out[r, c]):
   test_transpose_is_recast[E4M3/E5M2] fail on the bytes (and 9 Linear tests in
   test_linear_block_scaling.py fail on dW: "dW: 23040 of 23040 elements outside the bound").
4. CPU GEMM using one scale for every tile (gemm.cpp to_fp32: dequantize(t, scale_inv[0])):
   all 6 test_gemm_matches_reference fail, and 9 Linear tests.
"""

import math

import pytest
import torch
from _block_ref import (
    ceil128,
    decode,
    dequant_blocks,
    dequant_rows,
    gemm_bound,
    quantize_blocks,
    quantize_rows,
)

import fp8dp
from fp8dp import _C
from fp8dp.recipe import Float8BlockScaling, Format, QParams

FMT = {"E4M3": _C.Format.E4M3, "E5M2": _C.Format.E5M2}
TILE, BLOCK = _C.BlockShape.TILE_1x128, _C.BlockShape.BLOCK_128x128


def data(rows, cols, dtype=torch.float32, seed=0, outliers=True):
    """Normal values with per-row outliers (x1000) and a wide spread of magnitudes, so tiles differ
    in scale and some values fall into the FP8 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-12, 8, (rows, 1), generator=g)
    )
    if outliers and cols > 3:
        idx = torch.randint(0, cols, (rows, 2), generator=g)
        x.scatter_(1, idx, x.gather(1, idx) * 1000)
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------
# The recipe


def test_recipe_defaults_follow_transformer_engine():
    r = Float8BlockScaling()
    assert r.fp8_format is Format.E4M3
    assert r.fp8_quant_fwd_inp == QParams(power_2_scale=True, amax_epsilon=0.0)
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    c = r.to_cpp()
    assert c.kind == _C.RecipeKind.BLOCK
    assert (c.fwd_format, c.bwd_format) == (_C.Format.E4M3, _C.Format.E4M3)
    assert c.block_weight.power_2_scale and c.block_grad.amax_epsilon == 0.0
    h = Float8BlockScaling(
        fp8_format=Format.HYBRID, fp8_quant_bwd_grad=QParams(power_2_scale=False, amax_epsilon=1e-6)
    ).to_cpp()
    assert h.bwd_format == _C.Format.E5M2
    assert not h.block_grad.power_2_scale and h.block_grad.amax_epsilon == pytest.approx(1e-6)
    assert h.block_inp.power_2_scale
    assert fp8dp.Float8BlockScaling is Float8BlockScaling


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fp8_format": "E4M3"}, "fp8_format: expected fp8dp.recipe.Format"),
        ({"fp8_quant_fwd_inp": True}, "fp8_quant_fwd_inp: expected fp8dp.recipe.QParams"),
        ({"x_block_scaling_dim": 2}, "x_block_scaling_dim: only 1 is supported"),
        ({"w_block_scaling_dim": 1}, "w_block_scaling_dim: only 2 is supported"),
        ({"grad_block_scaling_dim": True}, "grad_block_scaling_dim: only 1 is supported"),
    ],
)
def test_recipe_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Float8BlockScaling(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"power_2_scale": 1}, "power_2_scale: expected True or False"),
        ({"amax_epsilon": -1e-3}, "amax_epsilon: expected a finite number >= 0"),
        ({"amax_epsilon": math.nan}, "amax_epsilon: expected a finite number >= 0"),
        ({"amax_epsilon": 1e39}, "amax_epsilon: expected a finite number >= 0"),
        ({"amax_epsilon": "0"}, "amax_epsilon: expected a finite number >= 0"),
    ],
)
def test_qparams_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QParams(**kwargs)


def test_autocast_takes_the_recipe():
    r = Float8BlockScaling()
    with fp8dp.fp8_autocast(fp8_recipe=r):
        assert _C.autocast_current().recipe.kind == _C.RecipeKind.BLOCK
    with pytest.raises(ValueError, match="Float8BlockScaling"):
        with fp8dp.fp8_autocast(fp8_recipe="block"):
            pass


def test_autocast_rejects_a_bad_cpp_recipe():
    # A hand-made C++ recipe bypasses QParams' check: autocast_enter checks it again.
    r = Float8BlockScaling().to_cpp()
    q = _C.BlockQParams()
    q.amax_epsilon = -1.0
    r.block_inp = q
    with pytest.raises(ValueError, match="amax_epsilon must be finite and >= 0"):
        _C.autocast_enter(True, r)


# ---------------------------------------------------------------------------------------------
# Casts: bytes and scales against the float64 reference

SHAPES = [(1, 16), (3, 130), (129, 128), (200, 300), (130, 257)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("p2", [True, False], ids=["p2", "fp32scale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cast_bytes_and_scales(shape, fmt, p2, dtype):
    x = data(*shape, seed=1)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)  # within float16's range
    x = x.to(dtype)
    for shape_kind, ref in ((TILE, quantize_rows), (BLOCK, quantize_blocks)):
        q = _C.block_quantize(x, FMT[fmt], shape_kind, power_2_scale=p2, transpose=True)
        want, want_sinv = ref(x, fmt, p2)
        assert torch.equal(q.data.view(torch.uint8), want), f"bytes differ ({shape_kind})"
        assert torch.equal(q.scale_inv, want_sinv), f"scale_inv differs ({shape_kind})"
        assert q.amax is None or not q.amax.numel()


def test_power_2_scales_are_powers_of_two():
    x = data(64, 512, seed=2)
    for shape_kind in (TILE, BLOCK):
        s = _C.block_quantize(x, FMT["E4M3"], shape_kind).scale_inv
        m, _ = torch.frexp(s)
        assert torch.all(m == 0.5), "power_2_scale=True must give power-of-two scale_inv"
    # The largest value of each tile lands in the top binade: amax * scale in (224, 448], which
    # rounds to [224, 448] (the scale is rounded down, so at most one bit of range is left unused).
    q = _C.block_quantize(x, FMT["E4M3"], TILE)
    top = decode(q.data.view(torch.uint8), "E4M3").abs().view(64, 4, 128).amax(-1)
    assert torch.all((top >= 224) & (top <= 448))


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_transpose_is_recast(fmt):
    """1x128: xᵀ's tiles run along x's columns, so data_t is x.t() cast in its own tiles (not
    data's bytes transposed); 128x128: the same blocks, so data_t is data's bytes transposed."""
    x = data(300, 200, seed=3)
    q = _C.block_quantize(x, FMT[fmt], TILE, transpose=True)
    want, want_sinv = quantize_rows(x.t().contiguous(), fmt)
    assert q.data_t.shape == (200, 300) and q.scale_inv_t.shape == (200, ceil128(300))
    assert torch.equal(q.data_t.view(torch.uint8), want)
    assert torch.equal(q.scale_inv_t, want_sinv)
    assert not torch.equal(q.data_t.view(torch.uint8), q.data.view(torch.uint8).t())
    b = _C.block_quantize(x, FMT[fmt], BLOCK, transpose=True)
    assert torch.equal(b.data_t.view(torch.uint8), b.data.view(torch.uint8).t())
    assert torch.equal(b.scale_inv_t, b.scale_inv.t())
    only_t = _C.block_quantize(x, FMT[fmt], TILE, data=False, transpose=True)
    assert only_t.data is None and torch.equal(only_t.data_t, q.data_t)


def test_special_tiles():
    """An all-zero tile gets scale 1; a tile holding Inf or NaN gets scale 1 (its finite values
    cast unscaled, Inf saturates, NaN stays NaN); amax_epsilon floors the amax."""
    x = torch.randn(4, 256)
    x[0, :128] = 0
    x[1, 5] = math.inf
    x[2, 130] = math.nan
    x[3, 128:] = 1e-30
    q = _C.block_quantize(x, FMT["E4M3"], TILE)
    assert q.scale_inv[0, 0] == 1 and q.scale_inv[1, 0] == 1 and q.scale_inv[2, 1] == 1
    u = q.data.view(torch.uint8)
    assert torch.all(u[0, :128] == 0)
    assert u[1, 5] == 0x7E  # +448, saturated
    assert (u[2, 130] & 0x7F) == 0x7F  # NaN
    want, want_sinv = quantize_rows(x, "E4M3")
    assert torch.equal(u, want) and torch.equal(q.scale_inv, want_sinv)
    e = _C.block_quantize(x, FMT["E4M3"], TILE, power_2_scale=False, amax_epsilon=1e-3)
    # tile (3, 1): amax 1e-30 floored to 1e-3, scale = 448 / 1e-3
    assert e.scale_inv[3, 1].item() == pytest.approx(1e-3 / 448, rel=1e-6)
    want_e, want_e_sinv = quantize_rows(x, "E4M3", p2=False, eps=1e-3)
    assert torch.equal(e.data.view(torch.uint8), want_e) and torch.equal(e.scale_inv, want_e_sinv)


def test_dbias_and_options():
    x = data(96, 160, seed=4)
    q = _C.block_quantize(x, FMT["E4M3"], TILE, dbias=True, dbias_dtype=torch.bfloat16)
    want = x.double().sum(0)
    assert q.dbias.dtype == torch.bfloat16
    # FP32 sum over 96 rows, then one bf16 rounding: gamma_96 |x| summed, plus 2^-8 relative
    bound = 96 * 2.0**-24 * x.double().abs().sum(0) + 2.0**-8 * want.abs()
    assert torch.all((q.dbias.double() - want).abs() <= bound)
    empty = _C.block_quantize(torch.empty(0, 32), FMT["E4M3"], TILE, transpose=True)
    assert empty.data.shape == (0, 32) and empty.scale_inv.shape == (0, 1)
    assert empty.data_t.shape == (32, 0)


def test_cast_errors():
    with pytest.raises(ValueError, match="fp8dp.block_quantize: argument 'x'"):
        _C.block_quantize(torch.zeros(4, 4, dtype=torch.int32), FMT["E4M3"], TILE)
    with pytest.raises(ValueError, match="amax_epsilon must be finite and >= 0"):
        _C.block_quantize(torch.zeros(4, 4), FMT["E4M3"], TILE, amax_epsilon=-1.0)


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_block_dequantize(fmt):
    x = data(200, 300, seed=5)
    t = _C.block_quantize(x, FMT[fmt], TILE)
    b = _C.block_quantize(x, FMT[fmt], BLOCK)
    u_t, u_b = t.data.view(torch.uint8), b.data.view(torch.uint8)
    # decode(byte) * scale_inv is one float32 product: exact for power-of-two scales
    got_t = _C.block_dequantize(t.data, t.scale_inv, torch.float32)
    got_b = _C.block_dequantize(b.data, b.scale_inv, torch.float32)
    assert torch.equal(got_t.double(), dequant_rows(u_t, t.scale_inv, fmt))
    assert torch.equal(got_b.double(), dequant_blocks(u_b, b.scale_inv, fmt))
    with pytest.raises(ValueError, match="fits no scaling of a \\[200, 300\\] operand"):
        _C.block_dequantize(t.data, torch.ones(3, 3), torch.float32)


# ---------------------------------------------------------------------------------------------
# The block-scaled GEMM (CPU emulation)


@pytest.mark.parametrize("b_shape", ["tile", "block"])
@pytest.mark.parametrize("mnk", [(48, 32, 256), (130, 144, 400), (16, 16, 16)], ids=str)
def test_gemm_matches_reference(b_shape, mnk):
    m, n, k = mnk
    a = data(m, k, seed=6)
    b = data(n, k, seed=7, outliers=False)
    qa = _C.block_quantize(a, FMT["E4M3"], TILE)
    qb = _C.block_quantize(b, FMT["E4M3"], TILE if b_shape == "tile" else BLOCK)
    bias = torch.randn(n)
    out = _C.gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, bias=bias)
    a64 = dequant_rows(qa.data.view(torch.uint8), qa.scale_inv, "E4M3")
    deq_b = dequant_rows if b_shape == "tile" else dequant_blocks
    b64 = deq_b(qb.data.view(torch.uint8), qb.scale_inv, "E4M3")
    ref = a64 @ b64.T + bias.double()
    bound = gemm_bound(a64, b64) + 2.0**-24 * ref.abs()
    assert torch.all((out.double() - ref).abs() <= bound)
    # beta = 1 accumulation into an FP32 buffer (the fused main_grad route)
    acc = torch.randn(m, n)
    before = acc.double().clone()
    _C.gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out=acc, accumulate=True)
    ref_acc = before + a64 @ b64.T
    assert torch.all(
        (acc.double() - ref_acc).abs() <= gemm_bound(a64, b64) + 2.0**-23 * ref_acc.abs()
    )


def test_gemm_rejects_unsupported_pairs():
    a = data(32, 256, seed=8)
    qa_t = _C.block_quantize(a, FMT["E4M3"], TILE)
    qa_b = _C.block_quantize(a, FMT["E4M3"], BLOCK)
    pt = _C.quantize(a, torch.ones(1), FMT["E4M3"])
    with pytest.raises(ValueError, match="operand 'a' in 1x128 tiles.*got 'a' in 128x128 blocks"):
        _C.gemm(qa_b.data, qa_t.data, qa_b.scale_inv, qa_t.scale_inv)
    with pytest.raises(ValueError, match="got 'a' in 1x128 tiles and 'b' in per-tensor"):
        _C.gemm(qa_t.data, pt.data, qa_t.scale_inv, pt.scale_inv)
    with pytest.raises(ValueError, match="'b_scale_inv' has shape \\[2, 2\\]"):
        _C.gemm(qa_t.data, qa_t.data, qa_t.scale_inv, torch.ones(2, 2))
