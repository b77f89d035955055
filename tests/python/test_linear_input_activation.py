"""fp8dp.Linear with `input_activation=` ("gelu", "swiglu"): forward returns act(x) · Wᵀ + b, the
activation applied inside the FP8 cast of the GEMM's input (LinearCore::cast_activation) instead of
written in high precision first; backward returns dgrad · act'(x).

1. Against the composition (the same layer without it, after fp8dp's activation op): every output
   and gradient equal bit for bit, on every device, every precision mode (and with the fprop or
   the wgrad GEMM overridden to high precision, where the layer computes act(x) itself), with and
   without bias, over two steps (delayed scaling's history and scales carry over). Why exact: the
   fused cast's bytes and amax are those of quantize(activation_forward(x)) (activation.h; the
   LayerNormMLP tests check the kernels against that), the GEMMs then read the same bytes, and the
   derivative is the same activation_backward on the same dgrad.
2. Against float64 (FP8 off, float32 parameters): y within the FP32 GEMM bound plus the
   activation's own error (1e-6 relative + 2e-7 (1 + |x|) absolute, test_layernorm_mlp's
   ACT_ABS, for SwiGLU times |up|) carried through |W|; the gradients normwise within 1e-4
   relative (FP32 GEMMs of k <= 48 terms and the derivative's 1e-6 relative error stay far below;
   a wrong formula is O(1)). Each check is also shown to fail on the pre-activation.
3. Refusals: an unknown name, activation and input_activation together, and an input of the
   wrong width (SwiGLU takes 2 * in_features), each a ValueError naming the argument.
4. Delayed wgrad into main_grad (backward_dw) and activation checkpointing give the same bits as
   the plain immediate run (x is saved through save_for_backward, C14); an input without
   requires_grad saves nothing for the derivative and still gives the weight's gradient; a
   residual (a block's fc2(h, residual=x)) gives the composition's bits.

Mutations tried (2026-12-07, CPU build, each reverted after it failed as shown):
- the input cast without the activation (core.cast(x2d) instead of cast_activation): all 20 FP8
  cases of test_matches_composition fail (the forward; with fprop_hp the weight's gradient) and
  test_input_without_grad[delayed];
- input_grads returning dgrad without the derivative: all 24 composition cases fail ("dx") and
  both test_matches_float64 cases (x's gradient);
- FP8 off computing the GEMM on x instead of act(x): the 4 "off" composition cases,
  test_input_without_grad[off] and both test_matches_float64 cases fail.
"""

import pytest
import torch
import torch.nn.functional as F
from _linear_cases import (
    FP8_MODES,
    IN,
    OUT,
    check_dw_and_checkpoint,
    mode_recipe,
    random_cases,
    randomize_,
)

import fp8dp

ACTS = ["gelu", "swiglu"]
U32 = 2.0**-24  # float32 unit roundoff
ACT_ABS = 2e-7  # the activation math's absolute error (test_layernorm_mlp.py)


def _cols(act):
    return 2 * IN if act == "swiglu" else IN


def _pair(act, bias, device, dtype=torch.bfloat16, seed=0, **kw):
    """(fused, plain): the same parameters; the plain layer takes fp8dp.activation(x)."""
    fused = fp8dp.Linear(
        IN, OUT, bias=bias, params_dtype=dtype, device=device, input_activation=act, **kw
    )
    plain = fp8dp.Linear(IN, OUT, bias=bias, params_dtype=dtype, device=device, **kw)
    randomize_(fused, seed)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def _recipe(mode):
    """FP8_MODES, and delayed scaling with the fprop ("fprop_hp") or the wgrad ("wgrad_hp") GEMM
    in high precision (override_linear_precision): the routes that need act(x) unquantized."""
    if mode in ("fprop_hp", "wgrad_hp"):
        return fp8dp.DelayedScaling(
            fp8_format=fp8dp.Format.HYBRID,
            amax_history_len=4,
            override_linear_precision=(mode == "fprop_hp", False, mode == "wgrad_hp"),
        )
    return mode_recipe(mode)


