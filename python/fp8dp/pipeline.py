"""Pipeline parallelism on torch.distributed.pipelining with fp8dp's deferred weight gradients
(contract C10).

torch's schedules run the pipeline; fp8dp plugs in where torch cannot see inside its layers:

- **Groups.** ``make_groups(pp)`` splits the world into ``pp`` pipeline ranks × ``dp`` data-parallel
  ranks in Megatron's order: ``rank = pp_rank * dp + dp_rank``, so the data-parallel ranks of one
  stage are adjacent (on one host when dp divides the GPUs per host, where their gradient
  collectives are the heaviest traffic), and the pipeline group of a rank is every dp-th rank.
- **Stages.** The model is a list of blocks (each maps one tensor to one tensor); they are split
  into ``pp * virtual_stages`` contiguous stages, as even as possible (the first stages take one
  block more). With one stage per rank stage s runs on pipeline rank s; with two, ``"zbv"`` puts
  stages r and 2*pp-1-r on rank r (the V shape), the interleaved schedules stages r and r+pp.
  Each stage module is wrapped in ``fp8dp.DistributedDataParallel`` over its data-parallel group.
  Its blocks keep their index in the whole model as their name (``blocks.<i>``), so FP8 scaling
  identities (C9) never collide between the two stages of one rank.
- **W steps.** Every stage gets a ``dw_builder``; the runner it returns for a micro-batch calls
  ``backward_dw()`` on every delayed fp8dp module of the stage, as many times as that
  micro-batch's B step queued (once per use: a module used twice in the forward queues two, an
  unused one none). A stage runs its B steps and its W steps in micro-batch order, so the head
  of each module's FIFO is always that micro-batch's.
- **Static metadata.** Each PipelineStage gets ``input_args`` / ``output_args`` built from example
  tensors, so torch never runs a shape-inference forward: under ``fp8_autocast`` that forward,
  on uninitialised memory, would be the first cast and set the delayed scales.
- **Sync policy (fp8dp's, not torch's).** torch's stage only recognises torch's DDP. Here every
  micro-batch but the last accumulates as under ``no_sync()``; readiness is counted only for the
  last micro-batch's B step (its autograd-hook gradients) and W step (its deferred GEMMs), so with
  ``overlap_grad_reduce`` each bucket starts when its last W has run. ``step()`` then finishes
  the collectives.
- **Scaling (fp8dp's, not torch's).** torch's ``scale_grads`` divides ``p.grad``, which fp8dp has
  already moved into ``main_grad``; the schedule is built with ``scale_grads=False`` and
  ``step()`` scales ``main_grad`` by 1/n_microbatches instead (for a loss that is a mean per
  micro-batch; ``scale_grads=False`` here for a sum).

- **Shared parameters (C15, pipeline_shared.py).** A Parameter that blocks of two stages reach
  (a tied embedding / output weight, one module placed twice) or a declared group of names
  (``shared_parameters``) gets one copy per stage, initialised from the first stage's; step()
  sums the copies' gradients after finish_grad_sync (Megatron's embedding group; under ZeRO-1
  over the owned elements), so they stay bit-identical.
- **Batch check (pipeline_batch.py).** step() checks the batch against the declared shapes on
  every rank and raises on all of them before anything is sent.

A step::

    groups = fp8dp.pipeline.make_groups(pipeline_parallel_size=2)
    pp = fp8dp.pipeline.Pipeline(blocks, groups, schedule="zero_bubble", n_microbatches=4,
                                 loss_fn=loss_fn, microbatch_input=x_mb, activation=h_mb,
                                 microbatch_output=y_mb, ddp_config=cfg, virtual_stages=2)
    losses = []
    with fp8dp.fp8_autocast(fp8_recipe=r):
        pp.step(x if pp.is_first else None, target=y if pp.is_last else None, losses=losses)
    for m in pp.modules: ...                      # optimizer step on each stage's main_grad
    pp.update_fp8_scales()                        # amaxes reduce over the stage's DP group

Amax reduction must run over ``groups.dp_group``: the world group would mix different layers'
amaxes (and the FP8 registry check fails, as the ranks of different stages hold other states).
The stage calls its module without ``is_first_microbatch``: passing it through the schedule's
kwargs would apply it to every micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import agreement
from . import pipeline_shared as shared_params
from .ddp import DistributedDataParallel
from .ddp_config import DistributedDataParallelConfig
from .modules import _FP8LinearBase
from .pipeline_batch import BatchCheck
from .scaling import update_fp8_scales

SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
# How many stages per pipeline rank each schedule takes.
_VIRTUAL = {"1f1b": (1,), "interleaved_1f1b": (1, 2), "zero_bubble": (1, 2), "zbv": (2,)}


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's place in the pp × dp layout (Megatron order: rank = pp_rank * dp + dp_rank)."""

    pp_size: int
    dp_size: int
    pp_rank: int
    dp_rank: int
    pp_group: object  # the pipeline ranks that hold this rank's data-parallel slice
    dp_group: object  # the ranks that hold the same stages (gradient and amax reductions)
    timeout: object = None  # make_groups' timeout, for the groups Pipeline makes (shared params)
    check_group: object = None  # gloo, every rank: Pipeline.step's batch check (pipeline_batch.py)


