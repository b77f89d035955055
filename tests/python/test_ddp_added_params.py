"""DistributedDataParallel refuses parameters added to its module after construction (their
gradients would have no place in the buffers and go unreduced), at the next forward and at
zero_grad_buffer(), and walks the module for them only when some module registered a parameter or
submodule since its last walk (the walk cost about a millisecond of host time per call at 150
parameters, at the start of every step).

Mutations (2026-12-05, each restored):
- the early return in DistributedDataParallel._check_parameters removed (a walk every call):
  test_no_walk_without_registrations failed (3 walks);
- the early return made unconditional (never walks): all 7 failed (the refusals DID NOT RAISE,
  and no walk after a registration).
"""

import pytest
import torch

import fp8dp


def _ddp(group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(fp8dp.Linear(16, 16), torch.nn.Linear(16, 8))
    cfg = fp8dp.DistributedDataParallelConfig(overlap_grad_reduce=False)
    return fp8dp.DistributedDataParallel(model, cfg, process_group=group)


def _add_parameter(ddp):
    ddp.module.extra = torch.nn.Parameter(torch.zeros(3))
    return "extra"


def _attach_old_module(ddp):
    # built before the DDP, so its parameters were registered before the DDP's construction
    ddp.module.add_module("late", _attach_old_module.prebuilt)
    return "late.weight"


def _replace_weight(ddp):
    ddp.module[1].weight = torch.nn.Parameter(torch.zeros(8, 16))
    return "1.weight"


_attach_old_module.prebuilt = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("change", [_add_parameter, _attach_old_module, _replace_weight])
@pytest.mark.parametrize("call", ["forward", "zero_grad_buffer"])
def test_added_parameter_is_refused(group, change, call):
    ddp = _ddp(group)
    ddp(torch.randn(4, 16)).sum().backward()
    ddp.finish_grad_sync()
    name = change(ddp)
    run = (lambda: ddp(torch.randn(4, 16))) if call == "forward" else ddp.zero_grad_buffer
    with pytest.raises(ValueError, match=f"parameter '{name}' was added after"):
        run()
    with pytest.raises(ValueError, match="was added after"):  # and again: nothing was accepted
        run()


def test_no_walk_without_registrations(group, monkeypatch):
    ddp = _ddp(group)
    walks = []
    real = ddp.module.named_parameters

    def counted(*args, **kwargs):
        walks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ddp.module, "named_parameters", counted)
    for _ in range(3):
        ddp.zero_grad_buffer()
        ddp(torch.randn(4, 16)).sum().backward()
        ddp.finish_grad_sync()
    assert len(walks) == 0
    torch.nn.Linear(2, 2)  # a registration anywhere in the process: one walk, then none
    for _ in range(2):
        ddp.zero_grad_buffer()
        ddp(torch.randn(4, 16)).sum().backward()
        ddp.finish_grad_sync()
    assert len(walks) == 1
