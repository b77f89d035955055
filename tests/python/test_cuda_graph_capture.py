"""fp8dp layers under CUDA graph capture (torch.cuda.graph), src/modules/capture_check.h: what a
replay would silently get wrong is refused at capture with an error that says why (delayed
scaling's amax marks, delayed weight gradients, a reused FP8 weight cast), and what is left
(current scaling, no delayed weight gradient, the weight cast in every forward) replays to the
eager results bit for bit, as does an inference forward under delayed scaling. Skipped without a
GPU.

Not yet run on a GPU when written (2026-12-05); the capture itself was shown to work for
fp8dp's layers by dev/graph_ceiling.py on the H200 the same day.
"""

import copy

import pytest
import torch

import fp8dp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layer(kind, **kw):
    torch.manual_seed(0)
    if kind == "Linear":
        return fp8dp.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda", **kw)
    if kind == "LayerNormLinear":
        return fp8dp.LayerNormLinear(256, 128, params_dtype=torch.bfloat16, device="cuda", **kw)
    return fp8dp.LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device="cuda", **kw)


def _step(m, x, dy, recipe, **fwd):
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(x, **fwd)
    y.backward(dy)
    if getattr(m, "delay_wgrad_compute", False):
        m.backward_dw()  # the warm-up's queued weight gradient, as a training loop pops it
    return y


def _capture(m, x, dy, recipe, **fwd):
    """Warm-up on the capture stream (cuBLASLt's workspace is per stream), then one capture of
    forward + backward. Returns the graph and its static output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            _step(m, x, dy, recipe, **fwd)
            for p in m.parameters():
                p.grad = None
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = _step(m, x, dy, recipe, **fwd)
    return g, y


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_delayed_scaling_is_refused_at_capture(kind):
    m = _layer(kind)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(
        64, 256 if kind == "LayerNormMLP" else 128, device="cuda", dtype=torch.bfloat16
    )
    with pytest.raises(
        RuntimeError, match="cannot be captured into a CUDA graph in training under delayed"
    ):
        _capture(m, x, dy, fp8dp.DelayedScaling())


@pytest.mark.parametrize(
    "kw, fwd, match",
    [
        (dict(delay_wgrad_compute=True), {}, "delay_wgrad_compute=True"),
        ({}, dict(is_first_microbatch=False), "is_first_microbatch=False"),
    ],
)
def test_host_only_weight_paths_are_refused_at_capture(kw, fwd, match):
    m = _layer("Linear", **kw)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    recipe = fp8dp.Float8CurrentScaling()
    if fwd:  # the FP8 weight cast is made (and cached) eagerly first, as a loop would
        _step(m, x, dy, recipe, is_first_microbatch=True)
    with pytest.raises(RuntimeError, match=match):
        _capture(m, x, dy, recipe, **fwd)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_current_scaling_replays_bit_for_bit(kind):
    """Three replays with new inputs and a changed weight against the same steps run eagerly on
    a copy of the layer: outputs, input gradients and weight gradients equal (torch.equal)."""
    eager = _layer(kind)
    graphed = copy.deepcopy(eager)
    out_w = 256 if kind == "LayerNormMLP" else 128
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, out_w, device="cuda", dtype=torch.bfloat16)
    recipe = fp8dp.Float8CurrentScaling()
    g, y_static = _capture(graphed, x, dy, recipe)
    for i in range(3):
        torch.manual_seed(10 + i)
        xi = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        dyi = torch.randn(64, out_w, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():  # an optimizer-like write, in place, on both copies
            for pe, pg in zip(eager.parameters(), graphed.parameters()):
                pe.mul_(0.99)
                pg.mul_(0.99)
        for p in eager.parameters():
            p.grad = None
        xe = xi.clone().requires_grad_(True)
        ye = _step(eager, xe, dyi, recipe)
        with torch.no_grad():
            x.copy_(xi)
            dy.copy_(dyi)
            # The parameters had no .grad at capture, so the replay writes their static grads
            # afresh; x kept its warm-up .grad, so the captured backward adds into it.
            x.grad.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, ye), f"replay {i}: output"
        assert torch.equal(x.grad, xe.grad), f"replay {i}: input gradient"
        for (n, pe), pg in zip(eager.named_parameters(), graphed.parameters()):
            assert torch.equal(pg.grad, pe.grad), f"replay {i}: {n}.grad"


def test_unsafe_capture_lets_delayed_scaling_through(monkeypatch):
    """The escape hatch for measurements (dev/graph_ceiling.py), nothing else."""
    monkeypatch.setenv("FP8DP_UNSAFE_CAPTURE", "1")
    m = _layer("Linear")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    g, _ = _capture(m, x, dy, fp8dp.DelayedScaling())
    g.replay()
    torch.cuda.synchronize()


def test_inference_under_delayed_scaling_is_capturable():
    """No autograd, no scale update: an inference forward replays to the eager output."""
    m = _layer("LayerNormLinear")
    recipe = fp8dp.DelayedScaling()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            m(x)  # the first cast's scales, eagerly
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), fp8dp.fp8_autocast(fp8_recipe=recipe):
            m(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s), fp8dp.fp8_autocast(fp8_recipe=recipe):
            y = m(x)
        x.copy_(torch.randn_like(x))
        g.replay()
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            ye = m(x)
    torch.cuda.synchronize()
    assert torch.equal(y, ye)
