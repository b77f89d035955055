"""C3 — delayed wgrad, FIFO order: several backwards queued before the backward_dw() calls, popped
in FIFO order, equal the immediate result; a weight tied between two modules accumulates both
modules' delayed contributions."""

import pytest
import torch
from _linear_cases import (
    KINDS,
    RECIPES,
    attach_main_grad,
    autocast,
    batches,
    make_module,
    make_recipe,
    twin,
)


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_queued_backwards_fifo(kind, recipe_name, fuse, device):
    """Three micro-batches forward+backward, then three backward_dw() calls. Popped in FIFO order
    they are added in the immediate module's order, so the sums agree bit for bit (the fused
    GEMM accumulates into main_grad on every micro-batch, is_first_microbatch=True included)."""
    recipe = make_recipe(recipe_name)
    imm, dly = twin(kind, bias=True, fuse_wgrad_accumulation=fuse, device=device)
    for m in (imm, dly):
        attach_main_grad(m, fill=0.5)  # accumulated onto, never overwritten (C2 b)
    data = batches(3, torch.float32, seed=21, device=device)
    for m in (imm, dly):
        for i, (x, dy) in enumerate(data):
            with autocast(recipe):
                y = m(x.clone().requires_grad_(True), is_first_microbatch=i == 0)
            y.backward(dy)
    assert dly._core.queued_wgrads == 3 and dly.need_backward_dw()
    if not fuse:
        assert dly.weight.grad is None  # nothing written until backward_dw
    for _ in range(3):
        dly.backward_dw()
    assert not dly.need_backward_dw()
    if fuse:
        assert torch.equal(imm.weight.main_grad, dly.weight.main_grad)
    else:
        assert torch.equal(imm.weight.grad, dly.weight.grad)
    assert torch.equal(imm.bias.grad, dly.bias.grad)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_tied_weight_accumulates_both(recipe_name, device):
    """Two Linear modules share one weight Parameter (both delayed); each backward_dw() adds its
    module's contribution to weight.grad, which equals the immediate modules' autograd sum."""
    recipe = make_recipe(recipe_name)
    grads = {}
    for delay in (False, True):
        torch.manual_seed(4)
        a = make_module("Linear", bias=False, delay_wgrad_compute=delay, device=device)
        b = make_module("Linear", bias=False, delay_wgrad_compute=delay, device=device)
        b.weight = a.weight
        (x1, dy1), (x2, dy2) = batches(2, torch.float32, seed=22, device=device)
        with autocast(recipe):
            y1, y2 = a(x1), b(x2)
        torch.autograd.backward([y1, y2], [dy1, dy2])
        if delay:
            assert a.weight.grad is None  # nothing written until backward_dw
            a.backward_dw()
            g_a = a.weight.grad.clone()
            b.backward_dw()
            assert not torch.equal(a.weight.grad, g_a)  # b's contribution was added, not dropped
        grads[delay] = a.weight.grad
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=0)


def test_wgrad_hooks_run_after_each_backward_dw(device):
    m = make_module("Linear", delay_wgrad_compute=True, device=device)
    seen = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append(m.weight.grad is not None))
    for x, dy in batches(2, torch.float32, seed=23, device=device):
        m(x).backward(dy)
    m.backward_dw()
    m.backward_dw()
    assert seen == [True, True]
    assert m.weight.skip_backward_post_hook and m.bias.skip_backward_post_hook
    assert not make_module("Linear").weight.skip_backward_post_hook
