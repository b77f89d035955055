"""A dropped DistributedDataParallel is freed at once, with its buffers and communicator.

fp8dp modules keep their delayed-wgrad hooks in C++, where Python's cycle collector cannot see
them; a hook that held the DDP strongly made model -> hook -> DDP -> model a cycle nobody could
free. On GPUs every leaked DDP kept its NCCL communicator, and the 1536-cell NCCL test matrix ran
the device out of memory after ~360 cells. These tests fail if a hook holds the DDP strongly."""

import gc
import weakref

import pytest
import torch

import fp8dp


@pytest.mark.parametrize("delay_wgrad_compute", [False, True])
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_dropped_ddp_is_freed_without_the_cycle_collector(
    group, delay_wgrad_compute, use_distributed_optimizer
):
    def build_and_train():
        model = torch.nn.Sequential(
            fp8dp.LayerNormLinear(32, 32, delay_wgrad_compute=delay_wgrad_compute),
            fp8dp.Linear(32, 32, delay_wgrad_compute=delay_wgrad_compute),
        )
        cfg = fp8dp.DistributedDataParallelConfig(
            overlap_grad_reduce=True,
            use_distributed_optimizer=use_distributed_optimizer,
            delay_wgrad_compute=delay_wgrad_compute,
        )
        ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
        opt = (
            fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.1)
            if use_distributed_optimizer
            else torch.optim.SGD(model.parameters(), lr=0.1)
        )
        ddp(torch.randn(16, 32)).square().sum().backward()
        if delay_wgrad_compute:
            for m in model:
                m.backward_dw()
        ddp.finish_grad_sync()
        opt.step()
        return weakref.ref(ddp), weakref.ref(model)

    # The first run in a process leaves its frame in a one-time lazy initialisation outside
    # fp8dp (seen with torch 2.13); the second run is the one that shows a leak.
    build_and_train()
    gc.collect()
    gc.disable()  # only reference counting may free them
    try:
        ddp_ref, model_ref = build_and_train()
        assert ddp_ref() is None, "the DDP outlived its last reference"
        assert model_ref() is None, "the wrapped model outlived its last reference"
    finally:
        gc.enable()
