"""The training demo under pipeline parallelism (C10 — pipelines), 4 CPU ranks on gloo under
torchrun (--device cpu: the tests say where their ranks run, not the machine): PP 2 x DP 2 trains
(finite, falling loss) and follows the DP 4 run of the same model, data, seed and global batch step
by step; a PP run resumed from a checkpoint continues bit-exactly.

Why the two layouts are comparable at all: the pipelines read exactly the DP run's global batch
(fp8dp/train/pipeline_run.py), every rank builds the same initial GPT from the seed, and AdamW
is elementwise, so sharding it over 2 or 4 ranks changes nothing.

Tolerances, derived:
- FP8 off (--compare-bf16's second run: FP32 parameters and GEMMs): each micro-batch's forward
  and backward are the same FP32 operations on the same bits in both layouts; what differs is the
  order in which the 8 micro-batch gradients are summed (DP 4: 2 per rank, then 4 ranks; PP: 4
  per pipeline, then 2) and the loss averages. A sum of n = 8 terms reordered moves by at most
  2·n·u relative (u = 2^-24), so each step's gradient agrees to ~1e-6. AdamW's update m/sqrt(v)
  is scale-free, so it passes relative errors on without gain, and the weights drift apart at
  most linearly over S steps: S·2·n·u ≈ 6e-6 relative for S = 6. We assert 1e-4 relative on
  every loss (a 10x margin for the parts not proven: elements whose gradient is near 0, where
  Adam's sign can flip, but whose effect on the loss is second order). Measured: 1.4e-8.
- FP8 on (delayed scaling): the layouts also differ in the first step's scales. A delayed-scaling
  tensor's first cast takes its own amax, and the casts after it in the step reuse that scale;
  in DP 4 every rank's first micro-batch sets it, in PP only the first micro-batch of each
  pipeline, so in step 1 half of the micro-batches are cast with another scale (from step 2 on
  both layouts scale by the MAX over the whole global batch and agree). That re-draws part of
  one step's FP8 rounding noise, so the runs can differ by about the FP8 noise's own effect on
  the loss, which the FP8-vs-FP32 difference of one run measures. We assert the issue's 1%
  (relative) and that the PP-vs-DP difference stays below 4 × the largest FP8-vs-FP32 gap plus
  the FP32 bound. Measured: PP vs DP 6.3e-4, DP 4 FP8 vs FP8 off 9.3e-4 (largest over the 9
  losses).
The schedule is zbv (2 stages per pipeline rank, in a V) where this torch runs it on gloo, and
zero_bubble with 2 virtual stages (interleaved placement) where it does not: the project's own
rule, fp8dp.pipeline.check_backend, refuses zbv on gloo before torch 2.13. Both pass on torch
2.13 (zero_bubble checked by making _schedule pass torch_version "2.11.0": FP8 off 1.4e-8, FP8
on 6.3e-4, the zbv numbers below).

Run time: two 4-rank launches, 47-81 s on the 2-core machine at load average 7-10 (other jobs
compiling); most of it is process start-up (a 1-step launch took 30 s there at load 7).
"""

import json
from pathlib import Path

import pytest
import torch
from harness import torchrun as launch
from state_compare import assert_identical

from fp8dp.pipeline import check_backend, stage_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.own_launch,
]  # starts ranks (pyproject markers)

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
# A small model that still learns in 6 steps: 2 layers x 32, sequences of 32 bytes; global batch
# 16 = 8 micro-batches of 2: DP 4 runs 2 per rank, PP 2 x DP 2 runs 4 per pipeline.
TINY = [
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.seq_len=32",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
    "train.warmup_steps=3",
    "train.lr=1e-2",
    "train.eval_batches=2",
    "ddp.bucket_size=3000",
]


def _schedule() -> str:
    """zbv where this torch runs it on gloo, else zero_bubble (module docstring)."""
    try:
        check_backend("zbv", "gloo")
        return "zbv"
    except ValueError:
        return "zero_bubble"


SCHEDULE = _schedule()
PP2 = [
    "parallel.pipeline_parallel_size=2",
    f"parallel.schedule={SCHEDULE}",
    "parallel.virtual_stages=2",
]
FP32_TOL = 1e-4  # relative, FP8 off: docstring
FP8_TOL = 0.01  # relative, FP8 on: the 1%; docstring


def _sets(*kv):
    return [a for item in kv for a in ("--set", item)]


def torchrun(args, timeout=300):
    rc, log = launch(
        "fp8dp.train",
        4,
        ["--config", REPO / "configs" / "demo.yaml", "--no-progress", "--device", "cpu", *args],
        timeout=timeout,
        module=True,
        cwd=REPO,
    )
    assert rc == 0, log[-4000:]


def _metrics(path):
    return [json.loads(line) for line in open(path)]


