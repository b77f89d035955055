"""The README's training-loop example runs as printed: its python block, extracted from README.md,
run as a script on CPU with one gloo rank (the environment torchrun would set), must finish and
print one finite loss per step, the last below the first (5 AdamW steps at lr 1e-3 on a fixed
batch: the loss falls by ~7% in exact arithmetic, far more than FP8 rounding can undo).

Mutations tried (2026-12-03, then reverted):
1. `fp8dp.DistributedOptimizer` renamed to `fp8dp.DistOptimizer` in the README block:
       AssertionError: the README example failed (exit 1):
         [rank0]: AttributeError: module 'fp8dp' has no attribute 'DistOptimizer'
2. The `backward_dw()` loop removed from the README block (the weight gradients never computed):
       AssertionError: the README example failed (exit 1):
         [rank0]: RuntimeError: weight gradients queued by backward were never computed by
         backward_dw(): '0.weight' (4 queued, by module '0'), '2.weight' (4 queued, ...) ...
"""

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Using fp8dp in your training loop"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    blocks = re.findall(r"```python\n(.*?)```", text.split(SECTION, 1)[1], re.S)
    assert blocks, f"README.md: no python block under {SECTION!r}"
    return blocks[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_example_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example(), encoding="utf-8")
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",  # the example's CPU form, whatever the machine has
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")])),
    )
    r = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert (
        r.returncode == 0
    ), f"the README example failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", r.stdout, re.M)]
    assert len(losses) == 5, f"expected 5 'step N loss L' lines, got:\n{r.stdout}"
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
