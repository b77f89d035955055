"""The residual in the GEMM epilogue: GemmArgs::residual (out = a·bᵀ + bias + residual, summed in
FP32 and rounded once), fp8dp.Linear.forward(x, residual=) and fp8dp.LayerNormMLP.forward(x,
residual=), on the CPU (the CUDA comparisons are in test_residual_epilogue_cuda.py).

Tolerances, from the numerics:
1. GEMM against float64. The CPU path dequantizes FP8 operands exactly, multiplies in FP32 (k
   products summed: gamma_k sum|a||b|, gamma_k ~ k 2^-24), then adds the bias and the residual in
   FP32 (two more roundings), then rounds once into the output (half an ulp: 2^-8 relative for
   bfloat16, 2^-24 for float32). Bound: (k + 2) 2^-24 (sum|a||b| + |bias| + |residual|) +
   u_out (|ref| + that), elementwise. The residual is as large as the product, so a GEMM that
   ignored it would be off by far more than the bound.
2. Rounded once: a·bᵀ = 2^-8 + 2^-20 plus a residual of 1 is 1.0078125 in bfloat16 when summed in
   FP32 and rounded once; rounding the product first (to 2^-8) makes the sum a tie that rounds
   to 1.0. So an epilogue that rounded twice fails test_residual_rounded_once.
3. Layers against the same layer without residual plus a float64-added residual: both runs cast
   the same values with the same scales (deep copies with the same FP8 state) and compute the same
   FP32 GEMM + bias P; the fused output is round(P + r), the reference y_u + r with y_u = round(P).
   So |fused - ref| <= u_out (|P + r| + |P|): one output-dtype rounding of each, evaluated as
   u_out (|ref| + |y_u|) (1 + 2^-6) for the rounding of those magnitudes themselves.
4. Backward: unchanged by the residual, so x's and the weights' gradients equal the unfused
   layer's exactly, and the residual's gradient is grad_output itself (torch.equal and the same
   storage).

Mutations tried (2026-12-06, CPU build, each reverted after it failed as shown):
- gemm_cpu ignoring the residual: 78 of the 101 tests here and in test_train_fused_residual.py
  fail (every GEMM and layer comparison); test_gemm_residual_with_strided_rows and the
  checkpoint test then still passed, and now compare against torch's mm + residual / the
  unfused output as well.
- gemm_cpu rounding the product into the output dtype before adding the residual: every
  bfloat16 test_gemm_residual_matches_float64 case and both test_residual_rounded_once cases
  fail (1.0 instead of 1.0078125). The layer tests allow that much (one rounding of each side).
- the Linear backward returning grad_output.clone() for the residual: every test_linear_residual
  case fails on the storage check.
"""

import copy

import pytest
import torch
from _linear_cases import FP8_MODES, gemm_operands
from _linear_cases import mode_autocast as autocast

import fp8dp
from fp8dp import _C

E4M3 = torch.float8_e4m3fn
ROUND = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


# ---- the GEMM ------------------------------------------------------------------------------


# float32 operands only into float32 (cuBLASLt's rule, applied on the CPU too).
KIND_OUT = [
    (kind, out)
    for kind in ("fp8", "fp32", "bf16")
    for out in (torch.bfloat16, torch.float32)
    if kind != "fp32" or out == torch.float32
]


