"""The low-precision gradient wires (grad_reduce_wire, C6 — collectives) on the harness's runs (gloo
at world sizes 2 and 3, where 3 leaves the last chunk of an all-reduced bucket padded; nccl on 2
GPUs): the communicator's all-to-all, main_grad (or the owned shard) against a float64 reference
within a bound derived from the wire format, bit-identical main_grad on every rank, a result that
differs from the FP32 wire (so a silently ignored option fails), random gradients over a wide range
with a printed seed, and NaN / Inf that arrive as non-finite values.

The bound, per element, for contributions a_i = g_i / dp (g_i: rank i's local gradient) and
T = sum_i |a_i| (wire.h has the rounding rules):
- each a_i is rounded once on the wire: relative u = 2^-8 (BF16: 8 significant bits), 2^-4 (E4M3),
  2^-3 (E5M2), plus, for FP8, half a subnormal step (2^-10 or 2^-17) times the chunk's scale_inv,
  which is < 2 amax / fp8_max for the chunk's amax (bounded here by rank i's amax over the model);
- the dp decoded values are added in FP32 (dp - 1 roundings of 2^-24, and the 1/dp pre-scale): a
  generous 2^-20 T covers them;
- without the distributed optimizer the sum is encoded once more for the all-gather: u |sum| plus
  the subnormal floor of the sum's scale;
- the local FP32 gradients themselves differ from the float64 reference by cases_ddp.FP32.

Mutations tried (2 ranks), each caught: the owner keeping its FP32 sum instead of the decoded
all-gathered one (wire_matches_float64_within_its_bound: "main_grad of rank 1 differs from rank
0's"); a non-finite chunk's scale_inv left finite (wire_keeps_nonfinite_gradients, E4M3: the Inf
arrived as 448; test_wire's NaN test too); the option ignored in GradSync ("the result equals
the FP32 wire's bit for bit").
"""

import copy
import os
import random
import time

import cases_ddp as D
import torch
import torch.distributed as dist
from harness import case
from torch import nn

import fp8dp

WIRES = ["bf16", "fp8_e4m3", "fp8_e5m2"]
# wire -> (relative rounding u, half subnormal step in units of scale_inv, format max)
ROUNDING = {
    "bf16": (2.0**-8, 0.0, float("inf")),
    "fp8_e4m3": (2.0**-4, 2.0**-10, 448.0),
    "fp8_e5m2": (2.0**-3, 2.0**-17, 57344.0),
}


def gather_rows(t):
    """[world size, *t.shape]: every rank's t (float64), on every rank."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def bounds(local, wire, all_reduce):
    """local: this rank's contributions a_i (float64, one tensor per parameter). Returns the exact
    sums and the bound of each parameter (float64), from every rank's contributions."""
    u, half_sub, fmax = ROUNDING[wire]
    ws = dist.get_world_size()
    amax = gather_rows(torch.stack([a.abs().max() for a in local]).max().reshape(1)).flatten()
    floor_in = half_sub * float((2 * amax * 1.01 / fmax).sum()) if half_sub else 0.0
    sums, bnds = [], []
    for a in local:
        rows = gather_rows(a)
        s, t = rows.sum(0), rows.abs().sum(0)
        b = u * t + floor_in + 2.0**-20 * t
        sums.append(s)
        bnds.append(b)
    if all_reduce:
        s_amax = max(float((s.abs() + b).max()) for s, b in zip(sums, bnds))
        floor_out = half_sub * 2 * s_amax * 1.01 / fmax if half_sub else 0.0
        bnds = [b + u * (s.abs() + b) + floor_out for s, b in zip(sums, bnds)]
    tol = D.FP32
    bnds = [b + tol["rtol"] * s.abs() + tol["atol"] * ws for s, b in zip(sums, bnds)]
    return sums, bnds


