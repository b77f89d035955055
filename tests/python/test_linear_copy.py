"""copy.deepcopy of fp8dp modules (an EMA or reference copy of a model): the copy has its own
parameters and C++ core, the same FP8 scaling state, and trains on its own. Without
_FP8LinearBase.__deepcopy__ the copy fails ("cannot pickle 'fp8dp._C.LinearCore'")."""

import copy

import pytest
import torch
from _linear_cases import KINDS, autocast, batches, make_module, make_recipe


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_is_an_independent_twin(kind, device):
    recipe = make_recipe("delayed")
    m = make_module(kind, bias=True, delay_wgrad_compute=True, device=device)
    (x, dy), (x2, _) = batches(2, torch.float32, seed=41, device=device)
    with autocast(recipe):
        m(x).backward(dy)
    m.backward_dw()
    twin = copy.deepcopy(m)
    assert twin._core is not m._core
    for (name, p), q in zip(m.named_parameters(), twin.parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name
        if name in ("weight", "bias"):  # C3's attribute, set anew on the copy
            assert q.skip_backward_post_hook, name
    torch.testing.assert_close(twin._core.scale.cpu(), m._core.scale.cpu(), rtol=0, atol=0)
    with torch.no_grad(), autocast(make_recipe("delayed")):
        assert torch.equal(twin(x2), m(x2)), "the same FP8 state casts alike"
    with torch.no_grad():
        twin.weight.mul_(2.0)
    assert not torch.equal(twin.weight, m.weight)
    with autocast(recipe):
        twin(x).backward(dy)
    assert twin.need_backward_dw() and not m.need_backward_dw()  # its own queue
    twin.backward_dw()
    assert twin.weight.grad is not None
