"""Shared builders for the fp8dp.Linear / LayerNormLinear tests: module kinds, recipes, and a
micro-batch runner that follows the C2/C3 call order of a Megatron-style loop."""

from __future__ import annotations

import contextlib
import copy
import os
import random

import torch

import fp8dp

IN, OUT, TOKENS = 32, 48, 32  # multiples of 16: FP8 GEMMs need them in every inner dimension

KINDS = ["Linear", "LayerNorm", "RMSNorm"]
RECIPES = ["none", "delayed", "current"]


def make_module(kind: str, **kw) -> torch.nn.Module:
    if kind == "Linear":
        return fp8dp.Linear(IN, OUT, **kw)
    return fp8dp.LayerNormLinear(IN, OUT, normalization=kind, **kw)


def make_recipe(name: str):
    return {
        "none": None,
        "delayed": fp8dp.DelayedScaling(amax_history_len=4),
        "current": fp8dp.Float8CurrentScaling(),
    }[name]


def autocast(recipe):
    if recipe is None:
        return contextlib.nullcontext()
    return fp8dp.fp8_autocast(enabled=True, fp8_recipe=recipe)


# The four precision modes of the LayerNormMLP and residual tests, by name: FP8 off and each
# recipe with the HYBRID format (block scaling: E4M3 throughout, its default).
FP8_MODES = ["off", "delayed", "current", "block"]


def mode_recipe(mode: str):
    if mode == "delayed":
        return fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID, amax_history_len=4)
    if mode == "current":
        return fp8dp.Float8CurrentScaling(fp8_format=fp8dp.Format.HYBRID)
    if mode == "block":
        return fp8dp.Float8BlockScaling()
    return None


def mode_autocast(mode: str):
    r = mode_recipe(mode)
    return fp8dp.fp8_autocast(enabled=r is not None, fp8_recipe=r)