def reduced(ddp):
    """What the reduction produced on this rank: [(parameter index, flat values, flat slice)] for
    the whole main_grad (all-reduce) or the owned shards (distributed optimizer)."""
    sync = ddp._sync
    if ddp.config.use_distributed_optimizer:
        return [
            (s.param, sync.grad_shard(s), slice(s.param_offset, s.param_offset + s.numel))
            for s in sync.owned_shards()
        ]
    return [(i, p.main_grad.flatten(), slice(None)) for i, p in enumerate(ddp._params)]


def check_within(ddp, sums, bnds, what):
    worst = 0.0
    for i, got, sl in reduced(ddp):
        exp, b = sums[i].flatten()[sl], bnds[i].flatten()[sl]
        err = (got.double().cpu() - exp.cpu()).abs()
        bad = err > b.cpu()
        assert not bad.any(), (
            f"{what}: parameter {i}: {int(bad.sum())} element(s) outside the wire's bound, worst "
            f"excess {float((err - b.cpu()).max()):.3g} (error {float(err.max()):.3g})"
        )
        worst = max(worst, float((err / b.cpu().clamp_min(1e-300)).max()))
    return worst


def check_identical_on_all_ranks(ddp):
    flat = torch.cat([p.main_grad.flatten() for p in ddp._params]).double()
    rows = gather_rows(flat)
    for r in range(rows.shape[0]):
        assert torch.equal(rows[r], rows[0]), f"main_grad of rank {r} differs from rank 0's"


def local_contributions(model, x, y, rank, n_mb):
    """This rank's a_i = (gradient of its local loss) / dp, in float64, per parameter."""
    ref = copy.deepcopy(model).double()
    n = n_mb * D.B
    xs, ys = x[rank * n : (rank + 1) * n].double(), y[rank * n : (rank + 1) * n].double()
    return [g / dist.get_world_size() for g in D.reference_grads(ref, xs, ys)]


# ---------------------------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}


def all_to_all_exact(comm, rank, ws, dtype):
    """Chunk j of rank r's input arrives as chunk r of rank j's output, grouped (two buffers of
    different sizes and a float32 one in one call); uint8 carries FP8 bytes. Values r * 10 + j +
    k / 8 (k the position in the chunk) are exact in every dtype (uint8: integers only)."""
    ins, outs = [], []
    for m in (3, 40):
        k = torch.arange(m, dtype=torch.float32, device=D.DEV)
        frac = (k % 8) / 8 if dtype != torch.uint8 else k % 4
        ins.append(torch.cat([rank * 10 + j + frac for j in range(ws)]).to(dtype))
        outs.append(torch.empty(ws * m, dtype=dtype, device=D.DEV))
    ins.append(torch.arange(ws, dtype=torch.float32, device=D.DEV) + rank * 100)
    outs.append(torch.empty(ws, device=D.DEV))
    comm.all_to_all(ins, outs).wait()
    for m, out in zip((3, 40), outs):
        k = torch.arange(m, dtype=torch.float32, device=D.DEV)
        frac = (k % 8) / 8 if dtype != torch.uint8 else k % 4
        want = torch.cat([j * 10 + rank + frac for j in range(ws)]).to(dtype)
        assert torch.equal(out, want), (out, want)
    assert torch.equal(outs[2], torch.arange(ws, device=D.DEV) * 100.0 + rank)
    D.expect_error(
        ValueError,
        "all_to_all inputs[0]: expected a multiple of the world size",
        lambda: comm.all_to_all([ins[0][:-1]], [outs[0][:-1]]),
    )
    D.expect_error(
        ValueError,
        "all_to_all outputs[0]: expected a buffer apart from inputs[0]",
        lambda: comm.all_to_all([ins[0]], [ins[0]]),
    )


@case(dtype=list(DTYPES))
def communicator_all_to_all(rank, ws, dtype):
    """The ProcessGroupCommunicator's all-to-all (all_to_all_exact)."""
    comm = fp8dp._C.ProcessGroupCommunicator(dist.group.WORLD)
    all_to_all_exact(comm, rank, ws, DTYPES[dtype])


