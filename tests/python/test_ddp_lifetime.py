"""A dropped DistributedDataParallel is freed at once, with its buffers and communicator.

fp8dp modules once kept their delayed-wgrad hooks in C++, where Python's cycle collector cannot
see them; a hook that held the DDP strongly made model -> hook -> DDP -> model a cycle nobody could
free. On GPUs every leaked DDP kept its NCCL communicator, and the 1536-cell NCCL test matrix ran
the device out of memory after ~360 cells. The DDP's hooks hold it weakly, so reference counting
alone frees it (the first test fails if a hook holds the DDP strongly); the modules now keep the
hooks in Python, so a user's hook that holds the model is freed by the cycle collector (the
second test, which failed while the core held the hooks)."""

import gc
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

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


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_a_wgrad_hook_that_holds_its_module_does_not_keep_it_alive(kind):
    """A hook closing over its own module (Megatron-style: the hook reaches the model) makes a
    cycle module -> hook -> module. The GC frees it, FP8 scaling state included: while the C++ core
    held the hooks, such a module lived as long as the process, and its CPU FP8 state failed a
    later CUDA test's update_fp8_scales() ("FP8 states live on different devices", make test on
    the GPU machine, 2026-12-03)."""
    make = {
        "Linear": lambda: fp8dp.Linear(32, 48, delay_wgrad_compute=True),
        "LayerNormLinear": lambda: fp8dp.LayerNormLinear(32, 48, delay_wgrad_compute=True),
        "LayerNormMLP": lambda: fp8dp.LayerNormMLP(32, 48, delay_wgrad_compute=True),
    }[kind]
    gc.collect()
    before = len(fp8dp._C.fp8_registry_descriptions())

    def build_and_train():
        m = make()
        calls = []
        m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(m.training))
        with fp8dp.fp8_autocast(fp8_recipe=fp8dp.DelayedScaling(amax_history_len=4)):
            y = m(torch.randn(16, 32))
        y.square().sum().backward()
        m.backward_dw()
        assert calls == [True]  # the hook ran, once
        assert len(fp8dp._C.fp8_registry_descriptions()) > before  # the FP8 state exists
        return weakref.ref(m)

    ref = build_and_train()
    gc.collect()
    assert ref() is None, "the module outlived its last reference"
    assert len(fp8dp._C.fp8_registry_descriptions()) == before, "its FP8 scaling state lives on"


_AT_EXIT = r"""
import atexit, gc, os, sys, weakref
import torch, torch.distributed as dist
import fp8dp

gc.disable()  # only an explicit collection frees cycles below
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")


def build():
    model = torch.nn.Sequential(fp8dp.Linear(32, 32))
    cfg = fp8dp.DistributedDataParallelConfig(use_distributed_optimizer=True)
    ddp = fp8dp.DistributedDataParallel(model, cfg)
    ddp.cycle = [ddp]  # a reference cycle, as torch's AdamW.__init__ frame makes in practice
    fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.1)
    return weakref.ref(ddp)


ref = build()
dist.destroy_process_group()
alive_before = ref() is not None
atexit._run_exitfuncs()  # what interpreter exit runs first, while the interpreter is whole
print("before", alive_before, "after", ref() is not None)
"""


def _exit_script(tmp_path, text: str) -> tuple:
    """(script path, a free port, the environment) for running `text` in fresh interpreters
    that import this tree's fp8dp: what happens at interpreter exit needs a process of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "script.py"
    script.write_text(text)
    python_dir = Path(fp8dp.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(python_dir), "OMP_NUM_THREADS": "1"}
    return script, port, env


def test_ddp_in_a_reference_cycle_is_freed_before_interpreter_teardown(tmp_path):
    """fp8dp collects cycles at exit (ddp.py's atexit handler), so a DDP that only the cycle
    collector can free is finalised while the interpreter is whole, not during its teardown
    (where four-rank gloo demo runs aborted: 'terminate called without an active exception')."""
    script, port, env = _exit_script(tmp_path, _AT_EXIT)
    out = subprocess.run(
        [sys.executable, str(script), str(port)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "before True after False" in out.stdout, out.stdout + out.stderr


_IN_FLIGHT_AT_EXIT = r"""
import atexit, os, sys
import torch, torch.distributed as dist

rank = int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK=str(rank), WORLD_SIZE="2")
# Registered before fp8dp's own exit handler, so it runs after it (atexit runs last in, first out).
atexit.register(lambda: print("in flight after fp8dp's exit handler:", ddp._sync.param_sync_pending))
import fp8dp

dist.init_process_group("gloo")
torch.manual_seed(0)
cfg = fp8dp.DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True)
ddp = fp8dp.DistributedDataParallel(torch.nn.Sequential(fp8dp.Linear(64, 64)), cfg)
opt = fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.1)
ddp(torch.randn(8, 64)).square().sum().backward()
ddp.finish_grad_sync()
opt.step()  # leaves the parameter all-gathers in flight for the next forward
print("in flight at the end of the script:", ddp._sync.param_sync_pending, flush=True)
"""


def test_parameter_all_gathers_in_flight_are_waited_for_at_exit(tmp_path):
    """A script that ends right after DistributedOptimizer.step() with overlap_param_gather leaves
    its all-gathers in flight; fp8dp's exit handler waits for them while the interpreter is whole
    (a gloo collective that completes during interpreter teardown aborts the process)."""
    script, port, env = _exit_script(tmp_path, _IN_FLIGHT_AT_EXIT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(port), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}:\n{out}"
        assert "in flight at the end of the script: True" in out, out  # the case is the one meant
        assert "in flight after fp8dp's exit handler: False" in out, out
