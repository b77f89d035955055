"""fp8dp.pipeline (contract C10) across gloo ranks: after one step of each torch schedule, with
fp8dp's deferred W through dw_builder, fp8dp's sync policy and scaling, and the gradient ledger
on, every stage's main_grad and every parameter after one SGD step equal a float64
single-process reference of the same model on the same global batch.

Layouts: PP 2 × DP 1 (2 ranks), PP 2 × DP 2 (4 ranks, Megatron rank order) and PP 4 × DP 1
(4 ranks; only the cases with one stage per rank: 4 blocks make 4 stages); schedules 1f1b
(one stage per rank), interleaved_1f1b, zero_bubble and zbv (two stages per rank), zero_bubble
with one stage per rank; fused and unfused wgrad; FP8 off (the exact comparison) and on (a
sanity bound). One spawn per world size (2 and 4) runs every case of every layout that fits it,
to keep process start-up (seconds on a small machine) out of the loop.

Tolerances, derived:
- FP8 off: the ranks compute in FP32, the reference in FP64. Each weight gradient is a sum over
  the batch's T = 128 rows and each activation a dot product over H = 16 features; the forward
  and backward chain through L = 4 blocks passes ~ 2L + 2 such reductions, each with relative
  error at most gamma_n = n·u, u = 2^-24. Bound: (2L + 2)·T·u ≈ 7.6e-5 relative (norm of the
  difference over the norm of the reference, per parameter), asserted as is — the worst-case
  bound, which rounding errors of either sign stay far below (measured: at most 1.9e-7).
- FP8 on: HYBRID quantizes forward operands to E4M3 (unit roundoff 2^-4) and gradients to E5M2
  (2^-3). A weight gradient is one GEMM of an E5M2 and an E4M3 operand, each already carrying
  the error of the casts before it; per parameter we assert a relative error below
  2·(2^-4 + 2^-3) = 0.375 (measured: 0.06-0.07), and above the FP8-off bound, which shows FP8
  really ran.
  It is a sanity check that the pipeline wiring (static stage metadata: no shape-inference
  forward poisons the first scale; amax reduction over the stage's DP group) gives gradients of
  the right size and direction, not a numerics test (test_linear_fp8_numerics.py is).

Evidence that it catches the bugs it is about (tried on this branch, then reverted):
- torch's own scale_grads instead of Pipeline's main_grad scaling: every gradient 4× too large
  (n_microbatches = 4), relative error 3.0.
- the ledger keyed by the latest forward (before set_backward_microbatch): finish_grad_sync
  raises "gradient ledger: ... missing" on every schedule that runs forwards ahead.
"""

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks

from fp8dp.pipeline import check_backend

H, ROWS, N_MB, N_BLOCKS, LR = 16, 16, 4, 4, 0.5
FP32_TOL = (2 * N_BLOCKS + 2) * (N_MB * ROWS * 2) * 2.0**-24  # (2L + 2)·T·u ≈ 7.6e-5: docstring
FP8_TOL = 2 * (2.0**-4 + 2.0**-3)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASES = [
    # (schedule, virtual_stages, fused, fp8)
    ("1f1b", 1, False, False),
    ("1f1b", 1, True, False),
    ("interleaved_1f1b", 1, False, False),
    ("interleaved_1f1b", 2, False, False),
    ("interleaved_1f1b", 2, True, False),
    ("zero_bubble", 2, False, False),
    ("zero_bubble", 2, True, False),
    ("zero_bubble", 1, True, False),
    ("zbv", 2, False, False),
    ("zbv", 2, True, False),
    ("1f1b", 1, True, True),
    ("zbv", 2, False, True),
    # (..., distributed optimizer: ZeRO-1 reduce-scatter, SGD on the master shards)
    ("1f1b", 1, True, False, True),
    ("zbv", 2, False, False, True),
]


