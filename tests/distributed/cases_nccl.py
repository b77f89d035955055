"""The native NCCL communicator's own cases (harness.py's registry), on the "nccl_native" run:
one GPU per rank (>= 2 GPUs) on a gloo group (the NCCL unique id travels as a CPU tensor), every
fp8dp collective on fp8dp's own ncclComm_t."""

import copy
import time

import torch
import torch.distributed as dist
from _models import mlp
from cases_ddp import (
    FP32_CUDA,
    cfg,
    check_main_grads,
    data,
    iteration,
    micro,
    mse,
    reference_grads,
)
from harness import case

import fp8dp

NATIVE = ("nccl_native",)

# GPU FP32 GEMMs sum the batch in another order than the single-process reference (and without TF32,
# disabled by worker.py, each product is exact to 2^-24 relative): cases_ddp's CPU bound, widened 4x
# for the GEMM's own reordering within a micro-batch.
FP32 = FP32_CUDA
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dev():
    return torch.device("cuda", torch.cuda.current_device())


@case(runs=NATIVE, dtype=list(DTYPES), op=["SUM", "AVG"])
def collectives_exact(rank, ws, dtype, op):
    """all_reduce / reduce_scatter (in place) / all_gather (in place) on 2^24 elements. Values are
    small integers times (rank + 1): every sum and every average (k * (ws+1)/2 with ws = 2) is
    exact in float16 and bfloat16, so results must match exactly. The buffer is written on the
    compute stream just before each call: without the start event the comm stream would read stale
    data."""
    comm = fp8dp._C.make_communicator("nccl", dist.group.WORLD, True)
    assert comm.name == "nccl" and comm.rank == rank and comm.size == ws
    t = DTYPES[dtype]
    n = (1 << 24) // ws * ws
    pattern = (torch.arange(n, device=dev()) % 8).to(t)
    total = pattern * (ws * (ws + 1) / 2)
    want = total / ws if op == "AVG" else total
    op = getattr(fp8dp._C.ReduceOp, op)
    buf = torch.empty(n, dtype=t, device=dev())
    buf.copy_(pattern * (rank + 1))
    comm.all_reduce([buf], op).wait()
    assert torch.equal(buf, want), "all_reduce"
    buf.copy_(pattern * (rank + 1))
    m = n // ws
    chunk = buf[rank * m : (rank + 1) * m]
    comm.reduce_scatter([buf], [chunk], op).wait()
    assert torch.equal(chunk, want[rank * m : (rank + 1) * m]), "reduce_scatter in place"
    out = torch.zeros(n, dtype=t, device=dev())
    out[rank * m : (rank + 1) * m] = pattern[rank * m : (rank + 1) * m]
    comm.all_gather([out[rank * m : (rank + 1) * m]], [out]).wait()
    assert torch.equal(out, pattern), "all_gather in place"
    # Two buffers in one group (one ncclGroupStart/End), int64 bookkeeping included.
    a = torch.full((5,), rank + 1, dtype=torch.int64, device=dev())
    b = torch.full((3,), float(rank + 1), dtype=t, device=dev())
    comm.all_reduce([a, b], fp8dp._C.ReduceOp.SUM).wait()
    assert a.tolist() == [ws * (ws + 1) // 2] * 5 and b.tolist() == [ws * (ws + 1) / 2] * 3


@case(runs=NATIVE, overlap=[False, True], dist_opt=[False, True], avg=[False, True])
def native_grads_match_reference(rank, ws, overlap, dist_opt, avg):
    """main_grad (all-reduce) or each rank's owned chunk (reduce-scatter) equals the gradient of a
    single-process FP32 model on the global batch, with fp8dp's NCCL communicator."""
    n_mb = 2
    model = mlp().to(dev())
    ref = copy.deepcopy(model)
    ddp = fp8dp.DistributedDataParallel(
        model,
        cfg(
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=dist_opt,
            average_in_collective=avg,
            bucket_size=150,
            comm_backend="nccl",
        ),
    )
    assert ddp._sync.communicator().name == "nccl"
    for step in range(2):  # step 0 learns the golden counts, step 1 launches from the hooks
        x, y = (t.to(dev()) for t in data(step, ws, n_mb))
        iteration(ddp, x, y, rank, n_mb)
        assert check_main_grads(ddp, reference_grads(ref, x, y), **FP32) > 0 or dist_opt


@case(runs=NATIVE)
def auto_picks_nccl_and_optimizer_stays_in_sync(rank, ws):
    """comm_backend='auto' on CUDA parameters picks the native communicator; 3 DistributedOptimizer
    (AdamW) steps (reduce-scatter, shard step, all-gather) leave bit-identical parameters on every
    rank."""
    ddp = fp8dp.DistributedDataParallel(
        mlp().to(dev()),
        cfg(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=150),
    )
    assert ddp._sync.communicator().name == "nccl"
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=1e-2)
    for step in range(3):
        x, y = (t.to(dev()) for t in data(step, ws, 1))
        iteration(ddp, x, y, rank, 1)
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in ddp.module.parameters()])
    gathered = [torch.empty_like(flat.cpu()) for _ in range(ws)]
    dist.all_gather(gathered, flat.cpu())
    for g in gathered[1:]:
        assert torch.equal(g, gathered[0])


