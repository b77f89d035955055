"""The distributed test matrix on gloo: the pairwise covering subset of configs/test_matrix.yaml
passes, and a micro-batch counted twice or never makes its cells fail (so the checks bite)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def run_matrix(tmp_path, config, *extra, timeout=900):
    out = tmp_path / "matrix.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    cmd = [sys.executable, "-m", "fp8dp.testing.matrix", "--backend", "gloo", "--config",
           str(config), "--json", str(out), *extra]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return p, json.loads(out.read_text())


def test_pairwise_subset_passes_on_gloo(tmp_path):
    p, report = run_matrix(tmp_path, REPO / "configs" / "test_matrix.yaml")
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    s = report["summary"]
    assert s["pass"] == s["total"] >= 12 and s["skipped"] == 0
    # every value of every axis was exercised by a passing cell
    axes = yaml.safe_load((REPO / "configs" / "test_matrix.yaml").read_text())["axes"]
    for name, values in axes.items():
        if name != "backend":
            assert {c[name] for c in report["cells"]} == set(values), name


@pytest.mark.parametrize("inject", ["double", "skip"])
def test_a_miscounted_microbatch_fails_its_cells(tmp_path, inject):
    # Two ranks, FP8 delayed scaling, delayed wgrad; FP32 and BF16 main_grad, with and without the
    # distributed optimizer (whose cells are checked through the trained parameters).
    raw = yaml.safe_load((REPO / "configs" / "test_matrix.yaml").read_text())
    raw["axes"].update(world_size=[2], module=["Linear"], recipe=["delayed"], bias=[True],
                       delay_wgrad_compute=[True], fuse_wgrad_accumulation=[True],
                       overlap_grad_reduce=[True], use_distributed_optimizer=[False, True],
                       grad_dtype=["fp32", "bf16"], consumer=["ddp"])
    raw["problem"]["steps"] = 1
    config = tmp_path / "m.yaml"
    config.write_text(yaml.safe_dump(raw))
    # --jobs 2: two concurrent launches of two cells each, merged into one report
    p, report = run_matrix(tmp_path, config, "--inject", inject, "--jobs", "2")
    assert p.returncode == 1, p.stdout[-4000:]
    assert p.stdout.count("cell(s) in one torchrun launch (part ") == 2, p.stdout[-4000:]
    assert [c["status"] for c in report["cells"]] == ["FAIL"] * 4, report["cells"]
    # one micro-batch of 3 x 2 ranks out of place is far outside the bounds, not at their edge
    assert min(max(c["grad_ratio"], c["param_ratio"]) for c in report["cells"]) > 3
