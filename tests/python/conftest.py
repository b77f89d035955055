"""Shared pytest fixtures of the single-process tests.

`device`: every module test group runs once on the CPU (FP8 emulated, FP32 GEMMs) and once on
CUDA (CUDA kernels, cuBLASLt). The CUDA runs skip at once, with the reason from
fp8dp.cuda_available(return_reason=True), where the build has no CUDA or torch sees no GPU, so CI
on a CPU machine pays nothing for them.
"""

import gc

import pytest
import torch

import fp8dp

CUDA_OK, CUDA_REASON = fp8dp.cuda_available(return_reason=True)


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not CUDA_OK:
        pytest.skip(CUDA_REASON)
    yield torch.device(request.param)
    # fp8dp.update_fp8_scales() walks every live FP8 state of the process and refuses states on
    # two devices at once; drop the finished test's modules before a test on the other device.
    gc.collect()
