"""Launches the DDP worker under torchrun (gloo, CPU) at world sizes 2 and 3 (3 exercises uneven
padding) and checks that every case passed on every rank. One launch runs all cases: process
start-up dominates on small machines."""

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _case_names():
    import ddp_worker

    return [name for name, _, _ in ddp_worker.CASES]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_cases_pass_on_every_rank(world_size):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        os.path.join(HERE, "ddp_worker.py"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    results = re.findall(r"\[rank (\d+)/\d+\] (PASS|FAIL) (\w+\[[^\]]*\])", out)
    failed = sorted({name for _, status, name in results if status == "FAIL"})
    assert proc.returncode == 0 and not failed, f"failed: {failed}\n{out[-6000:]}"
    for name in _case_names():
        ranks = {int(r) for r, status, n in results if n == name and status == "PASS"}
        assert ranks == set(range(world_size)), f"{name}: passed on ranks {sorted(ranks)}"