@pytest.mark.parametrize("mode", FP8_MODES + ["fprop_hp", "wgrad_hp"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", ACTS)
def test_matches_composition(act, bias, mode, device):
    fused, plain = _pair(act, bias, device)
    recipe = _recipe(mode)
    g = torch.Generator().manual_seed(7)
    for step in range(2):
        x = (torch.randn(2, 16, _cols(act), generator=g) * 2).to(torch.bfloat16).to(device)
        dy = torch.randn(2, 16, OUT, generator=g).to(torch.bfloat16).to(device)
        xf = x.clone().requires_grad_()
        xp = x.clone().requires_grad_()
        with fp8dp.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = fused(xf)
            want = plain(fp8dp.activation(xp, act))
        assert torch.equal(y, want), (step, "forward")
        y.backward(dy)
        want.backward(dy)
        assert torch.equal(xf.grad, xp.grad), (step, "dx")
        for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad), (step, name)
        for m in (fused, plain):
            m.zero_grad(set_to_none=True)
        if mode in ("delayed", "fprop_hp", "wgrad_hp"):
            fp8dp.update_fp8_scales()


def _reference(m, x64, act):
    """float64 autograd of m's function on x64: (y, a, parameter copies)."""
    params = {n: p.detach().double().requires_grad_(True) for n, p in m.named_parameters()}
    if act == "gelu":
        a = F.gelu(x64)
    else:
        gate, up = x64.chunk(2, -1)
        a = F.silu(gate) * up
    y = a @ params["weight"].t() + params["bias"]
    return y, a, params


@pytest.mark.parametrize("act", ACTS)
def test_matches_float64(act):
    for cseed, tokens, scale in random_cases(6):
        m = fp8dp.Linear(IN, OUT, params_dtype=torch.float32, input_activation=act)
        randomize_(m, cseed)
        g = torch.Generator().manual_seed(cseed)
        x = (torch.randn(tokens, _cols(act), generator=g) * scale).requires_grad_()
        dy = torch.randn(tokens, OUT, generator=g)
        y = m(x)
        y.backward(dy)
        x64 = x.detach().double().requires_grad_(True)
        yr, a, params = _reference(m, x64, act)
        yr.backward(dy.double())
        a, yr = a.detach(), yr.detach()
        W, b = params["weight"].detach().abs(), params["bias"].detach().abs()
        # The activation's error (1e-6 relative + ACT_ABS absolute, SwiGLU's scaled by |up|)
        # through |W|, plus the FP32 GEMM of IN terms and the bias add: 2 (k + 1) u32, doubled
        # for the inputs' own rounding, + 4 u32 |y|.
        big = x64.detach().abs() if act == "gelu" else x64.detach().chunk(2, -1)[1].abs()
        e_a = 1e-6 * a.abs() + ACT_ABS * (1 + big)
        e_y = 2 * (IN + 1) * U32 * (a.abs() @ W.t() + b) + 4 * U32 * yr.abs() + e_a @ W.t()
        err = (y.detach().double() - yr).abs()
        assert bool((err <= e_y).all()), (cseed, float((err / e_y).max()))
        # The check can fail: the GEMM on x instead of act(x).
        pre = x64.detach()[:, :IN] @ params["weight"].detach().t() + params["bias"].detach()
        assert not bool(((pre - yr).abs() <= e_y).all())
        grads = [("x", x.grad, x64.grad)] + [
            (n, p.grad, params[n].grad) for n, p in m.named_parameters()
        ]
        for name, got, ref in grads:
            rel = float((got.double() - ref).norm() / ref.norm())
            assert rel < 1e-4, (cseed, name, rel)
        # The gradient check can fail: dgrad without the activation's derivative.
        da = dy.double() @ params["weight"].detach()
        if act == "gelu":
            assert float((da - x64.grad).norm() / x64.grad.norm()) > 1e-2


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(input_activation="relu"),
            "input_activation: expected None, 'gelu' or 'swiglu', got 'relu'",
        ),
        (dict(input_activation=2), "input_activation: expected None, 'gelu' or 'swiglu', got 2"),
        (
            dict(input_activation="gelu", activation="gelu"),
            "input_activation: not supported together with activation='gelu'",
        ),
    ],
    ids=["unknown", "not_str", "with_activation"],
)
def test_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        fp8dp.Linear(IN, OUT, **kw)


@pytest.mark.parametrize(
    "act, cols, match",
    [
        ("swiglu", IN, rf"input must have 2 \* in_features={2 * IN} as its last dimension"),
        ("gelu", 2 * IN, rf"input must have in_features={IN} as its last dimension"),
    ],
)
def test_input_width_refused(act, cols, match):
    m = fp8dp.Linear(IN, OUT, input_activation=act)
    with pytest.raises(ValueError, match=match):
        m(torch.randn(16, cols))


@pytest.mark.parametrize("mode", ["off", "delayed"])
@pytest.mark.parametrize("act", ACTS)
def test_delayed_wgrad_and_checkpoint(act, mode, device):
    """backward_dw into main_grad, and torch.utils.checkpoint around the layer, against the plain
    immediate run: the same bits."""

    def make(**kw):
        return fp8dp.Linear(
            IN, OUT, params_dtype=torch.bfloat16, device=device, input_activation=act, **kw
        )

    check_dw_and_checkpoint(make, mode, device, in_cols=_cols(act))


@pytest.mark.parametrize("mode", ["off", "delayed"])
def test_input_without_grad(mode, device):
    """x without requires_grad (the first layer's input): nothing is saved for the derivative, the
    weight's gradient is the composition's, and no gradient reaches x."""
    fused, plain = _pair("swiglu", True, device)
    x = torch.randn(32, 2 * IN).to(torch.bfloat16).to(device)
    dy = torch.randn(32, OUT).to(torch.bfloat16).to(device)
    recipe = mode_recipe(mode)
    with fp8dp.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = fused(x)
        want = plain(fp8dp.activation(x, "swiglu"))
    assert torch.equal(y, want)
    y.backward(dy)
    want.backward(dy)
    assert x.grad is None
    for a, b in zip(fused.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("mode", ["off", "delayed"])
def test_with_residual(mode, device):
    """fc2(h, residual=x) of a block: act(h) · Wᵀ + b + residual in the epilogue, the residual's
    gradient y's own; the same bits as the composition with the same residual."""
    fused, plain = _pair("gelu", True, device)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(32, IN, generator=g).to(torch.bfloat16).to(device)
    r = torch.randn(32, OUT, generator=g).to(torch.bfloat16).to(device)
    dy = torch.randn(32, OUT, generator=g).to(torch.bfloat16).to(device)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    rs = [r.clone().requires_grad_() for _ in range(2)]
    recipe = mode_recipe(mode)
    with fp8dp.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = fused(xs[0], residual=rs[0])
        want = plain(fp8dp.activation(xs[1], "gelu"), residual=rs[1])
    assert torch.equal(y, want)
    y.backward(dy)
    want.backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad) and torch.equal(rs[0].grad, dy)
    assert torch.equal(rs[1].grad, dy)
    for a, b in zip(fused.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)
