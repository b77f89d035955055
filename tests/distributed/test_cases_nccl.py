"""The distributed cases on 2 GPUs (harness.py): the DDP cases that gloo runs on CPU, here on a
pure NCCL group with CUDA models ("nccl"), and the native NCCL communicator's own cases on a gloo
group ("nccl_native"). One torchrun launch per run; each test skips, saying why, without 2 GPUs or
without fp8dp's native NCCL communicator."""

import pytest
from harness import case_params

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, pytest.mark.slow]

LAUNCHES = [("nccl", 2), ("nccl_native", 2)]


@pytest.mark.parametrize("launch, name", case_params(LAUNCHES), indirect=["launch"])
def test_case(launch, name):
    launch.check(name)


@pytest.mark.parametrize("launch", LAUNCHES, indirect=True, ids=lambda k: f"{k[0]}-ws{k[1]}")
def test_launch(launch):
    launch.check_exit()
