"""The DDP cases (harness.py's registry): every one runs on the "gloo" run (CPU, world sizes 2
and 3: 3 exercises uneven padding) and, on a machine with 2 GPUs, on the "nccl" run (a pure NCCL
group, CUDA models and data, comm_backend "auto", i.e. fp8dp's native NCCL communicator). Values
are checked against references derived analytically: with loss = mean over the global batch, the
averaged main_grad must equal the gradient of a single-process FP32 model on the whole global
batch."""

import contextlib
import copy
import io

import _models
import torch
import torch.distributed as dist
from harness import case
from torch import nn

import fp8dp

B = 4  # samples per micro-batch per rank
# FP32 tolerance: each gradient element is a sum of at most ws * n_mb * B <= 48 per-sample terms of
# magnitude <= ~1 (tanh MLP, unit-normal data), reduced in a different order than the reference (and
# scaled by 1/dp); each reordered addition errs by <= 2^-24 relative, so 64 * 2^-23 bounds the sum.
FP32 = dict(rtol=1e-5, atol=64 * 2.0**-23)
# The bound above covers any order of the per-sample sum (the NCCL ring's included: with 2 ranks it
# adds the two partial sums once). On the GPU the per-sample terms themselves differ too: cuBLAS
# picks other kernels for the micro-batch and the global-batch shapes, which sum each backprop
# GEMM's k <= 24 products in another order (<= 24 2^-24 relative per layer, three layers). 4x the
# CPU bound covers both.
FP32_CUDA = dict(rtol=4e-5, atol=4 * 64 * 2.0**-23)

# ---- device ---------------------------------------------------------------------------------
# Where the cases' models and data live: the CPU on gloo, this rank's GPU on nccl (set by
# worker.py through use_device() before any case runs). The model builders below move what they
# build there.
DEV = torch.device("cpu")


def use_device(device):
    """Point DEV (and the FP32 tolerance) at `device`."""
    global DEV, FP32
    DEV = torch.device(device)
    if DEV.type == "cuda":
        FP32 = FP32_CUDA


def mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    return _models.mlp(seed, dtype).to(DEV)


def delayed_mlp(seed: int = 0) -> nn.Module:
    return _models.delayed_mlp(seed).to(DEV)


def plain_twin(model: nn.Module) -> nn.Module:
    return _models.plain_twin(model).to(DEV)


def data(step, ws, n_mb, din=12, dout=5):
    g = torch.Generator().manual_seed(1000 + step)  # on the CPU: the same data on every device
    n = ws * n_mb * B
    x, y = torch.randn(n, din, generator=g), torch.randn(n, dout, generator=g)
    return x.to(DEV), y.to(DEV)


def micro(t, rank, k, n_mb):
    i = (rank * n_mb + k) * B
    return t[i : i + B]


def mse(out, y):
    return ((out - y) ** 2).mean()


def iteration(ddp, x, y, rank, n_mb, delayed=(), before_finish=None, inject=None):
    """One training iteration: n_mb micro-batches, all but the last under no_sync()."""
    ddp.zero_grad_buffer()
    for k in range(n_mb):
        ctx = ddp.no_sync() if k < n_mb - 1 else contextlib.nullcontext()
        with ctx:
            loss = mse(ddp(micro(x, rank, k, n_mb)), micro(y, rank, k, n_mb)) / n_mb
            loss.backward()
            if inject is not None:
                inject(k)
            else:
                for m in reversed(delayed):
                    m.backward_dw()
    if before_finish is not None:
        before_finish()
    ddp.finish_grad_sync()


def reference_grads(ref, x, y):
    ref.zero_grad()
    mse(ref(x), y).backward()
    return [p.grad.clone() for p in ref.parameters()]


def check_main_grads(ddp, ref_grads, **tol):
    sync = ddp._sync
    if ddp.config.use_distributed_optimizer:  # C6: each rank's owned chunk equals the reference
        shards = sync.owned_shards()
        for s in shards:
            exp = ref_grads[s.param].flatten()[s.param_offset : s.param_offset + s.numel]
            torch.testing.assert_close(sync.grad_shard(s), exp, **tol)
        return len(shards)
    for p, r in zip(ddp._params, ref_grads):
        torch.testing.assert_close(p.main_grad, r, **tol)
    return len(ref_grads)


def cfg(**kw):
    return fp8dp.DistributedDataParallelConfig(**kw)