@case(runs=("nccl_native",), dtype=list(DTYPES))
def nccl_all_to_all(rank, ws, dtype):
    """The native NCCL communicator's all-to-all (grouped ncclSend / ncclRecv), as above."""
    comm = fp8dp._C.make_communicator("nccl", dist.group.WORLD, True)
    all_to_all_exact(comm, rank, ws, DTYPES[dtype])


@case(
    wire=WIRES,
    dist_opt=[False, True],
    overlap=[False, True],
    avg=[False, True],
    when=lambda wire, dist_opt, overlap, avg: not avg or (wire == "fp8_e4m3" and overlap),
)
def wire_matches_float64_within_its_bound(rank, ws, wire, dist_opt, overlap, avg):
    """main_grad (all-reduce) or the owned shards (distributed optimizer) against the float64 sum
    of every rank's contribution, within the bound of the module docstring, for two iterations
    (the second launches from the hooks with overlap); all-reduced main_grad bit-identical on every
    rank; and a result that differs from the FP32 wire's (same model, same data) in at least one
    element, within the same bound: a wire silently ignored (or one rounding nothing) fails
    here."""
    n_mb = 2
    model = D.mlp()
    fp32_model = copy.deepcopy(model)
    kw = dict(
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=dist_opt,
        average_in_collective=avg,
        bucket_size=150,
    )
    ddp = fp8dp.DistributedDataParallel(model, D.cfg(grad_reduce_wire=wire, **kw))
    fp32 = fp8dp.DistributedDataParallel(fp32_model, D.cfg(**kw))
    assert ddp._sync.num_bucket_groups > 1 if overlap else ddp._sync.num_bucket_groups == 1
    for step in range(2):
        x, y = D.data(step, ws, n_mb)
        D.iteration(ddp, x, y, rank, n_mb)
        D.iteration(fp32, x, y, rank, n_mb)
        sums, bnds = bounds(local_contributions(model, x, y, rank, n_mb), wire, not dist_opt)
        check_within(ddp, sums, bnds, f"{wire} step {step}")
        check_within(fp32, sums, bnds, f"FP32 wire step {step}")  # the reference itself fits
        differs = False
        for (i, got, _), (_, ref, _) in zip(reduced(ddp), reduced(fp32)):
            differs = differs or not torch.equal(got, ref)
        assert differs, f"{wire}: the result equals the FP32 wire's bit for bit: wire ignored?"
        if not dist_opt:
            check_identical_on_all_ranks(ddp)


