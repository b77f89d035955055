"""On a GPU a training step of the demo's loop (data, forward, backward, backward_dw, the NaN
check, the clip, the optimizer, the FP8 scale update, the loss mean) launches without making the
host wait for the device, so the host runs ahead and the GPU never idles behind a read.

The check is torch's own: torch.cuda.set_sync_debug_mode("error") raises on every synchronizing
call (a stream or device synchronize, a blocking copy such as .cpu(), .item() or a pageable
.to("cuda")). It is on for the whole of steps 3-6 (steps 1-2 warm up: allocator, cuBLASLt plans,
the NCCL communicator); a sync there fails the run with the call's traceback. Covered by it:
the batch copies (fp8dp.train.data.to_device), ddp.defer_nan_check (the last step's flags read
from pinned memory behind an event, not with a blocking copy queued after this step's
backward) and the clip's coefficient on the device. The loop's deliberate reads (a step's loss,
one step late; the validation) happen outside run.step and are not covered; nor are fp8dp's own
raw CUDA synchronizations, which torch's debug mode does not see (one-time setup only: the
cuBLASLt autotuning of a new plan, the activation tables).

Skipped without a GPU. Not yet run on a GPU when written (2026-12-06).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fp8dp

pytestmark = pytest.mark.skipif(
    not fp8dp.cuda_available(), reason="needs a CUDA GPU and fp8dp built with CUDA"
)
REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import sys
import torch
from fp8dp.train import loop
from fp8dp.train.__main__ import main

step = loop._Run.step


def strict(self, s):
    if s < 2:
        return step(self, s)
    torch.cuda.set_sync_debug_mode("error")
    try:
        return step(self, s)
    finally:
        torch.cuda.set_sync_debug_mode("default")


loop._Run.step = strict
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "fp8-off"])
def test_a_training_step_never_waits_for_the_device(tmp_path, fp8):
    cfg = tmp_path / "tiny.yaml"
    out = tmp_path / "run"
    cfg.write_text(
        "model: {n_layer: 2, d_model: 64, n_head: 2, seq_len: 32, params_dtype: bfloat16}\n"
        "train: {steps: 6, global_batch_size: 4, micro_batch_size: 2, warmup_steps: 1,\n"
        "        eval_every: 6, eval_batches: 1, clip_grad: 1.0}\n"
        "ddp: {delay_wgrad_compute: true, fuse_wgrad_accumulation: true,\n"
        "      overlap_grad_reduce: true, check_for_nan_in_grad: true, defer_nan_check: true}\n"
        f"fp8: {{enabled: {'true' if fp8 else 'false'}}}\n"
        f"data: {{path: {REPO / 'data' / 'shakespeare.txt'}}}\n"
        f"out: {{dir: {out}}}\n"
    )
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO / "python")
    cmd = [sys.executable, str(driver), "--config", str(cfg), "--device", "cuda", "--no-progress"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert (out / ("fp8" if fp8 else "nofp8") / "metrics.jsonl").exists()
