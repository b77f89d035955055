"""Shared pytest fixtures of the single-process tests.

`device`: every module test runs once on the CPU (FP8 emulated, FP32 GEMMs) and once on
CUDA (CUDA kernels, cuBLASLt). The CUDA runs skip at once, with the reason from
fp8dp.cuda_available(return_reason=True), where the build has no CUDA or torch sees no GPU, so CI
on a CPU machine pays nothing for them.

`fp8_states_released`: after the test, nothing keeps its FP8 modules alive. Every test also
starts with the FP8 modules of the last file or device released (pytest-xdist interleaves them).

`group`: a gloo process group of one rank (this process), for the tests of
DistributedDataParallel and its optimizer; one per test module.

Every test also leaves torchrun's environment variables as it found them: fp8dp.train's
setup_distributed sets RANK / LOCAL_RANK / WORLD_SIZE for a run without torchrun, so a test that
calls its main() in-process made every later `python -m fp8dp.train` subprocess of the same
pytest-xdist worker believe it ran under torchrun (MASTER_ADDR missing; seen 2026-12-05 when the
load distribution put test_train_demo.py after test_train_graphs_host.py, whose run calls
main() in-process; mutation-checked: that pair in that order fails without this fixture).
"""

import gc
import os
import sys

import pytest
import torch
from _process_group import world_of_one

import fp8dp

CUDA_OK, CUDA_REASON = fp8dp.cuda_available(return_reason=True)


def _release_fp8_states():
    # fp8dp.update_fp8_scales() walks every live FP8 scaling state of the process and refuses
    # states on two devices at once, so a test's modules must be gone before a test on another
    # device runs. pytest keeps the last failure's traceback for post-mortem debugging
    # (sys.last_traceback and friends), and with it the failed test's modules: drop that too, or
    # one failure on one device would fail every later update_fp8_scales() on the other.
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked slow first (a stable sort: otherwise collection order): pytest-xdist hands out
    work in this order, and one slow test handed out last runs alone while the other workers
    idle. On CI's 2 workers the slowest, test_fp8_ablations_script's 249 s, started after most of
    tests/python (2026-12-06); on the GPU machine's 16, pytest sat at 99% for minutes."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


_LAST = [None]  # (file, device) of the last test this process ran


_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _torchrun_env_restored():
    before = {k: os.environ.get(k) for k in _TORCHRUN_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _fp8_states_of_another_device_released(request):
    """Under pytest-xdist's load distribution (the Makefile's) a worker runs any subset of a file's
    tests, of many files in turn: a CPU test that leaves its FP8 modules to the garbage collector
    (an autograd graph's reference cycle) may be followed at once by a CUDA test whose
    update_fp8_scales() would meet them (seen on the GPU machine). Release them whenever the
    file or the device changes (a test without the `device` fixture runs on the CPU): one
    gc.collect() per switch instead of one per test."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    key = (str(request.node.path), params.get("device", "cpu"))
    if _LAST[0] not in (None, key):
        _release_fp8_states()
    _LAST[0] = key


@pytest.fixture
def fp8_states_released():
    yield
    _release_fp8_states()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, fp8_states_released):
    if request.param == "cuda" and not CUDA_OK:
        pytest.skip(CUDA_REASON)
    return torch.device(request.param)


@pytest.fixture(scope="module")
def group():
    yield from world_of_one("gloo")