@pytest.mark.parametrize("kind,out_dtype", KIND_OUT, ids=lambda v: str(v))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mnk", [(32, 48, 64), (1, 16, 16), (17, 32, 144)], ids=str)
def test_gemm_residual_matches_float64(kind, out_dtype, bias, mnk):
    m, n, k = mnk
    gen = torch.Generator().manual_seed(7)
    (a, sa, b, sb), (a64, b64) = gemm_operands(kind, m, n, k, gen)
    prod = a64 @ b64.T
    scale = float(prod.abs().mean()) + 1.0  # residual as large as the product
    res = (torch.randn(m, n, generator=gen) * scale).to(out_dtype)
    bias_t = (torch.randn(n, generator=gen) * scale).to(out_dtype) if bias else None
    out = _C.gemm(
        a, b, a_scale_inv=sa, b_scale_inv=sb, bias=bias_t, out_dtype=out_dtype, residual=res
    )
    assert out.dtype == out_dtype and out.shape == (m, n)
    ref = prod + res.double() + (bias_t.double() if bias else 0.0)
    absum = a64.abs() @ b64.abs().T + res.double().abs()
    if bias:
        absum = absum + bias_t.double().abs()
    fp32 = (k + 2) * 2.0**-24 * absum
    bound = fp32 + ROUND[out_dtype] * (ref.abs() + fp32) + 1e-30
    worst = float(((out.double() - ref).abs() / bound).max())
    assert worst <= 1.0, f"error {worst:.3f}x the bound"


def test_gemm_residual_with_strided_rows():
    """A residual whose rows are further apart than n (a slice of a wider buffer) is read in place,
    and out= works beside it: the same bytes as a contiguous copy, and as torch's FP32
    mm + residual (the same FP32 operations in the same order)."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 32, generator=gen), torch.randn(24, 32, generator=gen)
    wide = torch.randn(16, 40, generator=gen)
    res = wide[:, 4:28]
    want = _C.gemm(a, b, residual=res.contiguous())
    out = torch.empty(16, 24)
    got = _C.gemm(a, b, residual=res, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want)
    assert torch.equal(got, torch.mm(a, b.t()) + res)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_residual_rounded_once(kind, device):
    """a·bᵀ = 2^-8 (1 + 2^-12) (exact in FP32), residual 1: the FP32 sum 1 + 2^-8 + 2^-20 rounds
    to 1 + 2^-7 in bfloat16. Rounding the product first gives 2^-8, and 1 + 2^-8 is a tie that
    rounds to even, 1.0. bf16: (1 + 2^-4) * 2^-8 (1 - 2^-4 + 2^-8), both bfloat16 values (float32
    operands have no bfloat16 output). FP8: k = 16 with one non-zero product (a = 1 with
    scale_inv 2^-8 + 2^-20, b = 1 with scale_inv 1: 2^-8 + 2^-20 is no E4M3 value). On CUDA this
    is cuBLASLt's epilogue (C = residual, beta = 1)."""
    m = n = 16
    if kind == "bf16":
        a = torch.zeros(m, 16, dtype=torch.bfloat16)
        a[:, 0] = 1.0 + 2.0**-4
        b = torch.zeros(n, 16, dtype=torch.bfloat16)
        b[:, 0] = 2.0**-8 * (1.0 - 2.0**-4 + 2.0**-8)
        assert float(a[0, 0]) * float(b[0, 0]) == 2.0**-8 * (1.0 + 2.0**-12)
        sa = sb = None
    else:
        a = torch.zeros(m, 16)
        a[:, 0] = 1.0
        b = torch.zeros(n, 16)
        b[:, 0] = 1.0
        a, b = a.to(E4M3), b.to(E4M3)
        sa, sb = torch.tensor([2.0**-8 + 2.0**-20]), torch.tensor([1.0])

    def on(t):
        return None if t is None else t.to(device)

    res = torch.ones(m, n, dtype=torch.bfloat16, device=device)
    out = _C.gemm(
        on(a), on(b), a_scale_inv=on(sa), b_scale_inv=on(sb), out_dtype=torch.bfloat16, residual=res
    )
    assert torch.equal(out.float().cpu(), torch.full((m, n), 1.0 + 2.0**-7))


