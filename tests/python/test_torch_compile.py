"""fp8dp under torch.compile: the same bits as eager, every step (CPU; FP8 emulated).

Users compile their models. fp8dp's layers run C++ autograd functions that Dynamo cannot trace, so
each layer call is a graph break: the torch code between the layers is compiled, the layers run
as in eager mode, and their state (FP8 scales and amax histories, the weight cache, the queue of
delayed weight gradients, DDP's readiness counts and hooks) changes exactly as in eager mode.
What could go wrong, and is checked here: Dynamo baking a Python-side value into a compiled graph
(the autocast state, is_first_microbatch, DDP's recompute test), a compiled frame skipping a
side effect, a wrapper (torch.compile's OptimizedModule) hiding parameters or module names that
DDP and the FP8 identities (C9) need.

Every case trains the same model from the same initial weights twice, eager and compiled, over
several steps with scale updates, and asserts the outputs, gradients (or main_grads) and updated
parameters bit-identical. The models hold only fp8dp layers, residual adds and ReLU between them,
whose compiled kernels give the same bits as eager ones (a torch.nn.Linear would not: Inductor's
GEMM and bias add round differently from ATen's by an ulp, which would hide nothing about fp8dp).
"""

import contextlib
import copy

import pytest
import torch

import fp8dp

pytestmark = pytest.mark.slow  # Dynamo compiles each case (~5-20 s on 2 cores)

RECIPES = {
    "delayed": lambda: fp8dp.DelayedScaling(amax_history_len=4),
    "current": lambda: fp8dp.Float8CurrentScaling(),
    "block": lambda: fp8dp.Float8BlockScaling(),
}


class Stack(torch.nn.Module):
    """LayerNormLinear -> ReLU -> Linear (+ residual), then a LayerNormMLP (+ residual)."""

    def __init__(self, delay: bool, fuse: bool, width: int = 128):
        super().__init__()
        kw = {"delay_wgrad_compute": delay, "fuse_wgrad_accumulation": fuse}
        self.up = fp8dp.LayerNormLinear(width, 2 * width, **kw)
        self.down = fp8dp.Linear(2 * width, width, **kw)
        self.mlp = fp8dp.LayerNormMLP(width, 2 * width, **kw)

    def forward(self, x, is_first_microbatch=None):
        x = x + self.down(torch.relu(self.up(x, is_first_microbatch)), is_first_microbatch)
        return x + self.mlp(x, is_first_microbatch)

    def backward_dw(self):
        for m in (self.mlp, self.down, self.up):
            m.backward_dw()


def _batches(steps, micro, width=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(128, width, generator=g) for _ in range(micro)] for _ in range(steps)]


def _assert_same(eager, compiled, what):
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert torch.equal(a, b), (
            f"{what}: item {i} differs between eager and compiled, max |diff| "
            f"{(a.double() - b.double()).abs().max().item():.3g}"
        )


def _train_plain(model, call, recipe, batches, delay, autocast_inside):
    """A loop without DDP: outputs and .grad of every step, then the parameters."""
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in batches:
        for k, x in enumerate(step):
            first = k == 0
            if autocast_inside:
                y = call(x, first)
            else:
                with fp8dp.fp8_autocast(fp8_recipe=recipe):
                    y = call(x, first)
            y.square().mean().backward()
            if delay:
                model.backward_dw()
            out.append(y.detach().clone())
        fp8dp.update_fp8_scales()
        out += [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("delay", [False, True], ids=["wgrad", "delayed_wgrad"])
@pytest.mark.parametrize("autocast_inside", [False, True], ids=["autocast_outside", "inside"])
def test_compiled_module_matches_eager(recipe, delay, autocast_inside):
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Stack(delay, fuse=False)
    batches = _batches(steps=3, micro=2)
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        r = RECIPES[recipe]()

        def fwd(x, first, model=model, r=r):
            if autocast_inside:  # fp8_autocast entered inside the compiled function
                with fp8dp.fp8_autocast(fp8_recipe=r):
                    return model(x, first)
            return model(x, first)

        call = torch.compile(fwd) if compiled else fwd
        runs.append(_train_plain(model, call, r, batches, delay, autocast_inside))
    _assert_same(runs[0], runs[1], f"{recipe}, delay={delay}, autocast_inside={autocast_inside}")


def _train_ddp(wrap, base, batches, delay, group):
    model = copy.deepcopy(base)
    cfg = fp8dp.DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,  # the forwards' waits for the all-gathers run compiled too
        bucket_size=20000,
    )
    ddp, call = wrap(model, cfg, group)
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=1e-2)
    recipe = fp8dp.DelayedScaling(amax_history_len=4)
    out = []
    for step in batches:
        ddp.zero_grad_buffer()
        for k, x in enumerate(step):
            with ddp.no_sync() if k + 1 < len(step) else contextlib.nullcontext():
                with fp8dp.fp8_autocast(fp8_recipe=recipe):
                    y = call(x)
                y.square().mean().backward()
                if delay:
                    model.backward_dw()
            out.append(y.detach().clone())
        ddp.finish_grad_sync()
        out += [p.main_grad.clone() for p in ddp._params]
        fp8dp.update_fp8_scales()
        opt.step()
    return out + [p.detach().clone() for p in model.parameters()]


def _eager(model, cfg, group):
    ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
    return ddp, ddp


def _compile_outside(model, cfg, group):
    ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
    return ddp, torch.compile(ddp)


def _compile_inside(model, cfg, group):
    ddp = fp8dp.DistributedDataParallel(torch.compile(model), cfg, process_group=group)
    return ddp, ddp


@pytest.mark.parametrize("delay", [False, True], ids=["wgrad", "delayed_wgrad"])
@pytest.mark.parametrize(
    "wrap", [_compile_outside, _compile_inside], ids=["compile(ddp)", "ddp(compile(model))"]
)
def test_compiled_ddp_zero1_matches_eager(group, wrap, delay):
    """fp8dp DDP with ZeRO-1, overlapped reduce and parameter all-gather, two micro-batches (the
    first under no_sync) and fused main_grad accumulation: main_grads and AdamW's updates bit-identical to eager, with
    torch.compile around the DDP module or around the model inside it."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    base = Stack(delay, fuse=True)
    batches = _batches(steps=3, micro=2, seed=1)
    eager = _train_ddp(_eager, base, batches, delay, group)
    compiled = _train_ddp(wrap, base, batches, delay, group)
    _assert_same(eager, compiled, f"{wrap.__name__}, delay={delay}")
