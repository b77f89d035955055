"""C2 b — the fused route's stand-in gradient, not bound to fp8dp's DDP (a Megatron-style loop with
its own hooks): the wgrad GEMM adds into `weight.main_grad`, and autograd gets a weight-shaped
stand-in so that the weight's AccumulateGrad hooks fire, with `grad_added_to_main_grad` saying
not to add it.

The stand-in is a fresh tensor each backward, which AccumulateGrad takes as `.grad` without a
copy. The layer once cached it, so AccumulateGrad copied it (a full pass over the weight's bytes
per micro-batch on the GPU); `test_the_stand_in_is_not_copied` watches the ops of the backward
and fails on that copy (checked against the cached version: it logs new_empty_strided + copy_
of the weight's shape). Values: with zero_out_wgrad the stand-in is zeros (exact), so `.grad`
stays zero over micro-batches; main_grad gets each micro-batch's gradient once.
"""

import pytest
import torch
from _linear_cases import FP8_MODES, IN, OUT, attach_main_grad, mode_autocast
from torch.utils._python_dispatch import TorchDispatchMode

import fp8dp

LAYERS = ["Linear", "LayerNormLinear", "LayerNormMLP"]


def make_layer(kind: str, device):
    kw = dict(fuse_wgrad_accumulation=True, params_dtype=torch.bfloat16, device=device)
    if kind == "Linear":
        return fp8dp.Linear(IN, OUT, **kw)
    if kind == "LayerNormLinear":
        return fp8dp.LayerNormLinear(IN, OUT, **kw)
    return fp8dp.LayerNormMLP(IN, OUT, **kw)


def gemm_weights(layer):
    """The weights whose gradient the fused route adds into main_grad."""
    return [p for p in layer.parameters() if p.dim() == 2]


class OpLog(TorchDispatchMode):
    """Every aten op dispatched while active, with the shapes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, shapes))
        return func(*args, **(kwargs or {}))


def inputs(device, out_features, n=2, seed=3):
    """n micro-batches of (input, output gradient), drawn on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(16, IN, generator=g).to(device, torch.bfloat16),
            torch.randn(16, out_features, generator=g).to(device, torch.bfloat16),
        )
        for _ in range(n)
    ]


def out_features(kind: str) -> int:
    return IN if kind == "LayerNormMLP" else OUT


@pytest.mark.parametrize("mode", FP8_MODES[:2])
@pytest.mark.parametrize("kind", LAYERS)
def test_the_stand_in_is_not_copied(kind, mode, device):
    layer = make_layer(kind, device)
    attach_main_grad(layer)
    weights = gemm_weights(layer)
    ((x, _),) = inputs(device, out_features(kind), n=1)
    with mode_autocast(mode):
        y = layer(x)
    log = OpLog()
    with log:
        y.float().square().sum().backward()
    shapes = {tuple(w.shape) for w in weights}
    # AccumulateGrad's copy of a gradient it cannot take: new_empty_strided, then copy_ (the
    # layers' own GEMMs copy with clone / _to_copy).
    copies = [
        op for op in log.ops if op[0] in ("copy_", "new_empty_strided") and op[1][0] in shapes
    ]
    assert not copies, copies
    for w in weights:
        assert w.grad is not None and w.grad.shape == w.shape
        assert w.grad_added_to_main_grad
        assert torch.count_nonzero(w.main_grad) > 0


@pytest.mark.parametrize("kind", LAYERS)
def test_zeroed_stand_in_over_micro_batches(kind, device):
    """zero_out_wgrad: `.grad` is zeros after two micro-batches (the second stand-in added into
    the first), and main_grad is the sum of the two micro-batches' gradients, each added once:
    the main_grads of the two micro-batches run alone, added in FP32 (FP8 off; the GEMM adds its
    FP32 product into main_grad with one rounding, as the sum does: bit for bit)."""
    layer = make_layer(kind, device)
    attach_main_grad(layer)
    for w in gemm_weights(layer):
        w.zero_out_wgrad = True
    data = inputs(device, out_features(kind))
    alone = []
    for x, dy in data:  # each micro-batch alone, main_grad zeroed between
        for w in gemm_weights(layer):
            w.main_grad.zero_()
            w.grad = None
        layer(x).backward(dy)
        alone.append([w.main_grad.clone() for w in gemm_weights(layer)])
    for w in gemm_weights(layer):
        w.main_grad.zero_()
        w.grad = None
    for x, dy in data:  # both, `.grad` kept between
        layer(x).backward(dy)
    for i, w in enumerate(gemm_weights(layer)):
        assert torch.equal(w.grad, torch.zeros_like(w)), i
        want = alone[0][i] + alone[1][i]
        assert torch.equal(w.main_grad, want), i