def _losses(path):
    """{(step, 'train_loss' | 'val_loss'): value}"""
    return {
        (r["step"], k): r[k] for r in _metrics(path) for k in ("train_loss", "val_loss") if k in r
    }


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("exclude", ["[]", "[head,qkv]"], ids=["all_fp8", "head_qkv_bf16"])
def test_pp2_dp2_trains_like_dp4(tmp_path, exclude):
    """fp8.exclude [head, qkv]: the pipeline's last block is the head outside FP8
    (pipeline_run._Head), its blocks run their QKV projections outside FP8."""
    common = _sets(*TINY, f"train.steps={STEPS}", "train.eval_every=3", f"fp8.exclude={exclude}")
    common += ["--compare-bf16"]
    torchrun(common + _sets(*PP2, f"out.dir={tmp_path / 'pp'}"))
    torchrun(common + _sets(f"out.dir={tmp_path / 'dp'}"))
    run = {
        (layout, fp8): _losses(tmp_path / layout / fp8 / "metrics.jsonl")
        for layout in ("pp", "dp")
        for fp8 in ("fp8", "nofp8")
    }
    keys = sorted(run["dp", "fp8"])
    assert len(keys) == STEPS + 3  # train loss each step, val loss at 0, 3, 6
    for k in run:
        assert sorted(run[k]) == keys, k
        assert all(torch.isfinite(torch.tensor(v)) for v in run[k].values()), k
    # The loss falls: bytes start uniform, ln(256) = 5.55; the byte frequencies alone reach ~3.3.
    for k in run:
        assert run[k][0, "val_loss"] == pytest.approx(5.55, abs=0.1), k
        assert run[k][STEPS, "val_loss"] < run[k][0, "val_loss"] - 0.5, (k, run[k])
        train = [run[k][s, "train_loss"] for s in range(1, STEPS + 1)]
        assert train[-1] < train[0] - 0.5, (k, train)
    fp32_err = max(_rel(run["pp", "nofp8"][s], run["dp", "nofp8"][s]) for s in keys)
    fp8_err = max(_rel(run["pp", "fp8"][s], run["dp", "fp8"][s]) for s in keys)
    fp8_gap = max(_rel(run["dp", "fp8"][s], run["dp", "nofp8"][s]) for s in keys)
    print(
        f"PP 2 x DP 2 vs DP 4, max relative loss difference over {len(keys)} losses: "
        f"FP8 off {fp32_err:.3g}, FP8 on {fp8_err:.3g}; DP 4 FP8 vs FP8 off {fp8_gap:.3g}"
    )
    for s in keys:
        print(s, {k: round(v[s], 6) for k, v in run.items()})
    assert fp32_err < FP32_TOL, fp32_err
    assert fp8_err < min(FP8_TOL, 4 * fp8_gap + FP32_TOL), (fp8_err, fp8_gap)


def test_pp_resume_is_bit_exact(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = _sets(*TINY, *PP2, "train.steps=6", "train.eval_every=3", "train.save_every=3")
    # Uninterrupted: 6 steps, checkpointing at step 3 (full/ckpt/step_000003) and at the end.
    torchrun(common + _sets(f"out.dir={full}") + ["--save", str(full / "ckpt")])
    torchrun(
        common
        + _sets(f"out.dir={resumed}")
        + ["--resume", str(full / "ckpt" / "step_000003"), "--save", str(resumed / "ckpt")]
    )
    a = {r["step"]: r for r in _metrics(full / "fp8" / "metrics.jsonl")}
    b = {r["step"]: r for r in _metrics(resumed / "fp8" / "metrics.jsonl")}
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):  # bit-exact: the same float, not merely close
        assert b[step]["train_loss"] == a[step]["train_loss"], step
    assert b[6]["val_loss"] == a[6]["val_loss"]
    for rank in range(4):  # each rank's stages: parameters, FP8 state and optimizer shards
        sa = torch.load(full / "ckpt" / f"rank{rank:03d}.pt", weights_only=False)
        sb = torch.load(resumed / "ckpt" / f"rank{rank:03d}.pt", weights_only=False)
        # zbv on PP 2: pipeline rank 0 (ranks 0, 1) holds stages 0 and 3, rank 1 stages 1 and 2;
        # zero_bubble: 0 and 2, and 1 and 3
        stages = [f"stage{s}" for s in stage_ranks(SCHEDULE, 2, 2)[rank // 2]]
        assert sorted({k.split(".")[0] for k in sa["model"]}) == stages, sorted(sa["model"])
        assert any(k.endswith("_extra_state") for k in sa["model"]), "no FP8 state saved"
        assert_identical(sa["model"], sb["model"], "model")
        assert_identical(sa["optimizer"], sb["optimizer"], "optimizer")


def test_pp2_dp2_tied_embeddings_train_like_dp4(tmp_path):
    """model.tie_embeddings (configs/demo_pp_tied.yaml): the head's weight is the token
    embedding. Under PP 2 x DP 2 (zbv: both on pipeline rank 0, in two stages, each with a copy)
    fp8dp.pipeline sums the copies' gradients (contract C15); the run must follow DP 4's, where
    the tie is one parameter in one DDP, as closely as the untied runs do: FP8 off, FP32_TOL (the
    same derivation as above: the order of the micro-batch sums differs, now also one more sum of
    two stage gradients, inside the 2·n·u per step bound).

    Measured: 2.9e-8. Evidence (tried, then reverted): reduce_grads removed from Pipeline.step,
    each copy then steps on its own stage's part of the gradient: 4.3e-3 (the train loss of step
    3 5.1111 against 5.1040), the test fails."""
    common = _sets(
        *TINY,
        f"train.steps={STEPS}",
        "train.eval_every=3",
        "fp8.enabled=false",
        "model.tie_embeddings=true",
    )
    torchrun(common + _sets(*PP2, f"out.dir={tmp_path / 'pp'}"))
    torchrun(common + _sets(f"out.dir={tmp_path / 'dp'}"))
    pp = _losses(tmp_path / "pp" / "nofp8" / "metrics.jsonl")
    dp = _losses(tmp_path / "dp" / "nofp8" / "metrics.jsonl")
    assert sorted(pp) == sorted(dp) and len(dp) == STEPS + 3, (sorted(pp), sorted(dp))
    err = max(_rel(pp[k], dp[k]) for k in dp)
    print(f"tied, PP 2 x DP 2 vs DP 4: max relative loss difference {err:.3g}")
    assert dp[STEPS, "val_loss"] < dp[0, "val_loss"] - 0.5, dp
    assert err < FP32_TOL, (err, {k: (pp[k], dp[k]) for k in sorted(dp)})