# ---------------------------------------------------------------------------------------------
@case(native=[True, False], dtype=[torch.float32, torch.bfloat16, torch.float16])
def communicator_collectives(rank, ws, native, dtype):
    """Every collective of the ProcessGroupCommunicator, grouped (two buffers per call), in place,
    against values derived by hand; native=False forces the fallbacks (AVG as SUM + divide,
    reduce-scatter as all-reduce + chunk copy). Rank r contributes (r + 1) * base with
    base = arange % 8: all sums are small integers or halves, exact in every dtype."""
    C = fp8dp._C
    comm = C.ProcessGroupCommunicator(
        dist.group.WORLD, native_avg=native, native_reduce_scatter=native
    )
    n = [ws * 5, ws * 128]  # two buckets of different sizes, each divisible by ws
    base = [(torch.arange(k, device=DEV) % 8).to(dtype) for k in n]
    total = ws * (ws + 1) / 2  # sum over ranks of (r + 1)
    for op, factor in ((C.ReduceOp.SUM, total), (C.ReduceOp.AVG, total / ws)):
        bufs = [b * (rank + 1) for b in base]
        comm.all_reduce(bufs, op).wait()
        for b, e in zip(bufs, base):
            assert torch.equal(b, e * factor), (op, b, e * factor)
        bufs = [b * (rank + 1) for b in base]
        chunks = [b.view(ws, -1)[rank] for b in bufs]  # in place: outputs alias the inputs
        comm.reduce_scatter(bufs, chunks, op).wait()
        for c, e in zip(chunks, base):
            assert torch.equal(c, (e * factor).view(ws, -1)[rank])
    bufs = [torch.zeros(k, dtype=dtype, device=DEV) for k in n]
    for b in bufs:
        b.view(ws, -1)[rank] = rank + 1
    comm.all_gather([b.view(ws, -1)[rank] for b in bufs], bufs).wait()
    for b in bufs:
        want = torch.arange(1, ws + 1, dtype=dtype, device=DEV).repeat_interleave(b.numel() // ws)
        assert torch.equal(b, want)
    bufs = [torch.full((k,), float(rank), dtype=dtype, device=DEV) for k in n]
    comm.broadcast(bufs, ws - 1).wait()
    assert all(torch.equal(b, torch.full_like(b, ws - 1)) for b in bufs)
    other = torch.float16 if dtype == torch.float32 else torch.float32
    wrong = [bufs[0][: n[0] // ws].to(other)]
    expect_error(
        ValueError,
        "reduce_scatter outputs[0]: expected dtype",
        lambda: comm.reduce_scatter([bufs[0]], wrong, C.ReduceOp.SUM),
    )
    expect_error(
        ValueError,
        "all_reduce buffers[0]: expected a flat contiguous buffer",
        lambda: comm.all_reduce([torch.zeros(2, 2, dtype=dtype, device=DEV)], C.ReduceOp.SUM),
    )


@case(overlap=[False, True], dist_opt=[False, True], avg=[False, True], n_mb=[1, 4])
def grads_match_reference(rank, ws, overlap, dist_opt, avg, n_mb):
    model = mlp()
    ref = copy.deepcopy(model)
    ddp = fp8dp.DistributedDataParallel(
        model,
        cfg(
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=dist_opt,
            average_in_collective=avg,
            bucket_size=150,
        ),
    )
    sync = ddp._sync
    groups = sync.num_bucket_groups
    assert (groups > 1) if overlap else (groups == 1), groups
    for step in range(2):  # step 0 learns the golden counts, step 1 launches from the hooks
        x, y = data(step, ws, n_mb)

        def launched_during_backward(step=step):
            state = [sync.group_launched(g) for g in range(groups)]
            assert all(state) if (overlap and step == 1) else not any(state), state

        iteration(ddp, x, y, rank, n_mb, before_finish=launched_during_backward)
        assert check_main_grads(ddp, reference_grads(ref, x, y), **FP32) > 0 or dist_opt
        before = [p.main_grad.clone() for p in ddp._params]
        ddp.finish_grad_sync()  # idempotent: no second reduction
        for p, b in zip(ddp._params, before):
            assert torch.equal(p.main_grad, b)


@case(grad_reduce_in_fp32=[True, False])
def bf16_params(rank, ws, grad_reduce_in_fp32):
    n_mb = 2
    model = mlp(dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    ddp = fp8dp.DistributedDataParallel(model, cfg(grad_reduce_in_fp32=grad_reduce_in_fp32))
    want = torch.float32 if grad_reduce_in_fp32 else torch.bfloat16
    assert all(p.main_grad.dtype == want for p in ddp._params)
    x, y = data(0, ws, n_mb)
    x, y = x.bfloat16(), y.bfloat16()
    iteration(ddp, x, y, rank, n_mb)
    # Reference: the same BF16 per-micro-batch gradients, summed in FP32 and averaged.
    total = [torch.zeros_like(p, dtype=torch.float32) for p in ref.parameters()]
    for r in range(ws):
        for k in range(n_mb):
            ref.zero_grad()
            (mse(ref(micro(x, r, k, n_mb)), micro(y, r, k, n_mb)) / n_mb).backward()
            for t, p in zip(total, ref.parameters()):
                t += p.grad.float()
    for p, t in zip(ddp._params, total):
        t /= ws
        if grad_reduce_in_fp32:
            torch.testing.assert_close(p.main_grad, t, **FP32)
        else:
            # BF16 buffer: each of the <= ws*n_mb + 2 roundings (accumulate, pre-scale, reduce)
            # errs by <= 2^-8 of the running magnitude.
            bound = (ws * n_mb + 2) * 2.0**-8 * t.abs().max().item()
            assert (p.main_grad.float() - t).abs().max().item() <= bound


@case(overlap=[False, True], avg=[False, True])
def adamw_matches_torch_ddp(rank, ws, overlap, avg):
    model = mlp()
    twin = copy.deepcopy(model)
    ddp = fp8dp.DistributedDataParallel(
        model,
        cfg(
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=True,
            average_in_collective=avg,
            bucket_size=150,
        ),
    )
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=1e-2, weight_decay=0.1)
    tddp = nn.parallel.DistributedDataParallel(twin)
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(10):
        x, y = data(step, ws, 1)
        opt.zero_grad()
        mse(ddp(micro(x, rank, 0, 1)), micro(y, rank, 0, 1)).backward()
        opt.step()
        topt.zero_grad()
        mse(tddp(micro(x, rank, 0, 1)), micro(y, rank, 0, 1)).backward()
        topt.step()
        # AdamW is elementwise: sharding changes nothing but the gradient's reduction order
        # (FP32 rounding, see FP32), which the normalised update passes on undamped.
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, **FP32)


@case(overlap=[True])
def resume_is_bit_exact(rank, ws, overlap):
    def build(seed):
        model = mlp(seed)
        ddp = fp8dp.DistributedDataParallel(
            model, cfg(overlap_grad_reduce=overlap, use_distributed_optimizer=True, bucket_size=150)
        )
        return model, ddp, fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=1e-2)

    def train(ddp, opt, steps):
        for step in steps:
            x, y = data(step, ws, 1)
            opt.zero_grad()
            mse(ddp(micro(x, rank, 0, 1)), micro(y, rank, 0, 1)).backward()
            opt.step()

    model, ddp, opt = build(0)
    train(ddp, opt, range(3))
    blob = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "opt": opt.state_dict()}, blob)
    train(ddp, opt, range(3, 6))
    blob.seek(0)
    saved = torch.load(blob)
    model2, ddp2, opt2 = build(7)  # different init: everything must come from the checkpoint
    ddp2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(ddp2, opt2, range(3, 6))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q), (p - q).abs().max()


