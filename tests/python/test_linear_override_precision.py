"""override_linear_precision=(fprop, dgrad, wgrad): the GEMMs marked True in the parameters'
precision on the unquantized operands, the others in FP8 (recipe.h's *_high_precision).

Against the default recipe on the same module and inputs, one GEMM overridden at a time: the two
other GEMMs' results are bit-identical (the same FP8 GEMMs on the same casts; the bias gradient
comes from the same eager pass), and the overridden one is exact against an FP64 reference to
the high-precision GEMM's own rounding: FP32 summation over K terms, bounded by K * 2^-24 * (the
product of the absolute values), plus one BF16 rounding of the result (2^-8 relative) for BF16
parameters (two for the forward: the product, then the sum with the bias), where FP8 is off by E4M3 / E5M2 rounding of its operands (2^-4 / 2^-3). The input
gradient of a LayerNormLinear passes the norm's backward in FP32: compared with FP64 autograd at
1e-5 as test_norm_without_fp8_matches_torch does. The immediate and the delayed route
(backward_dw into main_grad) give the same weight gradient, activation checkpointing recomputes
what is saved, the delayed-scaling state still records grad_output's amax, and LayerNormMLP
refuses an override before anything is written.

Mutation tried (then restored): the forward's and backward's high_precision() always empty (FP8
as before): test_gemm_in_high_precision fails in every CPU case of every GEMM.
"""

import pytest
import torch
from _linear_cases import (
    IN,
    OUT,
    attach_main_grad,
    batches,
    cpu64,
    make_module,
    norm_stats,
    randomize_,
)

import fp8dp

BF16_U = 2.0**-8
HP = (False, False, True)
OVERRIDE = {"fprop": (True, False, False), "dgrad": (False, True, False), "wgrad": HP}
CASES = [
    ("Linear", torch.float32),
    ("Linear", torch.bfloat16),
    ("LayerNorm", torch.float32),
    ("RMSNorm", torch.float32),
]
RECIPES = {
    "delayed": lambda **kw: fp8dp.DelayedScaling(amax_history_len=4, **kw),
    "current": lambda **kw: fp8dp.Float8CurrentScaling(**kw),
}


