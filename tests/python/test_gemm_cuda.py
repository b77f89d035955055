"""cuBLASLt GEMM (gemm_cuda) against a float64 reference of the dequantized operands.

Tolerances come from the numerics. FP8 x FP8 products are exact, but Hopper's FP8 tensor cores add
them with a reduced-precision accumulator (about 14 mantissa bits, as reported for H800/H100), so a
run of up to c products carries up to c * 2^-14 * sum|a||b|. With the split accumulator the partial
sums are promoted to FP32 at least every 128 products (c = min(k, 128)) and then summed in FP32
(k * 2^-24 * sum|a||b|); with fast accumulation they never are (c = k). The output rounding adds
half an ulp: 2^-8 relative for bfloat16, 2^-11 for float16, 2^-24 for float32. Measured first on the
H200 with a bound of k * 2^-24 alone, small-k split-accumulator results exceeded it by up to 8x,
which is the reduced-precision accumulation showing.
For the high-precision (bf16 / fp16 inputs, FP32 compute) GEMMs only the FP32 term applies.
"""

import pytest
import torch

import fp8dp

_C = fp8dp._C
OK, REASON = fp8dp.cuda_available(return_reason=True)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=REASON)]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROUND = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def fp8_operand(rows, cols, dtype, gen):
    """Random FP8 tensor (values within range, many binades) and a non-trivial scale_inv."""
    fmax = 448.0 if dtype == E4M3 else 57344.0
    x = torch.randn(rows, cols, generator=gen, device="cuda") * (fmax / 8)
    data = x.clamp(-fmax, fmax).to(dtype)
    scale_inv = torch.rand(1, generator=gen, device="cuda") * 0.01 + 0.001
    return data, scale_inv


def reference(a, a_si, b, b_si):
    """float64 product of the dequantized operands, and sum|a||b| for the error bound."""
    a64 = a.double() * a_si.double()
    b64 = b.double() * b_si.double()
    return a64 @ b64.T, a64.abs() @ b64.abs().T


def assert_within(out, ref, absprod, k, out_dtype, fast, fp8=True):
    chunk = (k if fast else min(k, 128)) if fp8 else 0
    bound = (chunk * 2.0**-14 + k * 2.0**-24) * absprod + ROUND[out_dtype] * ref.abs() + 1e-30
    err = (out.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3f}x the bound"
    assert torch.isfinite(out).all()


@pytest.fixture
def gen():
    g = torch.Generator(device="cuda")
    g.manual_seed(1234)
    return g


@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("split", [True, False], ids=["split_acc", "fast_acc"])
@pytest.mark.parametrize("mnk", [(256, 512, 1024), (77, 48, 32), (1, 16, 16)], ids=str)
def test_fp8_gemm_matches_reference(fmts, out_dtype, split, mnk, gen):
    m, n, k = mnk
    a, a_si = fp8_operand(m, k, fmts[0], gen)
    b, b_si = fp8_operand(n, k, fmts[1], gen)
    out = _C._gemm_cuda(
        a, b, a_scale_inv=a_si, b_scale_inv=b_si, out_dtype=out_dtype, use_split_accumulator=split
    )
    assert out.shape == (m, n) and out.dtype == out_dtype
    ref, absprod = reference(a, a_si, b, b_si)
    assert_within(out, ref, absprod, k, out_dtype, fast=not split)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_gemm_bias_epilogue(out_dtype, gen):
    m, n, k = 128, 256, 512
    a, a_si = fp8_operand(m, k, E4M3, gen)
    b, b_si = fp8_operand(n, k, E4M3, gen)
    bias = torch.randn(n, generator=gen, device="cuda") * 10
    out = _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si, bias=bias, out_dtype=out_dtype)
    ref, absprod = reference(a, a_si, b, b_si)
    bias_r = bias.to(out_dtype).double()  # the epilogue reads the bias in the output dtype
    ref = ref + bias_r
    assert_within(out, ref, absprod + bias_r.abs(), k, out_dtype, fast=False)
    # Without the epilogue the result differs by the bias: the test would catch a dropped bias.
    plain = _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si, out_dtype=out_dtype)
    assert (out.double() - plain.double() - bias_r).abs().max() < 1.0 + 0.01 * ref.abs().max()


