"""fp8dp.quantize / dequantize / update_scaling on CUDA tensors against the CPU kernels (C7).

Through the LibTorch layer (device guard, current stream, output allocation): identical FP8 bytes,
transposed bytes, amax and scale_inv; dbias within twice the FP32 summation bound
(rows - 1) * 2^-24 * sum|x| of two differently ordered FP32 sums.
"""

import pytest
import torch

import fp8dp

_C = fp8dp._C
OK, REASON = fp8dp.cuda_available(return_reason=True)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=REASON)]

FORMATS = {
    "E4M3": (_C.Format.E4M3, torch.float8_e4m3fn),
    "E5M2": (_C.Format.E5M2, torch.float8_e5m2),
}


def as_bytes(t):
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1,), (7, 13), (256, 384), (3, 130, 96)], ids=str)
@pytest.mark.parametrize("special", ["none", "nan", "inf"])
def test_quantize_cuda_matches_cpu(fmt, dtype, shape, special):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(shape, generator=g) * 300).to(dtype)
    if special == "nan":
        x.view(-1)[x.numel() // 2] = float("nan")
    elif special == "inf":
        x.view(-1)[0] = float("-inf")
    scale = torch.tensor([1.75])
    f, _ = FORMATS[fmt]
    cpu = _C.quantize(x, scale, f, True, True, True)
    gpu = _C.quantize(x.cuda(), scale.cuda(), f, True, True, True)
    assert gpu.data.is_cuda and gpu.data.dtype == cpu.data.dtype
    assert torch.equal(as_bytes(gpu.data), as_bytes(cpu.data))
    assert torch.equal(as_bytes(gpu.data_t), as_bytes(cpu.data_t))
    assert torch.equal(gpu.amax.cpu().view(torch.int32), cpu.amax.view(torch.int32))
    assert torch.equal(gpu.scale_inv.cpu(), cpu.scale_inv)
    x2 = x.float().reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    bound = 2 * max(rows - 1, 1) * 2.0**-24 * x2.abs().sum(0)
    d_gpu, d_cpu = gpu.dbias.cpu(), cpu.dbias
    finite = torch.isfinite(d_cpu)
    assert torch.equal(torch.isnan(d_gpu), torch.isnan(d_cpu))
    assert ((d_gpu - d_cpu).abs()[finite] <= bound[finite]).all()
    # In the bias's dtype: the same FP32 sums, rounded once in the same launch.
    low = _C.quantize(x.cuda(), scale.cuda(), f, True, True, True, dbias_dtype=torch.bfloat16)
    torch.testing.assert_close(
        low.dbias.cpu(), d_gpu.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True
    )


def _dbias_bound(x2, ref, dbias_dtype):
    """Allowed |dbias - ref| per column, from the numerics: `rows` FP32 terms added in a fixed order
    are within (rows - 1) * 2^-24 * sum|x| of the exact sum (the recursive-summation bound, 1.001 for
    the second-order term); the one rounding to dbias_dtype adds half an ulp (2^-8 of the value in
    bf16, 2^-11 in fp16, plus 2^-25 absolute in fp16's subnormal range)."""
    rows = x2.shape[0]
    sum_err = 1.001 * max(rows - 1, 1) * 2.0**-24 * x2.abs().sum(0)
    u_out, sub = {torch.float32: (0.0, 0.0), torch.bfloat16: (2.0**-8, 0.0)}.get(
        dbias_dtype, (2.0**-11, 2.0**-25)
    )
    return sum_err + u_out * (ref.abs() + sum_err) + sub


def _poisoned_dbias(x, fmt, dbias_dtype):
    """One cast's dbias. A NaN tensor of dbias's size is freed just before the call, so that the
    caching allocator likely hands its block to dbias: a column the kernel misses then shows as NaN
    instead of whatever the block held (the C++ test poisons its outputs for certain)."""
    poison = torch.full((x.shape[-1],), float("nan"), dtype=dbias_dtype, device=x.device)
    del poison
    scale = torch.ones(1, device=x.device)
    return _C.quantize(x, scale, FORMATS[fmt][0], True, True, True, dbias_dtype=dbias_dtype).dbias


@pytest.mark.parametrize("dbias_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5767, 200), (1000, 97), (2, 300, 4099)], ids=str)
def test_quantize_cuda_dbias_sum(shape, dtype, dbias_dtype):
    """dbias from the cast's per-strip partial rows and their column sums: several strips of 64 /
    128 rows and several column tiles, partial last tiles included. Within the numerics' bound of
    a float64 reference, every column written, and bit for bit the same on every further call (the
    order of the additions is fixed by the shape)."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(shape, generator=g) + torch.rand(shape[-1], generator=g) * 2 - 1).to(dtype)
    x2 = x.double().reshape(-1, shape[-1])
    ref = x2.sum(0)
    xc = x.cuda()
    runs = [_poisoned_dbias(xc, "E4M3", dbias_dtype) for _ in range(3)]
    first = runs[0].cpu()
    assert first.dtype == dbias_dtype and not torch.isnan(first).any()
    assert ((first.double() - ref).abs() <= _dbias_bound(x2, ref, dbias_dtype)).all()
    for d in runs[1:]:
        assert torch.equal(d.cpu().view(torch.uint8), first.view(torch.uint8))


def test_quantize_cuda_dbias_two_streams_at_once():
    """Casts on two streams at the same time share no scratch: every dbias equals, bit for bit, the
    one the same cast gives alone."""
    g = torch.Generator().manual_seed(12)
    xa = torch.randn(8192, 1000, generator=g).to(torch.bfloat16).cuda()
    xb = torch.randn(4099, 1030, generator=g).cuda()
    want_a = _poisoned_dbias(xa, "E4M3", torch.bfloat16).cpu()
    want_b = _poisoned_dbias(xb, "E5M2", torch.float32).cpu()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    got_a, got_b = [], []
    for _ in range(8):
        with torch.cuda.stream(s1):
            got_a.append(_poisoned_dbias(xa, "E4M3", torch.bfloat16))
        with torch.cuda.stream(s2):
            got_b.append(_poisoned_dbias(xb, "E5M2", torch.float32))
    torch.cuda.synchronize()
    for k, (a, b) in enumerate(zip(got_a, got_b)):
        assert torch.equal(a.cpu().view(torch.int16), want_a.view(torch.int16)), f"stream 1, {k}"
        assert torch.equal(b.cpu().view(torch.int32), want_b.view(torch.int32)), f"stream 2, {k}"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_cuda_matches_cpu(fmt, dtype):
    f, t = FORMATS[fmt]
    data = torch.arange(256, dtype=torch.uint8).repeat(5).view(t)
    s = torch.tensor([0.37])
    cpu = _C.dequantize(data, s, dtype)
    gpu = _C.dequantize(data.cuda(), s.cuda(), dtype).cpu()
    nan = torch.isnan(cpu)
    assert torch.equal(torch.isnan(gpu), nan)
    assert torch.equal(gpu[~nan], cpu[~nan])


@pytest.mark.parametrize("algo", ["MAX", "MOST_RECENT"])
def test_update_scaling_cuda_matches_cpu(algo):
    g = torch.Generator().manual_seed(3)
    L, n = 16, 70
    hist = torch.rand(L, n, generator=g) * 100
    hist[:, 5] = 0.0
    hist[3, 9] = float("nan")
    hist[0, 11] = float("inf")
    scale = torch.rand(n, generator=g) + 0.5
    scale_inv = 1 / scale
    fmax = torch.where(torch.arange(n) % 2 == 0, 448.0, 57344.0)
    state = [hist, scale, scale_inv]
    gpu = [t.cuda() for t in state]
    a = getattr(_C.AmaxAlgo, algo)
    _C.update_scaling(*state, fmax, a, 1.0)
    _C.update_scaling(*gpu, fmax.cuda(), a, 1.0)
    for c, d in zip(state, gpu):
        assert torch.equal(d.cpu().nan_to_num(123.0), c.nan_to_num(123.0))