class Block(torch.nn.Module):
    """x + fc2(gelu(fc1(layernorm(x)))): LayerNormLinear's norm parameters take the autograd
    route at the B step, the weights and biases the deferred W step."""

    def __init__(self, fused: bool):
        super().__init__()
        import fp8dp

        kw = {"fuse_wgrad_accumulation": fused, "delay_wgrad_compute": True}
        self.fc1 = fp8dp.LayerNormLinear(H, H, **kw)
        self.fc2 = fp8dp.Linear(H, H, **kw)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def _reference_block(x, p, i):
    def g(n):
        return p[f"{i}.{n}"]

    h = F.layer_norm(x, (H,), g("fc1.layer_norm_weight"), g("fc1.layer_norm_bias"), 1e-5)
    h = F.gelu(F.linear(h, g("fc1.weight"), g("fc1.bias")))
    return x + F.linear(h, g("fc2.weight"), g("fc2.bias"))


def _blocks(fused):
    torch.manual_seed(1234)  # the same model on every rank and in the reference
    return [Block(fused) for _ in range(N_BLOCKS)]


def _data(dp):
    g = torch.Generator().manual_seed(99)
    x = torch.randn(dp, N_MB * ROWS, H, generator=g)
    y = torch.randn(dp, N_MB * ROWS, H, generator=g)
    return x, y


def _reference(blocks, dp):
    """float64, one process: the mean over all dp × n_microbatches micro-batches of each one's
    MSE (what DDP's 1/dp average and Pipeline's 1/n_microbatches scaling compute)."""
    params = {
        f"{i}.{n}": p.detach().double().requires_grad_(True)
        for i, b in enumerate(blocks)
        for n, p in b.named_parameters()
    }
    x, y = _data(dp)
    losses = []
    for r in range(dp):
        for xm, ym in zip(x[r].double().chunk(N_MB), y[r].double().chunk(N_MB)):
            h = xm
            for i in range(N_BLOCKS):
                h = _reference_block(h, params, i)
            losses.append(F.mse_loss(h, ym))
    torch.stack(losses).mean().backward()
    return {k: (v.grad, (v - LR * v.grad).detach()) for k, v in params.items()}


def _run_case(groups, schedule, virtual, fused, fp8, distopt=False):
    import fp8dp
    from fp8dp.pipeline import Pipeline

    blocks = _blocks(fused)
    ref = _reference(blocks, groups.dp_size)
    forwards = [0] * N_BLOCKS
    for i, b in enumerate(blocks):
        b.register_forward_pre_hook(lambda *_, i=i: forwards.__setitem__(i, forwards[i] + 1))
    cfg = fp8dp.DistributedDataParallelConfig(
        delay_wgrad_compute=True,
        overlap_grad_reduce=True,
        bucket_size=300,
        grad_ledger=True,
        use_distributed_optimizer=distopt,
    )
    ex = torch.empty(ROWS, H)
    pp = Pipeline(
        blocks,
        groups,
        schedule=schedule,
        n_microbatches=N_MB,
        loss_fn=F.mse_loss,
        microbatch_input=ex,
        activation=ex,
        microbatch_output=ex,
        virtual_stages=virtual,
        ddp_config=cfg,
    )
    opts = [fp8dp.DistributedOptimizer(torch.optim.SGD, m, lr=LR) for m in pp.modules if distopt]
    x, y = _data(groups.dp_size)
    args = (x[groups.dp_rank],) if pp.is_first else ()
    target = y[groups.dp_rank] if pp.is_last else None
    # Two steps on the same parameters and data, both compared: DDP learns its readiness counts
    # in the first iteration and launches buckets from readiness (the last micro-batch's B and W)
    # only from the second on, so only the second exercises the sync policy with overlap.
    for _ in range(2):
        with fp8dp.fp8_autocast(enabled=fp8, fp8_recipe=fp8dp.DelayedScaling()):
            pp.step(*args, target=target)
        pp.update_fp8_scales()  # over the DP group: the registry check passes there
    # Static stage metadata: torch ran no shape-inference forward (under fp8_autocast it would be
    # the first cast, on uninitialised memory, and set the delayed scales).
    mine = [i for m in pp.modules for i in (int(n) for n in m.module.blocks)]
    assert [forwards[i] for i in mine] == [2 * N_MB] * len(mine), f"forwards per block: {forwards}"
    if distopt:  # reduce-scattered: main_grad holds this rank's chunk only; compare parameters
        for o in opts:
            o.step()
    worst = 0.0
    for ddp in pp.modules:
        for name, p in ddp.module.named_parameters():
            key = name.removeprefix("blocks.")
            g_ref, p_ref = ref[key]
            g = p.main_grad.double()
            err = 0.0 if distopt else ((g - g_ref).norm() / g_ref.norm()).item()
            if not distopt:
                with torch.no_grad():
                    p -= LR * p.main_grad  # the optimizer step
            perr = ((p.double() - p_ref).norm() / p_ref.norm()).item()
            tol = FP8_TOL if fp8 else FP32_TOL
            assert err < tol, f"{key}: main_grad relative error {err:.3g} >= {tol:.3g}"
            assert perr < tol, f"{key}: parameter relative error {perr:.3g} >= {tol:.3g}"
            worst = max(worst, err, perr)
    return worst


