"""An invalid cast scale (0, negative, NaN or Inf) is refused or marks the result, never silently
wrong (FP8 numerics, bad input).

The casts take their scale as a one-element float32 tensor on the input's device. On the CPU the
entry points read it and refuse an invalid one with a ValueError naming 'scale'. On a GPU they do
not read it back (a host sync per cast), so the kernels guard it: they write scale_inv = NaN
(fp8/format.h scale_inverse) where they wrote 1 / scale. Before that, a scale of +Inf gave
scale_inv = 0, and every dequantized value and GEMM output of the cast was a silent 0 (bytes
saturated at the format's max times 0); a scale of 0 gave +Inf, so a NaN only where a byte was 0.
With NaN, every use of the result is NaN, which the training loop's and DDP's NaN checks report.

Entry points: quantize (flat and tiled kernels, and the empty input's path), activation_cast
(flat and tiled kernels, empty input), norm_forward (the fused norm + cast; on the CPU it used to
accept any scale). The GEMM consumes scale_inv as it is, so a NaN there gives a NaN output.

Mutations tried (2026-12-05, CPU, then restored): scale_inverse returning 1 / scale again fails
the C++ twins of these tests (tests/cpp/test_quantize.cpp: ScaleInverse.ReciprocalOfValidScales-
NaNForTheRest and QuantizeArgs.InvalidScaleReachingTheKernelWritesNaNScaleInv); removing the
check from norm_forward fails test_cpu_entry_points_refuse[norm_forward-*] (all 4: no error).
The CUDA tests run on the GPU machine only.
"""

import math

import pytest
import torch

import fp8dp
from fp8dp import _C

BAD = [0.0, -2.0, math.inf, math.nan]
BAD_IDS = ["zero", "negative", "inf", "nan"]
E4M3, E5M2 = _C.Format.E4M3, _C.Format.E5M2


def _quantize(x, scale, **kw):
    return _C.quantize(x, scale, E4M3, **kw)


def _act_forward(x, scale, **kw):
    return _C.activation_cast(None, x, "gelu", scale, E4M3, **kw)


def _norm(x, scale, **kw):
    gamma = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    return _C.norm_forward(x, gamma, scale=scale, format=E4M3)


ENTRY = {"quantize": _quantize, "activation_cast": _act_forward, "norm_forward": _norm}


def _fp8_bytes(result):
    return result.out_fp8 if hasattr(result, "out_fp8") else result.data


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("entry", list(ENTRY))
def test_cpu_entry_points_refuse(entry, bad):
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="argument 'scale' must be finite and > 0"):
        ENTRY[entry](x, torch.tensor([bad]))


# ---- CUDA: the kernels mark the result ----

OK, REASON = fp8dp.cuda_available(return_reason=True)
cuda = pytest.mark.skipif(not OK, reason=REASON)

# (entry, options): each kernel that writes scale_inv. quantize: the flat kernel (row-major
# bytes) and the tiled one (transpose + dbias); activation_cast: the flat kernel (forward bytes)
# and the tiled one (backward bytes, transpose and dbias); the fused norm + cast.
KERNELS = [
    ("quantize", {}),
    ("quantize", {"transpose": True, "dbias": True}),
    ("activation_cast", {}),
    ("activation_cast", {"transpose": True, "dbias": True}),
    ("norm_forward", {}),
]
KERNEL_IDS = ["quantize-flat", "quantize-tiled", "act-flat", "act-tiled-dbias", "norm"]


def _cuda_cast(entry, opts, x, scale):
    if entry == "activation_cast" and opts.get("dbias"):
        da = torch.randn_like(x)
        return _C.activation_cast(da, x, "gelu", scale, E5M2, data=True, **opts)
    return ENTRY[entry](x, scale, **opts)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("kernel", range(len(KERNELS)), ids=KERNEL_IDS)
def test_cuda_invalid_scale_gives_nan_everywhere_it_is_used(kernel, bad):
    entry, opts = KERNELS[kernel]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 512, generator=g).to(torch.bfloat16).cuda()
    r = _cuda_cast(entry, opts, x, torch.tensor([bad], device="cuda"))
    torch.cuda.synchronize()
    assert torch.isnan(r.scale_inv).all(), f"{entry} {opts}: scale_inv {r.scale_inv.item()}"
    deq = _C.dequantize(_fp8_bytes(r), r.scale_inv, torch.float32)
    assert torch.isnan(deq).all(), f"{entry} {opts}: {int((~deq.isnan()).sum())} values not NaN"
    # A GEMM that takes the cast as an operand: NaN everywhere (cuBLASLt multiplies by scale_inv).
    w = _C.quantize(
        torch.randn(64, 512, generator=g).cuda(), torch.tensor([1.0], device="cuda"), E4M3
    )
    out = _C._gemm_cuda(
        _fp8_bytes(r).view(256, 512),
        w.data,
        a_scale_inv=r.scale_inv,
        b_scale_inv=w.scale_inv,
        out_dtype=torch.bfloat16,
    )
    assert torch.isnan(out).all(), f"{entry} {opts}: GEMM output has finite values"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kernel", range(len(KERNELS)), ids=KERNEL_IDS)
def test_cuda_valid_scale_inverse_is_the_fp32_reciprocal(kernel):
    """The guard leaves valid scales alone: scale_inv is 1 / scale, bit for bit (as the CPU)."""
    entry, opts = KERNELS[kernel]
    x = torch.randn(64, 128).to(torch.bfloat16)
    for s in (3.0, 448.0, 1e-30, torch.finfo(torch.float32).max):
        scale = torch.tensor([s])
        gpu = _cuda_cast(entry, opts, x.cuda(), scale.cuda())
        assert gpu.scale_inv.item() == (1 / scale).item(), f"{entry} {opts} scale {s}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("entry", list(ENTRY))
def test_cuda_empty_input_marks_too(entry, bad):
    """An empty input casts nothing; its scale_inv follows the same rule (quantize: a one-thread
    kernel; activation_cast: ATen ops; norm_forward: the norm kernel with no rows)."""
    x = torch.empty(0, 16, dtype=torch.bfloat16, device="cuda")
    r = ENTRY[entry](x, torch.tensor([bad], device="cuda"))
    assert torch.isnan(r.scale_inv).all(), f"{entry}: scale_inv {r.scale_inv.item()}"
    ok = ENTRY[entry](x, torch.tensor([4.0], device="cuda"))
    assert ok.scale_inv.item() == 0.25