@case(runs=NATIVE, skipper=[1], blocking=[True, False])
def skipped_collective_times_out(rank, ws, skipper, blocking):
    """One rank skips the gradient all-reduce: the others get an fp8dp error naming the collective
    within the (2 s) timeout instead of hanging, their communicator is aborted, and later calls say
    so. blocking=True (nccl_blocking_wait): finish_grad_sync() itself raises. blocking=False (the
    default, stream-ordered): finish_grad_sync() returns at once, the watchdog aborts the stuck
    all-reduce after 2 s, which releases the compute stream (so a host sync returns instead of
    hanging), and the next collective raises with the reason."""
    # Overlap off: the all-reduce is launched by finish_grad_sync(), which the skipper never calls.
    ddp = fp8dp.DistributedDataParallel(
        mlp().to(dev()),
        cfg(comm_backend="nccl", overlap_grad_reduce=False, nccl_blocking_wait=blocking),
    )
    comm = ddp._sync.communicator()
    assert comm.blocking_wait == blocking
    x, y = (t.to(dev()) for t in data(0, ws, 1))
    iteration(ddp, x, y, rank, 1)  # a healthy step first
    comm.set_timeout(2.0)
    ddp.zero_grad_buffer()
    mse(ddp(micro(x, rank, 0, 1)), micro(y, rank, 0, 1)).backward()
    if rank != skipper:
        t0 = time.monotonic()
        if blocking:
            try:
                ddp.finish_grad_sync()
            except RuntimeError as e:
                msg = str(e)
                assert "nccl all_reduce" in msg and "did not finish within 2000 ms" in msg, msg
            else:
                raise AssertionError("a rank that skipped the collective went unnoticed")
        else:
            ddp.finish_grad_sync()
            assert time.monotonic() - t0 < 1.0, "a stream-ordered wait blocked the host"
            torch.cuda.synchronize()  # returns once the watchdog aborted the stuck all-reduce
        elapsed = time.monotonic() - t0
        assert 2.0 <= elapsed < 15.0, elapsed
        try:
            comm.all_reduce([torch.zeros(4, device=dev())], fp8dp._C.ReduceOp.SUM).wait()
        except RuntimeError as e:
            msg = str(e)
            assert "aborted" in msg and "did not finish within 2000 ms" in msg, msg
        else:
            raise AssertionError("an aborted communicator accepted a collective")
    dist.barrier()  # gloo: independent of the aborted NCCL communicator


@case(runs=NATIVE)
def overlap_param_gather_on_nccl(rank, ws):
    """overlap_param_gather with the native communicator: the last rank joins each step's
    parameter all-gather 0.3 s late, so the other ranks' next forward must wait for it on the
    device (forward pre-hooks, stream-ordered); 3 steps give exactly the losses and parameters
    of the non-overlapped twin."""
    models = []
    for opg in (True, False):
        model = mlp().to(dev())
        ddp = fp8dp.DistributedDataParallel(
            model,
            cfg(
                use_distributed_optimizer=True,
                overlap_grad_reduce=True,
                bucket_size=150,
                comm_backend="nccl",
                overlap_param_gather=opg,
            ),
        )
        models.append((model, ddp, fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=1e-2)))
    (model, ddp, opt), (ref_model, ref_ddp, ref_opt) = models
    assert ddp._sync.num_bucket_groups > 1
    for step in range(3):
        x, y = (t.to(dev()) for t in data(step, ws, 1))
        losses = []
        for d, o in ((ddp, opt), (ref_ddp, ref_opt)):
            o.zero_grad()
            loss = mse(d(micro(x, rank, 0, 1)), micro(y, rank, 0, 1))
            loss.backward()
            losses.append(loss.item())
            if d is ddp and rank == ws - 1:
                time.sleep(0.3)
            o.step()
        assert ddp._sync.param_sync_pending
        assert losses[0] == losses[1], (step, losses)
    opt.finish_param_sync()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