@case(overlap=[False, True], consumer=[False, True], n_mb=[1, 3])
def delayed_wgrad_routing(rank, ws, overlap, consumer, n_mb):
    model = delayed_mlp()
    ref = plain_twin(model)
    if consumer:
        # An unconditional external consumer, hooked before DDP: moves every .grad autograd makes
        # into main_grad and clears it (the C4 scenario). DDP must then add nothing a second time.
        def consume(p):
            if p.grad is not None:
                p.main_grad.add_(p.grad)
                p.grad = None

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(consume)
    ddp = fp8dp.DistributedDataParallel(
        model,
        cfg(
            overlap_grad_reduce=overlap, delay_wgrad_compute=True, bucket_size=100, grad_ledger=True
        ),
    )
    sync = ddp._sync
    delayed = [model[0]]
    g_delayed, g_plain = sync.group_of_param(1), sync.group_of_param(3)  # 0.weight, 2.weight
    assert (g_delayed != g_plain) == overlap
    for step in range(2):
        x, y = data(step, ws, n_mb)

        def inject(k, step=step):
            if overlap and step == 1 and k == n_mb - 1:
                # C5 for delayed parameters: their bucket launches only after backward_dw().
                assert sync.group_launched(g_plain) and not sync.group_launched(g_delayed)
                model[0].backward_dw()
                assert sync.group_launched(g_delayed)
            else:
                model[0].backward_dw()

        iteration(ddp, x, y, rank, n_mb, delayed=delayed, inject=inject)
        check_main_grads(ddp, reference_grads(ref, x, y), **FP32)


def fp8dp_model(fuse, delay):
    """fp8dp.Linear(16, 32) -> Tanh -> fp8dp.LayerNormLinear(32, 16): every route of C2 at once
    (the norm's parameters always take the autograd hook)."""
    torch.manual_seed(0)
    return nn.Sequential(
        fp8dp.Linear(16, 32, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay),
        nn.Tanh(),
        fp8dp.LayerNormLinear(32, 16, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay),
    ).to(DEV)