def make_groups(
    pipeline_parallel_size: int, backend: str | None = None, timeout=None
) -> PipelineGroups:
    """Split the initialised world into pipeline_parallel_size pipeline ranks × dp = world /
    pipeline_parallel_size data-parallel ranks, Megatron's rank order (module docstring). Every
    rank must call it (new_group is collective). timeout (a datetime.timedelta; default: torch's
    new_group default, 30 minutes on gloo, not the world group's): how long a pipeline send or
    receive or a gradient collective waits for a peer before it raises, so that a rank that died
    or skipped a step ends the others' steps with an error, not a hang."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("make_groups: call torch.distributed.init_process_group() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    pp = int(pipeline_parallel_size)
    if pp < 1 or world % pp != 0:
        raise ValueError(
            f"pipeline_parallel_size: expected a divisor of the world size {world}, got {pp}"
        )
    dp = world // pp
    pp_group = dp_group = None
    for d in range(dp):  # every rank creates every group, in the same order
        g = dist.new_group([p * dp + d for p in range(pp)], backend=backend, timeout=timeout)
        if rank % dp == d:
            pp_group = g
    for p in range(pp):
        g = dist.new_group([p * dp + d for d in range(dp)], backend=backend, timeout=timeout)
        if rank // dp == p:
            dp_group = g
    check = dist.new_group(backend="gloo", timeout=timeout)
    return PipelineGroups(pp, dp, rank // dp, rank % dp, pp_group, dp_group, timeout, check)


def stage_ranks(schedule: str, pp_size: int, virtual_stages: int) -> list[list[int]]:
    """The stage indices that each pipeline rank holds (list per rank, in stage order)."""
    n = pp_size * virtual_stages
    if schedule == "zbv":
        return [sorted({r, n - 1 - r}) for r in range(pp_size)]
    return [[s for s in range(n) if s % pp_size == r] for r in range(pp_size)]


def split_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, as even as possible (the first take the extras)."""
    if n_stages > n_blocks:
        raise ValueError(
            f"blocks: expected at least one per stage ({n_stages} stages = pipeline_parallel_size "
            f"× virtual_stages), got {n_blocks}"
        )
    base, extra = divmod(n_blocks, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def check_layout(
    schedule: str, pp_size: int, virtual_stages: int, n_blocks: int, n_microbatches: int
) -> None:
    """ValueError naming the argument, what was expected and what was given, for a layout that
    the schedule cannot run (before any stage or group is built)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if virtual_stages not in _VIRTUAL[schedule]:
        raise ValueError(
            f"virtual_stages: schedule {schedule!r} expected {' or '.join(map(str, _VIRTUAL[schedule]))} "
            f"stages per pipeline rank, got {virtual_stages}"
        )
    split_blocks(n_blocks, pp_size * virtual_stages)
    # Every schedule here fills the pipeline with at least one micro-batch per pipeline rank.
    if n_microbatches < pp_size:
        raise ValueError(
            f"n_microbatches: schedule {schedule!r} expected at least pipeline_parallel_size = "
            f"{pp_size}, got {n_microbatches}"
        )
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        # torch runs them in rounds of pp micro-batches (its own check, here with the fix named).
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise ValueError(
                f"n_microbatches: schedule {schedule!r} expected a multiple of its "
                f"{rounds} rounds (n_microbatches // pipeline_parallel_size), got {n_microbatches}"
            )


def check_backend(schedule: str, backend: str, torch_version: str = torch.__version__) -> None:
    """ValueError for a schedule this torch cannot run on the pipeline group's backend.

    "zbv" on gloo needs torch >= 2.13. Before it, the schedule's start-up exchange sends a tensor
    from each stage to its neighbours' ranks, and the V's turn puts two neighbouring stages on one
    rank, which then sends to itself; gloo refuses that and every rank fails with "Connection
    reset by peer" (seen with torch 2.11 on the GPU machine, while 2.13 passes the same tests).
    NCCL sends to itself, and the other schedules have no neighbouring stages on one rank."""
    major, minor = (int(v) for v in torch_version.split("+")[0].split(".")[:2])
    if schedule == "zbv" and backend == "gloo" and (major, minor) < (2, 13):
        raise ValueError(
            f"schedule: 'zbv' on gloo needs torch >= 2.13 (its start-up exchange makes the rank "
            f"holding the V's turn send to itself, which gloo refuses), got torch {torch_version}; "
            f"use 'zero_bubble' with virtual_stages=2, NCCL, or a newer torch"
        )


class _StageModule(torch.nn.Module):
    """Some blocks of the model, run in order; named by their index in the whole model."""

    def __init__(self, blocks: dict):
        super().__init__()
        self.blocks = torch.nn.ModuleDict({str(i): b for i, b in blocks.items()})

    def forward(self, x):
        for b in self.blocks.values():
            x = b(x)
        return x


class _StageSync:
    """fp8dp's sync policy and W runner for one stage (module docstring). torch calls dw_builder()
    right after each B step (in micro-batch order) and the runner it returns at that micro-batch's
    W step (also in order; at once for schedules without a separate W).

    Readiness is on exactly while the last micro-batch's gradients arrive: during its B step and
    its W step, and off for an earlier micro-batch's W, which a schedule that defers W steps may
    run after the last B. (Leaving it on from the last B to the end of the step also passed
    test_pipeline_dist.py when tried: readiness learns its counts in the first iteration, so any
    such W would count as one more expected report every step, as long as the schedule's order
    never changes. This policy does not depend on that.)"""

    def __init__(self, ddp: DistributedDataParallel, n_microbatches: int):
        self.ddp = ddp
        self.n = n_microbatches
        self.delayed = [
            m
            for m in ddp.module.modules()
            if isinstance(m, _FP8LinearBase) and m.delay_wgrad_compute
        ]
        self.b_done = 0
        # A module may be reached by a micro-batch's backward any number of times (used twice in
        # the forward, or not at all): each W pops exactly what its own B queued, counted from
        # the queue's length right after each B (the FIFO holds B(mb)'s entries behind those of
        # earlier micro-batches whose W has not run yet).
        self.pending = [0] * len(self.delayed)  # entries queued by Bs whose W has not run
        self.queued_by = {}  # micro-batch -> entries its B queued, per delayed module

    def begin_step(self) -> None:
        self.b_done = 0
        self.pending = [0] * len(self.delayed)
        self.queued_by = {}
        # Readiness is counted during the last micro-batch's B step only (and its W, below).
        self.ddp._sync.sync_enabled = self.n == 1

    def dw_builder(self) -> Callable[[], None]:
        mb = self.b_done
        self.b_done += 1
        if self.b_done > self.n:
            raise RuntimeError(
                f"pipeline stage: {self.b_done} backward steps in one step of {self.n} "
                "micro-batches (the schedule ran outside Pipeline.step()?)"
            )
        # B(mb) is done; the next B is micro-batch mb + 1, the last one's or not.
        self.ddp._sync.sync_enabled = mb + 1 == self.n - 1
        now = [m._core.queued_wgrads for m in self.delayed]
        self.queued_by[mb] = [q - p for q, p in zip(now, self.pending)]
        self.pending = now
        return functools.partial(self._run_w, mb)

    def _run_w(self, mb: int) -> None:
        sync = self.ddp._sync
        previous = sync.sync_enabled
        sync.sync_enabled = mb == self.n - 1  # a W before the last B may run after it
        counts = self.queued_by.pop(mb)
        try:
            for i, m in enumerate(self.delayed):  # FIFO head: micro-batch mb's (module doc)
                for _ in range(counts[i]):
                    m.backward_dw()
                    self.pending[i] -= 1
        finally:
            sync.sync_enabled = previous


class Pipeline:
    """The stages this rank holds, their fp8dp DDP wrappers and the torch schedule that runs
    them (module docstring). `modules`: the DistributedDataParallel of each local stage, in stage
    order; `stage_indices`: their global stage indices; `is_first` / `is_last`: whether this rank
    holds stage 0 (give step() the input) / the last stage (give it the target; under "zbv" that
    is pipeline rank 0)."""

    def __init__(
        self,
        blocks: Sequence[torch.nn.Module],
        groups: PipelineGroups,
        *,
        schedule: str,
        n_microbatches: int,
        loss_fn: Callable,
        microbatch_input: torch.Tensor,
        activation: torch.Tensor,
        microbatch_output: torch.Tensor,
        virtual_stages: int = 1,
        ddp_config: DistributedDataParallelConfig | None = None,
        scale_grads: bool = True,
        device: torch.device | str = "cpu",
        shared_parameters: Sequence[Sequence[str]] | None = None,
        microbatch_target: torch.Tensor | None = None,
    ):
        from torch.distributed import pipelining as pl

        blocks = list(blocks)
        # C12: every rank of the world (all pipeline and data-parallel ranks) must build the
        # pipeline alike; compared once, over the world that make_groups split, before the local
        # checks below, which read what may differ between ranks.
        agreement.check_ranks_agree(
            dist.group.WORLD,
            "Pipeline",
            lambda: agreement.pipeline_fields(
                blocks,
                groups,
                schedule=schedule,
                n_microbatches=n_microbatches,
                virtual_stages=virtual_stages,
                scale_grads=scale_grads,
                microbatch_input=microbatch_input,
                activation=activation,
                microbatch_output=microbatch_output,
                device=torch.device(device).type,
                ddp_config=ddp_config,
            ),
        )
        check_layout(schedule, groups.pp_size, virtual_stages, len(blocks), n_microbatches)
        check_backend(schedule, dist.get_backend(groups.pp_group))
        n_stages = groups.pp_size * virtual_stages
        ranges = split_blocks(len(blocks), n_stages)
        self.groups = groups
        self.n_microbatches = n_microbatches
        self.scale_grads = scale_grads
        self.stage_indices = stage_ranks(schedule, groups.pp_size, virtual_stages)[groups.pp_rank]
        device = torch.device(device)

        def example(t: torch.Tensor, grad: bool) -> torch.Tensor:
            return torch.empty_like(t, device=device).requires_grad_(grad)

        # C15 (pipeline_shared.py): parameters shared between stages, one copy per stage; found
        # alike on every rank, compared across ranks, initialised from the first stage's copy.
        owners = stage_ranks(schedule, groups.pp_size, virtual_stages)
        zero1 = ddp_config is not None and ddp_config.use_distributed_optimizer
        self.shared, local = shared_params.prepare(
            blocks, ranges, owners, groups, zero1, shared_parameters
        )
        self._zero1 = zero1
        # The batch check of step() (pipeline_batch.py): every rank learns whether any rank's
        # batch is wrong before anything is sent.
        self._batch_check = BatchCheck(
            n_microbatches, microbatch_input, microbatch_target, group=groups.check_group
        )

        self.modules, self._syncs, stages = [], [], []
        for s in self.stage_indices:
            module = _StageModule(local[s])
            ddp = DistributedDataParallel(module, ddp_config, process_group=groups.dp_group)
            sync = _StageSync(ddp, n_microbatches)
            first, last = s == 0, s == n_stages - 1
            stages.append(
                pl.PipelineStage(
                    ddp,
                    s,
                    n_stages,
                    device,
                    # Static metadata: torch runs no shape-inference forward (module docstring).
                    # Stage outputs and non-first inputs need requires_grad for the B step.
                    input_args=example(microbatch_input if first else activation, not first),
                    output_args=example(microbatch_output if last else activation, True),
                    group=groups.pp_group,
                    dw_builder=sync.dw_builder,
                )
            )
            self.modules.append(ddp)
            self._syncs.append(sync)
        self.stages = stages  # torch's PipelineStage of each local stage
        shared_params.bind(self.shared, dict(zip(self.stage_indices, self.modules)))
        self.is_last = (n_stages - 1) in self.stage_indices
        self.is_first = 0 in self.stage_indices
        cls = {
            "1f1b": pl.Schedule1F1B,
            "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
            "zero_bubble": pl.ScheduleInterleavedZeroBubble,
            "zbv": pl.ScheduleZBVZeroBubble,
        }[schedule]
        stage_arg = stages[0] if schedule == "1f1b" else stages
        # fp8dp scales main_grad itself: torch's scale_grads would divide p.grad (module doc).
        self.schedule = cls(stage_arg, n_microbatches, loss_fn=loss_fn, scale_grads=False)

    def update_fp8_scales(self) -> None:
        """fp8dp.update_fp8_scales over this rank's data-parallel group: the ranks that hold the
        same stages (the world group would mix different layers' amaxes). Once per step, after
        the optimizer step; DistributedOptimizer.step() on a stage's DDP does it too."""
        update_fp8_scales(self.groups.dp_group)

    def step(self, *args, target=None, losses: list | None = None, **kwargs):
        """One iteration: zero every stage's main_grad, run the schedule over the batch (split
        into n_microbatches along dim 0), finish the gradient collectives and scale main_grad by
        1/n_microbatches (scale_grads), then sum the gradients of parameters shared between
        stages over their copies (C15, pipeline_shared.py). Returns what the torch schedule
        returns.

        Before anything changes or is sent, every rank checks its part of the batch (the first
        stage the input, the last the target) against the shapes the pipeline was built with,
        and all ranks learn the outcome: a wrong batch raises ValueError on every rank, naming
        what was expected and what came (pipeline_batch.py)."""
        self._batch_check(
            args if self.is_first else None,
            target if self.is_last else None,
            self.is_first,
            self.is_last,
            self.stage_indices,
        )
        for ddp, sync in zip(self.modules, self._syncs):
            ddp.zero_grad_buffer()
            sync.begin_step()
        try:
            out = self.schedule.step(*args, target=target, losses=losses, **kwargs)
        finally:
            for ddp in self.modules:
                ddp._sync.sync_enabled = True
        for sync in self._syncs:
            if sync.b_done != self.n_microbatches:
                raise RuntimeError(
                    f"pipeline stage: {sync.b_done} backward steps ran, expected "
                    f"n_microbatches = {self.n_microbatches}"
                )
        for ddp in self.modules:
            ddp.finish_grad_sync()
            if self.scale_grads and self.n_microbatches != 1:
                ddp.scale_gradients(1.0 / self.n_microbatches)
        shared_params.reduce_grads(self.shared, self._zero1)
        return out
