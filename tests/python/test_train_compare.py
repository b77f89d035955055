"""fp8dp.train.compare on run directories written by hand: every FP8 run (delayed, current, block)
is compared with FP8 off, with the gaps and the speed-up computed from the metrics exactly; the
check misses a required run (delayed, current) when it is absent, the optional block run only when
it was trained and is off target.

Mutation tried (then reverted): FP8_RUNS without "block": test_every_fp8_run_is_compared_with_off
failed (no final gap for block, and its row missing from the table).
"""

import json

import pytest

from fp8dp.train import compare as cmp


def _write(base, name, sub, val, tokens_per_s):
    d = base / name / sub
    d.mkdir(parents=True)
    recs = [{"step": s, "val_loss": v} for s, v in val.items()]
    recs += [{"step": s, "train_loss": 1.0, "tokens_per_s": tokens_per_s} for s in range(11, 21)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_every_fp8_run_is_compared_with_off(tmp_path):
    off = {0: 6.0, 100: 2.0, 200: 1.0}
    _write(tmp_path, "off", "nofp8", off, 100.0)
    _write(tmp_path, "delayed", "fp8", {0: 6.0, 100: 2.2, 200: 1.5}, 130.0)
    _write(tmp_path, "block", "fp8", {0: 6.0, 100: 2.1, 200: 1.1}, 90.0)
    runs = cmp.load_runs(str(tmp_path))
    assert sorted(runs) == ["block", "delayed", "off"]
    res = cmp.compare(runs, after=50)
    block, delayed = res["runs"]["block"], res["runs"]["delayed"]
    # exact: |1.1 - 1.0| / 1.0 at the last common step; the curve gap is the largest after step 50
    assert block["final_gap"] == pytest.approx(0.1, rel=1e-12)
    assert block["final_gap_step"] == 200
    assert block["curve_gap"] == pytest.approx(0.1, rel=1e-12)
    assert delayed["final_gap"] == pytest.approx(0.5, rel=1e-12)
    assert block["speedup"] == pytest.approx(0.9, rel=1e-12)
    table = cmp.table(res)
    assert "FP8 block scaling" in table and "10.000%" in table
    assert "FP8 current" not in table  # a run that was not trained has no row


def test_check_requires_delayed_and_current_and_block_only_when_trained(tmp_path):
    off = {0: 6.0, 100: 2.0, 200: 1.0}
    _write(tmp_path, "off", "nofp8", off, 100.0)
    _write(tmp_path, "delayed", "fp8", {0: 6.0, 100: 2.0, 200: 1.001}, 130.0)
    _write(tmp_path, "current", "fp8", {0: 6.0, 100: 2.0, 200: 1.002}, 120.0)
    res = cmp.compare(cmp.load_runs(str(tmp_path)), after=50)
    assert cmp.check(res, final_tol=0.0025, curve_tol=0.01) == []  # block not trained: no miss
    _write(tmp_path, "block", "fp8", {0: 6.0, 100: 2.0, 200: 1.01}, 90.0)
    res = cmp.compare(cmp.load_runs(str(tmp_path)), after=50)
    bad = cmp.check(res, final_tol=0.0025, curve_tol=0.02)
    assert len(bad) == 1 and bad[0].startswith("block: final validation gap 1.000%")
    (tmp_path / "current" / "fp8" / "metrics.jsonl").unlink()
    res = cmp.compare(cmp.load_runs(str(tmp_path)), after=50)
    assert "current: no validation loss to compare with FP8 off" in cmp.check(res, 0.0025, 0.02)