@case(
    fp8=[False, True],
    delay=[False, True],
    fuse=[False, True],
    consumer=[False, True],
    when=lambda fp8, delay, fuse, consumer: not (fuse and consumer),
)
def fp8dp_modules_count_every_gradient_once(rank, ws, fp8, delay, fuse, consumer):
    """With fp8dp modules: fused accumulation (C2 b), delayed wgrad (C3) and an unconditional
    external consumer (C4) each deliver every gradient exactly once (the ledger is on too).

    Reference: the same modules without DDP, fusion or delay, each rank's micro-batches on a fresh
    model (so FP8 scales start from the same first-cast amaxes as on that rank), gradients summed
    in FP32 and averaged. The FP8 quantization is identical, so only the FP32 reduction order
    differs, except for fused weight gradients on CUDA (wgrad_magnitudes)."""
    n_mb, tokens = 2, 16  # FP8 GEMMs need multiples of 16 in every inner dimension (tokens: wgrad)
    g = torch.Generator().manual_seed(77)
    x = torch.randn(ws * n_mb, tokens, 16, generator=g).to(DEV)
    y = torch.randn(ws * n_mb, tokens, 16, generator=g).to(DEV)
    recipe = fp8dp.DelayedScaling()

    def run(model, i):
        with fp8dp.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            out = model(x[i])
        return mse(out, y[i]) / n_mb

    total = None
    wide = fp8 and fuse and DEV.type == "cuda"
    mags = {}
    for r in range(ws):
        ref = fp8dp_model(fuse=False, delay=False)
        if wide:
            wgrad_magnitudes(ref, mags)
        for k in range(n_mb):
            run(ref, r * n_mb + k).backward()
        grads = [p.grad.float() for p in ref.parameters()]
        total = grads if total is None else [t + q for t, q in zip(total, grads)]
    total = [t / ws for t in total]

    model = fp8dp_model(fuse, delay)
    if consumer:

        def consume(p):  # moves whatever autograd produced into main_grad, unconditionally
            if p.grad is not None:
                p.main_grad.add_(p.grad)
                p.grad = None

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(consume)
    ddp = fp8dp.DistributedDataParallel(
        model,
        cfg(overlap_grad_reduce=True, bucket_size=400, delay_wgrad_compute=delay, grad_ledger=True),
    )
    delayed = [model[0], model[2]] if delay else []
    ddp.zero_grad_buffer()
    for k in range(n_mb):
        with ddp.no_sync() if k < n_mb - 1 else contextlib.nullcontext():
            run(ddp, rank * n_mb + k).backward()
            if delay and k == n_mb - 1:
                # C5: the delayed parameters' buckets wait for backward_dw().
                g0 = ddp._sync.group_of_param(0)  # 0.weight
                assert not ddp._sync.group_launched(g0)
            for m in reversed(delayed):
                m.backward_dw()
    ddp.finish_grad_sync()
    for p, t, name in zip(ddp._params, total, ddp._names):
        if name in mags:
            # Each rank's and the reference's GEMMs err by <= acc * 1.25^2 * |dy|ᵀ|z| (|q(v)| <=
            # 1.25 |v| for E4M3 / E5M2), averaged over the ranks like the gradients.
            acc = tokens * 2.0**-14 + 2 * tokens * 2.0**-24  # wgrad: k = tokens <= 128
            bound = 2 * acc * 1.25**2 * mags[name] / ws
            bound += FP32["atol"] + FP32["rtol"] * t.abs().double()
            excess = ((p.main_grad - t).abs().double() - bound).max().item()
            assert excess <= 0, f"{name}: {excess:.3g} past the bound"
        else:
            torch.testing.assert_close(
                p.main_grad, t, **FP32, msg=lambda m, name=name: f"{name}: {m}"
            )


def wgrad_magnitudes(model, mags):
    """Hooks on the reference model of fp8dp_model that add |dy|ᵀ|z| of every weight-gradient GEMM
    (dy: the gradient of the module's output, z: the GEMM input, i.e. the input or its norm) into
    mags[weight name], summed over micro-batches and ranks.

    Why: on CUDA the fused weight gradient is a cuBLASLt GEMM accumulating into a main_grad view
    (beta = 1): another plan, possibly another algorithm than the reference's GEMM. Hopper's FP8
    tensor cores add the exact products with a reduced-precision accumulator (about 14 mantissa
    bits, see tests/python/test_gemm_cuda.py): with the split accumulator a GEMM over k tokens
    errs by up to (min(k, 128) 2^-14 + k 2^-24) |q(dy)|ᵀ|q(z)|, and two algorithms may differ by
    twice that."""

    def forward_hook(name):
        def hook(mod, inputs, out):
            z = inputs[0].detach().double()
            if isinstance(mod, fp8dp.LayerNormLinear):
                w, b = mod.layer_norm_weight.detach(), mod.layer_norm_bias.detach()
                z = nn.functional.layer_norm(z, z.shape[-1:], w.double(), b.double(), mod.eps)

            def grad_hook(g, z=z):
                zz = z.abs().reshape(-1, z.shape[-1])
                m = g.detach().double().abs().reshape(-1, g.shape[-1]).t() @ zz
                mags[name] = mags[name] + m if name in mags else m

            out.register_hook(grad_hook)

        return hook

    for i in (0, 2):
        model[i].register_forward_hook(forward_hook(f"{i}.weight"))


