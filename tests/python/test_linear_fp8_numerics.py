"""C7 — FP8 numerics: FP8 forward and backward against an FP64 reference on the same inputs.

Every tolerance is the elementwise worst-case bound derived in _linear_cases.product_bound from
the formats' unit roundoff (E4M3 2^-4, E5M2 2^-3) and subnormal spacing, with the scales the cast
actually used. A wrong scale, a wrong format or a missing dequantization breaks the bound by far;
`err.max() > 0` shows that FP8 quantization really took place (the plain path is exact here to
FP32 accumulation). On CUDA the bounds add the tensor cores' accumulation error
(_linear_cases.accumulation_error: fast accumulation in fprop, split accumulator in dgrad/wgrad)."""

import pytest
import torch
from _linear_cases import (
    FP8,
    IN,
    OUT,
    autocast,
    batches,
    cpu64,
    input_grad_bound,
    make_module,
    make_recipe,
    norm_stats,
    product_bound,
    randomize_,
)

import fp8dp

BF16_U = 2.0**-8  # unit roundoff of bfloat16 (7 stored mantissa bits): one rounding of a result


def scales_used(m, recipe, x_in, dy2d, fmt_fwd, fmt_bwd):
    """(s_input, s_weight, s_grad_output) of the one step that ran."""
    if isinstance(recipe, fp8dp.DelayedScaling):
        # No update_fp8_scales() ran, so each role still has the scale of its first cast.
        return tuple(float(v) for v in m._core.scale)
    cur = lambda t, fmt: FP8[fmt][2] / float(t.abs().max())  # noqa: E731
    return cur(x_in, fmt_fwd), cur(m.weight.detach(), fmt_fwd), cur(dy2d, fmt_bwd)


def check(actual, ref, bound, dtype, what):
    bound = bound.float()
    if dtype == torch.bfloat16:  # one rounding of the FP32 result into bf16
        bound = bound + BF16_U * (ref.abs() + bound)
    err = (actual.detach().cpu().float() - ref).abs()
    assert (
        err <= bound + 1e-6
    ).all(), f"{what}: error exceeds the FP8 bound by {(err - bound).max()}"
    assert err.max() > 0, f"{what}: no quantization error at all, so FP8 did not run"


CASES = [
    ("Linear", torch.float32),
    ("Linear", torch.bfloat16),
    ("LayerNorm", torch.float32),
    ("RMSNorm", torch.float32),
]


