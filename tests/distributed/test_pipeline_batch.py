"""A batch that does not fit the shapes a Pipeline was built with (C10 — pipelines) raises the same
ValueError on every rank before anything is sent, naming what was expected and what came; the
step changes nothing (main_grad bit-identical to before it) and the next good step runs as if
the bad one had never been tried.

gloo ranks, PP 2 × DP 1 (2 ranks) and PP 2 × DP 2 (4 ranks; there only data-parallel rank 1 is
given the bad batch, so the other replica's ranks, whose own batch is fine, must raise too).
Micro-batches are [2 sequences, 8 tokens, 16 features], 4 per step: the batch the pipeline was
built for is (8, 8, 16). Bad batches: a longer sequence (8, 12, 16), a shorter one (8, 6, 16),
7 sequences (not divisible by 4), 12 sequences (divisible, but micro-batches of 3), float64,
the target missing on the last stage, a target of another shape (microbatch_target declared).

Evidence (tried on this branch, then reverted): without the check in Pipeline.step (the
BatchCheck call removed) the first bad batch, a longer sequence, kills rank 1 (the receiving
stage) with SIGABRT inside gloo ("terminate called after throwing an instance of
'gloo::EnforceNotMet'", exit code -6), and rank 0 fails with "RuntimeError: ... Connection reset
by peer"; no rank raises the ValueError, and the test fails with "rank 0: RuntimeError: ...".
"""

import datetime

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks

N_MB, MB, SEQ, H = 4, 2, 8, 16
TIMEOUT_S = 60

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
GOOD = (N_MB * MB, SEQ, H)

# (name, input shape, input dtype, target: "good" / "none" / a shape)
BAD = [
    ("longer_sequence", (N_MB * MB, SEQ + 4, H), torch.float32, "good"),
    ("shorter_sequence", (N_MB * MB, SEQ - 2, H), torch.float32, "good"),
    ("not_divisible", (N_MB * MB - 1, SEQ, H), torch.float32, "good"),
    ("wrong_microbatch", (N_MB * 3, SEQ, H), torch.float32, "good"),
    ("float64", GOOD, torch.float64, "good"),
    ("no_target", GOOD, torch.float32, "none"),
    ("target_shape", GOOD, torch.float32, (N_MB * MB, SEQ + 1, H)),
]
# What every rank's message must say, per case (the expected and the given shapes).
EXPECT = {
    "longer_sequence": ["input: expected shape (8, 8, 16)", "got (8, 12, 16)"],
    "shorter_sequence": ["input: expected shape (8, 8, 16)", "got (8, 6, 16)"],
    "not_divisible": ["got (7, 8, 16): 7 rows do not split into 4 micro-batches of 2"],
    "wrong_microbatch": ["got (12, 8, 16): 12 rows do not split into 4 micro-batches of 2"],
    "float64": ["input: expected dtype float32, got float64"],
    "no_target": ["target: the last stage expected the loss's target", "got None"],
    "target_shape": ["target: expected shape (8, 8, 16)", "got (8, 9, 16)"],
}


def _worker(rank, world):
    """On every rank (harness.run_ranks, process group timeout TIMEOUT_S): one good step, each
    bad batch, one good step again; returns what each raised and whether main_grad changed."""
    import fp8dp
    from fp8dp.pipeline import Pipeline, make_groups

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    groups = make_groups(2, timeout=timeout)
    torch.manual_seed(0)
    blocks = [fp8dp.Linear(H, H, delay_wgrad_compute=True) for _ in range(2)]
    ex = torch.empty(MB, SEQ, H)
    pp = Pipeline(
        blocks,
        groups,
        schedule="1f1b",
        n_microbatches=N_MB,
        loss_fn=F.mse_loss,
        microbatch_input=ex,
        activation=ex,
        microbatch_output=ex,
        microbatch_target=ex,
        ddp_config=fp8dp.DistributedDataParallelConfig(delay_wgrad_compute=True),
    )
    g = torch.Generator().manual_seed(5 + groups.dp_rank)
    x, y = torch.randn(GOOD, generator=g), torch.randn(GOOD, generator=g)

    def good_step():
        pp.step(*((x,) if pp.is_first else ()), target=y if pp.is_last else None)
        return [p.main_grad.clone() for m in pp.modules for p in m.module.parameters()]

    out = {}
    try:
        before = good_step()
        for name, shape, dtype, tgt in BAD:
            # On DP 2 only the second replica's batch is bad (the first's ranks must raise too).
            bad_here = groups.dp_size == 1 or groups.dp_rank == 1
            xb = torch.randn(shape, dtype=dtype) if bad_here else x
            yb = y
            if bad_here and tgt == "none":
                yb = None
            elif bad_here and tgt != "good":
                yb = torch.randn(tgt)
            try:
                pp.step(*((xb,) if pp.is_first else ()), target=yb if pp.is_last else None)
                out[name] = "no error"
            except ValueError as e:
                out[name] = str(e)
            grads = [p.main_grad for m in pp.modules for p in m.module.parameters()]
            out[name + ":unchanged"] = all(torch.equal(a, b) for a, b in zip(before, grads))
        after = good_step()
        out["next_step_equal"] = all(torch.equal(a, b) for a, b in zip(before, after))
    except Exception as e:  # noqa: BLE001  (reported by the pytest side)
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _launch(world):
    return run_ranks(_worker, world, timeout=TIMEOUT_S * 6, pg_timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("world", [2, 4], ids=["pp2xdp1", "pp2xdp2"])
@pytest.mark.parametrize("case", [c[0] for c in BAD])
def test_bad_batch_raises_on_every_rank_before_anything_is_sent(world, case):
    res = _launch(world)
    for r, out in enumerate(res):
        assert "died" not in out, f"rank {r} died (exit code {out['died']}): {res}"
        assert "error" not in out, f"rank {r}: {out['error']}"
        msg = out[case]
        assert msg.startswith("Pipeline.step: the batch does not fit"), f"rank {r}: {msg}"
        for part in EXPECT[case]:
            assert part in msg, f"rank {r}: {part!r} not in {msg!r}"
        # The rank named: the first stage's for the input, the last's for the target (on DP 2
        # only replica 1's ranks, 1 and 3, were given the bad batch).
        culprit = (
            (1 if world == 2 else 3)
            if case.startswith(("no_target", "target"))
            else (0 if world == 2 else 1)
        )
        assert f"rank {culprit} (stages" in msg, f"rank {r}: {msg}"
        assert msg.count("(stages") == 1, f"rank {r}: {msg}"
        assert out[case + ":unchanged"], f"rank {r}: main_grad changed by the refused step"
        assert msg == res[0][case], f"rank {r} raised another message than rank 0"


@pytest.mark.parametrize("world", [2, 4], ids=["pp2xdp1", "pp2xdp2"])
def test_good_step_after_refused_ones_is_unchanged(world):
    res = _launch(world)
    for r, out in enumerate(res):
        assert "died" not in out and "error" not in out, f"rank {r}: {out}"
        assert out["next_step_equal"], f"rank {r}: the good step's main_grad differs"
