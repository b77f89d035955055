"""The pieces that let a layer skip launches and copies (the GPT stack's launch count), on every
device this build has:

- quantize(amax_into=...) max-merges the cast's amax into a running amax (a delayed-scaling
  history's row 0) inside the cast kernel: same bytes as a plain cast, and the merge is an exact
  max (NaN above everything, an empty cast changes nothing);
- transpose_fp8 is an exact byte transpose (the tiled CUDA kernel where the shape allows, an ATen
  copy elsewhere);
- the GEMM takes high-precision operands as transpose views (column-major) instead of copies. On
  the CPU the result is bit-identical to the contiguous operands' (the CPU path makes them
  row-major itself); on CUDA it is within the FP32 accumulation bound k * 2^-24 * sum|a||b| plus
  the output rounding of the float64 reference (cuBLASLt may pick another algorithm per layout).
FP8 operands must stay row-major (Hopper's FP8 GEMM is TN only): a transpose view is refused.
"""

import pytest
import torch

import fp8dp

_C = fp8dp._C
CUDA_OK, _ = fp8dp.cuda_available(return_reason=True)
DEVICES = ["cpu"] + (["cuda"] if CUDA_OK else [])
E4M3 = _C.Format.E4M3
ROUND = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def bytes_of(t):
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize(
    "start, scale_x, expect",
    [
        (5.0, 1.0, "start"),  # the running amax is larger: kept
        (0.5, 1.0, "x"),  # the cast's amax is larger: taken
        (float("nan"), 1.0, "nan"),  # NaN in the history stays (C7 keeps the old scale)
        (2.0, float("nan"), "nan"),  # a NaN in the input wins
        (0.0, float("inf"), "inf"),
    ],
)
def test_amax_into_merges_exactly(device, start, scale_x, expect):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=g).clamp(-2.5, 2.5).to(device)
    if scale_x != 1.0:
        x[7, 5] = scale_x
    scale = torch.tensor([3.0], device=device)
    slot = torch.tensor([start], device=device)
    plain = _C.quantize(x, scale, E4M3, True, True, False)
    merged = _C.quantize(x, scale, E4M3, True, True, False, amax_into=slot)
    assert merged.amax.data_ptr() == slot.data_ptr()  # the slot itself, no copy
    assert torch.equal(bytes_of(merged.data), bytes_of(plain.data))
    assert torch.equal(bytes_of(merged.data_t), bytes_of(plain.data_t))
    got = slot.item()
    if expect == "nan":
        assert got != got
    elif expect == "inf":
        assert got == float("inf")
    else:
        want = start if expect == "start" else plain.amax.item()
        assert got == want


def test_amax_into_empty_cast_changes_nothing(device):
    slot = torch.tensor([1.25], device=device)
    _C.quantize(
        torch.empty(0, 32, device=device),
        torch.ones(1, device=device),
        E4M3,
        amax_into=slot,
    )
    assert slot.item() == 1.25


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda d: torch.zeros(1, dtype=torch.float64, device=d), "float32"),
        (lambda d: torch.zeros(2, device=d), "one element"),
    ],
)
def test_amax_into_bad_argument_is_named(device, bad, match):
    x = torch.ones(4, 16, device=device)
    with pytest.raises(ValueError, match=f"amax_into.*{match}"):
        _C.quantize(x, torch.ones(1, device=device), E4M3, amax_into=bad(device))


@pytest.mark.parametrize("shape", [(64, 128), (48, 16), (4096, 80), (33, 17), (1, 16), (0, 16)])
def test_transpose_fp8_is_exact(device, shape):
    g = torch.Generator().manual_seed(11)
    data = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn).to(device)
    out = _C.transpose_fp8(data)
    assert out.shape == (shape[1], shape[0]) and out.is_contiguous()
    assert torch.equal(bytes_of(out), bytes_of(data.t().contiguous()))


def test_transpose_fp8_refuses_bad_input(device):
    with pytest.raises(ValueError, match="2-D"):
        _C.transpose_fp8(torch.zeros(16, device=device).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="float8"):
        _C.transpose_fp8(torch.zeros(16, 16, device=device))


def operands(m, n, k, dtype, device, seed=5):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, k, generator=g).to(dtype).to(device)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["a_col", "b_col", "both_col"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["new_out", "accumulate_fp32"])
def test_gemm_takes_transpose_views(device, dtype, layout, accumulate):
    m, n, k = 96, 80, 112
    a, b = operands(m, n, k, dtype, device)
    # Column-major views holding the same values: the transpose of a contiguous [k, m] tensor.
    a_in = a.t().contiguous().t() if layout in ("a_col", "both_col") else a
    b_in = b.t().contiguous().t() if layout in ("b_col", "both_col") else b
    assert layout == "b_col" or not a_in.is_contiguous()
    start = torch.randn(m, n, generator=torch.Generator().manual_seed(9)).to(device)
    kw = {}
    if accumulate:
        kw = dict(out=start.clone(), accumulate=True)
    got = _C.gemm(a_in, b_in, out_dtype=dtype, **kw)
    kw2 = dict(out=start.clone(), accumulate=True) if accumulate else {}
    want = _C.gemm(a, b, out_dtype=dtype, **kw2)
    if device == "cpu":
        assert torch.equal(got, want)
        return
    ref = a.double() @ b.double().T + (start.double() if accumulate else 0)
    absprod = a.double().abs() @ b.double().abs().T
    out_dtype = torch.float32 if accumulate else dtype
    bound = k * 2.0**-24 * absprod + ROUND[out_dtype] * ref.abs() + 1e-30
    assert ((got.double() - ref).abs() / bound).max().item() <= 1.0


def test_gemm_refuses_fp8_transpose_view(device):
    a = torch.ones(32, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn).t()  # [32, 16] column-major
    si = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="FP8 operand 'b' must be row-major"):
        _C.gemm(a, b, a_scale_inv=si, b_scale_inv=si)


def test_gemm_refuses_other_strides(device):
    a = torch.ones(32, 64, device=device)[:, ::2]  # neither rows nor columns contiguous
    with pytest.raises(ValueError, match="operand 'a' must be row-major contiguous or the"):
        _C.gemm(a, torch.ones(16, 32, device=device))