@case(wire=WIRES, dist_opt=[False, True])
def wire_random_gradients(rank, ws, wire, dist_opt):
    """Random gradients straight into main_grad (loss = sum_p (p * c_p).sum(), so p's gradient is
    c_p): sizes 1 .. 300 (chunks that are empty, partial or padded), magnitudes 2^-24 .. 2^6 with
    both signs, one parameter all zero on every rank (amax 0), one whose values differ by 2^20
    between ranks. Seed printed, and taken from FP8DP_WIRE_SEED when set."""
    seed = torch.tensor([int(os.environ.get("FP8DP_WIRE_SEED", time.time_ns() % 2**31))])
    dist.broadcast(seed, 0)
    seed = int(seed)
    if rank == 0:
        print(f"[wire_random_gradients] wire={wire} dist_opt={dist_opt} seed={seed}", flush=True)
    rnd = random.Random(seed)
    sizes = [rnd.randint(1, 300) for _ in range(rnd.randint(3, 7))]
    params = nn.ParameterList([nn.Parameter(torch.zeros(n, device=D.DEV)) for n in sizes])
    g = torch.Generator().manual_seed(seed * 131 + rank)
    cs = []
    for k, n in enumerate(sizes):
        mag = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * 30 - 24)
        c = torch.where(torch.rand(n, generator=g) < 0.5, -mag, mag)
        if k == 0:
            c.zero_()
        if k == 1:
            c *= 2.0 ** (20 * (rank % 2))
        cs.append(c.float().to(D.DEV))

    class Sum(nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = params

        def forward(self):
            return sum((p * c).sum() for p, c in zip(self.ps, cs))

    cfg = D.cfg(grad_reduce_wire=wire, use_distributed_optimizer=dist_opt)
    ddp = fp8dp.DistributedDataParallel(Sum(), cfg)
    try:
        ddp.zero_grad_buffer()
        ddp().backward()
        ddp.finish_grad_sync()
        local = [c.double() / ws for c in cs]  # on the device: NCCL gathers CUDA tensors
        sums, bnds = bounds(local, wire, not dist_opt)
        check_within(ddp, sums, bnds, f"{wire} seed {seed}")
        for i, got, _ in reduced(ddp):
            if i == 0:
                assert torch.equal(got, torch.zeros_like(got)), "all-zero gradients became nonzero"
        if not dist_opt:
            check_identical_on_all_ranks(ddp)
    except AssertionError as e:
        raise AssertionError(f"{e} (rerun with FP8DP_WIRE_SEED={seed})") from e


@case(wire=WIRES, check=[False, True])
def wire_keeps_nonfinite_gradients(rank, ws, wire, check):
    """Rank 0's gradient gets an Inf at one element, the last rank's a NaN at another. Without
    check_for_nan_in_grad both positions are non-finite in every rank's all-reduced main_grad (the
    FP8 cast alone would turn the Inf into the format's max: the wire must not); BF16 keeps the
    other elements finite. With the check, finish_grad_sync raises on every rank naming the
    parameter, as on the FP32 wire."""
    n_mb = 1
    model = D.mlp()
    ddp = fp8dp.DistributedDataParallel(
        model, D.cfg(grad_reduce_wire=wire, check_for_nan_in_grad=check)
    )
    w = ddp._params[2]  # the second layer's weight
    x, y = D.data(0, ws, n_mb)

    def inject(k):
        if rank == 0:
            w.main_grad[3, 4] = float("inf")
        if rank == ws - 1:
            w.main_grad[7, 1] = float("nan")

    if check:
        injected = rank in (0, ws - 1)
        D.expect_error(
            RuntimeError,
            "has NaN or Inf in the local gradients of '2.weight'" if injected else "found errors",
            lambda: D.iteration(ddp, x, y, rank, n_mb, before_finish=lambda: inject(0)),
        )
        return
    D.iteration(ddp, x, y, rank, n_mb, before_finish=lambda: inject(0))
    mg = w.main_grad
    assert not torch.isfinite(mg[3, 4]) and not torch.isfinite(mg[7, 1]), (mg[3, 4], mg[7, 1])
    if wire == "bf16":
        finite = torch.isfinite(mg)
        assert int((~finite).sum()) == 2, int((~finite).sum())
        assert torch.isinf(mg[3, 4]) or ws == 1
    check_identical_on_all_ranks_nan(ddp)


def check_identical_on_all_ranks_nan(ddp):
    """As check_identical_on_all_ranks, with NaN equal to NaN."""
    flat = torch.cat([p.main_grad.flatten() for p in ddp._params]).double()
    rows = gather_rows(flat)
    for r in range(rows.shape[0]):
        assert torch.equal(rows[r].isnan(), rows[0].isnan())
        assert torch.equal(rows[r].nan_to_num(0.0), rows[0].nan_to_num(0.0))


@case()
def fp32_wire_is_the_default_path(rank, ws):
    """grad_reduce_wire='fp32' is the default and gives bit for bit what the default config
    gives (the wire code is not on that path)."""
    assert fp8dp.DistributedDataParallelConfig().grad_reduce_wire == "fp32"
    a, b = D.mlp(), D.mlp()
    da = fp8dp.DistributedDataParallel(a, D.cfg(overlap_grad_reduce=True, bucket_size=150))
    db = fp8dp.DistributedDataParallel(
        b, D.cfg(overlap_grad_reduce=True, bucket_size=150, grad_reduce_wire="fp32")
    )
    for step in range(2):
        x, y = D.data(step, ws, 2)
        D.iteration(da, x, y, rank, 2)
        D.iteration(db, x, y, rank, 2)
        for p, q in zip(da._params, db._params):
            assert torch.equal(p.main_grad, q.main_grad)