@pytest.mark.parametrize(
    "case,match",
    [
        ("shape", r"'residual' must have shape \[8, 16\] \(the output's\), got \[8, 15\]"),
        ("dtype", r"'residual' must have the output's dtype BFloat16 .*got Float"),
        ("hp", r"'residual'"),
        ("device", r"'residual' is on meta but the operands are on cpu"),
        ("rows", r"'residual' must have contiguous rows"),
        ("accumulate", r"'residual' cannot be combined with accumulate=True"),
        ("overlap", r"'residual' overlaps 'out' in memory"),
    ],
)
def test_gemm_residual_errors(case, match):
    a, b = torch.randn(8, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    kw = dict(out_dtype=torch.bfloat16, residual=torch.zeros(8, 16, dtype=torch.bfloat16))
    if case == "shape":
        kw["residual"] = torch.zeros(8, 15, dtype=torch.bfloat16)
    elif case == "dtype":
        kw["residual"] = torch.zeros(8, 16)
    elif case == "hp":
        kw["residual"] = torch.zeros(8, 16).to(E4M3)
    elif case == "device":
        kw["residual"] = torch.zeros(8, 16, dtype=torch.bfloat16, device="meta")
    elif case == "rows":
        kw["residual"] = torch.zeros(16, 8, dtype=torch.bfloat16).t()
    elif case == "accumulate":
        kw.update(out=torch.zeros(8, 16, dtype=torch.bfloat16), accumulate=True)
    elif case == "overlap":
        out = torch.zeros(8, 16, dtype=torch.bfloat16)
        kw.update(out=out, residual=out)
    with pytest.raises(ValueError, match=match):
        _C.gemm(a, b, **kw)


# ---- the layers ----------------------------------------------------------------------------


def assert_one_rounding(fused, unfused, res):
    """fused = round(P + r) against unfused + r with unfused = round(P): within one output-dtype
    rounding of each (module docstring, 3)."""
    u = ROUND[fused.dtype]
    ref = unfused.double() + res.double()
    bound = u * (ref.abs() + unfused.double().abs()) * (1 + 2.0**-6) + 1e-30
    worst = float(((fused.double() - ref).abs() / bound).max())
    assert worst <= 1.0, f"error {worst:.3f}x one rounding"


def run_pair(make, mode, x_shape, out_features, dtype, seed=0):
    """The layer with residual and a deep copy without it (same FP8 state), forward and backward
    with one grad_output. Returns (fused, unfused, residual, grad_output), each a dict of the
    output and the gradients by name."""
    torch.manual_seed(seed)
    lay = make()
    twin = copy.deepcopy(lay)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*x_shape, generator=gen).to(dtype)
    res = (torch.randn(*x_shape[:-1], out_features, generator=gen) * 4).to(dtype)
    g = torch.randn(*x_shape[:-1], out_features, generator=gen).to(dtype)
    runs = []
    for m, fused in ((lay, True), (twin, False)):
        xi = x.clone().requires_grad_(True)
        ri = res.clone().requires_grad_(True)
        with autocast(mode):
            y = m(xi, residual=ri) if fused else m(xi)
        seen = []
        if fused:
            ri.register_hook(seen.append)
        y.backward(g)
        grads = {n: p.grad for n, p in m.named_parameters()}
        grads["x"] = xi.grad
        runs.append((y.detach(), grads, ri.grad, seen))
    return runs, res, g


def check_pair(runs, res, g):
    (yf, gf, rgrad, seen), (yu, gu, _, _) = runs
    assert_one_rounding(yf, yu, res)
    assert torch.equal(rgrad, g)
    assert seen and seen[0].data_ptr() == g.data_ptr(), "the residual's gradient is a copy"
    assert sorted(gf) == sorted(gu)
    for k in gu:
        assert gu[k] is not None and torch.equal(gf[k], gu[k]), k


