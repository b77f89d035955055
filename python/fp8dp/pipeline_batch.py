"""The batch check of Pipeline.step(): a batch whose shape differs from the one the pipeline was
built with fails on every rank, before anything is sent.

The stages exchange activations of the shapes declared at construction (static metadata, no
shape inference): a first stage fed a longer sequence sends a larger tensor than its neighbour
posted a receive for (gloo aborts that process: SIGABRT), and a batch that does not split into
n_microbatches equal micro-batches fails in some stage's forward or loss while the other ranks
wait for it until the timeout. Only the first stage sees the input and only the last the target,
so a check on one rank cannot stop the others: every rank checks what it holds, then one
all-reduce (MAX of a 0/1 flag) over every rank of the pipeline tells all of them whether any
failed, and only then does anything run. On a failure the ranks gather each other's reasons
(all_gather_object, the failure path only) so each raises the same ValueError naming the rank,
what was expected and what came.

The exchange runs on a gloo group over CPU tensors (make_groups makes it): a flag on an NCCL group
would need a device-to-host copy, a host synchronisation at every step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _shape(t) -> str:
    return "(" + ", ".join(map(str, t)) + ")"


def _dtype(d) -> str:
    return str(d).replace("torch.", "")


def _check(name: str, t, per_mb, n: int) -> list:
    """Reasons why `t` is not the whole batch of n micro-batches shaped like `per_mb` (a
    (shape, dtype) pair; a None shape checks only that dim 0 splits into n equal parts)."""
    if not isinstance(t, torch.Tensor):
        return [f"{name}: expected a tensor, got {type(t).__name__}"]
    shape, dtype = per_mb
    if shape is None:
        if t.dim() == 0 or t.shape[0] % n:
            return [
                f"{name}: expected a first dimension that splits into n_microbatches = {n} equal "
                f"micro-batches, got shape {_shape(t.shape)}"
            ]
        return []
    want = (n * shape[0], *shape[1:])
    out = []
    if tuple(t.shape) != want:
        why = (
            f"{t.shape[0]} rows do not split into {n} micro-batches of {shape[0]}"
            if t.dim() and t.shape[0] != want[0]
            else "other dimensions after the first"
        )
        out.append(
            f"{name}: expected shape {_shape(want)} (n_microbatches = {n} micro-batches of "
            f"{_shape(shape)}, the shape the pipeline was built with), got {_shape(t.shape)}: "
            f"{why}; pass batches of that shape (pad or crop), or build a Pipeline for the new "
            "shape"
        )
    if dtype is not None and t.dtype != dtype:
        out.append(f"{name}: expected dtype {_dtype(dtype)}, got {_dtype(t.dtype)}")
    return out


class BatchCheck:
    """Checks the batch of one Pipeline.step() on every rank (module docstring). `group`: a gloo
    group of every rank of the pipeline (None: make one now; every rank must then construct the
    Pipeline together, which it does anyway)."""

    def __init__(self, n_microbatches, microbatch_input, microbatch_target=None, group=None):
        self.n = n_microbatches
        self.input = (tuple(microbatch_input.shape), microbatch_input.dtype)
        self.target = (
            (tuple(microbatch_target.shape), microbatch_target.dtype)
            if microbatch_target is not None
            else (None, None)
        )
        self.group = dist.new_group(backend="gloo") if group is None else group

    def reasons(self, args, target, is_first: bool, is_last: bool) -> list:
        """What is wrong with this rank's part of the batch (empty: nothing)."""
        out = []
        if is_first:
            if len(args) != 1:
                out.append(
                    f"input: the first stage expected the whole batch as one positional tensor "
                    f"(n_microbatches = {self.n} micro-batches of {_shape(self.input[0])}), got "
                    f"{len(args)} positional arguments"
                )
            else:
                out += _check("input", args[0], self.input, self.n)
        if is_last:
            if target is None:
                out.append(
                    "target: the last stage expected the loss's target for the whole batch "
                    "(step(..., target=...)), got None"
                )
            else:
                out += _check("target", target, self.target, self.n)
        return out

    def __call__(self, args, target, is_first: bool, is_last: bool, stages) -> None:
        mine = self.reasons(args, target, is_first, is_last)
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (list(stages), mine), group=self.group)
        lines = [f"rank {r} (stages {st}): {m}" for r, (st, ms) in enumerate(everyone) for m in ms]
        raise ValueError(
            "Pipeline.step: the batch does not fit the shapes the pipeline was built with; no "
            "rank ran the step (nothing was sent, every main_grad is as it was): "
            + "; ".join(lines)
        )
