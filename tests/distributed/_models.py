"""Test models for the DDP workers: a plain MLP and a test-only module that follows the delayed
weight-gradient protocol of contract C3 (queue in backward, compute in backward_dw(), then call the
registered hooks), with the guarded bias backfill of C4. It stands in for fp8dp.Linear until the
modules land, and exercises the same DDP routing."""

import torch
from torch import nn


def mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 20), nn.Tanh(), nn.Linear(20, 5)
    ).to(dtype)


class _DelayedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.save_for_backward(x, weight)
        ctx.module = module
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        ctx.module._queue.append((x, dy))  # the weight-gradient GEMM waits for backward_dw()
        # Bias gradient produced eagerly (as in FP8 mode, C4); no weight gradient to autograd.
        return dy @ weight, None, dy.sum(0), None


class DelayedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        ref = nn.Linear(in_features, out_features)
        self.weight = nn.Parameter(ref.weight.detach().clone())
        self.bias = nn.Parameter(ref.bias.detach().clone())
        for p in (self.weight, self.bias):
            p.skip_backward_post_hook = True
        self._queue = []
        self._hooks = []

    def forward(self, x):
        return _DelayedLinearFn.apply(x, self.weight, self.bias, self)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        self._hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return bool(self._queue)

    def backward_dw(self) -> None:
        if not self._queue:
            raise RuntimeError("DelayedLinear.backward_dw(): nothing queued")
        x, dy = self._queue.pop(0)
        wgrad = dy.t() @ x
        self.weight.grad = wgrad if self.weight.grad is None else self.weight.grad + wgrad
        # C4: the deferred GEMM returned no bias gradient (it was eager), so nothing to backfill.
        for hook in self._hooks:
            hook()


def delayed_mlp(seed: int = 0) -> nn.Module:
    """DelayedLinear(12, 24) -> Tanh -> nn.Linear(24, 5): delayed and plain routes in one model."""
    torch.manual_seed(seed)
    return nn.Sequential(DelayedLinear(12, 24), nn.Tanh(), nn.Linear(24, 5))


def plain_twin(model: nn.Module) -> nn.Module:
    """An nn.Linear-only copy of a (possibly delayed) model with the same weights: the reference."""
    layers = []
    for m in model:
        if isinstance(m, DelayedLinear):
            lin = nn.Linear(m.weight.shape[1], m.weight.shape[0])
            with torch.no_grad():
                lin.weight.copy_(m.weight)
                lin.bias.copy_(m.bias)
            layers.append(lin)
        elif isinstance(m, nn.Linear):
            lin = nn.Linear(m.in_features, m.out_features)
            with torch.no_grad():
                lin.weight.copy_(m.weight)
                lin.bias.copy_(m.bias)
            layers.append(lin)
        else:
            layers.append(m)
    return nn.Sequential(*layers)