@pytest.mark.parametrize("mode", FP8_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear_residual(mode, dtype, bias):
    runs, res, g = run_pair(
        lambda: fp8dp.Linear(32, 48, bias=bias, params_dtype=dtype), mode, (2, 16, 32), 48, dtype
    )
    check_pair(runs, res, g)


@pytest.mark.parametrize("mode", FP8_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_layernorm_mlp_residual(mode, dtype, act):
    runs, res, g = run_pair(
        lambda: fp8dp.LayerNormMLP(32, 48, activation=act, params_dtype=dtype),
        mode,
        (16, 2, 32),
        32,
        dtype,
    )
    check_pair(runs, res, g)


def test_mlp_residual_is_its_input():
    """A transformer block's ``mlp(x, residual=x)``: x's gradient is the MLP's input gradient plus
    grad_output, as for ``x + mlp(x)`` (the two edges of one tensor summed by autograd)."""
    torch.manual_seed(0)
    m = fp8dp.LayerNormMLP(32, 48)
    twin = copy.deepcopy(m)
    x = torch.randn(16, 32)
    g = torch.randn(16, 32)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y1 = m(x1, residual=x1)
    y2 = x2 + twin(x2)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    assert_one_rounding(y1.detach(), (y2 - x2).detach(), x)
    assert torch.equal(x1.grad, x2.grad)


def test_linear_residual_delayed_wgrad_and_checkpoint():
    """delay_wgrad_compute with backward_dw(), and a torch.utils.checkpoint region (C14: the
    recompute repeats the forward with its residual): the same output (FP32: the GEMM's
    (x·Wᵀ + bias) + residual is the unfused fl(residual + fl(x·Wᵀ + bias)), no second rounding)
    and the same gradients as the unfused layer."""
    torch.manual_seed(0)
    lin = fp8dp.Linear(32, 48, delay_wgrad_compute=True)
    twin = copy.deepcopy(lin)
    x = torch.randn(16, 32)
    res = torch.randn(16, 48)
    g = torch.randn(16, 48)
    r = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID)
    out = []
    for m, fused in ((lin, True), (twin, False)):
        xi = x.clone().requires_grad_(True)
        ri = res.clone().requires_grad_(True)

        def body(xi, ri, m=m, fused=fused):
            with fp8dp.fp8_autocast(enabled=True, fp8_recipe=r):
                return m(xi, residual=ri) if fused else ri + m(xi)

        y = torch.utils.checkpoint.checkpoint(body, xi, ri, use_reentrant=False)
        y.backward(g)
        assert m.weight.grad is None
        m.backward_dw()
        out.append((y.detach(), xi.grad, ri.grad, m.weight.grad, m.bias.grad))
    for a, b in zip(*out):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "case,match",
    [
        ("type", r"residual: expected None or a torch\.Tensor, got list"),
        ("shape", r"'residual' must have the output's shape \[2, 16, 48\], got \[2, 16, 32\]"),
        ("dtype", r"'residual' must have the output's dtype Float, got BFloat16"),
        ("device", r"'residual' must be on the input's device cpu, got meta"),
    ],
)
@pytest.mark.parametrize("layer", ["linear", "mlp"])
def test_bad_residual_refused(case, match, layer):
    if layer == "linear":
        m, n = fp8dp.Linear(32, 48), 48
    else:
        m, n = fp8dp.LayerNormMLP(32, 48), 32
        match = match.replace("48", "32")
        if case == "shape":
            match = r"'residual' must have the output's shape \[2, 16, 32\], got \[2, 16, 31\]"
    x = torch.randn(2, 16, 32)
    bad = {
        "type": [1.0],
        "shape": torch.zeros(2, 16, 32 if layer == "linear" else 31),
        "dtype": torch.zeros(2, 16, n, dtype=torch.bfloat16),
        "device": torch.zeros(2, 16, n, device="meta"),
    }[case]
    with pytest.raises(ValueError, match=match):
        m(x, residual=bad)


def test_residual_refused_with_qkv_heads():
    lnl = fp8dp.LayerNormLinear(32, 96, qkv_heads=2)
    x = torch.randn(16, 32)
    with pytest.raises(ValueError, match=r"'residual' is not supported with qkv_heads"):
        lnl._core.forward(
            x,
            lnl.weight,
            lnl.bias,
            lnl.layer_norm_weight,
            lnl.layer_norm_bias,
            None,
            torch.zeros(16, 96),
        )
