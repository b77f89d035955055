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


def _write_seed(base, seed, name, sub, val, tokens_per_s=100.0):
    _write(base / f"seed{seed}", name, sub, val, tokens_per_s)


def test_seeds_compare_mean_curves_and_paired_gaps(tmp_path):
    """Two seeds with FP8 off and delayed, a third with delayed alone (no pair: left out of
    delayed's comparison). Every number below is computed by hand from the written losses."""
    _write_seed(tmp_path, 1, "off", "nofp8", {0: 6.0, 100: 2.0, 200: 1.0}, 100.0)
    _write_seed(tmp_path, 1, "delayed", "fp8", {0: 6.0, 100: 2.1, 200: 1.01}, 130.0)
    _write_seed(tmp_path, 2, "off", "nofp8", {0: 6.0, 100: 2.2, 200: 1.02}, 100.0)
    _write_seed(tmp_path, 2, "delayed", "fp8", {0: 6.0, 100: 2.2, 200: 1.0}, 130.0)
    _write_seed(tmp_path, 3, "delayed", "fp8", {0: 6.0, 100: 9.0, 200: 9.0}, 130.0)
    seeds = cmp.seed_dirs(str(tmp_path))
    assert list(seeds) == [1, 2, 3]
    assert cmp.load_runs(str(tmp_path)) == {}  # the runs are one level down
    per_seed = {s: cmp.load_runs(d) for s, d in seeds.items()}
    res = cmp.compare_seeds(per_seed, after=50)
    d, off = res["runs"]["delayed"], res["runs"]["off"]
    assert d["seeds"] == [1, 2] and off["seeds"] == [1, 2]
    # mean curves: delayed 1.005 at step 200 and 2.15 at 100, off 1.01 and 2.1
    assert d["final_val_loss"] == pytest.approx(1.005, rel=1e-12)
    assert d["final_gap"] == pytest.approx(0.005 / 1.01, rel=1e-9)
    assert d["final_gap_signed"] == pytest.approx(-0.005 / 1.01, rel=1e-9)
    assert d["curve_gap"] == pytest.approx(0.05 / 2.1, rel=1e-9)
    assert d["curve_gap_step"] == 100
    gaps = [0.01, (1.0 - 1.02) / 1.02]
    assert d["paired_gaps"] == pytest.approx(gaps, rel=1e-12)
    mean = (gaps[0] + gaps[1]) / 2
    sd = abs(gaps[0] - gaps[1]) / 2**0.5  # the sample sd of two values
    half = 12.706 * sd / 2**0.5  # t(0.975, 1 dof)
    assert d["paired_gap_mean"] == pytest.approx(mean, rel=1e-12)
    assert d["paired_gap_ci95"] == pytest.approx([mean - half, mean + half], rel=1e-9)
    assert off["final_val_loss_sd"] == pytest.approx(0.02 / 2**0.5, rel=1e-9)
    assert off["final_spread"] == pytest.approx(0.02 / 2**0.5 / 1.01, rel=1e-9)
    assert d["speedup"] == pytest.approx(1.3, rel=1e-12)
    assert sorted(res["per_seed"]) == ["1", "2", "3"]  # each seed's own comparison kept
    assert res["per_seed"]["1"]["runs"]["delayed"]["final_gap"] == pytest.approx(0.01)
    md = cmp.table_seeds(res)
    assert (
        "| FP8 delayed (HYBRID) | 2 | 1.0050 ± 0.0071 | -0.495% | -0.480% [-19.290%, +18.329%] |"
        in md
    )
    assert "| FP8 off | 2 | 1.0100 ± 0.0141 | – | – |" in md


def test_seeds_main_checks_the_gap_of_the_means(tmp_path, capsys):
    for seed, (o, f) in {1: (1.0, 1.001), 2: (1.02, 1.021)}.items():
        _write_seed(tmp_path, seed, "off", "nofp8", {0: 6.0, 100: 2.0, 200: o})
        _write_seed(tmp_path, seed, "delayed", "fp8", {0: 6.0, 100: 2.0, 200: f})
        _write_seed(tmp_path, seed, "current", "fp8", {0: 6.0, 100: 2.0, 200: f + 0.02})
    assert cmp.main([str(tmp_path), "--after", "50", "--check"]) == 1
    out = capsys.readouterr().out
    assert "MISSED current: final validation gap 2.079% > 0.250% (step 200)" in out
    assert "MISSED delayed" not in out  # 0.001 / 1.01 = 0.099%; current 0.021 / 1.01
    assert "delayed: paired gap +0.099%" in out and "over 2 seeds" in out
    res = json.loads((tmp_path / "compare.json").read_text())
    assert res["seeds"] == [1, 2] and res["runs"]["delayed"]["seeds"] == [1, 2]
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_t975():
    assert cmp.t975(1) == 12.706 and cmp.t975(4) == 2.776 and cmp.t975(31) == 1.96
    with pytest.raises(ValueError, match="t975: dof: expected >= 1, got 0"):
        cmp.t975(0)
