"""The Python face of the FP8 core: package metadata and the bound casts (fp8dp._C).

Values are checked bit-for-bit against torch's own float8 conversion where torch defines it
(|x * scale| <= max; torch turns overflow into NaN, fp8dp saturates as contract C7 says).
"""

import math

import pytest
import torch

import fp8dp
from fp8dp import _C

FORMATS = {
    "E4M3": (_C.Format.E4M3, torch.float8_e4m3fn, 448.0, 0x7E),
    "E5M2": (_C.Format.E5M2, torch.float8_e5m2, 57344.0, 0x7B),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bytes(t):
    return t.contiguous().view(torch.uint8)


# ---- package ----


def test_version_matches_the_build():
    assert isinstance(fp8dp.__version__, str)
    assert fp8dp.__version__ == fp8dp.build_info()["version"]


def test_build_info_keys_and_values():
    info = fp8dp.build_info()
    assert set(info) == {
        "version",
        "torch_version",
        "cuda",
        "cuda_runtime_version",
        "cublaslt_version",
        "nccl_version",
    }
    # built against the torch that runs it (torch.__version__ may carry a local suffix like +cpu)
    assert torch.__version__.split("+")[0] == info["torch_version"]
    assert isinstance(info["cuda"], bool)
    if not info["cuda"]:
        assert info["cublaslt_version"] == info["nccl_version"] == ""


def test_cuda_available_gives_a_reason():
    ok, reason = fp8dp.cuda_available(return_reason=True)
    assert isinstance(ok, bool) and isinstance(reason, str)
    assert ok or reason  # a False always says why
    assert fp8dp.cuda_available() is ok


def test_fp8_max():
    assert _C.fp8_max(_C.Format.E4M3) == 448.0
    assert _C.fp8_max(_C.Format.E5M2) == 57344.0


# ---- quantize / amax / dequantize ----


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (3, 31), (65, 63), (2, 3, 129)], ids=str)
def test_quantize_matches_torch(fmt, dtype, shape):
    cfmt, fp8, fmax, maxb = FORMATS[fmt]
    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.exp2(torch.randn(shape) * 3)).to(dtype)
    scale = fmax / x.abs().max().float().item() * 2  # about half of the values overflow the max
    q = _C.quantize(x, torch.tensor([scale]), cfmt)
    y = x.float() * scale
    got = _bytes(q.data)
    assert q.data.dtype == fp8 and q.data.shape == x.shape
    ok = y.abs() <= fmax
    assert torch.equal(got[ok], _bytes(y.to(fp8))[ok])
    # beyond the max: saturated to +-max
    want_sat = torch.where(y < 0, 0x80 | maxb, maxb).to(torch.uint8)
    assert torch.equal(got[~ok], want_sat[~ok])
    assert q.amax.item() == x.abs().max().float().item()
    assert q.scale_inv.item() == pytest.approx(1 / scale, rel=1e-7)
    assert q.data_t is None and q.dbias is None  # not asked for


