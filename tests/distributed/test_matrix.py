"""The distributed test matrix (matrix/) on gloo: every cell of the pairwise covering subset of
configs/test_matrix.yaml passes (one test per cell, all cells of a world size in one launch), and a
micro-batch counted twice or never makes its cells fail (so the checks bite)."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from harness import ROOT
from tests.distributed.matrix.runner import load_matrix, make_cells, run_matrix

CONFIG = ROOT / "configs" / "test_matrix.yaml"
CELLS = make_cells(load_matrix(str(CONFIG))[0], "gloo", full=False)


@pytest.fixture(scope="module")
def subset(tmp_path_factory):
    """The runner's report of the pairwise subset, {cell id: cell with its result}."""
    out = tmp_path_factory.mktemp("matrix") / "matrix.json"
    report = run_matrix("gloo", False, str(CONFIG), str(out), timeout=900, log=lambda _: None)
    return {c["id"]: c for c in report["cells"]}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=[c["id"] for c in CELLS])
def test_cell(subset, cell):
    got = subset[cell["id"]]
    if got["status"] != "pass":
        detail = "\n".join(got[k].rstrip() for k in ("traceback", "log_tail") if got.get(k))
        pytest.fail(
            f"{cell}\n{got['status']}: {got.get('error', 'a check exceeded its bound')} "
            f"(grad err/bound {got.get('grad_ratio')}, param err/bound "
            f"{got.get('param_ratio')})\n{detail}",
            pytrace=False,
        )


def test_subset_covers_every_value():
    # every value of every axis is exercised by some cell (and so by a passing test above)
    axes = yaml.safe_load(CONFIG.read_text())["axes"]
    assert len(CELLS) >= 12
    for name, values in axes.items():
        if name != "backend":
            assert {c[name] for c in CELLS} == set(values), name


def run_cli(tmp_path, config, *extra, timeout=900):
    out = tmp_path / "matrix.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "tests.distributed.matrix",
        "--backend",
        "gloo",
        "--config",
        str(config),
        "--json",
        str(out),
        *extra,
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p, json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("inject", ["double", "skip"])
def test_a_miscounted_microbatch_fails_its_cells(tmp_path, inject):
    # Two ranks, FP8 delayed scaling, delayed wgrad; FP32 and BF16 main_grad, with and without the
    # distributed optimizer (whose cells are checked through the trained parameters).
    raw = yaml.safe_load(CONFIG.read_text())
    raw["axes"].update(
        world_size=[2],
        module=["Linear"],
        recipe=["delayed"],
        bias=[True],
        delay_wgrad_compute=[True],
        fuse_wgrad_accumulation=[True],
        overlap_grad_reduce=[True],
        use_distributed_optimizer=[False, True],
        grad_dtype=["fp32", "bf16"],
        consumer=["ddp"],
        grad_reduce_wire=["fp32"],  # an FP8 wire's bound is wider than one micro-batch's share
    )
    raw["problem"]["steps"] = 1
    config = tmp_path / "m.yaml"
    config.write_text(yaml.safe_dump(raw))
    # --jobs 2: two concurrent launches of two cells each, merged into one report
    p, report = run_cli(tmp_path, config, "--inject", inject, "--jobs", "2")
    assert p.returncode == 1, p.stdout[-4000:]
    assert p.stdout.count("cell(s) in one torchrun launch (part ") == 2, p.stdout[-4000:]
    assert [c["status"] for c in report["cells"]] == ["FAIL"] * 4, report["cells"]
    # one micro-batch of 3 x 2 ranks out of place is far outside the bounds, not at their edge
    assert min(max(c["grad_ratio"], c["param_ratio"]) for c in report["cells"]) > 3