def random_cases(n: int):
    """n generated cases for the float64 comparisons: (case seed, tokens, input scale), from a seed
    that is printed (FP8DP_SEED repeats it)."""
    seed = int(os.environ.get("FP8DP_SEED", random.randrange(2**31)))
    print(f"seed {seed} (FP8DP_SEED={seed} repeats it)")
    rnd = random.Random(seed)
    for case in range(n):
        yield seed + case, 16 * rnd.randint(1, 4), 10.0 ** rnd.uniform(-1, 1)


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values in every parameter (norm weights and biases included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def twin(kind: str, seed: int = 0, **kw):
    """Two modules with identical parameters: (immediate wgrad, delayed wgrad)."""
    a = make_module(kind, delay_wgrad_compute=False, **kw)
    b = make_module(kind, delay_wgrad_compute=True, **kw)
    randomize_(a, seed)
    b.load_state_dict(a.state_dict())
    return a, b


def attach_main_grad(module: torch.nn.Module, fill: float = 0.0) -> None:
    """What DDP does (C1): an FP32 main_grad per parameter, on the parameter's device."""
    for p in module.parameters():
        p.main_grad = torch.full(p.shape, fill, dtype=torch.float32, device=p.device)


def batches(n: int, dtype: torch.dtype, seed: int = 1, shape=(2, TOKENS // 2), device="cpu"):
    """n micro-batches of (input, grad_output), input shaped [seq, batch, in] like Megatron.
    Drawn on the CPU and then moved, so every device sees the very same values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(*shape, IN, generator=g).to(device=device, dtype=dtype)
        dy = torch.randn(*shape, OUT, generator=g).to(device=device, dtype=dtype)
        out.append((x, dy))
    return out


def run_microbatches(module, data, recipe, first_microbatch_flags=True):
    """Forward + backward of each micro-batch; with delayed wgrad, backward_dw right after each
    backward. Returns the outputs and input gradients."""
    ys, dxs = [], []
    for i, (x, dy) in enumerate(data):
        x = x.clone().requires_grad_(True)
        first = (i == 0) if first_microbatch_flags else None
        with autocast(recipe):
            y = module(x, is_first_microbatch=first)
        y.backward(dy)
        if module.delay_wgrad_compute:
            module.backward_dw()
        ys.append(y.detach())
        dxs.append(x.grad)
    return ys, dxs


# ---- FP8 error bounds (C4 and C7 tests) ----------------------------------------------------
# One FP8 rounding of v (already multiplied by its scale s) with round-to-nearest-even:
#   normal range:    |q(v) - v| <= u |v|,  u = 2^-(mantissa bits + 1): E4M3 2^-4, E5M2 2^-3
#   subnormal range: |q(v) - v| <= half the subnormal spacing: E4M3 2^-10, E5M2 2^-17
# so, back in unscaled units, |q(v) - v| <= u |v| + d with d = (half spacing) / s, as long as
# nothing saturates (|v| * s <= fp8_max, which the tests assert). For a product of two quantized
# operands, q(a) q(b) - a b = (q(a) - a) q(b) + a (q(b) - b) and |q(b)| <= (1 + u_b)|b| + d_b, so
#   |q(a)·q(b)ᵀ - a·bᵀ| <= (u_a|a| + d_a)·((1 + u_b)|b| + d_b)ᵀ + |a|·(u_b|b| + d_b)ᵀ
# elementwise, plus the accumulation error of the GEMM (accumulation_error below) on the
# quantized magnitudes.
FP8 = {"E4M3": (2.0**-4, 2.0**-10, 448.0), "E5M2": (2.0**-3, 2.0**-17, 57344.0)}


def accumulation_error(k: int, device, fast_accum: bool = False) -> float:
    """Relative accumulation error of a k-term GEMM (a factor on sum|a||b|) on `device`.

    CPU: FP32 accumulation, k 2^-24. CUDA FP8: Hopper's tensor cores add the exact FP8 products
    with a reduced-precision accumulator (about 14 mantissa bits, as measured for H100/H800 and
    confirmed by tests/python/test_gemm_cuda.py on the H200): a run of c products carries up to
    c 2^-14, with c = min(k, 128) under the split accumulator (dgrad, wgrad: promoted to FP32 at
    least every 128 products) and c = k with fast accumulation (fprop); the promoted partial sums
    add k 2^-24. cuBLASLt's FP32 / BF16 GEMMs (FP32 compute, no TF32) have the FP32 term only, so
    the CUDA term is an over-estimate there, harmless next to the FP8 error."""
    fp32 = k * 2.0**-24
    if torch.device(device).type != "cuda":
        return fp32
    chunk = k if fast_accum else min(k, 128)
    return chunk * 2.0**-14 + fp32


def product_bound(a, b, fmt_a, scale_a, fmt_b, scale_b, device="cpu", fast_accum=False):
    """Elementwise bound on |deq(q(a)) · deq(q(b))ᵀ - a · bᵀ| for a [m, k], b [n, k] (any device;
    the bound is computed on the CPU) when the GEMM runs on `device`."""
    ua, ha, max_a = FP8[fmt_a]
    ub, hb, max_b = FP8[fmt_b]
    A, B = a.detach().cpu().double().abs(), b.detach().cpu().double().abs()
    # Scales come from FP32 amaxes, so the largest value may land a few ulps above fp8_max and
    # saturate there: an error of ~1e-6 relative, far inside u. Anything more is real saturation.
    assert float(A.max()) * scale_a <= max_a * 1.0001, f"a saturates: {float(A.max()) * scale_a}"
    assert float(B.max()) * scale_b <= max_b * 1.0001, f"b saturates: {float(B.max()) * scale_b}"
    da, db = ha / scale_a, hb / scale_b
    k = a.shape[1]
    # The GEMM adds the quantized products, |q(a)| <= (1 + u)|a| + d.
    acc = accumulation_error(k, device, fast_accum) * (
        ((1 + ua) * A + da) @ ((1 + ub) * B + db).t()
    )
    return ((ua * A + da) @ ((1 + ub) * B + db).t() + A @ (ub * B + db).t() + acc).float()


def cpu64(t: torch.Tensor) -> torch.Tensor:
    """A float64 CPU copy, where every reference and bound is computed."""
    return t.detach().cpu().double()


def norm_stats(module, x2d):
    """(normalized output, xhat, rsigma) of module's norm in float64 on the CPU for a reference."""
    x = cpu64(x2d)
    mu = torch.zeros(x.shape[0], 1, dtype=torch.float64)
    if module.normalization == "LayerNorm":
        mu = x.mean(1, keepdim=True)
    rs = 1.0 / torch.sqrt(((x - mu) ** 2).mean(1, keepdim=True) + module.eps)
    xhat = (x - mu) * rs
    g = cpu64(module.layer_norm_weight) + (1.0 if module.zero_centered_gamma else 0.0)
    out = xhat * g
    if module.layer_norm_bias is not None:
        out = out + cpu64(module.layer_norm_bias)
    return out.float(), xhat, rs


def input_grad_bound(module, x2d, gemm_in_bound):
    """Bound on the input-gradient error, given an elementwise bound E on the error of the dgrad
    GEMM output (the gradient of the norm output). Without a norm that is E itself; the norm's
    backward is linear in its incoming gradient,
        dx = rsigma (g dz - mean(g dz) - xhat mean(g dz xhat))   (RMSNorm: no mean(g dz) term),
    so the triangle inequality bounds its error by the same expression on |g| E."""
    if not isinstance(module, fp8dp.LayerNormLinear):
        return gemm_in_bound
    _, xhat, rs = norm_stats(module, x2d)
    g = (cpu64(module.layer_norm_weight) + (1.0 if module.zero_centered_gamma else 0.0)).abs()
    ge = g * cpu64(gemm_in_bound)
    inner = ge + xhat.abs() * (ge * xhat.abs()).mean(1, keepdim=True)
    if module.normalization == "LayerNorm":
        inner = inner + ge.mean(1, keepdim=True)
    return (rs * inner).float()


def gemm_operands(kind: str, m: int, n: int, k: int, gen: torch.Generator):
    """Random GEMM operands a [m, k], b [n, k] of `kind` ("fp8": E4M3 with per-tensor scale_inv
    0.01 / 0.02; "fp32", "bf16": high precision, no scales): ((a, a_scale_inv, b, b_scale_inv),
    (a64, b64)), the float64 values the operands stand for."""
    if kind == "fp8":
        a = (torch.randn(m, k, generator=gen) * 40).to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)
        sa, sb = torch.tensor([0.01]), torch.tensor([0.02])
        return (a, sa, b, sb), (a.double() * sa.double(), b.double() * sb.double())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[kind]
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, k, generator=gen).to(dtype)
    return (a, None, b, None), (a.double(), b.double())


def check_dw_and_checkpoint(make, mode: str, device, in_cols: int = IN, out_cols: int = OUT):
    """make(**kw) builds a layer. backward_dw into main_grad, and torch.utils.checkpoint around the
    layer, against the plain immediate run of the same parameters under mode_autocast(mode): the
    same bits in every output and gradient."""
    base = make()
    randomize_(base, 3)
    ckpt = copy.deepcopy(base)
    delayed = make(delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    delayed.load_state_dict(base.state_dict())
    attach_main_grad(delayed)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, in_cols, generator=g).to(torch.bfloat16).to(device)
    dy = torch.randn(32, out_cols, generator=g).to(torch.bfloat16).to(device)
    xs = [x.clone().requires_grad_() for _ in range(3)]
    with mode_autocast(mode):
        y0 = base(xs[0])
        y1 = torch.utils.checkpoint.checkpoint(ckpt, xs[1], use_reentrant=False)
        y2 = delayed(xs[2])
    for y in (y1, y2):
        assert torch.equal(y, y0)
    for y in (y0, y1, y2):
        y.backward(dy)
    delayed.backward_dw()
    assert torch.equal(xs[1].grad, xs[0].grad) and torch.equal(xs[2].grad, xs[0].grad)
    for (name, p0), p1, p2 in zip(base.named_parameters(), ckpt.parameters(), delayed.parameters()):
        assert torch.equal(p1.grad, p0.grad), name
        got = p2.main_grad if name == "weight" else p2.grad
        assert torch.equal(got.to(p0.grad.dtype), p0.grad), name
