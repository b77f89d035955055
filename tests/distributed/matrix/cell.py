"""One cell of the distributed test matrix, run on every rank of a torchrun job.

The model: two layers of the cell's module type (hidden -> hidden, GELU between), wrapped in
fp8dp.DistributedDataParallel with the cell's options. Each step runs ``micro_batches``
micro-batches under ``no_sync()`` (backward, then ``backward_dw()`` on every module when
delay_wgrad_compute is on), ``finish_grad_sync()`` and an SGD step.

The reference: a second copy of the same model built with delay_wgrad_compute and
fuse_wgrad_accumulation off and no DDP - plain autograd into ``.grad`` - which at the start of
every step loads the DDP model's state dict (weights and FP8 scaling state), so both make
bit-identical FP8 casts, and runs the same micro-batches on the same rank. Its per-micro-batch
gradients are summed in FP64 over micro-batches and, with one plain FP64 all-reduce, over ranks
(for world size 1 it is simply a single-process reference). Two checks per step:

1. exactly-once accumulation: ``main_grad`` after ``finish_grad_sync()`` equals the reference sum
   divided by the world size where this rank holds reduced values (everywhere after an all-reduce;
   with the distributed optimizer, the rank's own chunk of every bucket);
2. trained parameters: after the optimizer step every parameter equals ``p - lr * g_ref``.

Tolerances come from the numerics of the gradient's dtype T (unit roundoff u: 2^-24 for FP32,
2^-8 for BF16). Every element of main_grad goes through at most n = 2M + W + 4 roundings in T
(M micro-batches, W ranks: the per-micro-batch result, the accumulation, the collective's
additions, the scaling), each at most u times the sum A = sum |g_(rank, micro-batch)| / W; FP32
GEMMs that sum the K = 32 tokens in a different order differ by at most K*sqrt(K) < 256 FP32
roundoffs of A for random data. Per element: |main_grad - ref| <= (n u + 256 * 2^-24) A. As a
whole (rounding errors are unbiased, rms u * sqrt(n / 12) each): ||main_grad - ref||_2 <=
(u sqrt(n) + 256 * 2^-24) ||A||_2. A micro-batch counted twice or not at all moves an element by
|g_(r,m)| / W, on average A / (M W) - above both bounds for every cell of the matrix (M W <= 24,
u sqrt(n) <= 2^-8 * sqrt(22) < 1/24).
A cell with a low-precision grad_reduce_wire adds the wire's own rounding to both bounds
(_wire_bound: u_wire A per rounding on the wire, plus the FP8 subnormal floor); the fault
injection runs on the FP32 wire, whose bound the argument above is about.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8dp

_U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
_GEMM_ORDER = 256 * 2.0**-24
# grad_reduce_wire -> (relative rounding, half a subnormal step in units of scale_inv, format max).
_WIRE = {
    "bf16": (2.0**-8, 0.0, math.inf),
    "fp8_e4m3": (2.0**-4, 2.0**-10, 448.0),
    "fp8_e5m2": (2.0**-3, 2.0**-17, 57344.0),
}


def _wire_bound(wire: str, a: torch.Tensor, a_max: float, world: int, all_reduce: bool):
    """The extra error a low-precision wire may add to an element whose A (see the module
    docstring) is `a`; a_max: the largest A of the model (a chunk spans parameters). Each rank's
    contribution a_r (|a_r| <= A elementwise, sum_r |a_r| <= A) is rounded once (relative u, plus
    half a subnormal step times its chunk's scale_inv < 2 amax / fp8_max), an all-reduced sum once
    more (the all-gather); 5% covers the FP32 additions and the local gradients' own rounding."""
    if wire == "fp32" or world == 1:
        return torch.zeros_like(a)
    u, half_sub, fmax = _WIRE[wire]
    times = 2 if all_reduce else 1
    floor = half_sub * 2 * a_max / fmax * (world + times - 1)
    return 1.05 * (times * u * a + floor)


@dataclass
class Problem:
    hidden: int = 32
    seq: int = 16
    micro_batch: int = 2
    micro_batches: int = 3
    steps: int = 3
    lr: float = 0.5
    bucket_size: int = 700
    seed: int = 7


class TwoLayer(torch.nn.Module):
    def __init__(self, cls, hidden: int, **kw):
        super().__init__()
        self.l1 = cls(hidden, hidden, **kw)
        self.l2 = cls(hidden, hidden, **kw)

    def forward(self, x, is_first_microbatch=None):
        h = F.gelu(self.l1(x, is_first_microbatch=is_first_microbatch))
        return self.l2(h, is_first_microbatch=is_first_microbatch)


def _recipe(name: str):
    if name == "delayed":
        return fp8dp.DelayedScaling(amax_history_len=4)
    if name == "current":
        return fp8dp.Float8CurrentScaling()
    return None


def _build(cell: dict, prob: Problem, device, dtype, delay: bool, fuse: bool) -> TwoLayer:
    torch.manual_seed(prob.seed)  # same weights on every rank and in both copies
    cls = {"Linear": fp8dp.Linear, "LayerNormLinear": fp8dp.LayerNormLinear}[cell["module"]]
    return TwoLayer(
        cls,
        prob.hidden,
        bias=cell["bias"],
        params_dtype=dtype,
        device=device,
        delay_wgrad_compute=delay,
        fuse_wgrad_accumulation=fuse,
    )


def _batch(prob: Problem, step: int, rank: int, micro: int, device, dtype):
    g = torch.Generator().manual_seed(prob.seed * 1_000_003 + step * 10_007 + rank * 101 + micro)
    x = torch.randn(prob.seq, prob.micro_batch, prob.hidden, generator=g)
    w = torch.randn(prob.seq, prob.micro_batch, prob.hidden, generator=g) / prob.seq
    return x.to(device=device, dtype=dtype), w.to(device)


def _loss(y, w):
    return (y.float() * w).sum()


class _ExternalConsumer:
    """Moves every parameter's .grad into main_grad in a post-accumulate hook, ignoring
    skip_backward_post_hook (it does honour grad_added_to_main_grad: C2 b's dummy is not a
    gradient). fp8dp's DDP must still count each gradient once (C2, C4)."""

    def __init__(self, params):
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    @staticmethod
    def _hook(p):
        if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
            p.main_grad.add_(p.grad)
        p.grad = None

    def remove(self):
        for h in self.handles:
            h.remove()


def _compare(
    got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, u: float, n: int, wire=0.0
):
    """(elementwise ratio, aggregate ratio): error / bound, both must be <= 1. wire: the extra
    elementwise bound of a low-precision gradient wire (_wire_bound)."""
    diff = (got.double() - want).abs()
    wire = torch.as_tensor(wire, dtype=torch.float64, device=diff.device).expand_as(diff)
    elem = (n * u + _GEMM_ORDER) * scale + wire + 1e-30
    agg = (u * math.sqrt(n) + _GEMM_ORDER) * scale.norm() + wire.norm() + 1e-30
    return (diff / elem).max().item(), (diff.norm() / agg).item()


def run_cell(cell: dict, prob: Problem, device, inject: str = "") -> dict:
    """Run one cell on this rank; returns {"ok", "grad_ratio", "param_ratio", "checks", "error"}.
    Every rank reaches the same collectives whatever the numbers are.

    inject: a fault for the matrix's own tests, on the last rank, second micro-batch of every step:
    "double" runs that micro-batch's forward/backward twice on the DDP model (counted twice),
    "skip" leaves it out of the DDP model (counted never). The checks must then fail."""
    if inject not in ("", "double", "skip"):
        raise ValueError(f"inject: expected '', 'double' or 'skip', got {inject!r}")
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.float32 if cell["grad_dtype"] == "fp32" else torch.bfloat16
    u = _U[dtype]
    delay, fuse = cell["delay_wgrad_compute"], cell["fuse_wgrad_accumulation"]
    model = _build(cell, prob, device, dtype, delay, fuse)
    ref = _build(cell, prob, device, dtype, False, False)
    cfg = fp8dp.DistributedDataParallelConfig(
        grad_reduce_in_fp32=(dtype == torch.float32),
        overlap_grad_reduce=cell["overlap_grad_reduce"],
        use_distributed_optimizer=cell["use_distributed_optimizer"],
        bucket_size=prob.bucket_size,
        delay_wgrad_compute=delay,
        grad_reduce_wire=cell.get("grad_reduce_wire", "fp32"),
    )
    wire = cfg.grad_reduce_wire
    params = dict(model.named_parameters())
    # Registered before DDP wraps the model, so on every parameter it runs before DDP's own hook:
    # the harder case, DDP finds .grad already moved.
    consumer = _ExternalConsumer(params.values()) if cell["consumer"] == "external" else None
    ddp = fp8dp.DistributedDataParallel(model, cfg)
    opt = make_optimizer(ddp, model, cfg, prob.lr)
    recipe = _recipe(cell["recipe"])
    modules = [model.l2, model.l1]  # backward_dw in reverse layer order
    n = 2 * prob.micro_batches + world + 4
    worst_grad = worst_param = 0.0
    checks = 0
    for step in range(prob.steps):
        ref.load_state_dict(model.state_dict())  # same weights and FP8 state as the DDP model
        ddp.zero_grad_buffer()
        g_sum = {
            k: torch.zeros(p.shape, dtype=torch.float64, device=device) for k, p in params.items()
        }
        g_abs = {k: torch.zeros_like(v) for k, v in g_sum.items()}
        for m in range(prob.micro_batches):
            x, w = _batch(prob, step, rank, m, device, dtype)
            first = m == 0
            sync = ddp.no_sync() if m < prob.micro_batches - 1 else contextlib.nullcontext()
            repeats = 1
            if inject and m == 1 and rank == world - 1:
                repeats = 2 if inject == "double" else 0
            with sync:
                for _ in range(repeats):
                    with fp8dp.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                        y = ddp(x, is_first_microbatch=first)
                    _loss(y, w).backward()
                    if delay:
                        for mod in modules:
                            mod.backward_dw()
            with fp8dp.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                yr = ref(x, is_first_microbatch=first)
            _loss(yr, w).backward()
            for k, p in ref.named_parameters():
                g = p.grad.double()
                g_sum[k] += g
                g_abs[k] += g.abs()
                p.grad = None
        ddp.finish_grad_sync()
        flat = torch.cat([t.flatten() for k in params for t in (g_sum[k], g_abs[k])])
        dist.all_reduce(flat)  # FP64: the exact-enough global sum the DDP result is held to
        off = 0
        for k, p in params.items():
            numel = p.numel()
            g_sum[k] = flat[off : off + numel].view(p.shape) / world
            g_abs[k] = flat[off + numel : off + 2 * numel].view(p.shape) / world
            off += 2 * numel
        a_max = max(float(a.max()) for a in g_abs.values())
        dist_opt = cell["use_distributed_optimizer"]
        w_bound = {k: _wire_bound(wire, g_abs[k], a_max, world, not dist_opt) for k in params}
        if not cell["use_distributed_optimizer"]:
            for k, p in params.items():  # all-reduced: every element on every rank
                e, a = _compare(p.main_grad, g_sum[k], g_abs[k], u, n, w_bound[k])
                worst_grad = max(worst_grad, e, a)
                checks += 1
        else:  # reduce-scattered: this rank's chunk of every bucket, as the optimizer reads it
            names = list(params)
            for shard in ddp._sync.owned_shards():
                k = names[shard.param]
                sl = slice(shard.param_offset, shard.param_offset + shard.numel)
                e, a = _compare(
                    ddp._sync.grad_shard(shard),
                    g_sum[k].flatten()[sl],
                    g_abs[k].flatten()[sl],
                    u,
                    n,
                    w_bound[k].flatten()[sl],
                )
                worst_grad = max(worst_grad, e, a)
                checks += 1
        before = {k: p.detach().double().clone() for k, p in params.items()}
        opt.step()
        u_p = _U[dtype]
        for k, p in params.items():
            want = before[k] - prob.lr * g_sum[k]
            # the update inherits the gradient's bound times lr, plus the parameter's own rounding
            scale = prob.lr * g_abs[k] + (u_p / (n * u + _GEMM_ORDER)) * (
                want.abs() + before[k].abs()
            )
            e, a = _compare(p.detach(), want, scale, u, n, prob.lr * w_bound[k])
            worst_param = max(worst_param, e, a)
            checks += 1
    if consumer:
        consumer.remove()
    return {
        "ok": worst_grad <= 1.0 and worst_param <= 1.0,
        "grad_ratio": worst_grad,
        "param_ratio": worst_param,
        "checks": checks,
    }


class _PlainSGD:
    """Without the distributed optimizer: every rank holds the all-reduced main_grad and steps
    all parameters itself (p -= lr * main_grad), then updates the FP8 scales once."""

    def __init__(self, params, lr):
        self.params, self.lr = list(params), lr

    @torch.no_grad()
    def step(self):
        for p in self.params:
            p.sub_(p.main_grad.to(p.dtype), alpha=self.lr)
        fp8dp.update_fp8_scales()


def make_optimizer(ddp, model, cfg, lr):
    if cfg.use_distributed_optimizer:
        return fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=lr)
    return _PlainSGD(model.parameters(), lr)
