"""Batches reach the device without a host wait (data.to_device).

A plain ``.to("cuda")`` of a pageable host tensor copies and then synchronizes the stream: the
training loop's host waited there for the previous micro-batch's backward (or the last step's
optimizer) four times per step at 342M, and the GPU idled while it launched the next forward.

- CPU: the batch arrives unchanged (values and dtype), and the loop, the evaluation included,
  moves every batch the sampler draws (inputs and targets) through to_device.
- CUDA: under torch's sync debug mode "error" to_device raises nothing, while the plain copy it
  replaces raises (so the check can fail), and the bytes arrive intact.

Mutation (2026-12-06, restored): the training step's ``to_device`` calls put back to ``.to(device)``:
the loop test failed (32 of 48 tensors moved: the evaluations' only).
"""

from pathlib import Path

import pytest
import torch

from fp8dp.train import data, loop
from fp8dp.train.config import load_config

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "ci_convergence.yaml")


def test_cpu_batch_is_unchanged():
    t = torch.randint(0, 256, (65, 4))
    out = data.to_device(t, torch.device("cpu"))
    assert out.dtype == t.dtype and out.device.type == "cpu" and torch.equal(out, t)


def test_the_loop_moves_every_batch_through_to_device(group, tmp_path, monkeypatch):
    drawn, moved = [], []
    batch, to_device = data._Sampler.batch, data.to_device

    def counting_batch(self, split, *args, **kwargs):
        drawn.append(split)
        return batch(self, split, *args, **kwargs)

    def counting_to_device(t, device):
        moved.append(t.data_ptr())
        return to_device(t, device)

    monkeypatch.setattr(data._Sampler, "batch", counting_batch)
    monkeypatch.setattr(loop, "to_device", counting_to_device)
    cfg = load_config(
        CONFIG,
        [
            "train.steps=2",
            "train.eval_every=2",
            f"out.dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'corpus'}",
            "run.device=cpu",
        ],
    )
    torch.manual_seed(0)
    loop.train(
        cfg, str(tmp_path / "run" / "fp8"), rank=0, world_size=1, device=torch.device("cpu"),
        progress=False,
    )  # fmt: skip
    # 2 steps x 4 micro-batches (16 / 4, one rank) of training batches, plus the evaluations
    assert drawn.count("train") == 8 and drawn.count("val") > 0
    assert len(moved) == 2 * len(drawn)  # inputs and targets of every batch drawn


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_does_not_wait_for_the_device():
    x = torch.randint(0, 256, (1025, 16))  # 131 KB of int64: a 342M micro-batch's size
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = data.to_device(x, torch.device("cuda"))
        with pytest.raises(RuntimeError, match="synchroniz"):
            x.to("cuda")  # the copy to_device replaces waits: the debug mode sees it
    finally:
        torch.cuda.set_sync_debug_mode(before)
    assert out.device.type == "cuda" and torch.equal(out.cpu(), x)
