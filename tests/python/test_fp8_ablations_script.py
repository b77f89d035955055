"""scripts/fp8_ablations.sh across several GPU commands: with BUDGET each run stops at a step
boundary, keeps its checkpoint and exits 3; the same command resumes it, and the pieces add up to
the run trained in one go, bit for bit (the training loop's resume guarantee, through the script's
bookkeeping). On the CI-size config with the CPU, so it runs everywhere. Mutation (2026-12-05):
without the script's --resume every launch starts again at step 0 and never gets there (30
launches, all exit 3): the test fails."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "fp8_ablations.sh")
STOP = 30


def run(outdir, budget=None):
    env = dict(os.environ, CONFIG="configs/ci_convergence.yaml", OUTDIR=str(outdir), STOP=str(STOP))
    env["PY"] = sys.executable
    env.pop("BUDGET", None)
    if budget is not None:
        env["BUDGET"] = str(budget)
    return subprocess.run(
        ["bash", SCRIPT, "off"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def losses(outdir):
    with open(os.path.join(outdir, "off", "nofp8", "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r["train_loss"] for r in recs if "train_loss" in r}


@pytest.mark.slow
def test_budgeted_pieces_equal_one_run(tmp_path):
    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    # A one-second budget stops each launch after a few steps (about 10 steps a second here), so
    # the run takes several launches; each must make progress.
    rcs, reached = [], []
    for _ in range(30):
        r = run(tmp_path / "pieces", budget=1)
        rcs.append(r.returncode)
        assert r.returncode in (0, 3), r.stdout + r.stderr
        ckpt = tmp_path / "pieces" / "off" / "ckpt" / "meta.json"
        reached.append(json.loads(ckpt.read_text())["step"] if ckpt.exists() else STOP)
        if r.returncode == 0:
            break
    assert rcs[-1] == 0 and rcs.count(3) >= 1, rcs
    assert reached == sorted(set(reached)), f"a launch made no progress: {reached}"
    assert not (tmp_path / "pieces" / "off" / "ckpt").exists()  # removed once STOP is reached
    a, b = losses(tmp_path / "whole"), losses(tmp_path / "pieces")
    assert sorted(a) == sorted(b) == list(range(1, STOP + 1))
    assert a == b  # exact: resume is bit-exact
    # Once reached, the same command trains nothing again.
    again = run(tmp_path / "pieces", budget=1)
    assert again.returncode == 0 and f"at step {STOP} already" in again.stdout, again.stdout
