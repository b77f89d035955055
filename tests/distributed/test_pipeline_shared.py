"""Parameters shared between pipeline stages (C15 — shared across stages) across gloo ranks: after
each torch schedule's step, every stage's copy of a shared parameter holds the gradient of the
whole, unpipelined model (the sum of every use on every stage), compared with a float64
single-process reference in which the parameter is one tensor; the parameters after one SGD
step equal the reference's; and after two more steps (SGD, or AdamW through the distributed
optimizer) every copy on every rank is bit-identical.

Models (4 blocks, so 4 stages with two per rank on PP 2, or one per rank on PP 4):
- "emb": Megatron's tied embedding / output weight. Block 0 uses W in plain torch (autograd's
  route, at the B step), block 3 is an fp8dp.Linear whose weight IS W (the deferred W step,
  fused or not): W is on the first and the last stage, found by object identity.
- "module": "emb" plus one Block object placed as blocks 1 and 2, so all its parameters are on
  two stages (under zbv both on pipeline rank 1, whose second stage runs on a deep copy).
- "declared": as "emb" but the head has its own weight object, initialised differently, and
  Pipeline(shared_parameters=[["blocks.0.w", "blocks.3.head.weight"]]) ties it (Megatron builds
  its output layer untied): the head's copy starts from W's value (the broadcast from the first
  stage at construction), so the reference is the "emb" model.
- "emb_rev": "emb" tied the other way round (block 0's w = the head's weight object), so the
  first stage holds an object that the delayed head marked skip_backward_post_hook although no
  module of that stage computes its gradient later: the stage's copy must take autograd's route.
Layouts: PP 2 × DP 1, PP 2 × DP 2 (Megatron rank order), PP 4 × DP 1 (one stage per rank only);
plain data parallelism (main_grad compared) and ZeRO-1 (parameters compared: main_grad holds
only the owned chunks).

Tolerance: FP8 off; the same derivation as test_pipeline_dist.py, (2L + 2)·T·u relative per
parameter with L = 4 blocks and T = 128 rows, ≈ 7.6e-5 (a worst-case bound; the sum of two
stages' gradients adds one rounding, far inside it).

Evidence (tried on this branch, then reverted; one launch of the cases named):
- reduce_grads (the sum over the copies) removed from Pipeline.step: emb 1f1b and zbv, plain DP,
  PP 2 × DP 1 and × DP 2: "blocks.0.w: main_grad relative error 0.94" (0.965 on DP 2), the
  head's copy 0.354, and after 3 steps "the copy of stage 3 on rank 0 differs from stage 0's
  ... by 0.215"; ZeRO-1 (1f1b, module): "parameter relative error 0.0824" on W, 0.0566 on the
  Block placed twice (a parameter error: lr × the missing part of the gradient).
- ZeRO-1 through the plain-DP path (the replica's copies summed over the embedding group,
  owned elements or not): PP 2 × DP 2 1f1b: "blocks.0.w: parameter relative error 0.0433" and
  the copies 0.0845 apart after 3 steps; PP 2 × DP 1 passes (one owner per stage). With
  300-element buckets it passed on PP 2 × DP 2 too, as both stages then split W alike; hence one
  bucket per stage in the ZeRO-1 cases.
- broadcast_initial skipped: "declared" fails, the head's copy starting from its own init
  ("blocks.3.head.weight: parameter relative error 1.15", copies 0.933 apart).
- clear_foreign_skip_flags skipped: "emb_rev" refuses at construction on the first stage,
  "parameter 'blocks.0.w' has skip_backward_post_hook=True but its module First has no
  register_wgrad_accumulation_and_reduce_hooks()".
- untie_local_stages giving the blocks as passed: zbv refuses at construction, "parameter
  'blocks.3.head.weight' is already managed by another fp8dp.DistributedDataParallel".
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks

from fp8dp.pipeline import check_backend

H, ROWS, N_MB, N_BLOCKS, LR = 16, 16, 4, 4, 0.5
TIMEOUT_S = 60

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
FP32_TOL = (2 * N_BLOCKS + 2) * (N_MB * ROWS * 2) * 2.0**-24  # docstring

CASES = [
    # (schedule, virtual_stages, fused, zero1, model)
    ("1f1b", 1, False, False, "emb"),
    ("1f1b", 1, True, True, "emb"),
    ("interleaved_1f1b", 2, False, False, "emb"),
    ("interleaved_1f1b", 2, True, True, "emb"),
    ("zero_bubble", 1, True, False, "emb"),
    ("zero_bubble", 2, False, True, "emb"),
    ("zbv", 2, False, False, "emb"),
    ("zbv", 2, True, True, "emb"),
    ("1f1b", 1, True, False, "module"),
    ("interleaved_1f1b", 2, False, True, "module"),
    ("zbv", 2, True, False, "module"),
    ("zbv", 2, False, True, "module"),
    ("1f1b", 1, False, True, "declared"),
    ("1f1b", 1, False, False, "emb_rev"),
    ("zbv", 2, True, True, "emb_rev"),
    ("zbv", 2, True, False, "declared"),
]


def _fp8dp_linear(fused):
    import fp8dp

    return fp8dp.Linear(H, H, fuse_wgrad_accumulation=fused, delay_wgrad_compute=True)


class First(torch.nn.Module):
    """The "embedding": the shared weight in plain torch."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(H, H) * 0.3)

    def forward(self, x):
        return x + F.gelu(F.linear(x, self.w))


