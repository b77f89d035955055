"""fp8dp.Linear / LayerNormLinear with `activation=` ("gelu", "swiglu"): forward returns
act(x · Wᵀ + b) and, under FP8, backward applies the activation's derivative inside the cast of the
output gradient (LinearCore::cast_activation) instead of writing it in high precision first.

1. Against the composition (the same layer without activation, then fp8dp's activation op, and its
   derivative handed back): every output and gradient equal bit for bit, on every device, every
   precision mode, with and without bias, over two steps (delayed scaling's history and scales
   carry over). Why exact: both run the same GEMMs on the same bytes. The fused cast's bytes are
   quantize(activation_backward(dy, pre)) (activation.h; the LayerNormMLP tests check the kernels
   against that), its amax is of the same values, and without FP8 or with a GEMM overridden to
   high precision the layer computes activation_backward itself.
2. Against float64 (FP8 off, float32 parameters, Linear): the GEMM errs by at most
   (k + 1) 2^-24 (|x| |W|ᵀ + |b|) elementwise (FP32 summation and the bias add); GELU's
   derivative is at most 1.13 in magnitude, SiLU's 1.1, so that error passes through the
   activation at most that much amplified (SwiGLU: |up| 1.1 e_gate + |silu(gate)| e_up); the
   activation itself errs by 2e-7 |pre| (erf's absolute error times x, activation_math.h) plus a
   few FP32 roundings (4 2^-24 |y|). The bound asserted is twice that sum.
3. Refusals: an unknown activation, a non-string, SwiGLU with an odd out_features, activation with
   qkv_heads, and a residual with activation, each a ValueError naming the argument.
4. Delayed wgrad into main_grad (backward_dw) and activation checkpointing give the same
   gradients as the plain immediate run (the pre-activation is saved through save_for_backward,
   C14).

Mutations tried (2026-12-06, CPU build, each reverted after it failed as shown):
- the fused route's cast without the derivative (core.cast(dy) instead of cast_activation): the
  36 delayed, current and block cases of test_matches_composition fail (dx, dW differ);
- the high-precision route not applying the derivative: its 24 cases ("off", "wgrad_hp") fail;
- activate_output returning the pre-activation: every composition case and test_matches_float64
  fail.
"""

import pytest
import torch
import torch.nn.functional as F
from _linear_cases import (
    FP8_MODES,
    IN,
    KINDS,
    OUT,
    check_dw_and_checkpoint,
    make_module,
    mode_autocast,
    random_cases,
    randomize_,
)

import fp8dp
from fp8dp import _C

ACTS = ["gelu", "swiglu"]


def _make(kind, activation, bias=True, dtype=torch.bfloat16, device="cpu", **kw):
    return make_module(
        kind, bias=bias, params_dtype=dtype, device=device, activation=activation, **kw
    )


