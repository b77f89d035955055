"""fp8dp.make_graphed_callables' capture procedure on the CPU (tests/python/_host_graphs.py):
which FP8 states it accepts under delayed scaling, and that the warm-up leaves no trace.

- A layer that has cast must be ready (checked before the warm-up, test_graph_record.py has the
  messages); a layer that never cast may be one the model runs without FP8 (a nested
  fp8_autocast(enabled=False), as the demo's fp8.exclude does): accepted when the warm-up leaves
  it so, refused when the warm-up made it cast (it had no scale to capture with).
- The warm-up's changes are put back: every FP8 state bit for bit (and in place), main_grad,
  grad_added_to_main_grad, the registry's observed mark.
- clone_param_grads_on_return: the parameters' gradients copied out of the static buffers (the
  default; micro-batches accumulate) or handed over without a copy, where a backward that finds
  the buffer still in .grad is refused. Mutations, each tried and reverted: returning the static
  tensors undetached with False fails the copy test (and the refusal one: nothing to refuse);
  without the refusal the refusal test fails.
"""

import contextlib

import pytest
import torch
from _host_graphs import HostGraphs
from torch.utils._python_dispatch import TorchDispatchMode

import fp8dp
from fp8dp import _C, graph

H, TOKENS = 32, 16


class Model(torch.nn.Module):
    def __init__(self, exclude_last: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a = fp8dp.Linear(H, H, fuse_wgrad_accumulation=True)
        self.b = fp8dp.Linear(H, H)
        self.exclude_last = exclude_last

    def forward(self, x):
        h = self.a(x)
        if self.exclude_last:
            with fp8dp.fp8_autocast(enabled=False):
                return self.b(h)
        return self.b(h)


def _capture(m, x, dy, recipe):
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        graph._capture((m,), ((x.clone().requires_grad_(True),),), 2, False, None, HostGraphs(dy))


def _step(m, x, dy, recipe):
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(x.clone().requires_grad_(True))
    y.backward(dy)
    fp8dp.update_fp8_scales()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(TOKENS, H, generator=g), torch.randn(TOKENS, H, generator=g)


def test_a_layer_run_without_fp8_is_accepted():
    m = Model(exclude_last=True)
    m.a.weight.main_grad = torch.zeros(H, H)
    x, dy = _data()
    recipe = fp8dp.DelayedScaling()
    _step(m, x, dy, recipe)
    assert m.b._core.amax_history is None, "b runs without FP8"
    _capture(m, x, dy, recipe)
    assert m.b._core.amax_history is None


def test_a_layer_that_casts_without_a_scale_is_refused():
    m = Model(exclude_last=False)
    m.a.weight.main_grad = torch.zeros(H, H)
    x, dy = _data()
    recipe = fp8dp.DelayedScaling()
    m.exclude_last = True
    _step(m, x, dy, recipe)  # b did not cast in this step
    m.exclude_last = False  # now it would, in the capture, with no scale
    with pytest.raises(ValueError, match=r"Linear\(in_features=32.*has not cast in FP8 before"):
        _capture(m, x, dy, recipe)
    assert m.b._core.amax_history is None, "the warm-up's first cast was put back"


def test_the_warm_up_leaves_no_trace():
    m = Model(exclude_last=False)
    m.a.weight.main_grad = torch.zeros(H, H)
    x, dy = _data()
    recipe = fp8dp.DelayedScaling(amax_history_len=4)
    _step(m, x, dy, recipe)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        m(x)  # this step's forward so far: observed, row 0 holds its amaxes
    before = {k: m.a._core.get_extra_state()[k].clone() for k in ("amax_history", "scale")}
    ptr = m.a._core.amax_history.data_ptr()
    mg = m.a.weight.main_grad.clone()
    m.a.weight.grad_added_to_main_grad = False
    assert _C.fp8_registry_signature()[1]
    # The capture's own host code writes nothing on a GPU; on the CPU its work runs, so the
    # comparison is with the state a GPU capture leaves: put back after the warm-up only. The
    # warm-up runs num_warmup_iters steps with gradients of ones: it moves every amax row 0.
    saved = graph._Saved(graph._fp8_layers(m), HostGraphs(dy))
    warm = _C.GraphRecord()
    warm.begin(_C.GraphPhase.WARMUP)
    try:
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            for _ in range(2):
                y = m(x.clone().requires_grad_(True))
                torch.autograd.grad(y, list(m.parameters()), torch.ones_like(y) * 100.0)
        assert not torch.equal(m.a.weight.main_grad, mg), "the warm-up wrote main_grad"
    finally:
        warm.end()
        saved.restore()
    after = m.a._core.get_extra_state()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert m.a._core.amax_history.data_ptr() == ptr, "restored in place"
    assert torch.equal(m.a.weight.main_grad, mg)
    assert m.a.weight.grad_added_to_main_grad is False
    assert _C.fp8_registry_signature()[1], "the step's own observation stands"
    fp8dp.update_fp8_scales()


def test_a_second_call_before_the_backward_is_refused():
    """The first call's outputs and saved state live in the graphs' static buffers: a second call
    before its backward would overwrite them (torch's make_graphed_callables does not check)."""
    m = Model(exclude_last=False)
    m.a.weight.main_grad = torch.zeros(H, H)
    x, dy = _data()
    recipe = fp8dp.DelayedScaling()
    _step(m, x, dy, recipe)
    _capture(m, x, dy, recipe)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(x.clone().requires_grad_(True))
        with pytest.raises(RuntimeError, match="called again before the backward"):
            m(x.clone().requires_grad_(True))
        y.backward(dy)
        y2 = m(x.clone().requires_grad_(True))  # after the backward: allowed
        del y2  # dropped without a backward: allowed too
        y3 = m(x.clone().requires_grad_(True))
    y3.backward(dy)
    fp8dp.update_fp8_scales()


@pytest.mark.parametrize(
    "fuse,delay",
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["plain", "fused", "delayed", "fused+delayed"],
)
def test_an_unbound_layer_is_captured_in_every_wgrad_route(fuse, delay):
    """Without DDP, a delayed layer gives autograd no weight gradient (backward_dw() computes it):
    the capture (allow_unused_input=False) must not call the weight an unused input, and a replay
    then backward_dw() give the eager weight gradient. Missed until 2026-12-05 (a desk review of
    the GPU tests): every unbound delayed-only case was refused at capture, "requires grad but the
    captured backward gives it no gradient"; the fused+delayed one passed (a stand-in gradient)."""
    torch.manual_seed(0)
    m = fp8dp.Linear(H, H, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay)
    if fuse:
        m.weight.main_grad = torch.zeros(H, H)
    x, dy = _data()
    recipe = fp8dp.DelayedScaling()

    def step():
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            y = m(x.clone().requires_grad_(True))
        y.backward(dy)
        if delay:
            m.backward_dw()

    step()
    fp8dp.update_fp8_scales()
    _capture(m, x, dy, recipe)  # raises if the weight is taken for an unused input
    m.weight.grad = None
    m.weight.grad_added_to_main_grad = False
    step()  # a replay (on the host stand-in its kernels compute nothing: the host work runs)
    if fuse:  # the GEMM into main_grad is in the graph; the replay marks it done again
        assert m.weight.grad_added_to_main_grad is True
    else:  # the static gradient the capture computed reaches .grad through autograd
        assert m.weight.grad is not None and m.weight.grad.abs().sum() > 0


class _OpLog(TorchDispatchMode):
    """The aten ops dispatched while active, with their tensor arguments' shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(
            (func.overloadpacket.__name__, [tuple(a.shape) for a in args if torch.is_tensor(a)])
        )
        return func(*args, **(kwargs or {}))


def _plain_capture(clone: bool):
    """A plain Linear (gradients through autograd) captured with clone_param_grads_on_return."""
    torch.manual_seed(0)
    m = fp8dp.Linear(H, H)
    x, dy = _data()
    recipe = fp8dp.DelayedScaling()
    _step(m, x, dy, recipe)
    m.zero_grad(set_to_none=True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        graph._capture(
            (m,), ((x.clone().requires_grad_(True),),), 2, False, None, HostGraphs(dy), clone
        )
    return m, x, dy, recipe


def _graphed_backward(m, x, dy, recipe, log=None):
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(x.clone().requires_grad_(True))
    with log if log is not None else contextlib.nullcontext():
        y.backward(dy)


def test_param_grads_copied_or_handed_over():
    """clone_param_grads_on_return: True copies each parameter's static gradient into .grad
    (AccumulateGrad's new_empty_strided + copy_, or clone, of the parameter's shape); False hands
    the static buffer over, with no copy. The values are the same (the replay's gradient)."""
    grads = {}
    for c in (True, False):
        m, x, dy, recipe = _plain_capture(c)
        log = _OpLog()
        _graphed_backward(m, x, dy, recipe, log)
        shapes = {tuple(p.shape) for p in m.parameters()}
        copies = [
            op for op in log.ops if op[0] in ("copy_", "clone") and op[1] and op[1][0] in shapes
        ]
        assert bool(copies) == c, (c, copies)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
        grads[c] = [p.grad.clone() for p in m.parameters()]
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


def test_a_backward_into_a_handed_over_grad_is_refused():
    """clone_param_grads_on_return=False: a second backward while .grad still holds the static
    buffer is refused before its backward graph replays (the replay would overwrite that gradient
    and autograd would add the buffer to itself: twice the second micro-batch, none of the
    first); once .grad is cleared it runs."""
    m, x, dy, recipe = _plain_capture(False)
    _graphed_backward(m, x, dy, recipe)
    before = [p.grad.clone() for p in m.parameters()]
    replays = len(HostGraphs.Graph.replays)
    with pytest.raises(RuntimeError, match="'weight' still holds the previous backward's gradient"):
        _graphed_backward(m, x, dy, recipe)
    assert len(HostGraphs.Graph.replays) == replays + 1  # the forward graph only
    for p, b in zip(m.parameters(), before):
        assert torch.equal(p.grad, b)
    m.zero_grad(set_to_none=True)
    _graphed_backward(m, x, dy, recipe)
    for p, b in zip(m.parameters(), before):
        assert torch.equal(p.grad, b)


def test_copied_grads_accumulate_over_micro_batches():
    """The default (clone_param_grads_on_return=True): two backwards without clearing add, each
    once (on the host stand-in every replay hands back the capture's gradient: exactly twice)."""
    m, x, dy, recipe = _plain_capture(True)
    _graphed_backward(m, x, dy, recipe)
    once = [p.grad.clone() for p in m.parameters()]
    _graphed_backward(m, x, dy, recipe)
    for p, g in zip(m.parameters(), once):
        assert torch.equal(p.grad, 2 * g)


def test_clone_param_grads_on_return_must_be_a_bool():
    m = fp8dp.Linear(H, H)
    x, _ = _data()
    with pytest.raises(ValueError, match="clone_param_grads_on_return: expected True or False"):
        fp8dp.make_graphed_callables(m, (x,), clone_param_grads_on_return=1)