@case(delay=[False, True])
def fp8dp_training_stays_in_sync(rank, ws, delay):
    """DistributedOptimizer(AdamW) over fp8dp modules in FP8: after each step every rank holds the
    same parameters (the all-gather) and the same FP8 scales (step() runs update_fp8_scales, whose
    MAX reduction makes the scaling state identical on every rank)."""
    tokens = 16
    model = fp8dp_model(fuse=False, delay=delay)
    ddp = fp8dp.DistributedDataParallel(
        model,
        cfg(
            overlap_grad_reduce=True,
            use_distributed_optimizer=True,
            bucket_size=400,
            delay_wgrad_compute=delay,
        ),
    )
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=1e-2)
    g = torch.Generator().manual_seed(5 + rank)  # different data on every rank
    for _ in range(3):
        opt.zero_grad()
        with fp8dp.fp8_autocast(enabled=True, fp8_recipe=fp8dp.DelayedScaling()):
            out = ddp(torch.randn(tokens, 16, generator=g).to(DEV))
        mse(out, torch.randn(tokens, 16, generator=g).to(DEV)).backward()
        if delay:
            model[2].backward_dw()
            model[0].backward_dw()
        opt.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        scales = torch.cat(
            [m._core.get_extra_state()["scale"].flatten() for m in (model[0], model[2])]
        ).to(DEV)
        for t in (flat, scales):
            every = [torch.empty_like(t) for _ in range(ws)]
            dist.all_gather(every, t)
            assert all(torch.equal(every[0], e) for e in every), "ranks diverged"


@case(kind=["double", "skip"])
def ledger_catches(rank, ws, kind):
    n_mb = 2
    model = delayed_mlp()
    ddp = fp8dp.DistributedDataParallel(
        model, cfg(overlap_grad_reduce=True, delay_wgrad_compute=True, grad_ledger=True)
    )
    lin = model[0]

    def inject(k):
        if k == 0 and kind == "skip":
            lin._queue.pop(0)  # backward_dw() skipped: its gradient never arrives
            return
        lin.backward_dw()
        if k == 0 and kind == "double":  # a buggy module writes and reports its gradient twice
            lin.weight.grad = torch.ones_like(lin.weight)
            lin._hooks[0]()

    x, y = data(0, ws, n_mb)
    iteration(ddp, x, y, rank, n_mb, delayed=[lin])  # clean: learns one contribution per use
    # The injection is in micro-batch 0, under no_sync(): readiness counting cannot see it there.
    try:
        iteration(ddp, x, y, rank, n_mb, inject=inject)
    except RuntimeError as e:
        word = "duplicated 1" if kind == "double" else "missing 1"
        assert "gradient ledger" in str(e) and "'0.weight'" in str(e) and word in str(e), str(e)
        assert "'2.weight'" not in str(e), str(e)
    else:
        raise AssertionError("the ledger missed an injected " + kind)
    iteration(ddp, x, y, rank, n_mb, delayed=[lin])  # and a clean iteration passes again


@case(kind=["excess", "incomplete"])
def readiness_errors(rank, ws, kind):
    model = delayed_mlp()
    ddp = fp8dp.DistributedDataParallel(
        model, cfg(overlap_grad_reduce=True, delay_wgrad_compute=True, bucket_size=100)
    )
    lin = model[0]
    x, y = data(0, ws, 1)
    iteration(ddp, x, y, rank, 1, delayed=[lin])  # learn golden counts

    def inject(k):
        if kind == "incomplete":
            lin._queue.pop(0)
        else:
            lin.backward_dw()
            lin._hooks[0]()  # a second readiness report for 0.weight

    try:
        iteration(ddp, x, y, rank, 1, inject=inject)
    except RuntimeError as e:
        msg = str(e)
        if kind == "excess":
            assert "'0.weight' was reported ready 2 times in this iteration but 1" in msg, msg
        else:
            assert "still incomplete" in msg and "'0.weight' (ready 0 of 1)" in msg, msg
    else:
        raise AssertionError("readiness missed " + kind)
    ddp.zero_grad_buffer()  # drains what was in flight
    iteration(ddp, x, y, rank, 1, delayed=[lin])