class Block(torch.nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.fc1, self.fc2 = _fp8dp_linear(fused), _fp8dp_linear(fused)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Last(torch.nn.Module):
    """The "output head": an fp8dp.Linear (deferred W) after a norm."""

    def __init__(self, fused):
        super().__init__()
        self.head = _fp8dp_linear(fused)

    def forward(self, x):
        return self.head(F.layer_norm(x, (H,)))


def _model(kind, fused):
    """The blocks on every rank (the same seed) and the shared_parameters declaration."""
    torch.manual_seed(1234)
    first, b1, b2, last = First(), Block(fused), Block(fused), Last(fused)
    if kind == "module":
        b2 = b1
    if kind == "declared":
        return [first, b1, b2, last], [["blocks.0.w", "blocks.3.head.weight"]]
    if kind == "emb_rev":  # tied the other way: the head's object (marked delayed) in block 0
        first.w = last.head.weight
        return [first, b1, b2, last], None
    last.head.weight = first.w
    return [first, b1, b2, last], None


def _reference(blocks, dp):
    """float64, one process, the model unpipelined: {id(original parameter): (grad, parameter
    after SGD)}; a parameter reached twice is one tensor (the declared tie made one too)."""
    p64 = {}
    for b in blocks:
        for p in b.parameters():
            p64.setdefault(id(p), p.detach().double().requires_grad_(True))
    first, b1, b2, last = blocks
    w = p64[id(first.w)]
    head_w = w  # tied, found or declared: the head's copy starts from W and is summed with it

    def block(x, b):
        h = F.gelu(F.linear(x, p64[id(b.fc1.weight)], p64[id(b.fc1.bias)]))
        return x + F.linear(h, p64[id(b.fc2.weight)], p64[id(b.fc2.bias)])

    x, y = _data(dp)
    losses = []
    for r in range(dp):
        for xm, ym in zip(x[r].double().chunk(N_MB), y[r].double().chunk(N_MB)):
            h = xm + F.gelu(F.linear(xm, w))
            h = block(block(h, b1), b2)
            h = F.linear(F.layer_norm(h, (H,)), head_w, p64[id(last.head.bias)])
            losses.append(F.mse_loss(h, ym))
    torch.stack(losses).mean().backward()
    out = {k: (v.grad, (v - LR * v.grad).detach()) for k, v in p64.items() if v.grad is not None}
    out[id(last.head.weight)] = out[id(first.w)]  # "declared": the head's own object
    return out


def _data(dp):
    g = torch.Generator().manual_seed(99)
    x = torch.randn(dp, N_MB * ROWS, H, generator=g)
    y = torch.randn(dp, N_MB * ROWS, H, generator=g)
    return x, y


def _run_case(groups, schedule, virtual, fused, zero1, kind):
    import fp8dp
    from fp8dp.pipeline import Pipeline

    blocks, declared = _model(kind, fused)
    ref = _reference(blocks, groups.dp_size)
    cfg = fp8dp.DistributedDataParallelConfig(
        delay_wgrad_compute=True,
        overlap_grad_reduce=True,
        # ZeRO-1: one bucket per stage, so the shared parameter's elements are owned by other
        # data-parallel ranks on each stage (one 300-element bucket each would split it alike on
        # both, and a sum over the replica's copies would pass by that coincidence).
        bucket_size=10**6 if zero1 else 300,
        grad_ledger=True,
        use_distributed_optimizer=zero1,
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
        shared_parameters=declared,
    )
    # W, and for "module" the Block's four parameters too.
    assert len(pp.shared) == (5 if kind == "module" else 1), [t.describe() for t in pp.shared]
    x, y = _data(groups.dp_size)
    args = (x[groups.dp_rank],) if pp.is_first else ()
    target = y[groups.dp_rank] if pp.is_last else None
    opts = [fp8dp.DistributedOptimizer(torch.optim.SGD, m, lr=LR) for m in pp.modules if zero1]
    for _ in range(2):  # the second step launches buckets from readiness (test_pipeline_dist.py)
        pp.step(*args, target=target)
    for o in opts:
        o.step()

    def original(name):  # the parameter of the blocks as passed (a deep copy's source)
        _, i, path = name.split(".", 2)
        return blocks[int(i)].get_parameter(path)

    # Failures are collected, not raised at once: every rank then runs the same collectives
    # below, whatever its checks found (a rank that stopped would leave the others waiting).
    bad = []
    for ddp in pp.modules:
        for name, p in ddp.module.named_parameters():
            g_ref, p_ref = ref[id(original(name))]
            if not zero1:
                err = ((p.main_grad.double() - g_ref).norm() / g_ref.norm()).item()
                if not err < FP32_TOL:
                    bad.append(f"{name}: main_grad relative error {err:.3g}")
                with torch.no_grad():
                    p -= LR * p.main_grad
            perr = ((p.double() - p_ref).norm() / p_ref.norm()).item()
            if not perr < FP32_TOL:
                bad.append(f"{name}: parameter relative error {perr:.3g}")
    # Two more steps; then every copy of every shared parameter, on every rank, is the same.
    opts = [fp8dp.DistributedOptimizer(torch.optim.AdamW, m, lr=1e-2) for m in pp.modules if zero1]
    for _ in range(2):
        pp.step(*args, target=target)
        for o in opts:
            o.step()
        if not zero1:
            with torch.no_grad():
                for ddp in pp.modules:
                    for p in ddp.module.parameters():
                        p -= LR * p.main_grad
    mine = {}
    for t in pp.shared:
        for s, n in t.copies:
            if s in pp.stage_indices:
                m = pp.modules[pp.stage_indices.index(s)].module
                mine[t.copies[0][1], s, n] = m.get_parameter(n).detach().clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for t in pp.shared:
        key = t.copies[0][1]
        copies = [
            (r, s, v) for r, d in enumerate(everyone) for (k, s, _), v in d.items() if k == key
        ]
        assert len(copies) == len(t.copies) * groups.dp_size, (key, len(copies))
        r0, s0, v0 = copies[0]
        for r, s, v in copies[1:]:
            if not torch.equal(v, v0):
                diff = (v - v0).abs().max().item()
                bad.append(
                    f"{key}: the copy of stage {s} on rank {r} differs from stage {s0}'s on rank "
                    f"{r0} by {diff:.3g} after 3 steps"
                )
    assert not bad, "; ".join(bad)


def _zbv_ok():
    try:
        check_backend("zbv", "gloo")
        return True
    except ValueError:
        return False


def _cases(pp_size):
    return [c for c in CASES if pp_size * c[1] <= N_BLOCKS and (c[0] != "zbv" or _zbv_ok())]


PP_SIZES = {2: (2,), 4: (2, 4)}


def _worker(rank, world):
    """On every rank (harness.run_ranks, process group timeout TIMEOUT_S: a rank that fails
    inside a collective leaves the others waiting): every case of every layout that fits the
    world, until a case fails on any rank; returns {(pp_size, case): (status, detail)}."""
    from fp8dp.pipeline import make_groups

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    results = {}
    for pp_size in PP_SIZES[world]:
        groups = make_groups(pp_size, timeout=timeout)
        for case in _cases(pp_size):
            key = (pp_size, tuple(case))
            try:
                _run_case(groups, *case)
                results[key] = ("pass", "")
            except Exception as e:  # noqa: BLE001  (reported per case by the pytest side)
                import traceback

                results[key] = ("fail", f"{e}\n{traceback.format_exc()}")
            # A rank whose check failed after the case's last collective would let the
            # others run on into the next case without it: agree, and stop together.
            status = [None] * world
            dist.all_gather_object(status, results[key][0])
            if "fail" in status:
                return results
    return results


def _launch(world):
    return run_ranks(_worker, world, timeout=600, pg_timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("layout", [(2, 2), (4, 2), (4, 4)], ids=["pp2xdp1", "pp2xdp2", "pp4xdp1"])
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[
        f"{c[4]}-{c[0]}-v{c[1]}-{'fused' if c[2] else 'unfused'}-{'zero1' if c[3] else 'dp'}"
        for c in CASES
    ],
)
def test_shared_parameter_matches_unpipelined_float64(layout, case):
    world, pp_size = layout
    if case[0] == "zbv" and not _zbv_ok():
        pytest.skip(f"zbv on gloo needs torch >= 2.13, this is {torch.__version__}")
    if case not in _cases(pp_size):
        pytest.skip(f"{case[1]} stages per rank × pp {pp_size} > {N_BLOCKS} blocks")
    res = _launch(world)
    key = (pp_size, case)
    for r, rank_res in enumerate(res):
        if key not in rank_res:
            failed = {
                rr: [(c, v[1]) for c, v in other.items() if v[0] == "fail"] or "none (died?)"
                for rr, other in enumerate(res)
            }
            pytest.fail(f"rank {r} did not run {case}; failures by rank: {failed}")
        status, detail = rank_res[key]
        assert status == "pass", f"rank {r}: {detail}"


def _tie_on_rank0_only(rank, world):
    """A model tied on rank 0 only: building the Pipeline must raise on both ranks (the ranks
    agree on the ties before any group is made), so each rank returns the error it got."""
    import fp8dp
    from fp8dp.pipeline import Pipeline, make_groups

    groups = make_groups(2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    blocks = [fp8dp.Linear(16, 16, delay_wgrad_compute=True) for _ in range(2)]
    if rank == 0:
        blocks[1].weight = blocks[0].weight
    ex = torch.empty(16, 16)
    try:
        Pipeline(
            blocks,
            groups,
            schedule="1f1b",
            n_microbatches=2,
            loss_fn=F.mse_loss,
            microbatch_input=ex,
            activation=ex,
            microbatch_output=ex,
            ddp_config=fp8dp.DistributedDataParallelConfig(delay_wgrad_compute=True),
        )
        return "no error"
    except Exception as e:  # noqa: BLE001  (the message is what the test checks)
        return f"{type(e).__name__}: {e}"


def test_ranks_that_tie_differently_fail_together():
    """Ranks that found different ties fail together at construction, with one message naming
    each rank's ties, instead of hanging. Evidence (tried, then reverted, when the test had its
    own launcher): check_ranks_agree removed, rank 0 (which ties W) calls new_group for a group
    rank 1 never makes and waits for it: "rank 0: RuntimeError: Wait timeout" after 30 s."""
    for r, out in enumerate(run_ranks(_tie_on_rank0_only, 2, pg_timeout_s=TIMEOUT_S)):
        assert out.startswith(
            "ValueError: Pipeline shared parameters (build the same model, with the same ties"
        ), f"rank {r}: {out}"
        assert (
            "disagree on shared parameters: rank 0 [stage 0: blocks.0.weight, stage 1: blocks.1"
            in out
        ), out
        assert "rank 1 none" in out, out