def test_cast_transpose_and_dbias():
    torch.manual_seed(1)
    x = torch.randint(-8, 8, (70, 33)).float()  # integers: column sums are exact in FP32
    q = _C.quantize(x, torch.tensor([4.0]), _C.Format.E4M3, transpose=True, dbias=True)
    assert q.data_t.shape == (33, 70)
    assert torch.equal(_bytes(q.data_t), _bytes(q.data).t())
    assert torch.equal(q.dbias, x.sum(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dbias_in_the_bias_dtype_is_the_fp32_sum_rounded_once(dtype):
    """dbias_dtype stores the same FP32 column sums, rounded once to nearest even: bit for bit
    what a separate .to(dtype) of the FP32 result gives (the launch it saves)."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(300, 77, generator=g) * 3).to(torch.bfloat16)
    s = torch.tensor([2.0])
    f32 = _C.quantize(x, s, _C.Format.E5M2, transpose=True, dbias=True)
    low = _C.quantize(x, s, _C.Format.E5M2, transpose=True, dbias=True, dbias_dtype=dtype)
    assert low.dbias.dtype == dtype
    assert torch.equal(low.dbias, f32.dbias.to(dtype))
    assert torch.equal(_bytes(low.data_t), _bytes(f32.data_t))


def test_dbias_dtype_must_be_a_float_dtype():
    with pytest.raises(ValueError, match="dbias_dtype"):
        _C.quantize(
            torch.ones(4, 4),
            torch.tensor([1.0]),
            _C.Format.E4M3,
            dbias=True,
            dbias_dtype=torch.int32,
        )


def test_non_contiguous_input():
    torch.manual_seed(2)
    base = torch.randn(40, 50)
    x = base.t()[:, ::3]
    assert not x.is_contiguous()
    a = _C.quantize(x, torch.tensor([16.0]), _C.Format.E5M2)
    b = _C.quantize(x.contiguous(), torch.tensor([16.0]), _C.Format.E5M2)
    assert torch.equal(_bytes(a.data), _bytes(b.data))
    assert torch.equal(_bytes(a.data), _bytes((x * 16).to(torch.float8_e5m2)))


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, -3.0, 2.0], 3.0),
        ([1.0, -math.inf, 2.0], math.inf),
        ([1.0, math.nan, math.inf], math.nan),
        ([], 0.0),
    ],
    ids=["finite", "inf", "nan-wins", "empty"],
)
def test_amax_rules(values, expected):
    x = torch.tensor(values, dtype=torch.float32)
    got = _C.amax(x).item()
    assert math.isnan(got) if math.isnan(expected) else got == expected
    q = _C.quantize(x, torch.tensor([1.0]), _C.Format.E4M3)
    assert math.isnan(q.amax.item()) if math.isnan(expected) else q.amax.item() == expected


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_all_bytes(fmt, dtype):
    _, fp8, _, _ = FORMATS[fmt]
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8)
    out = _C.dequantize(data, torch.tensor([0.5]), dtype)
    want = (data.float() * 0.5).to(dtype)
    assert out.dtype == dtype
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~out.isnan()], want[~want.isnan()])


def test_update_scaling_updates_in_place():
    hist = torch.tensor([[2.0, 0.0], [7.0, 0.0]])  # [L=2, n=2]; tensor 1 never saw a value
    scale = torch.tensor([1.0, 5.0])
    scale_inv = 1 / scale
    fp8_max = torch.tensor([448.0, 57344.0])
    _C.update_scaling(hist, scale, scale_inv, fp8_max, _C.AmaxAlgo.MAX, 0.0)
    assert scale.tolist() == [64.0, 5.0]  # 448 / max(2, 7); amax 0 keeps the scale
    assert scale_inv.tolist() == [1 / 64, (1 / torch.tensor(5.0)).item()]  # FP32 1/scale
    assert hist.tolist() == [[0.0, 0.0], [2.0, 0.0]]  # rolled once, row 0 cleared


# ---- bad input: ValueError naming the argument ----

X = torch.randn(4, 4)


@pytest.mark.parametrize(
    "x, scale, arg",
    [
        (X.int(), torch.tensor([1.0]), "'x'"),
        (X.double(), torch.tensor([1.0]), "'x'"),
        (X.to("meta"), torch.tensor([1.0]), "'x'"),
        (X, torch.tensor([0.0]), "'scale'"),
        (X, torch.tensor([-2.0]), "'scale'"),
        (X, torch.tensor([math.nan]), "'scale'"),
        (X, torch.tensor([math.inf]), "'scale'"),
        (X, torch.tensor([1.0], dtype=torch.float64), "'scale'"),
        (X, torch.tensor([1.0, 2.0]), "'scale'"),
        (X, torch.tensor([1.0], device="meta"), "'scale'"),
    ],
    ids=[
        "x-int32",
        "x-float64",
        "x-meta",
        "scale-zero",
        "scale-negative",
        "scale-nan",
        "scale-inf",
        "scale-float64",
        "scale-two-elements",
        "scale-meta",
    ],
)
def test_quantize_bad_input(x, scale, arg):
    with pytest.raises(ValueError, match=arg):
        _C.quantize(x, scale, _C.Format.E4M3)


def test_amax_and_dequantize_bad_input():
    with pytest.raises(ValueError, match="fp8dp.amax: argument 'x'"):
        _C.amax(X.int())
    data = torch.zeros(4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="'data'"):
        _C.dequantize(X, torch.tensor([1.0]), torch.float32)
    with pytest.raises(ValueError, match="'scale_inv'"):
        _C.dequantize(data, torch.tensor([1.0], dtype=torch.float64), torch.float32)
    with pytest.raises(ValueError, match="'dtype'"):
        _C.dequantize(data, torch.tensor([1.0]), torch.int32)