@case(overlap=[False, True])
def nan_check_names_parameters(rank, ws, overlap):
    model = mlp()
    ddp = fp8dp.DistributedDataParallel(
        model, cfg(overlap_grad_reduce=overlap, check_for_nan_in_grad=True, bucket_size=150)
    )
    bad = ws - 1
    x, y = data(0, ws, 1)
    iteration(ddp, x, y, rank, 1)
    xb, poison = _nan_on(ddp, x, rank, bad, overlap)
    _expect_nan_report(
        lambda: iteration(ddp, xb, y, rank, 1, before_finish=poison), rank, bad, overlap
    )
    iteration(ddp, x, y, rank, 1)  # clean again


def _nan_on(ddp, x, rank, bad, overlap):
    """NaN on rank `bad` only: with overlap through the data (every gradient is poisoned before
    its group launches), else into 0.weight's main_grad before the finish. Returns the inputs and
    the before_finish callback for iteration()."""
    xb = x.clone()
    if overlap and rank == bad:
        xb[bad * B, 0] = float("nan")

    def poison():
        if not overlap and rank == bad:
            ddp._params[0].main_grad.view(-1)[3] = float("nan")  # only 0.weight

    return xb, poison


def _expect_nan_report(run, rank, bad, overlap, *also):
    """run() raises on every rank: rank `bad` names its poisoned parameters, the others name it;
    each message also holds the strings `also`."""
    try:
        run()
    except RuntimeError as e:
        msg = str(e)
        if rank == bad:
            assert f"rank {bad} has NaN or Inf in the local gradients of " in msg, msg
            assert "'0.weight'" in msg and ("'4.bias'" in msg) == overlap, msg
        else:
            assert f"rank(s) {bad} found errors" in msg, msg
        for a in also:
            assert a in msg, msg
    else:
        raise AssertionError("NaN not reported")


@case(overlap=[False, True])
def nan_on_two_ranks_names_both(rank, ws, overlap):
    """NaN on the first and the last rank: each of them names its own parameters and the other
    rank by number ("found errors too"), the ranks without NaN name both. Before, a poisoned rank's
    error named only itself, so rank 0 never learnt that rank 1 had failed as well."""
    model = mlp()
    ddp = fp8dp.DistributedDataParallel(
        model, cfg(overlap_grad_reduce=overlap, check_for_nan_in_grad=True, bucket_size=150)
    )
    bads = sorted({0, ws - 1})
    x, y = data(0, ws, 1)
    iteration(ddp, x, y, rank, 1)
    xb = x.clone()
    for b in bads:  # through the data (every gradient of rank b), with or without overlap
        xb[b * B, 0] = float("nan")
    try:
        iteration(ddp, xb, y, rank, 1)
    except RuntimeError as e:
        msg = str(e)
        others = ", ".join(str(b) for b in bads if b != rank)
        if rank in bads:
            assert f"rank {rank} has NaN or Inf in the local gradients of " in msg, msg
            if others:
                assert f"rank(s) {others} found errors too" in msg, msg
        else:
            assert f"rank(s) {', '.join(map(str, bads))} found errors" in msg, msg
    else:
        raise AssertionError("NaN not reported")
    iteration(ddp, x, y, rank, 1)  # clean again


@case(overlap=[False, True])
def deferred_nan_check_agrees(rank, ws, overlap):
    """defer_nan_check across ranks: NaN on the last rank only; its step is skipped on every rank
    (the flags are all-reduced before the optimizer reads them as found_inf), so all ranks keep
    equal, finite weights; the next finish raises on every rank (the bad one naming its
    parameters); redone, the iteration steps. (Single-process details: test_defer_nan_check.py.)"""
    model = mlp()
    ddp = fp8dp.DistributedDataParallel(
        model,
        cfg(
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=True,
            check_for_nan_in_grad=True,
            defer_nan_check=True,
            bucket_size=150,
        ),
    )
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=1e-2, fused=True)
    bad = ws - 1
    x, y = data(0, ws, 1)
    iteration(ddp, x, y, rank, 1)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    xb, poison = _nan_on(ddp, x, rank, bad, overlap)
    iteration(ddp, xb, y, rank, 1, before_finish=poison)  # finishes without raising
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)  # skipped on every rank, the good ones included
    x1, y1 = data(1, ws, 1)
    _expect_nan_report(
        lambda: iteration(ddp, x1, y1, rank, 1),
        rank,
        bad,
        overlap,
        "defer_nan_check: the gradients of iteration",
    )
    iteration(ddp, x1, y1, rank, 1)  # redone (zero_grad_buffer() first): clean
    opt.step()
    for p in model.parameters():
        gathered = [torch.empty_like(p) for _ in range(ws)]
        dist.all_gather(gathered, p.detach().contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered) and torch.isfinite(p).all()
    ddp.check_deferred()


