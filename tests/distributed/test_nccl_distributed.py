"""The 2-GPU NCCL tests: torchrun with one GPU per rank (2 ranks), checking that every case passed
on every rank. Two workers:
- nccl_worker.py: the native NCCL communicator itself (collectives, timeouts) on a gloo group;
- ddp_worker.py with FP8DP_DDP_BACKEND=nccl: the DDP cases that run on gloo in CPU CI, here on a
  pure NCCL process group with CUDA models and fp8dp's native communicator (comm_backend "auto").
Both skip without 2 GPUs or without fp8dp's native NCCL communicator."""

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


def _run_worker(worker, cases, extra_env=None, timeout=300):
    """torchrun `worker` on WORLD GPUs; asserts that each case of `cases` passed (or, for
    ddp_worker's GLOO_ONLY cases, was skipped) on every rank and nothing failed."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.update(extra_env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        os.path.join(HERE, worker),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    results = re.findall(r"\[rank (\d+)/\d+\] (PASS|FAIL|SKIP) (\w+\[[^\]]*\])", out)
    failed = sorted({name for _, status, name in results if status == "FAIL"})
    assert proc.returncode == 0 and not failed, f"failed: {failed}\n{out[-6000:]}"
    for name, expected in cases:
        ranks = {int(r) for r, status, n in results if n == name and status == expected}
        assert ranks == set(range(WORLD)), f"{name}: {expected} on ranks {sorted(ranks)}"


def test_nccl_cases_pass_on_every_rank():
    if _skip_reason():
        pytest.skip(_skip_reason())
    import nccl_worker

    _run_worker("nccl_worker.py", [(name, "PASS") for name, _, _ in nccl_worker.CASES])


def test_ddp_cases_pass_on_nccl():
    """Every ddp_worker case on NCCL (tolerances widened where the GPU reorders sums; see
    ddp_worker.use_backend and wgrad_magnitudes); the gloo-only ones are reported as skipped."""
    if _skip_reason():
        pytest.skip(_skip_reason())
    import ddp_worker

    cases = [
        (name, "SKIP" if fn.__name__ in ddp_worker.GLOO_ONLY else "PASS")
        for name, fn, _ in ddp_worker.CASES
    ]
    _run_worker("ddp_worker.py", cases, {"FP8DP_DDP_BACKEND": "nccl"}, timeout=480)
