"""What the demo model's training step spends outside fp8dp's kernels (the 342M step profile,
BENCHMARKS.md): the attention's q/k/v split and the optimizer.

- model.split_qkv gives the same q, k, v and the same qkv gradient as the permute-first split it
  replaced, bit for bit, and its backward writes that gradient with one stack and no other copy.
  Mutation (2026-12-05, restored): split_qkv as the permute-first split
  (`view(...).permute(2, 1, 3, 0, 4).unbind(0)`): test_split_qkv_backward_is_one_stack failed
  (ops stack, permute, clone, _unsafe_view).
- TrainSection.adamw_kwargs picks torch's fused AdamW on CUDA only, and a DistributedOptimizer
  around AdamW(fused=True) steps its masters exactly as that optimizer steps the same tensors.
- loop.clip_grad_norm, now one multi-tensor norm and one multi-tensor scale over the rank's
  shards, against float64. Mutation (2026-12-05, restored): `torch._foreach_mul_` removed (the
  norm computed, the gradients not scaled): [max_norm=0.001] failed. It reads nothing back to the
  host. Mutation (2026-12-05, restored): the coefficient computed from `norm.item()`:
  test_clip_grad_norm_does_not_wait_for_the_device failed.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fp8dp
from fp8dp.train.config import TrainSection
from fp8dp.train.model import split_qkv


class _Ops(TorchDispatchMode):
    """The aten ops that run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _reference_split(qkv, h):
    """q, k, v as [b, h, s, hd], by indexing the [s, b, 3, h, hd] view (copies)."""
    s, b, three_d = qkv.shape
    x = qkv.view(s, b, 3, h, three_d // 3 // h)
    return tuple(x[:, :, i].permute(1, 2, 0, 3).contiguous() for i in range(3))


@pytest.mark.parametrize("s,b,h,hd", [(8, 2, 2, 16), (5, 3, 4, 8), (16, 1, 1, 32)])
def test_split_qkv_matches_the_reference_and_its_gradient(s, b, h, hd):
    seed = s * 1000 + b * 100 + h
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(s, b, 3 * h * hd, generator=g, dtype=torch.float64)
    qkv = data.clone().requires_grad_()
    ref_in = data.clone().requires_grad_()
    out = F.scaled_dot_product_attention(*split_qkv(qkv, h), is_causal=True)
    ref = F.scaled_dot_product_attention(*_reference_split(ref_in, h), is_causal=True)
    # The same values reach the attention, so its output and gradients are identical.
    assert torch.equal(out, ref)
    dy = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(dy)
    ref.backward(dy)
    assert torch.equal(qkv.grad, ref_in.grad)
    assert qkv.grad.is_contiguous()


def test_split_qkv_backward_is_one_stack():
    qkv = torch.randn(8, 2, 3 * 32, requires_grad=True)
    q, k, v = split_qkv(qkv, 2)
    grads = tuple(torch.randn(t.shape) for t in (q, k, v))
    with _Ops() as rec:
        (dx,) = torch.autograd.grad((q, k, v), qkv, grads)
    copies = [op for op in rec.ops if op not in ("permute", "view", "unsqueeze", "detach")]
    assert copies == ["stack"], rec.ops
    assert dx.is_contiguous()


def test_adamw_kwargs_fused_only_on_cuda():
    t = TrainSection(lr=1e-3, beta1=0.8, beta2=0.9, weight_decay=0.05)
    base = dict(lr=1e-3, betas=(0.8, 0.9), weight_decay=0.05)
    assert t.adamw_kwargs(torch.device("cpu")) == base
    assert t.adamw_kwargs("cuda") == {**base, "fused": True}
    assert t.adamw_kwargs(torch.device("cuda", 1)) == {**base, "fused": True}


def test_distributed_optimizer_steps_fused_adamw_exactly(group):
    """AdamW(fused=True) (torch has a CPU kernel too) through DistributedOptimizer: every master
    after two steps equals a plain AdamW(fused=True) stepping a copy of the same FP32 values on
    the same gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(fp8dp.Linear(16, 16), fp8dp.Linear(16, 8))
    cfg = fp8dp.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False
    )
    ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, **kw)
    mirror = [torch.nn.Parameter(m.detach().clone()) for m in opt._masters]
    ref = torch.optim.AdamW(mirror, **kw)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(16, 16)).square().sum().backward()
        ddp.finish_grad_sync()
        for p, s in zip(mirror, opt._shards):
            p.grad = ddp.grad_shard(s).detach().clone()
        opt.step()
        ref.step()
    assert opt.param_groups[0]["fused"] is True
    for m, p in zip(opt._masters, mirror):
        assert torch.equal(m, p)


def _reduced_ddp(group, seed: int):
    """A two-layer model under ZeRO-1 DDP after one backward and finish_grad_sync: each owned
    shard holds its reduced gradient, as clip_grad_norm finds them in a training step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(fp8dp.Linear(16, 32), fp8dp.Linear(32, 8))
    cfg = fp8dp.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False
    )
    ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
    ddp(torch.randn(16, 16)).square().sum().backward()
    ddp.finish_grad_sync()
    return ddp


@pytest.mark.parametrize("max_norm", [1e-3, 1e6])
def test_clip_grad_norm_against_float64(group, max_norm):
    """loop.clip_grad_norm (one multi-tensor norm over the rank's shards): the norm of all
    gradients against float64 within FP32 rounding of the per-shard norms (relative 1e-6, a few
    ulps of each norm), and the gradients scaled by max_norm / (norm + 1e-6) exactly as one FP32
    multiply each, or left bit for bit when the norm is below max_norm."""
    from fp8dp.train.loop import clip_grad_norm

    ddp = _reduced_ddp(group, seed=3)
    shards = ddp.owned_shards()
    before = [ddp.grad_shard(s).clone() for s in shards]
    ref = math.sqrt(sum(float(g.double().square().sum()) for g in before))
    norm = float(clip_grad_norm(ddp, max_norm, torch.device("cpu")))
    assert norm == pytest.approx(ref, rel=1e-6)
    coef = min(1.0, max_norm / (norm + 1e-6))
    for s, g in zip(shards, before):
        after = ddp.grad_shard(s)
        assert torch.equal(after, g * coef if coef < 1.0 else g)
    assert (coef < 1.0) == (max_norm < ref)


@pytest.mark.parametrize("max_norm", [1e-3, 1e6])
def test_clip_grad_norm_does_not_wait_for_the_device(group, max_norm):
    """clip_grad_norm reads no value back to the host (no aten._local_scalar_dense, which is what
    .item() / float() dispatch): on CUDA such a read makes the host wait for the backward and the
    reduction before it launches the optimizer, and the GPU idles (4 ms per 342M step)."""
    from fp8dp.train.loop import clip_grad_norm

    ddp = _reduced_ddp(group, seed=4)
    with _Ops() as seen:
        norm = clip_grad_norm(ddp, max_norm, torch.device("cpu"))
    assert "_foreach_norm" in seen.ops and "_foreach_mul_" in seen.ops
    assert "_local_scalar_dense" not in seen.ops
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float64