@case(root=[0, -1])
def broadcast_and_scale(rank, ws, root):
    root = root % ws
    model = mlp(seed=rank)  # different on every rank
    ddp = fp8dp.DistributedDataParallel(model)
    ddp.broadcast_params(root)
    for p, q in zip(model.parameters(), mlp(seed=root).parameters()):
        assert torch.equal(p, q)
    x, y = data(0, ws, 1)
    iteration(ddp, x, y, rank, 1)
    before = [p.main_grad.clone() for p in ddp._params]
    ddp.scale_gradients(0.5)
    for p, b in zip(ddp._params, before):
        assert torch.equal(p.main_grad, b * 0.5)


@case(
    late_rank=[-1],
    runs=("gloo",),
    skip={
        "nccl": "a late gloo rank rejoins the group; on NCCL the timeout aborts the "
        "communicator, which cases_nccl.skipped_collective_times_out covers"
    },
)
def late_rank_times_out(rank, ws, late_rank):
    """A rank that does not join a collective makes the others fail with a clear error after the
    communicator's timeout instead of hanging; once it joins late, the group is usable again."""
    import time

    late = late_rank % ws
    ddp = fp8dp.DistributedDataParallel(mlp())
    x, y = data(0, ws, 1)
    iteration(ddp, x, y, rank, 1)
    ddp._sync.communicator().set_timeout(2.0)
    ddp.zero_grad_buffer()
    mse(ddp(micro(x, rank, 0, 1)), micro(y, rank, 0, 1)).backward()
    dist.barrier()  # aligned here, the late rank's 6 s dwarf any scheduling skew on a busy machine
    if rank == late:
        time.sleep(6.0)
        ddp.finish_grad_sync()  # pairs with the others' abandoned collective
    else:
        try:
            ddp.finish_grad_sync()
        except RuntimeError as e:
            msg = str(e)
            assert "did not finish within 2000 ms" in msg and "main_grad is NOT reduced" in msg, msg
        else:
            raise AssertionError("a missing rank went unnoticed")
    dist.barrier()


def expect_error(exc, text, fn):
    try:
        fn()
    except exc as e:
        assert text in str(e), f"expected {text!r} in: {e}"
        return
    raise AssertionError(f"no {exc.__name__} containing {text!r}")


@case(
    kind=[
        "added_param",
        "different_models",
        "world_size",
        "skip_flag_no_delay",
        "owner_without_hooks",
        "optimizer_without_dist_opt",
        "nccl_backend",
    ]
)
def bad_input(rank, ws, kind):
    if kind == "added_param":
        ddp = fp8dp.DistributedDataParallel(mlp())
        ddp.module.extra = nn.Parameter(torch.zeros(3))
        expect_error(
            ValueError, "parameter 'extra' was added after", lambda: ddp(torch.zeros(2, 12))
        )
    elif kind == "different_models":
        model = mlp() if rank == 0 else nn.Sequential(nn.Linear(12, 25)).to(DEV)
        # Found by the construction-time agreement check (C12) before GradSync's layout check.
        expect_error(
            ValueError,
            "DistributedDataParallel: ranks disagree on trainable parameters: rank 0 6, rank",
            lambda: fp8dp.DistributedDataParallel(model),
        )
    elif kind == "world_size":
        sub = dist.new_group(list(range(ws - 1)))  # every rank takes part in creating it
        c = cfg(use_distributed_optimizer=True)
        saved = None
        if rank < ws - 1:
            small = fp8dp.DistributedDataParallel(mlp(), c, process_group=sub)
            saved = fp8dp.DistributedOptimizer(torch.optim.AdamW, small).state_dict()
        big = fp8dp.DistributedDataParallel(mlp(), c)
        opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, big)
        if saved is not None:
            expect_error(
                ValueError,
                f"saved at world size {ws - 1}, loading at world size {ws}",
                lambda: opt.load_state_dict(saved),
            )
    elif kind == "skip_flag_no_delay":
        expect_error(
            ValueError,
            "'0.weight' has skip_backward_post_hook=True",
            lambda: fp8dp.DistributedDataParallel(delayed_mlp()),
        )
    elif kind == "owner_without_hooks":
        model = mlp()
        model[0].weight.skip_backward_post_hook = True
        expect_error(
            ValueError,
            "module Linear has no register_wgrad_accumulation_and_reduce_hooks",
            lambda: fp8dp.DistributedDataParallel(model, cfg(delay_wgrad_compute=True)),
        )
    elif kind == "nccl_backend":
        if fp8dp._C.native_nccl_available():
            return  # the CUDA build has it; its own tests cover it
        expect_error(
            ValueError,
            "comm_backend: 'nccl' needs fp8dp built with CUDA and NCCL",
            lambda: fp8dp.DistributedDataParallel(mlp(), cfg(comm_backend="nccl")),
        )
    elif kind == "optimizer_without_dist_opt":
        ddp = fp8dp.DistributedDataParallel(mlp())
        expect_error(
            ValueError,
            "use_distributed_optimizer=True",
            lambda: fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp),
        )