def test_fp8_gemm_accumulates_into_strided_main_grad(gen):
    """beta = 1 into an FP32 view with a row stride (a slice of a bigger grad buffer)."""
    m, n, k = 96, 128, 256
    a, a_si = fp8_operand(m, k, E5M2, gen)
    b, b_si = fp8_operand(n, k, E4M3, gen)
    buf = torch.randn(m, n + 32, generator=gen, device="cuda")
    main_grad = buf[:, :n]
    before = main_grad.clone()
    untouched = buf[:, n:].clone()
    res = _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si, out=main_grad, accumulate=True)
    assert res.data_ptr() == main_grad.data_ptr()
    ref, absprod = reference(a, a_si, b, b_si)
    assert_within(
        main_grad,
        ref + before.double(),
        absprod + before.double().abs(),
        k + 1,
        torch.float32,
        fast=False,
    )
    assert torch.equal(buf[:, n:], untouched)
    # A second accumulation adds the same product again (the autotuner must not have summed into it).
    _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si, out=main_grad, accumulate=True)
    assert_within(
        main_grad,
        2 * ref + before.double(),
        2 * absprod + before.double().abs(),
        k + 2,
        torch.float32,
        fast=False,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, "same"], ids=["fp32_out", "same_out"])
def test_high_precision_gemm(dtype, out_dtype, gen):
    m, n, k = 200, 136, 328
    out_dtype = dtype if out_dtype == "same" else out_dtype
    a = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    b = torch.randn(n, k, generator=gen, device="cuda").to(dtype)
    out = _C._gemm_cuda(a, b, out_dtype=out_dtype)
    ref = a.double() @ b.double().T
    assert_within(
        out, ref, a.double().abs() @ b.double().abs().T, k, out_dtype, fast=False, fp8=False
    )


def test_plan_cache_per_shape(gen):
    _C._gemm_clear_cache()
    a, a_si = fp8_operand(64, 64, E4M3, gen)
    b, b_si = fp8_operand(32, 64, E4M3, gen)
    _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si)
    _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si)
    assert _C._gemm_cache_size() == 1
    _C._gemm_cuda(a[:32], b, a_scale_inv=a_si, b_scale_inv=b_si)
    assert _C._gemm_cache_size() == 2


@pytest.mark.parametrize(
    "case,match",
    [
        ("k_not_16", "inner dimension k to be a multiple of 16, got k=40"),
        ("n_not_16", "multiple of 16, got n=24"),
        ("e5m2_e5m2", "two float8_e5m2"),
        ("no_scale", "'b_scale_inv' is required"),
        ("accumulate_no_out", "accumulate=True needs an 'out'"),
        ("cpu_operand", "must be on one CUDA device"),
        ("inner_mismatch", "inner dimensions differ"),
    ],
)
def test_gemm_errors(case, match, gen):
    a, a_si = fp8_operand(32, 64, E4M3, gen)
    b, b_si = fp8_operand(32, 64, E4M3, gen)
    kw = dict(a_scale_inv=a_si, b_scale_inv=b_si)
    if case == "k_not_16":
        a, b = a[:, :40].contiguous(), b[:, :40].contiguous()
    elif case == "n_not_16":
        b = b[:24].contiguous()
    elif case == "e5m2_e5m2":
        a, b = a.float().to(E5M2), b.float().to(E5M2)
    elif case == "no_scale":
        del kw["b_scale_inv"]
    elif case == "accumulate_no_out":
        kw["accumulate"] = True
    elif case == "cpu_operand":
        b = b.cpu()
    elif case == "inner_mismatch":
        b = b[:, :48].contiguous()
    with pytest.raises(ValueError, match=match):
        _C._gemm_cuda(a, b, **kw)


@pytest.fixture
def default_candidates():
    yield
    _C._gemm_set_candidates(8, -1)
    _C._gemm_clear_cache()