@pytest.mark.parametrize("fmt", [fp8dp.Format.HYBRID, fp8dp.Format.E4M3], ids=["HYBRID", "E4M3"])
@pytest.mark.parametrize(
    "recipe_cls", [fp8dp.DelayedScaling, fp8dp.Float8CurrentScaling], ids=["delayed", "current"]
)
@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_fp8_matches_reference(kind, dtype, recipe_cls, fmt, device):
    recipe = recipe_cls(fp8_format=fmt)
    fmt_fwd, fmt_bwd = "E4M3", ("E5M2" if fmt is fp8dp.Format.HYBRID else "E4M3")
    m = make_module(kind, bias=True, params_dtype=dtype, device=device)
    randomize_(m, seed=7)
    ((x, dy),) = batches(1, dtype, seed=8)  # on the CPU, for the reference
    xa = x.to(device, copy=True).requires_grad_(True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(xa)
    y.backward(dy.to(device))

    # FP64 reference on the very same (possibly bf16-rounded) values.
    x2d, dy2d = x.reshape(-1, IN).double(), dy.reshape(-1, OUT).double()
    W, b = cpu64(m.weight), cpu64(m.bias)
    x_in = x2d if kind == "Linear" else norm_stats(m, x.reshape(-1, IN))[0].double()
    s_in, s_w, s_go = scales_used(m, recipe, x_in, dy2d, fmt_fwd, fmt_bwd)

    y_ref = x_in @ W.t() + b
    check(
        y.reshape(-1, OUT),
        y_ref,
        product_bound(x_in, W, fmt_fwd, s_in, fmt_fwd, s_w, device, fast_accum=True),
        dtype,
        "output",
    )
    dw_ref = dy2d.t() @ x_in
    check(
        m.weight.grad,
        dw_ref,
        product_bound(dy2d.t(), x_in.t(), fmt_bwd, s_go, fmt_fwd, s_in, device),
        dtype,
        "weight grad",
    )
    # Bias gradient: FP32 column sums of the unquantized grad_output (no FP8 error at all).
    rtol = 1e-5 if dtype == torch.float32 else BF16_U  # bf16: the FP32 sum rounded once
    torch.testing.assert_close(cpu64(m.bias.grad), dy2d.sum(0), rtol=rtol, atol=1e-5)

    e_dgrad = product_bound(dy2d, W.t(), fmt_bwd, s_go, fmt_fwd, s_w, device)
    if kind == "Linear":
        dx_ref = dy2d @ W
    else:
        xr = x.reshape(-1, IN).double().requires_grad_(True)
        norm, _, _ = _norm_f64(m, xr)
        (norm @ W.t()).backward(dy2d)
        dx_ref = xr.grad
    check(
        xa.grad.reshape(-1, IN),
        dx_ref,
        input_grad_bound(m, x.reshape(-1, IN), e_dgrad),
        dtype,
        "input grad",
    )


def _norm_f64(m, x):
    g = cpu64(m.layer_norm_weight)
    if m.normalization == "LayerNorm":
        out = torch.nn.functional.layer_norm(x, (IN,), g, cpu64(m.layer_norm_bias), m.eps)
    else:
        out = torch.nn.functional.rms_norm(x, (IN,), g, m.eps)
    return out, None, None


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero_centered_gamma"])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_without_fp8_matches_torch(kind, zero_centered, device):
    """The fused norm kernel and its backward, outside FP8, against torch's own norms in FP64:
    FP32 arithmetic throughout, so the error stays within a few FP32 ulps of the values."""
    m = fp8dp.LayerNormLinear(
        IN,
        OUT,
        normalization=kind,
        zero_centered_gamma=zero_centered,
        return_layernorm_output=True,
        device=device,
    )
    randomize_(m, seed=9)
    ((x, dy),) = batches(1, torch.float32, seed=10)
    xa = x.to(device, copy=True).requires_grad_(True)
    y, ln = m(xa)
    torch.autograd.backward([y, ln], [dy.to(device), torch.ones_like(ln)])

    xr = x.double().requires_grad_(True)
    g = cpu64(m.layer_norm_weight).requires_grad_(True)
    gamma = g + 1 if zero_centered else g
    if kind == "LayerNorm":
        beta = cpu64(m.layer_norm_bias).requires_grad_(True)
        ln_ref = torch.nn.functional.layer_norm(xr, (IN,), gamma, beta, m.eps)
    else:
        ln_ref = torch.nn.functional.rms_norm(xr, (IN,), gamma, m.eps)
    y_ref = ln_ref @ cpu64(m.weight).t() + cpu64(m.bias)
    torch.autograd.backward([y_ref, ln_ref], [dy.double(), torch.ones_like(ln_ref)])
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu64(ln), ln_ref, **tol)
    torch.testing.assert_close(cpu64(y), y_ref, **tol)
    torch.testing.assert_close(cpu64(xa.grad), xr.grad, **tol)
    torch.testing.assert_close(cpu64(m.layer_norm_weight.grad), g.grad, **tol)
    if kind == "LayerNorm":
        torch.testing.assert_close(cpu64(m.layer_norm_bias.grad), beta.grad, **tol)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_return_layernorm_output_under_fp8(kind, recipe_name, device):
    """The returned norm output does not depend on FP8 (the fused kernel writes the same rounded
    values it casts), and its gradient flows into the norm's backward."""
    m = fp8dp.LayerNormLinear(
        IN, OUT, normalization=kind, return_layernorm_output=True, device=device
    )
    randomize_(m, seed=11)
    ((x, _),) = batches(1, torch.float32, seed=12, device=device)
    grads = []
    for recipe in (make_recipe(recipe_name), None):
        xa = x.clone().requires_grad_(True)
        with autocast(recipe):
            y, ln = m(xa)
        # Zero gradient for y: only the ln_out path carries a gradient, which is FP8-free.
        torch.autograd.backward([y, ln], [torch.zeros_like(y), torch.ones_like(ln)])
        grads.append((ln.detach(), xa.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])
    assert torch.count_nonzero(grads[0][1]) > 0