# -- overlap_param_gather: the all-gather after the step overlaps the next forward ------
def _dist_opt_pair(overlap_param_gather_a, seed=0):
    """Two identical models, each under DistributedDataParallel + DistributedOptimizer(AdamW),
    differing only in overlap_param_gather (bucket_size=150: several bucket groups)."""
    out = []
    for opg in (overlap_param_gather_a, False):
        model = mlp(seed)
        ddp = fp8dp.DistributedDataParallel(
            model,
            cfg(
                overlap_grad_reduce=True,
                use_distributed_optimizer=True,
                bucket_size=150,
                overlap_param_gather=opg,
            ),
        )
        out.append((model, ddp, fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=1e-2)))
    return out


@case(n_mb=[1, 2])
def overlap_param_gather_is_bit_identical(rank, ws, n_mb):
    """Several AdamW steps with the all-gather left in flight for the next forward give exactly the
    losses and parameters of the non-overlapped step (the same collectives, only the wait moves),
    and the gather really is left in flight after step() (else nothing would overlap)."""
    (model, ddp, opt), (ref_model, ref_ddp, ref_opt) = _dist_opt_pair(True)
    assert ddp.overlap_param_gather and not ref_ddp.overlap_param_gather
    assert ddp._sync.num_bucket_groups > 1
    for step in range(4):
        x, y = data(step, ws, n_mb)
        losses = []
        for d, o in ((ddp, opt), (ref_ddp, ref_opt)):
            o.zero_grad()
            total = 0.0
            for k in range(n_mb):
                ctx = d.no_sync() if k < n_mb - 1 else contextlib.nullcontext()
                with ctx:
                    loss = mse(d(micro(x, rank, k, n_mb)), micro(y, rank, k, n_mb)) / n_mb
                    loss.backward()
                total += loss.item()
            o.step()
            losses.append(total)
        assert ddp._sync.param_sync_pending and not ref_ddp._sync.param_sync_pending
        assert losses[0] == losses[1], (step, losses)
    opt.finish_param_sync()
    assert not ddp._sync.param_sync_pending
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), (name, (p - q).abs().max())


@case(
    reader=[
        "forward",
        "module_forward",
        "state_dict",
        "module_state_dict",
        "load_state_dict",
        "finish_param_sync",
        "broadcast_params",
    ]
)
def param_reads_wait_for_the_gather(rank, ws, reader):
    """The last rank joins the parameter all-gather 0.5 s late, so on every other rank the gather
    is certainly still in flight right after step(). Each way of reading the parameters must wait
    for it and see exactly the gathered values of the non-overlapped twin; without the wait (e.g.
    no forward pre-hook) the chunks of the other ranks would still hold the old parameters."""
    import time

    (model, ddp, opt), (ref_model, ref_ddp, ref_opt) = _dist_opt_pair(True)
    initial = copy.deepcopy(model.state_dict())
    x, y = data(0, ws, 1)
    for d, o in ((ddp, opt), (ref_ddp, ref_opt)):
        o.zero_grad()
        mse(d(micro(x, rank, 0, 1)), micro(y, rank, 0, 1)).backward()
    ref_opt.step()  # blocking gather: every rank leaves it together
    if rank == ws - 1:
        time.sleep(0.5)
    opt.step()
    xin = micro(x, rank, 0, 1)
    if reader in ("forward", "module_forward"):  # the bare module's submodules wait as well
        # (under no_grad: after the step a forward that builds a graph is refused until
        # zero_grad(), contract C11; a read is an evaluation)
        with torch.no_grad():
            out = ddp(xin) if reader == "forward" else model(xin)
        assert torch.equal(out, ref_model(xin))
    elif reader in ("state_dict", "module_state_dict"):  # a checkpoint right after step()
        mine = ddp.state_dict() if reader == "state_dict" else model.state_dict()
        ref = ref_model.state_dict()
        for k in ref:
            assert torch.equal(mine[k], ref[k]), k
    elif reader == "load_state_dict":  # a gather finishing after the load would overwrite it
        model.load_state_dict(initial)
        opt.finish_param_sync()
        for k, v in model.state_dict().items():
            assert torch.equal(v, initial[k]), k
    elif reader == "finish_param_sync":
        opt.finish_param_sync()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, q)
    else:  # broadcast_params writes every parameter: an unfinished gather would overwrite it
        ddp.broadcast_params(0)
        ref_ddp.broadcast_params(0)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, q)
    assert not ddp._sync.param_sync_pending
