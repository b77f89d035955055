"""C11 cases that need ranks (harness.py's registry; gloo at world sizes 2 and 3): the iteration's
phases where a misordered call used to give a silently wrong result only with a real collective in
flight. The single-process refusals are in tests/python/test_ddp_phases.py.

Mechanism removed (tried 2026-12-03: these cases, with only the phase assertion dropped, run
against the tree before C11, whose GradSync has neither wait; 2 gloo ranks):
- scale_in_flight: all 6 cases fail on both ranks, the plain all-reduce on gloo included
  ("AssertionError: 0.weight", or the owned shard's parameter index with the distributed
  optimizer): the factor applied while the collective was in flight is lost.
- forward_waits_for_the_gather: fails on both ranks ("Tensor-likes are not close"): the forward
  computed with the parameters before the +1 update.
- refusals_agree_on_every_rank: not run against that tree (it has no refusal to find); the
  single-process versions in tests/python/test_ddp_phases.py cover the removed check.
"""

import contextlib
import copy
import time

import torch
from cases_ddp import (
    FP32,
    cfg,
    check_main_grads,
    data,
    iteration,
    micro,
    mlp,
    mse,
    reference_grads,
)
from harness import case

import fp8dp

F = 0.25  # a power of two: scaling before or after a reduction rounds the same way


@case(wire=["fp32", "bf16", "fp8_e5m2"], dist_opt=[False, True])
def scale_in_flight(rank, ws, wire, dist_opt):
    """Case 3: scale_gradients() between the last backward (overlap: every bucket launched) and
    finish_grad_sync() equals scaling after the finish, bit for bit, whatever the wire or
    collective; with the FP32 buffer wire also F x the FP32 reference."""
    n_mb = 2
    x, y = data(0, ws, n_mb)
    ddps = []
    for when in ("in_flight", "after"):
        model = mlp()
        ddp = fp8dp.DistributedDataParallel(
            model,
            cfg(
                overlap_grad_reduce=True,
                use_distributed_optimizer=dist_opt,
                bucket_size=150,
                grad_reduce_wire=wire,
            ),
        )
        iteration(ddp, x, y, rank, n_mb)  # learns the readiness counts
        ddp.zero_grad_buffer()
        for k in range(n_mb):
            with ddp.no_sync() if k < n_mb - 1 else contextlib.nullcontext():
                (mse(ddp(micro(x, rank, k, n_mb)), micro(y, rank, k, n_mb)) / n_mb).backward()
        assert ddp.phase == "sync_started", ddp.phase
        if when == "in_flight":
            ddp.scale_gradients(F)
        ddp.finish_grad_sync()
        if when == "after":
            ddp.scale_gradients(F)
        ddps.append(ddp)
    a, b = ddps
    if dist_opt:
        for s in a._sync.owned_shards():
            assert torch.equal(a._sync.grad_shard(s), b._sync.grad_shard(s)), s.param
    else:
        for name, p, q in zip(a._names, a._params, b._params):
            assert torch.equal(p.main_grad, q.main_grad), name
    if wire == "fp32":
        ref = [F * g for g in reference_grads(copy.deepcopy(mlp()), x, y)]
        check_main_grads(a, ref, **FP32)


@case(n_mb=[1])
def forward_waits_for_the_gather(rank, ws, n_mb):
    """Case 4: copy_shards(); start_param_sync(); forward with overlap_param_gather=False. The last
    rank joins the all-gather 0.5 s late, so elsewhere it is certainly in flight at the forward,
    which must wait and compute with the gathered parameters (every element + 1), against a
    float64 model holding them."""
    model = mlp()
    ddp = fp8dp.DistributedDataParallel(
        model, cfg(overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=150)
    )
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        for p in ref.parameters():
            p += 1.0
    x, _ = data(0, ws, n_mb)
    xin = micro(x, rank, 0, n_mb)
    for _ in range(3):
        masters = [ddp.param_shard(s).float() + 1.0 for s in ddp.owned_shards()]
        ddp.copy_shards(masters)
        if rank == ws - 1:
            time.sleep(0.5)
        ddp.start_param_sync()
        with torch.no_grad():
            out = ddp(xin)
        torch.testing.assert_close(out.double(), ref(xin.double()), **FP32)
        assert not ddp._sync.param_sync_pending
        with torch.no_grad():
            for p in ref.parameters():
                p += 1.0


@case(kind=["no_sync_first", "forgotten_zero"])
def refusals_agree_on_every_rank(rank, ws, kind):
    """Cases 1 and 7 on real ranks: the misordered call is refused on every rank alike (no rank
    left waiting in a collective), and the next iteration in the right order matches the FP32
    reference."""
    n_mb = 2
    model = mlp()
    ddp = fp8dp.DistributedDataParallel(
        model,
        cfg(
            overlap_grad_reduce=True,
            use_distributed_optimizer=kind == "forgotten_zero",
            bucket_size=150,
        ),
    )
    opt = (
        fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.1)
        if kind == "forgotten_zero"
        else None
    )
    x, y = data(0, ws, n_mb)
    iteration(ddp, x, y, rank, n_mb)
    if opt is not None:
        opt.step()
    else:
        ddp.zero_grad_buffer()
        # no_sync() around every micro-batch but the FIRST: the first launches every bucket.
        mse(ddp(micro(x, rank, 0, n_mb)), micro(y, rank, 0, n_mb)).backward()
    refused = None
    try:
        with ddp.no_sync() if opt is None else contextlib.nullcontext():
            ddp(micro(x, rank, 1, n_mb))
    except RuntimeError as e:
        refused = str(e)
    assert refused is not None, "the misordered forward was accepted"
    want = "phase 'stepped'" if opt else "forward with grad enabled in phase 'sync_started'"
    assert want in refused, refused
    if opt is not None:
        opt.zero_grad()
    ref = copy.deepcopy(model)  # the parameters the next iteration runs at (stepped or not)
    iteration(ddp, x, y, rank, n_mb)
    check_main_grads(ddp, reference_grads(ref, x, y), **FP32)
