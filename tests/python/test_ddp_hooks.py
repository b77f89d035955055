"""DistributedDataParallel's autograd hook runs in C++ (ParamHooks) for the parameters that only
fp8dp and torch modules register, and in Python for those another module registers (it may mark
p.grad as a stand-in: grad_added_to_main_grad, Megatron's protocol, which only Python can read).
Both give the same main_grad, bit for bit; the C++ hooks go with their DDP."""

import pytest
import torch

import fp8dp
import fp8dp.ddp as ddp_mod


class Fused(torch.nn.Module):
    """A module outside fp8dp that fuses its weight gradient into main_grad itself and leaves a
    stand-in in p.grad (what Megatron's linear layers do)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return _FusedMatmul.apply(x, self.weight)


class _FusedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        w.main_grad.add_(g.t() @ x)
        w.grad_added_to_main_grad = True
        return g @ w, torch.zeros_like(w)  # the stand-in: must not be added again


def build(seed: int):
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(11, 16)
    lin = fp8dp.Linear(16, 16, bias=True)
    head = torch.nn.Linear(16, 11, bias=False)
    head.weight = emb.weight  # tied: torch-defined modules only -> C++ hook
    fused = Fused(torch.nn.Parameter(torch.randn(16, 16) * 0.1))
    model = torch.nn.ModuleDict(dict(emb=emb, lin=lin, head=head, fused=fused))
    return model


def step(model, ddp, seed: int):
    torch.manual_seed(seed + 1)
    tokens = torch.randint(0, 11, (8,))
    for _ in range(2):  # two micro-batches: every hook accumulates
        h = model["emb"](tokens)
        h = model["lin"](h).relu()
        h = model["fused"](h)
        loss = torch.nn.functional.cross_entropy(model["head"](h), tokens)
        loss.backward()
    ddp.finish_grad_sync()
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpp_and_python_hooks_give_the_same_main_grad(group, seed, monkeypatch):
    print(f"seed={seed}")
    grads = {}
    for python_hooks in (False, True):
        monkeypatch.setattr(ddp_mod, "_PYTHON_HOOKS", python_hooks)
        model = build(seed)
        ddp = fp8dp.DistributedDataParallel(model, process_group=group)
        native = {n for n, p in model.named_parameters() if p._post_accumulate_grad_hooks is None}
        if python_hooks:
            assert native == set()
        else:
            # fused.weight is registered by a module outside fp8dp and torch: Python hook.
            assert native == {"emb.weight", "lin.weight", "lin.bias"}
            assert len(ddp._param_hooks) == 3
        grads[python_hooks] = step(model, ddp, seed)
        assert all(p.grad is None for p in model.parameters())
        del ddp
    for name in grads[False]:
        # Same additions in the same order: bit for bit.
        assert torch.equal(grads[False][name], grads[True][name]), name
    # The stand-in of the fused module was not added: its main_grad is exactly what it fused.
    assert grads[False]["fused.weight"].abs().sum() > 0


def test_cpp_hooks_are_removed_with_their_ddp(group):
    model = torch.nn.Sequential(fp8dp.Linear(8, 8), torch.nn.Linear(8, 8))
    ddp = fp8dp.DistributedDataParallel(model, process_group=group)
    ddp(torch.randn(4, 8)).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # the hooks moved them to main_grad
    del ddp
    model(torch.randn(4, 8)).sum().backward()
    # No hook left: autograd keeps the gradients in p.grad, nothing touches the freed buffers.
    assert all(p.grad is not None for p in model.parameters())


def test_param_hooks_reject_a_parameter_it_does_not_know(group):
    model = torch.nn.Linear(4, 4)
    ddp = fp8dp.DistributedDataParallel(model, process_group=group)
    with pytest.raises(ValueError, match=r"params\[0\]: expected the parameter GradSync knows"):
        fp8dp._C.ParamHooks(ddp._sync, [0], [torch.nn.Parameter(torch.zeros(4, 4))])
