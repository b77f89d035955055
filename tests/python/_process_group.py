"""A process group of this process alone, for module fixtures (conftest.py's `group`, gloo;
test_graphed_cuda.py's `nccl_group`)."""

import pytest
import torch.distributed as dist


def world_of_one(backend: str):
    """A module fixture's body: yields the group, destroys it afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