def _step(kind, dtype, recipe, device, x, dy, **module_kw):
    m = make_module(kind, bias=True, params_dtype=dtype, device=device, **module_kw)
    randomize_(m, seed=3)
    xa = x.to(device, copy=True).requires_grad_(True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(xa)
    y.backward(dy.to(device))
    return m, y.detach(), xa.grad


def _exact_bound(a, b, dtype):
    """|a b - fl(a b)| for FP32 sums of K = a.shape[1] terms, plus a BF16 rounding of the
    result (see the module docstring)."""
    bound = a.shape[1] * 2.0**-24 * (a.abs() @ b.abs())
    if dtype == torch.bfloat16:
        bound = bound + BF16_U * (a @ b).abs()
    return bound


def _dx_reference(kind, m, x, dy2d, W):
    if kind == "Linear":
        return dy2d @ W
    xr = x.reshape(-1, IN).double().requires_grad_(True)
    g = cpu64(m.layer_norm_weight)
    if m.normalization == "LayerNorm":
        n = torch.nn.functional.layer_norm(xr, (IN,), g, cpu64(m.layer_norm_bias), m.eps)
    else:
        n = torch.nn.functional.rms_norm(xr, (IN,), g, m.eps)
    (n @ W.t()).backward(dy2d)
    return xr.grad


@pytest.mark.parametrize("gemm", list(OVERRIDE))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_gemm_in_high_precision(kind, dtype, recipe_name, gemm, device):
    ((x, dy),) = batches(1, dtype, seed=4)
    make = RECIPES[recipe_name]
    m8, y8, dx8 = _step(kind, dtype, make(), device, x, dy)
    mh, yh, dxh = _step(kind, dtype, make(override_linear_precision=OVERRIDE[gemm]), device, x, dy)
    assert torch.equal(m8.bias.grad, mh.bias.grad)  # the eager bias pass, unquantized either way
    results = {"fprop": (y8, yh), "dgrad": (dx8, dxh), "wgrad": (m8.weight.grad, mh.weight.grad)}
    for other, (a, b) in results.items():
        if other != gemm:
            assert torch.equal(a, b), f"{other} changed when only {gemm} left FP8"

    x2d, dy2d = x.reshape(-1, IN).double(), dy.reshape(-1, OUT).double()
    x_in = x2d if kind == "Linear" else norm_stats(mh, x.reshape(-1, IN))[0].double()
    W = cpu64(mh.weight)
    fp8_result, hp_result = results[gemm]
    if gemm == "dgrad" and kind != "Linear":  # through the norm's FP32 backward
        ref = _dx_reference(kind, mh, x, dy2d, W)
        torch.testing.assert_close(cpu64(hp_result).reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)
        assert (cpu64(fp8_result).reshape(ref.shape) - ref).abs().max() > 1e-3
        return
    a, b = {"fprop": (x_in, W.t()), "dgrad": (dy2d, W), "wgrad": (dy2d.t(), x_in)}[gemm]
    ref = a @ b
    if gemm == "fprop":
        ref = ref + cpu64(mh.bias)
    bound = _exact_bound(a, b, dtype)
    if gemm == "fprop" and dtype == torch.bfloat16:  # the bias added after a first rounding
        bound = bound + BF16_U * ref.abs()
    err_hp = (cpu64(hp_result).reshape(ref.shape) - ref).abs()
    err_fp8 = (cpu64(fp8_result).reshape(ref.shape) - ref).abs()
    assert (err_hp <= bound + 1e-6).all(), f"exceeds the bound by {(err_hp - bound).max():.3g}"
    # and the FP8 result is far coarser (E5M2 / E4M3 rounding of both operands)
    assert err_fp8.max() > 4 * err_hp.max() + 1e-6


@pytest.mark.parametrize("kind", ["Linear", "LayerNorm"])
def test_delayed_route_into_main_grad_matches_the_immediate_one(kind, device):
    """backward_dw() runs the queued high-precision GEMM into main_grad (beta = 1): the same
    gradient as the immediate route, added to what main_grad held."""
    ((x, dy),) = batches(1, torch.float32, seed=5)
    recipe = fp8dp.Float8CurrentScaling(override_linear_precision=HP)
    now, _, _ = _step(kind, torch.float32, recipe, device, x, dy)
    m = make_module(
        kind, bias=True, device=device, delay_wgrad_compute=True, fuse_wgrad_accumulation=True
    )
    randomize_(m, seed=3)
    attach_main_grad(m, fill=1.0)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(x.to(device, copy=True).requires_grad_(True))
    y.backward(dy.to(device))
    assert torch.equal(m.weight.main_grad, torch.ones_like(m.weight.main_grad))  # not yet
    m.backward_dw()
    torch.testing.assert_close(m.weight.main_grad, now.weight.grad.float() + 1.0)


@pytest.mark.parametrize("gemm", list(OVERRIDE))
def test_activation_checkpointing_recomputes_what_is_saved(gemm, device):
    """The high-precision operands (x for wgrad, W for dgrad) are saved through autograd (C14): a
    checkpointed region gives the gradients of the plain one, bit for bit."""
    ((x, dy),) = batches(1, torch.float32, seed=6)
    recipe = fp8dp.Float8CurrentScaling(override_linear_precision=OVERRIDE[gemm])
    plain, _, dx_plain = _step("LayerNorm", torch.float32, recipe, device, x, dy)
    m = make_module("LayerNorm", bias=True, device=device)
    randomize_(m, seed=3)
    xa = x.to(device, copy=True).requires_grad_(True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = torch.utils.checkpoint.checkpoint(m, xa, use_reentrant=False)
    y.backward(dy.to(device))
    assert torch.equal(m.weight.grad, plain.weight.grad)
    assert torch.equal(xa.grad, dx_plain)


def test_grad_output_amax_is_recorded_when_only_the_weight_needs_it(device):
    """No input gradient and no bias: the backward cast of grad_output still runs, so that
    delayed scaling's history holds its amax as it does without the override."""
    recipe = fp8dp.DelayedScaling(amax_history_len=4, override_linear_precision=HP)
    m = make_module("Linear", bias=False, device=device)
    randomize_(m, seed=3)
    ((x, dy),) = batches(1, torch.float32, seed=7)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(x.to(device))  # the input needs no gradient
    y.backward(dy.to(device))
    history = m.get_extra_state()["amax_history"]  # [steps, (x, w, dy)]: one step ran
    assert float(history[:, 2].max()) == float(dy.abs().max())


@pytest.mark.parametrize("gemm", list(OVERRIDE))
def test_layernorm_mlp_refuses_before_anything_is_written(gemm):
    m = fp8dp.LayerNormMLP(32, 64)
    x = torch.randn(16, 32)
    recipe = fp8dp.DelayedScaling(override_linear_precision=OVERRIDE[gemm])
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        with pytest.raises(ValueError, match="override_linear_precision other than"):
            m(x)
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("cls", [fp8dp.DelayedScaling, fp8dp.Float8CurrentScaling])
@pytest.mark.parametrize("value", [(0, 0, 1), [False, False, True], (True, False), None])
def test_recipe_refuses_what_is_not_three_bools(cls, value):
    with pytest.raises(ValueError, match=r"^override_linear_precision: expected a tuple of three"):
        cls(override_linear_precision=value)


@pytest.mark.parametrize("cls", [fp8dp.DelayedScaling, fp8dp.Float8CurrentScaling])
def test_recipe_field_reaches_cpp(cls):
    fields = ("fprop_high_precision", "dgrad_high_precision", "wgrad_high_precision")
    assert cls().override_linear_precision == (False, False, False)
    for value in [(False, False, False), *OVERRIDE.values(), (True, True, True)]:
        c = cls(override_linear_precision=value).to_cpp()
        assert tuple(getattr(c, f) for f in fields) == value
