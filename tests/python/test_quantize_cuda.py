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
pytestmark = pytest.mark.skipif(not OK, reason=REASON)

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