def test_algo_override_pins_each_candidate(gen, default_candidates):
    """Every heuristic candidate, pinned by index, computes the same GEMM within the split-accumulator
    bound, and the plan reports the index it was given (dev/gemm_energy_candidates.py relies on
    both)."""
    m, n, k = 256, 192, 512
    a, a_si = fp8_operand(m, k, E4M3, gen)
    b, b_si = fp8_operand(n, k, E5M2, gen)
    ref, absprod = reference(a, a_si, b, b_si)
    _C._gemm_clear_cache()
    _C._gemm_set_candidates(8, -1)
    _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si)
    (auto,) = _C._gemm_plans()
    assert 1 <= auto["candidates"] <= 8 and 0 <= auto["pick"] < auto["candidates"]
    assert f"m={m} n={n} k={k}" in auto["shape"] and auto["config"].startswith("algo ")
    for i in range(auto["candidates"]):
        _C._gemm_clear_cache()
        _C._gemm_set_candidates(8, i)
        out = _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si)
        (plan,) = _C._gemm_plans()
        assert plan["pick"] == i and plan["candidates"] == auto["candidates"]
        assert_within(out, ref, absprod, k, torch.float32, fast=False)


def test_algo_override_errors(gen, default_candidates):
    for max_algos, override, match in [
        (0, -1, r"max_algos must be in \[1, 32\], got 0"),
        (33, -1, r"max_algos must be in \[1, 32\], got 33"),
        (8, -2, r"algo_override must be -1 \(autotune\) or in \[0, max_algos = 8\), got -2"),
        (4, 4, r"in \[0, max_algos = 4\), got 4"),
    ]:
        with pytest.raises(ValueError, match=match):
            _C._gemm_set_candidates(max_algos, override)
    a, a_si = fp8_operand(64, 64, E4M3, gen)
    b, b_si = fp8_operand(32, 64, E4M3, gen)
    _C._gemm_clear_cache()
    _C._gemm_set_candidates(32, -1)
    _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si)
    (plan,) = _C._gemm_plans()
    if plan["candidates"] == 32:
        pytest.skip("cuBLASLt offers all 32 candidates here: no index is out of range")
    _C._gemm_clear_cache()
    _C._gemm_set_candidates(32, plan["candidates"])
    with pytest.raises(ValueError, match=f"algo_override must be below the {plan['candidates']}"):
        _C._gemm_cuda(a, b, a_scale_inv=a_si, b_scale_inv=b_si)
    assert _C._gemm_cache_size() == 0  # the failed plan is not cached


@pytest.mark.parametrize("split", [(False, True, True), (True, False, False), (True, True, False)])
def test_recipe_accumulation_reaches_each_layer_gemm(split, default_candidates):
    """The recipe's split_accumulator_{fprop,dgrad,wgrad} decide the accumulation of the Linear
    layer's three GEMMs: each one's cached plan says fast_accum exactly when its flag is off. The
    dimensions (tokens 64, in 48, out 32) tell the three GEMMs apart by shape."""
    tokens, fin, fout = 64, 48, 32
    fprop, dgrad, wgrad = split
    m = fp8dp.Linear(fin, fout, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = fp8dp.DelayedScaling(
        split_accumulator_fprop=fprop,
        split_accumulator_dgrad=dgrad,
        split_accumulator_wgrad=wgrad,
    )
    _C._gemm_clear_cache()
    with fp8dp.fp8_autocast(fp8_recipe=r):
        m(x).float().sum().backward()
    torch.cuda.synchronize()
    shapes = [p["shape"] for p in _C._gemm_plans()]
    want = {
        f"m={tokens} n={fout} k={fin}": not fprop,
        f"m={tokens} n={fin} k={fout}": not dgrad,
        f"m={fout} n={fin} k={tokens}": not wgrad,
    }
    for dims, fast in want.items():
        (shape,) = [s for s in shapes if dims in s]
        assert ("fast_accum" in shape) == fast, shape
    assert len(shapes) == 3, shapes
