"""Launches nccl_worker.py under torchrun with one GPU per rank (2 ranks) and checks that every case
passed on every rank. Skips without 2 GPUs or without fp8dp's native NCCL communicator."""

import os
import re
import subprocess
import sys

import pytest
import torch

import fp8dp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
WORLD = 2


def _skip_reason():
    ok, reason = fp8dp.cuda_available(return_reason=True)
    if not ok:
        return reason
    if torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} GPUs, torch sees {torch.cuda.device_count()}"
    if not fp8dp._C.native_nccl_available():
        return "fp8dp was built without the native NCCL communicator"
    return None


def test_nccl_cases_pass_on_every_rank():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    import nccl_worker

    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={WORLD}", os.path.join(HERE, "nccl_worker.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    results = re.findall(r"\[rank (\d+)/\d+\] (PASS|FAIL) (\w+\[[^\]]*\])", out)
    failed = sorted({name for _, status, name in results if status == "FAIL"})
    assert proc.returncode == 0 and not failed, f"failed: {failed}\n{out[-6000:]}"
    for name, _, _ in nccl_worker.CASES:
        ranks = {int(r) for r, status, n in results if n == name and status == "PASS"}
        assert ranks == set(range(WORLD)), f"{name}: passed on ranks {sorted(ranks)}"