def _pair(kind, act, bias, device, seed=0, **kw):
    """(fused, plain): the same parameters, the plain layer without activation."""
    fused = _make(kind, act, bias, device=device, **kw)
    plain = _make(kind, None, bias, device=device, **kw)
    randomize_(fused, seed)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("mode", FP8_MODES + ["wgrad_hp"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_composition(kind, act, bias, mode, device):
    """mode "wgrad_hp": delayed scaling with the wgrad GEMM in high precision
    (override_linear_precision), the route where the layer applies the derivative itself."""
    fused, plain = _pair(kind, act, bias, device)
    if mode == "wgrad_hp":
        recipe = fp8dp.DelayedScaling(
            fp8_format=fp8dp.Format.HYBRID,
            amax_history_len=4,
            override_linear_precision=(False, False, True),
        )

        def ctx():
            return fp8dp.fp8_autocast(enabled=True, fp8_recipe=recipe)

    else:

        def ctx():
            return mode_autocast(mode)

    g = torch.Generator().manual_seed(7)
    cols = OUT // 2 if act == "swiglu" else OUT
    for step in range(2):
        x = (torch.randn(2, 16, IN, generator=g) * 2).to(torch.bfloat16).to(device)
        dy = torch.randn(2, 16, cols, generator=g).to(torch.bfloat16).to(device)
        xf = x.clone().requires_grad_()
        xp = x.clone().requires_grad_()
        with ctx():
            y = fused(xf)
        with ctx():
            pre = plain(xp)
        want = _C.activation_forward(pre.detach().reshape(-1, OUT), act).view(y.shape)
        assert torch.equal(y, want), (step, "forward")
        y.backward(dy)
        dpre = _C.activation_backward(dy.reshape(-1, cols), pre.detach().reshape(-1, OUT), act)
        pre.backward(dpre.view(pre.shape))
        assert torch.equal(xf.grad, xp.grad), (step, "dx")
        for (name, a), b in zip(fused.named_parameters(), _grads(plain)):
            assert torch.equal(a.grad, b), (step, name)
        for m in (fused, plain):
            m.zero_grad(set_to_none=True)
        if mode in ("delayed", "wgrad_hp"):
            fp8dp.update_fp8_scales()


def _gemm_err(x, w, b):
    """(k + 1) 2^-24 (|x| |W|ᵀ + |b|): FP32 summation of k products and the bias add."""
    k = x.shape[-1]
    s = x.double().abs() @ w.double().abs().T + b.double().abs()
    return (k + 1) * 2.0**-24 * s


@pytest.mark.parametrize("act", ACTS)
def test_matches_float64(act):
    for cseed, tokens, scale in random_cases(6):
        m = _make("Linear", act, True, dtype=torch.float32)
        randomize_(m, cseed)
        g = torch.Generator().manual_seed(cseed)
        x = (torch.randn(tokens, IN, generator=g) * scale).requires_grad_()
        y = m(x)
        w64, b64, x64 = m.weight.double(), m.bias.double(), x.detach().double()
        pre64 = x64 @ w64.T + b64
        e = _gemm_err(x.detach(), m.weight.detach(), m.bias.detach())
        if act == "gelu":
            ref = F.gelu(pre64)
            bound = 1.13 * e + 2e-7 * pre64.abs() + 4 * 2.0**-24 * ref.abs()
        else:
            gate, up = pre64.chunk(2, -1)
            eg, eu = e.chunk(2, -1)
            ref = F.silu(gate) * up
            bound = 1.1 * up.abs() * eg + F.silu(gate).abs() * eu
            bound = bound + 2e-7 * (gate.abs() + 1) * up.abs() + 4 * 2.0**-24 * ref.abs()
        err = (y.detach().double() - ref).abs()
        assert bool((err <= 2 * bound).all()), (cseed, float((err / bound).max()))
        # The check can fail: the pre-activation instead of the activation.
        assert not bool(((pre64[:, : ref.shape[1]] - ref).abs() <= 2 * bound).all())


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(activation="relu"), "activation: expected None, 'gelu' or 'swiglu', got 'relu'"),
        (dict(activation=3), "activation: expected None, 'gelu' or 'swiglu', got 3"),
        (dict(activation="swiglu", out=63), "needs an even out_features"),
        (dict(activation="gelu", qkv_heads=2, out=96), "not supported with qkv_heads"),
    ],
    ids=["unknown", "not_str", "swiglu_odd", "qkv_heads"],
)
def test_refusals(kw, match):
    out = kw.pop("out", OUT)
    with pytest.raises(ValueError, match=match):
        fp8dp.LayerNormLinear(IN, out, **kw)


def test_residual_refused():
    m = fp8dp.Linear(IN, OUT, activation="gelu")
    x = torch.randn(4, IN)
    with pytest.raises(ValueError, match="'residual' is not supported with activation='gelu'"):
        m(x, residual=torch.zeros(4, OUT))


@pytest.mark.parametrize("mode", ["off", "delayed"])
def test_delayed_wgrad_and_checkpoint(mode, device):
    """backward_dw into main_grad, and torch.utils.checkpoint around the layer, against the plain
    immediate run: the same bits."""
    check_dw_and_checkpoint(
        lambda **kw: _make("LayerNorm", "gelu", device=device, **kw), mode, device
    )