def _zbv_ok():
    try:
        check_backend("zbv", "gloo")
        return True
    except ValueError:
        return False


def _cases(pp_size):
    """The cases a layout can run: one block per stage at least (and zbv where this torch runs
    it on gloo: check_backend)."""
    return [c for c in CASES if pp_size * c[1] <= N_BLOCKS and (c[0] != "zbv" or _zbv_ok())]


# Each world runs every layout that fits it, one after the other (make_groups on the same world):
# one process start-up per world size, the slow part on a small machine.
PP_SIZES = {2: (2,), 4: (2, 4)}


def _worker(rank, world):
    """On every rank (harness.run_ranks): every case of every layout that fits the world, until
    the first failure; returns {(pp_size, case): ("pass", worst error) or ("fail", traceback)}."""
    from fp8dp.pipeline import make_groups

    results = {}
    for pp_size in PP_SIZES[world]:
        groups = make_groups(pp_size)
        for case in _cases(pp_size):
            try:
                results[pp_size, tuple(case)] = ("pass", _run_case(groups, *case))
            except Exception as e:  # noqa: BLE001  (reported per case by the pytest side)
                import traceback

                results[pp_size, tuple(case)] = ("fail", f"{e}\n{traceback.format_exc()}")
                return results  # the other ranks may now wait on this one: stop here
    return results


def _launch(world):
    return run_ranks(_worker, world, timeout=600)


@pytest.mark.parametrize("layout", [(2, 2), (4, 2), (4, 4)], ids=["pp2xdp1", "pp2xdp2", "pp4xdp1"])
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[
        f"{c[0]}-v{c[1]}-{'fused' if c[2] else 'unfused'}-{'fp8' if c[3] else 'fp32'}"
        + ("-distopt" if c[4:] and c[4] else "")
        for c in CASES
    ],
)
def test_pipeline_step_matches_float64_reference(layout, case):
    world, pp_size = layout
    if case[0] == "zbv" and not _zbv_ok():
        pytest.skip(f"zbv on gloo needs torch >= 2.13, this is {torch.__version__}")
    if case not in _cases(pp_size):
        pytest.skip(f"{case[1]} stages per rank × pp {pp_size} > {N_BLOCKS} blocks")
    res = _launch(world)
    case_key = (pp_size, case)
    for r, rank_res in enumerate(res):
        if case_key not in rank_res:
            # Every rank's failure: the first one to fail is often not rank 0 (the others then
            # only see its closed connection).
            failed = {
                rr: [(c, v[1]) for c, v in other.items() if v[0] == "fail"] or "none (died?)"
                for rr, other in enumerate(res)
            }
            pytest.fail(f"rank {r} did not run {case}; failures by rank: {failed}")
        status, detail = rank_res[case_key]
        assert status == "pass", f"rank {r}: {detail}"
        if case[3]:  # FP8 on: the error shows the casts ran
            assert detail > FP32_TOL, f"rank {r}: FP8 on but error {detail:.3g} as small as FP32's"
