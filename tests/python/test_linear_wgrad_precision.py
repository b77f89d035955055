"""override_linear_precision=(False, False, True): the weight-gradient GEMM in the parameters'
precision while fprop and dgrad stay FP8 (recipe.h's wgrad_high_precision).

Against the default recipe on the same module and inputs: the output, the input gradient and the
bias gradient are bit-identical (the same FP8 GEMMs and the same eager bias pass), and against an
FP64 reference the weight gradient is exact to the high-precision GEMM's own rounding: FP32
summation over the tokens, bounded by TOKENS * 2^-24 * (|dy|ᵀ|x|), plus one BF16 rounding of the
result (2^-8 relative) for BF16 parameters, where the FP8 weight gradient is off by E5M2/E4M3
rounding (2^-3 / 2^-4 of the operands). The immediate and the delayed route (backward_dw into
main_grad) give the same gradient, activation checkpointing recomputes what it saves, the
delayed-scaling state still records grad_output's amax, and LayerNormMLP refuses the recipe
before anything is written.

Mutation tried (then restored): wgrad_in_high_precision() always false (the FP8 weight
gradient as before): test_weight_gradient_in_high_precision fails in all 8 CPU cases (by up to
1.6 in gradients of size ~10, against a bound of ~1e-5).
"""

import pytest
import torch
from _linear_cases import (
    IN,
    OUT,
    TOKENS,
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


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_weight_gradient_in_high_precision(kind, dtype, recipe_name, device):
    ((x, dy),) = batches(1, dtype, seed=4)
    make = RECIPES[recipe_name]
    m8, y8, dx8 = _step(kind, dtype, make(), device, x, dy)
    mh, yh, dxh = _step(kind, dtype, make(override_linear_precision=HP), device, x, dy)
    # fprop, dgrad and the bias gradient: the very same FP8 computation
    assert torch.equal(y8, yh)
    assert torch.equal(dx8, dxh)
    assert torch.equal(m8.bias.grad, mh.bias.grad)

    x2d, dy2d = x.reshape(-1, IN).double(), dy.reshape(-1, OUT).double()
    x_in = x2d if kind == "Linear" else norm_stats(mh, x.reshape(-1, IN))[0].double()
    ref = dy2d.t() @ x_in
    bound = TOKENS * 2.0**-24 * (dy2d.abs().t() @ x_in.abs())
    if dtype == torch.bfloat16:
        bound = bound + BF16_U * ref.abs()
    err_hp = (cpu64(mh.weight.grad) - ref).abs()
    err_fp8 = (cpu64(m8.weight.grad) - ref).abs()
    assert (err_hp <= bound + 1e-6).all(), f"exceeds the bound by {(err_hp - bound).max():.3g}"
    # and the FP8 weight gradient is far coarser (E5M2 / E4M3 rounding of both operands)
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


def test_activation_checkpointing_recomputes_the_saved_input(device):
    """The high-precision input is saved through autograd (C14): a checkpointed region gives the
    gradients of the plain one, bit for bit."""
    ((x, dy),) = batches(1, torch.float32, seed=6)
    recipe = fp8dp.Float8CurrentScaling(override_linear_precision=HP)
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


def test_layernorm_mlp_refuses_before_anything_is_written():
    m = fp8dp.LayerNormMLP(32, 64)
    x = torch.randn(16, 32)
    with fp8dp.fp8_autocast(fp8_recipe=fp8dp.DelayedScaling(override_linear_precision=HP)):
        with pytest.raises(ValueError, match=r"override_linear_precision \(False, False, True\)"):
            m(x)
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("cls", [fp8dp.DelayedScaling, fp8dp.Float8CurrentScaling])
@pytest.mark.parametrize(
    "value", [(True, False, False), (False, True, True), (0, 0, 1), [False, False, True], None]
)
def test_recipe_refuses_other_overrides(cls, value):
    with pytest.raises(ValueError, match=r"^override_linear_precision: expected \(False, False"):
        cls(override_linear_precision=value)


@pytest.mark.parametrize("cls", [fp8dp.DelayedScaling, fp8dp.Float8CurrentScaling])
def test_recipe_field_reaches_cpp(cls):
    assert cls().override_linear_precision == (False, False, False)
    assert cls().to_cpp().wgrad_high_precision is False
    assert cls(override_linear_precision=HP).to_cpp().wgrad_high_precision is True
