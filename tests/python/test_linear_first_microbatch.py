"""C8 — every use counts, is_first_microbatch: the FP8 weight cache (False reuses an unchanged
weight's FP8 copy, True/None refresh it, a changed weight is always re-quantized) and the fused
wgrad, which accumulates into main_grad whatever is_first_microbatch says (C2 b, C8)."""

import pytest
import torch
from _linear_cases import (
    IN,
    KINDS,
    accumulation_error,
    attach_main_grad,
    autocast,
    batches,
    cpu64,
    make_module,
    make_recipe,
)

import fp8dp


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("kind", KINDS)
def test_weight_cache(kind, recipe_name, device):
    recipe = make_recipe(recipe_name)
    m = make_module(kind, device=device)
    ((x, _),) = batches(1, torch.float32, seed=31, device=device)
    with torch.no_grad(), autocast(recipe):
        y_first = m(x, is_first_microbatch=True)
        # A write that autograd's version counter does not see (through .data) shows that False
        # reuses the cache (README: such writes need is_first_microbatch=None or True after them).
        m.weight.data.mul_(-2.0)
        y_reused = m(x, is_first_microbatch=False)
        y_refreshed = m(x, is_first_microbatch=None)
        y_true = m(x, is_first_microbatch=True)
        # C8: a reused FP8 weight is never stale. An in-place step (as torch optimizers make)
        # bumps the version: False re-quantizes. Without the version check y_stale == y_true.
        m.weight.mul_(-0.5)
        y_stale = m(x, is_first_microbatch=False)
        y_now = m(x, is_first_microbatch=None)
    assert torch.equal(y_reused, y_first), "False must reuse the cached FP8 weight"
    assert not torch.equal(y_refreshed, y_first), "None must re-quantize the changed weight"
    assert torch.equal(y_true, y_refreshed), "True re-quantizes too"
    assert not torch.equal(y_stale, y_true), "False reused a weight changed since it was cached"
    assert torch.equal(y_stale, y_now)
    # The refreshed output is that of a module loaded with the current weight (the state dict
    # carries the FP8 scales too, so both cast with the same scales).
    fresh = make_module(kind, device=device)
    fresh.load_state_dict(m.state_dict())
    with torch.no_grad(), autocast(make_recipe(recipe_name)):
        assert torch.equal(fresh(x), y_now)


def test_no_cache_outside_fp8(device):
    """Without FP8 there is nothing to cache: a changed weight is used at once."""
    m = make_module("Linear", device=device)
    ((x, _),) = batches(1, torch.float32, seed=32, device=device)
    with torch.no_grad():
        y1 = m(x, is_first_microbatch=True)
        m.weight.mul_(-2.0)
        y2 = m(x, is_first_microbatch=False)
    assert not torch.equal(y1, y2)


@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("recipe_name", ["none", "delayed"])
def test_main_grad_always_accumulates(recipe_name, delay, device):
    """C2 (b): the fused GEMM accumulates on every micro-batch, is_first_microbatch=True included;
    only zero_grad_buffer() zeroes main_grad. The former rule (True overwrites) fails the last
    assertion: 4 dw expected, dw found."""
    recipe = make_recipe(recipe_name)
    m = make_module(
        "Linear", fuse_wgrad_accumulation=True, delay_wgrad_compute=delay, device=device
    )
    attach_main_grad(m, fill=0.0)
    ((x, dy),) = batches(1, torch.float32, seed=33, device=device)

    def step(first):
        with autocast(recipe):
            y = m(x, is_first_microbatch=first)
        y.backward(dy)
        if delay:
            m.backward_dw()

    step(True)
    dw = m.weight.main_grad.clone()
    assert m.weight.grad_added_to_main_grad
    # Every step multiplies the same operands (same input, grad_output and scales). On the CPU
    # the accumulating GEMM adds the identical FP32 product, so 2 dw and 3 dw hold to an FP32
    # rounding (1e-6). cuBLASLt may pick another algorithm for the accumulating (beta = 1) plan
    # than for the overwriting one, so each product may differ from dw by up to twice its
    # accumulation error (k = tokens, split accumulator) on the quantized magnitudes
    # (|q(v)| <= 1.25 |v| for E4M3 / E5M2).
    k = x.numel() // IN
    mags = (1.25 * cpu64(dy).reshape(k, -1).abs()).t() @ (1.25 * cpu64(x).reshape(k, -1).abs())
    slack = 0.0
    if device.type == "cuda":
        slack = (2 * accumulation_error(k, device) * mags).to(dw.device).float()
    step(False)
    assert ((m.weight.main_grad - 2 * dw).abs() <= 1e-6 + 1e-6 * 2 * dw.abs() + slack).all()
    step(None)
    assert ((m.weight.main_grad - 3 * dw).abs() <= 1e-6 + 1e-6 * 3 * dw.abs() + 2 * slack).all()
    step(True)
    assert ((m.weight.main_grad - 4 * dw).abs() <= 1e-6 + 1e-6 * 4 * dw.abs() + 3 * slack).all()


@pytest.mark.parametrize("zero_out", [False, True])
def test_dummy_wgrad(zero_out, device):
    """The fused route hands autograd a cached dummy (zeros with zero_out_wgrad) so that the
    weight's AccumulateGrad hooks fire; the hook sees grad_added_to_main_grad already set."""
    m = make_module("Linear", fuse_wgrad_accumulation=True, device=device)
    attach_main_grad(m)
    m.weight.zero_out_wgrad = zero_out
    flags = []
    m.weight.register_post_accumulate_grad_hook(lambda p: flags.append(p.grad_added_to_main_grad))
    for x, dy in batches(2, torch.float32, seed=34, device=device):
        m(x).backward(dy)
    assert flags == [True, True]
    assert m.weight.grad is not None and m.weight.grad.shape == m.weight.shape
    if zero_out:
        assert torch.count_nonzero(m.weight.grad) == 0


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_reload_model_params_refreshes_the_weight_cache(group, recipe_name):
    """A write through p.data is invisible to the version counter that guards the FP8 weight
    cache; DistributedOptimizer.reload_model_params() is the call that says the weights changed,
    so the next forward re-casts even with is_first_microbatch=False: its output is bitwise the
    one a refreshing forward gives. Stateful finding (params family, seed 12: a .data write +
    reload_model_params(), then a micro-batch with is_first_microbatch=False reused the stale
    FP8 weight, main_grad 0.95 off). Mutation (2026-12-03): reload_model_params() without
    GradSync::note_params_written(): both cases fail, the reused output being the old weight's."""
    torch.manual_seed(0)
    m = fp8dp.Linear(32, 32, bias=False)
    ddp = fp8dp.DistributedDataParallel(
        m, fp8dp.DistributedDataParallelConfig(use_distributed_optimizer=True), process_group=group
    )
    opt = fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.0)
    x = torch.randn(16, 32)
    recipe = make_recipe(recipe_name)
    with fp8dp.fp8_autocast(fp8_recipe=recipe), torch.no_grad():
        ddp(x, is_first_microbatch=True)  # the cache: the old weight
        m.weight.data.copy_(torch.randn(32, 32))
        opt.reload_model_params()
        reused = ddp(x, is_first_microbatch=False)
        fresh = ddp(x, is_first_microbatch=True)
    assert torch.equal(reused, fresh)
