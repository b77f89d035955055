"""train.cuda_graphs' host side on the CPU: the demo's loop captures its model (under
fp8dp.DistributedDataParallel, ZeRO-1, fused and delayed weight gradients, two micro-batches per
step, delayed scaling) after the first step and calls the graphed model for every later
micro-batch, with fp8dp's capture procedure run on the host stand-in of tests/python/_host_graphs.py
(a capture runs its work, a replay computes nothing). So this checks the loop's use of
make_graphed_callables, not the numbers (tests/python/test_train_graphs_cuda.py compares those on
a GPU): the capture happens once, after step 1 and outside its step time; every later micro-batch
replays a forward and a backward graph and backward_dw() replays the delayed GEMMs' graphs, with
DDP's ledger, the one-call-at-a-time check and the acceptance checks passing in each; evaluation
runs eagerly (no replay); the summary says it captured.

CUDA is refused on the CPU (train.cuda_graphs), so the test turns the capture on through
_Run.capture_due instead of the config. Mutation (2026-12-05): the loop's capture call removed ->
"captured once" fails (no capture).
"""

import json
from pathlib import Path

import torch
from _host_graphs import HostGraphs

import fp8dp
from fp8dp import graph
from fp8dp.train import __main__ as train_main
from fp8dp.train import loop

REPO = Path(__file__).resolve().parents[2]
STEPS, MICRO = 5, 2


class _SmallGradients(HostGraphs):
    """The capture's backward gets a small grad_output (the loss's own is not known there)."""

    def __init__(self):
        super().__init__(None)

    def grad_output(self, o):
        return torch.full_like(o, 1e-3)


def test_the_loop_captures_once_and_replays_every_later_micro_batch(tmp_path, monkeypatch):
    captures = []

    def make_graphed_callables(modules, sample_args, num_warmup_iters=3, **kw):
        captures.append([tuple(a.shape) for a in sample_args])
        (out,) = graph._capture(
            (modules,), (sample_args,), num_warmup_iters, False, None, _SmallGradients()
        )
        return out

    monkeypatch.setattr(fp8dp, "make_graphed_callables", make_graphed_callables)
    monkeypatch.setattr(
        loop._Run,
        "capture_due",
        lambda self, step: not self.graphed and step + 1 < self.cfg.train.steps,
    )
    HostGraphs.Graph.replays.clear()
    out = tmp_path / "run"
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        "model: {n_layer: 2, d_model: 64, n_head: 2, seq_len: 32, params_dtype: bfloat16}\n"
        f"train: {{steps: {STEPS}, global_batch_size: {2 * MICRO}, micro_batch_size: 2,\n"
        "        warmup_steps: 1, eval_every: 3, eval_batches: 1}\n"
        "ddp: {delay_wgrad_compute: true, fuse_wgrad_accumulation: true,\n"
        "      overlap_grad_reduce: true, use_distributed_optimizer: true}\n"
        f"data: {{path: {REPO / 'data' / 'shakespeare.txt'}}}\n"
        f"out: {{dir: {out}}}\n"
    )
    rc = train_main.main(["--config", str(cfg), "--device", "cpu", "--no-progress"])
    assert rc in (0, None)
    assert captures == [[(32, 2)]], "captured once, a micro-batch ([seq, batch]) the sample"
    summary = json.loads((out / "fp8" / "summary.json").read_text())
    assert summary["cuda_graphs"] is True
    recs = [json.loads(line) for line in (out / "fp8" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["step"] for r in steps if "graph_capture_s" in r] == [1]
    # Each later micro-batch: its forward graph, its backward graph and, through backward_dw(),
    # at least one delayed-GEMM graph. Evaluation (steps 3 and 5) replays nothing.
    assert len(HostGraphs.Graph.replays) >= 3 * (STEPS - 1) * MICRO
