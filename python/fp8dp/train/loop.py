"""The training loop: one optimizer step = micro-batches under no_sync(), each a forward in FP8, a
backward that produces input gradients only, and backward_dw() on every fp8dp module (the weight
gradients, as a zero-bubble pipeline schedule would run them); then finish_grad_sync() and the
distributed optimizer's step. With parallel.pipeline_parallel_size > 1 the step, validation and
checkpointed state come from pipeline_run.py instead; the rest of the loop is shared."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8dp

from .checkpoint import load_checkpoint, save_checkpoint
from .config import RunSection, TrainConfig
from .data import VOCAB_SIZE, load_corpus, to_device
from .device import choose_device, local_world_size
from .flops import mfu
from .metrics import MetricsWriter
from .model import GPT
from .step_profile import phase


def setup_distributed(run: RunSection) -> tuple:
    """Join the torchrun job (or start a one-rank job without torchrun) on the device and backend
    that run.device / run.backend ask for (device.choose_device: ValueError, before
    init_process_group, for a request this machine cannot serve)."""
    # Plain `python -m fp8dp.train`: a world of one, which rendezvouses in its own memory (an
    # in-process store, no port: a fixed MASTER_PORT made two one-rank jobs on one machine
    # collide with EADDRINUSE, as two tests of CI's parallel run did on 2026-12-04).
    alone = "RANK" not in os.environ
    if alone:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    cuda_ok, cuda_reason = fp8dp.cuda_available(return_reason=True)
    device_type, backend = choose_device(
        run.device,
        run.backend,
        cuda_ok=cuda_ok,
        cuda_reason=cuda_reason,
        n_gpus=torch.cuda.device_count() if cuda_ok else 0,
        local_world_size=local_world_size(),
    )
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # A bounded timeout: a rank that died makes the others fail instead of hanging.
        timeout = timedelta(minutes=5)
        if alone:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device, backend


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)


def make_recipe(cfg: TrainConfig):
    """The run's FP8 recipe (config.FP8Section.recipe_object)."""
    return cfg.fp8.recipe_object()


def _all_mean(value, device) -> float:
    """The mean over the ranks of `value` (a float, or a one-element float64 tensor on `device`)."""
    if isinstance(value, torch.Tensor):
        t = value.reshape(1).clone()
    else:
        t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model, corpus, cfg: TrainConfig, rank: int, device) -> float:
    """Mean validation loss over eval_batches micro-batches per rank (a fixed set every time).

    Runs with FP8 off: the weights' own quality, and no FP8 cast records an amax, so the training
    trajectory (and with it bit-exact resume) does not depend on when evaluation happens."""
    total = 0.0
    for i in range(cfg.train.eval_batches):
        x, y = corpus.batch("val", cfg.train.seed, 0, rank, i, cfg.train.micro_batch_size)
        logits = model(to_device(x, device))
        y = to_device(y, device)
        total += F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), y.view(-1)).item()
    return _all_mean(total / cfg.train.eval_batches, device)


def clip_grad_norm(ddp, max_norm: float, device) -> torch.Tensor:
    """Scale the reduced gradients so that their global L2 norm is at most max_norm, as
    torch.nn.utils.clip_grad_norm_ does (coefficient max_norm / (norm + 1e-6), clamped at 1);
    returns the norm before clipping as a 0-dim float64 tensor on `device`.

    After finish_grad_sync each rank holds the reduced gradient of the shards it owns (ZeRO-1:
    chunk `rank` of every bucket; bucket padding is zero), so the squared norm is the sum over
    ranks of each rank's shards' squares: one all-reduce of one number over the DDP group. The
    gradients are scaled in place in the grad buffer, before the optimizer reads them.

    Nothing here waits for the device: the coefficient stays a tensor and every gradient is
    multiplied by it (by exactly 1 when the norm is below max_norm, which leaves the bits). A
    `.item()` on the norm made the host wait for the whole backward and the reduction before it
    could launch the optimizer, and the GPU then idled while the optimizer's launches began
    (4 ms per step at 342M on the H100, the profile's idle_by_phase)."""
    grads = [ddp.grad_shard(s) for s in ddp.owned_shards()]
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        # Each shard's norm in FP32 (as torch's per-tensor norms), their squares summed in FP64;
        # one multi-tensor launch for all shards: a loop over them made four small launches per
        # shard (hundreds per step at 342M) with the GPU waiting on the host.
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        sq += torch.stack(norms).double().square().sum()
    dist.all_reduce(sq, group=ddp.process_group)
    norm = sq.sqrt().reshape(())
    if grads:
        # The FP64 coefficient rounded once to FP32, as a Python float scalar is for FP32 data.
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
        torch._foreach_mul_(grads, coef)
    return norm


def _dp_step(
    cfg, ddp, opt, corpus, recipe, wgrad_modules, step, rank, n_micro, device, probe=None
) -> tuple:
    """One data-parallel optimizer step (the module docstring's); returns the mean training
    loss over all ranks (a one-element float64 tensor) and the gradient norm before clipping (a
    0-dim float64 tensor; None without train.clip_grad), both on the device and not yet read.
    probe: an fp8_stats.FP8Probe that watches this step's first micro-batch, or None."""
    t = cfg.train
    with phase("zero_grad"):
        ddp.zero_grad_buffer()
        # Summed on the device in FP64 (the same sum as Python floats of each loss): a .item()
        # per micro-batch would make the host wait for each backward before the next forward.
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(n_micro):
        with phase("data"):
            x, y = corpus.batch("train", t.seed, step, rank, i, t.micro_batch_size)
            x, y = to_device(x, device), to_device(y, device)
        # Only the last micro-batch may launch collectives; the others just accumulate.
        sync = ddp.no_sync() if i < n_micro - 1 else contextlib.nullcontext()
        watch = probe.capture(step + 1) if probe and i == 0 else contextlib.nullcontext()
        with sync, watch:
            with phase("forward"), fp8dp.fp8_autocast(enabled=cfg.fp8.enabled, fp8_recipe=recipe):
                logits = ddp(x, is_first_microbatch=(i == 0))
            with phase("loss"):
                loss = F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), y.view(-1))
            with phase("backward"):
                (loss / n_micro).backward()  # input gradients only with delayed wgrad
            with phase("backward_dw"):
                for m in wgrad_modules:  # the weight gradients, later, in reverse layer order
                    m.backward_dw()
        loss_sum += loss.detach().double()
    with phase("finish_grad_sync"):
        ddp.finish_grad_sync()
    with phase("clip_grad"):
        grad_norm = clip_grad_norm(ddp, t.clip_grad, device) if t.clip_grad > 0 else None
    with phase("optimizer"):
        opt.step()  # steps this rank's shard, all-gathers, updates the FP8 scales once
    with phase("loss_mean"):  # on the device: the loop reads it (_train_steps)
        mean = (loss_sum / n_micro).reshape(1)
        dist.all_reduce(mean)
        return mean / dist.get_world_size(), grad_norm


def peak_memory_gib(device) -> float:
    """CUDA: the peak of memory allocated by tensors on the device; CPU: the process's peak
    resident set (ru_maxrss, KiB on Linux), which includes the interpreter and libraries."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class _Stopper:
    """Whether to stop after step `done` (before train.steps): at stop_at, or when 2 + backlog more
    of the longest iterations so far (step + evaluation) would not fit in time_budget_s from
    train()'s start (the margin leaves the final checkpoint time; backlog counts steps launched but
    not yet finished). Rank 0 decides for all (clocks differ): with several ranks and a time budget,
    a broadcast on a gloo group of a CPU tensor, which waits for no device work, so that steps are
    still read late (_reads_late). Every rank must then make the same calls in the same order
    (_reads_late's conditions are the same on every rank). Where no gloo group can be made, the
    broadcast goes over the default group from the device, and its value waits for the device
    (`waits`: every step is then read at once)."""

    def __init__(self, cfg, stop_at, time_budget_s, t_enter, device, world_size: int):
        self.cfg, self.stop_at, self.budget = cfg, stop_at, time_budget_s
        self.t_enter, self.device = t_enter, device
        self.group, self.waits = None, False
        if time_budget_s is not None and world_size > 1:
            self.group = _host_group()
            self.waits = self.group is None

    def __call__(self, done: int, longest: float, backlog: int = 0) -> bool:
        if done >= self.cfg.train.steps or (self.stop_at is None and self.budget is None):
            return False
        stop = self.stop_at is not None and done >= self.stop_at
        if self.budget is not None:
            elapsed = time.perf_counter() - self.t_enter
            stop = stop or elapsed + (2 + backlog) * longest > self.budget
            if self.group is not None or self.waits:
                on_host = self.group is not None
                flag = torch.tensor([int(stop)], device="cpu" if on_host else self.device)
                dist.broadcast(flag, 0, group=self.group)
                stop = bool(flag.item())
        return stop


def _host_group():
    """A process group whose collectives run on the host (gloo): the default group when it is
    gloo, else a new gloo group of every rank (a collective call: every rank makes it here, in the
    same place); None when gloo is not available."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    try:
        return dist.new_group(backend="gloo")
    except (RuntimeError, ValueError):
        return None


def train(
    cfg: TrainConfig,
    run_dir: str,
    *,
    rank: int,
    world_size: int,
    device,
    save: str = None,
    resume: str = None,
    progress: bool = True,
    stop_at: int = None,
    time_budget_s: float = None,
    profile: tuple = None,
) -> dict:
    """Train one run (FP8 per cfg.fp8.enabled) writing <run_dir>/metrics.jsonl on rank 0; returns
    a summary dict (first/last validation loss, steps, time, and "complete").

    stop_at / time_budget_s end the run early at a step boundary (at that step, or before the
    seconds since this call would run out), checkpointing into `save`; --resume from there
    continues bit-exactly. summary["complete"] says whether train.steps was reached. profile:
    (first step, count) to profile on rank 0 into <run_dir>/step_profile.json (step_profile.py)."""
    t_enter = time.perf_counter()
    n_micro = cfg.check_world_size(world_size)
    _check_train_args(cfg, save, stop_at, time_budget_s)
    if cfg.train.cuda_graphs and torch.device(device).type != "cuda":
        raise ValueError(f"train.cuda_graphs: needs a CUDA device, got {device}")
    corpus = _load_corpus(cfg, run_dir, rank)
    run = _Run.build(cfg, n_micro, corpus, rank, world_size, device)
    start = 0
    if resume:
        start = run.resume(resume)
        if start == cfg.train.steps:
            # A finished run: nothing to train, and its metrics and summary stay as they are.
            if save:
                run.save(save, start)
            return run.finished_summary(start)
    if rank == 0 and cfg.fp8.enabled and cfg.train.fp8_stats_every > 0:
        from .fp8_stats import FP8Probe

        path = os.path.join(run_dir, "fp8_stats.jsonl")
        run.probe = FP8Probe(run.model, run.recipe, path, cfg.fp8.exclude, start if resume else -1)
    run.profile_range = profile
    if rank == 0 and profile:
        from .step_profile import StepProfiler

        run.profiler = StepProfiler(*profile, device, os.path.join(run_dir, "step_profile.json"))
    writer = (
        MetricsWriter(
            os.path.join(run_dir, "metrics.jsonl"), truncate_after=start if resume else -1
        )
        if rank == 0
        else None
    )
    bar = _progress_bar(cfg, start) if rank == 0 and progress else None
    first_val = None
    if start == 0:
        first_val = run.evaluate()
        if writer:
            writer.write({"step": 0, "val_loss": first_val})
    t_start = time.perf_counter()
    done, last_val = _train_steps(
        run,
        start,
        first_val,
        writer,
        bar,
        save,
        stop=_Stopper(cfg, stop_at, time_budget_s, t_enter, device, world_size),
    )
    if bar:
        bar.close()
    if save:
        run.save(save, done)
    summary = {
        "first_val_loss": first_val,
        "last_val_loss": last_val,
        "start_step": start,
        "steps": cfg.train.steps,
        "seed": cfg.train.seed,
        "world_size": world_size,
        "fp8": cfg.fp8.enabled,
        "recipe": cfg.fp8.recipe if cfg.fp8.enabled else None,
        "train_time_s": time.perf_counter() - t_start,
        "complete": done == cfg.train.steps,
        "stopped_at": done,
        "peak_mem_gib": peak_memory_gib(device),
        "corpus_sha256": corpus.meta.get("sha256"),
        "cuda_graphs": run.graphed,  # train.cuda_graphs and this launch captured
    }
    if run.probe:
        run.probe.close()
    if writer:
        writer.close()
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


# -- train()'s steps ---------------------------------------------------------------------------
def _check_train_args(cfg: TrainConfig, save, stop_at, time_budget_s) -> None:
    """ValueError, before any work, for options that cannot go together."""
    if (stop_at is not None or time_budget_s is not None) and not save:
        raise ValueError(
            "--stop-at / --time-budget: expected --save DIR too (a run that stops early continues "
            "from its checkpoint), got no --save"
        )
    if cfg.train.clip_grad > 0 and cfg.parallel.pipeline_parallel_size > 1:
        raise ValueError(
            "train.clip_grad: expected 0 with parallel.pipeline_parallel_size > 1 (the global "
            f"norm over pipeline stages is not implemented), got {cfg.train.clip_grad}"
        )
    if cfg.ddp.defer_nan_check and cfg.parallel.pipeline_parallel_size > 1:
        raise ValueError(
            "ddp.defer_nan_check: expected false with parallel.pipeline_parallel_size > 1 (the "
            "pipeline's stages do not read the deferred flags before a checkpoint), got true"
        )


def _load_corpus(cfg: TrainConfig, run_dir: str, rank: int):
    """The corpus (built once, by rank 0); its manifest goes into <run_dir>/corpus.json."""
    corpus = load_corpus(cfg.data, cfg.model.seq_len, rank=rank, barrier=dist.barrier)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "corpus.json"), "w") as f:
            json.dump(corpus.meta, f)
    return corpus


@dataclass
class _Run:
    """What one run trains with: the model, its data-parallel wrapper or pipeline, the optimizer
    and what a checkpoint holds of this rank."""

    cfg: TrainConfig
    corpus: Any
    rank: int
    world_size: int
    device: Any
    n_micro: int
    model: GPT
    ddp: Any  # fp8dp.DistributedDataParallel; None under pipeline parallelism
    pipe: Any  # PipelineRun (pipeline_parallel_size > 1); None on the data-parallel path
    opt: Any
    state_model: Any  # what a checkpoint holds of this rank's model
    recipe: Any
    wgrad_modules: list  # the modules whose backward_dw() each micro-batch runs, last layer first
    config_dict: dict
    probe: Any = None  # fp8_stats.FP8Probe on rank 0 with train.fp8_stats_every; else None
    profiler: Any = None  # step_profile.StepProfiler on rank 0 with --profile; else None
    profile_range: Any = None  # --profile's (first, count) on every rank; else None
    graphed: bool = False  # train.cuda_graphs: captured (after this launch's first step)

    @classmethod
    def build(cls, cfg: TrainConfig, n_micro: int, corpus, rank, world_size, device) -> "_Run":
        torch.manual_seed(cfg.train.seed)  # every rank builds the same initial weights
        d, t = cfg.ddp, cfg.train
        model = GPT(
            cfg.model, d.delay_wgrad_compute, d.fuse_wgrad_accumulation, device, cfg.fp8.exclude
        )
        ddp_cfg = d.library_config()
        ddp = pipe = None
        if cfg.parallel.pipeline_parallel_size > 1:
            from .pipeline_run import PipelineRun

            pipe = PipelineRun(cfg, model, ddp_cfg, n_micro, corpus, device)
            opt, state_model = pipe.optimizer, pipe.modules
        else:
            ddp = _build_ddp(model, ddp_cfg, t.cuda_graphs and device.type == "cuda")
            opt = fp8dp.DistributedOptimizer(
                torch.optim.AdamW,
                ddp,
                **t.adamw_kwargs(device, found_inf=d.defer_nan_check),
            )
            state_model = model
        wgrad_modules = list(reversed(model.fp8_modules())) if d.delay_wgrad_compute else []
        return cls(
            cfg,
            corpus,
            rank,
            world_size,
            device,
            n_micro,
            model,
            ddp,
            pipe,
            opt,
            state_model,
            make_recipe(cfg),
            wgrad_modules,
            cfg.to_dict(),
        )

    def resume(self, path: str) -> int:
        """Load the checkpoint in `path`; returns its step (at most train.steps)."""
        start = load_checkpoint(
            path,
            model=self.state_model,
            optimizer=self.opt,
            config=self.config_dict,
            rank=self.rank,
            world_size=self.world_size,
        )
        if start > self.cfg.train.steps:
            raise ValueError(
                f"train.steps: expected >= {start} (the step of the checkpoint in "
                f"{path}), got {self.cfg.train.steps}"
            )
        return start

    def check_deferred(self) -> None:
        """ddp.defer_nan_check: raise now if the last step's gradients held NaN (its update was
        skipped), so that no checkpoint or final result hides it."""
        if self.ddp is not None:
            self.ddp.check_deferred()

    def save(self, path: str, step: int) -> None:
        self.check_deferred()
        save_checkpoint(
            path,
            step=step,
            model=self.state_model,
            optimizer=self.opt,
            config=self.config_dict,
            rank=self.rank,
            world_size=self.world_size,
            barrier=dist.barrier,
        )

    def evaluate(self) -> float:
        if self.pipe:
            return self.pipe.evaluate()
        return evaluate(self.model, self.corpus, self.cfg, self.rank, self.device)

    def step(self, step: int) -> tuple:
        """One optimizer step: (mean training loss, gradient norm or None), as _dp_step's
        device tensors (floats for the pipeline)."""
        if self.pipe:
            return self.pipe.step(step, self.recipe), None
        every = self.cfg.train.fp8_stats_every
        due = self.probe is not None and (step == 0 or (step + 1) % every == 0)
        return _dp_step(
            self.cfg,
            self.ddp,
            self.opt,
            self.corpus,
            self.recipe,
            self.wgrad_modules,
            step,
            self.rank,
            self.n_micro,
            self.device,
            self.probe if due else None,
        )

    def profiles(self, step: int) -> bool:
        """Whether --profile covers step `step` (1-based; the same answer on every rank)."""
        if self.profile_range is None:
            return False
        first, count = self.profile_range
        return first <= step < first + count

    def capture_due(self, step: int) -> bool:
        """train.cuda_graphs: whether to capture after step `step` (this launch's first eager
        step, unless it was the run's last)."""
        t = self.cfg.train
        return t.cuda_graphs and not self.graphed and not self.pipe and step + 1 < t.steps

    def capture_graphs(self, step: int) -> None:
        """train.cuda_graphs: capture the model (under its DDP) after an eager step, which gave
        delayed scaling its scales; a micro-batch of this step is the sample (its shape)."""
        t = self.cfg.train
        x, _ = self.corpus.batch("train", t.seed, step, self.rank, 0, t.micro_batch_size)
        with fp8dp.fp8_autocast(enabled=self.cfg.fp8.enabled, fp8_recipe=self.recipe):
            fp8dp.make_graphed_callables(self.model, (x.to(self.device),))
        self.graphed = True

    def finished_summary(self, start: int) -> dict:
        """The summary of a resumed run that had already reached train.steps."""
        return {
            "first_val_loss": None,
            "last_val_loss": None,
            "start_step": start,
            "steps": self.cfg.train.steps,
            "world_size": self.world_size,
            "fp8": self.cfg.fp8.enabled,
            "recipe": self.cfg.fp8.recipe if self.cfg.fp8.enabled else None,
            "train_time_s": 0.0,
            "complete": True,
        }


def _build_ddp(model, ddp_cfg, graphs: bool):
    """fp8dp.DistributedDataParallel; built on a side stream for train.cuda_graphs, as torch's DDP
    must be: its gradient hooks create the parameters' AccumulateGrad nodes, which keep the stream
    they were made on, and a captured backward cannot sync with the legacy default stream."""
    if not graphs:
        return fp8dp.DistributedDataParallel(model, ddp_cfg)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp = fp8dp.DistributedDataParallel(model, ddp_cfg)
    torch.cuda.current_stream().wait_stream(side)
    return ddp


def _progress_bar(cfg: TrainConfig, start: int):
    from tqdm import tqdm

    return tqdm(
        total=cfg.train.steps,
        initial=start,
        unit="step",
        dynamic_ncols=True,
        desc="fp8" if cfg.fp8.enabled else "no-fp8",
    )


def _train_steps(run: _Run, start: int, last_val, writer, bar, save, stop) -> tuple:
    """The steps from `start` on, each recorded by `writer` and `bar` (rank 0), with validation
    every eval_every steps and at the last, and the save_every checkpoints; stop(done, longest
    iteration, backlog) ends the run early. Returns (steps done, the last validation loss:
    `last_val` when no step validated).

    A plain step (no validation, checkpoint, profile, capture or stop decision that needs the
    device after it, and not the last) is read one step late: its loss and gradient norm stay on
    the device until the next step has been launched. Reading them at once (a `.item()`) made the
    host wait for the step's end and the GPU idle while the next step's first kernels were
    launched (2 ms per 342M step on the H100, the profile's zero_grad / data / forward idle).
    The values and their order in metrics.jsonl are the same. A step's time (tokens/s) is taken
    where the device runs it (_StepTimer), so it does not depend on when the host reads it."""
    cfg, t = run.cfg, run.cfg.train
    longest = 0.0  # the longest iteration (step + evaluation) so far, for time_budget_s
    done = start
    pending = None  # a plain step launched before the running one, not yet read
    timer = _StepTimer(run.device)
    for step in range(start, t.steps):
        t0 = time.perf_counter()
        begin = timer.mark()
        lr = lr_at(cfg, step)
        for group in run.opt.param_groups:
            group["lr"] = lr
        profiled = run.profiler is not None and run.profiler.wants(step + 1)
        if profiled:
            run.profiler.begin(step + 1)
        train_loss, grad_norm = run.step(step)  # launched: device tensors on CUDA
        values, end = timer.finish(train_loss, grad_norm)
        rec = {"step": step + 1, "lr": lr, "values": values, "t0": t0, "begin": begin, "end": end}
        if pending is not None:  # the previous step's values: it ran while this one queued
            dt, _ = _record(run, pending, writer, bar, timer)
            longest = max(longest, dt)
            pending = None
        done = step + 1
        if _reads_late(run, done, save, stop, longest):
            pending = rec
            continue
        dt, val = _record(run, rec, writer, bar, timer, profiled=profiled)
        longest = max(longest, dt)
        last_val = val if val is not None else last_val
        if stop(done, longest):
            break
        if save and t.save_every and done % t.save_every == 0 and done != t.steps:
            run.save(os.path.join(save, f"step_{done:06d}"), done)
    run.check_deferred()
    return done, last_val


def _reads_late(run: _Run, done: int, save, stop, longest: float) -> bool:
    """Whether step `done` is plain (_train_steps' docstring): nothing after it needs its end."""
    t = run.cfg.train
    nxt = done + 1  # the step launched next, whose launch the read waits for
    if run.pipe or done >= t.steps or done % t.eval_every == 0:
        return False
    if run.capture_due(done - 1) or (save and t.save_every and done % t.save_every == 0):
        return False
    # The profiled steps, from --profile (every rank has it; rank 0 alone holds the profiler):
    # each condition here must be the same on every rank, since the stop decision below is a
    # broadcast that every rank joins, or none.
    if run.profiles(done) or run.profiles(nxt):
        return False
    # The stop decision is made now, before the step's end: one more step of margin. Where its
    # broadcast waits for the device (no gloo group), every step is read at once.
    return not stop.waits and not stop(done, longest, backlog=1)


class _StepTimer:
    """A step's values and seconds as the device produces them.

    On CUDA, the loss and the gradient norm go to pinned host memory by a copy queued right after
    the step, and an event marks its end: reading them waits for that event only. (`.item()`
    synchronises the whole stream, so after the next step's launch it would wait for that step
    too, and the GPU would idle again while the host launched the one after.) The step's seconds
    are between an event recorded before its launch (which the GPU reaches when it starts the
    step, or at once when it was waiting for the host, which then counts) and its end event. On
    a CPU the host clock around the launch, which runs the step."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def finish(self, loss, norm) -> tuple:
        """After a step's launch: (its loss and gradient norm on their way to the host, its end
        mark). loss: a float64 device tensor of one element, or a float (the pipeline's)."""
        if not isinstance(loss, torch.Tensor):
            return (float(loss), None if norm is None else float(norm)), self.mark()
        vals = loss.reshape(1) if norm is None else torch.cat([loss.reshape(1), norm.reshape(1)])
        if self.cuda:
            host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
            host.copy_(vals, non_blocking=True)
            vals = host
        return vals, self.mark()

    def read(self, values, end) -> tuple:
        """(loss, gradient norm or None) of a finish(); waits for the step's end only."""
        if isinstance(values, tuple):
            return values
        if self.cuda:
            end.synchronize()
        out = values.tolist()
        return out[0], (out[1] if len(out) > 1 else None)

    def seconds(self, begin, end) -> float:
        if not self.cuda:
            return end - begin
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def _record(run: _Run, rec: dict, writer, bar, timer, profiled: bool = False) -> tuple:
    """Reads step rec["step"]'s loss and gradient norm (the wait for its end), writes its record,
    validates after it when due; returns (the iteration's seconds with the validation, the
    validation loss or None)."""
    cfg, t = run.cfg, run.cfg.train
    tokens_per_step = t.global_batch_size * cfg.model.seq_len
    done = rec["step"]
    train_loss, grad_norm = timer.read(rec["values"], rec["end"])  # the wait for the step's end
    # A profiled step is read at once: the profiler's own measure, launch to read, as before.
    dt = time.perf_counter() - rec["t0"] if profiled else timer.seconds(rec["begin"], rec["end"])
    if profiled:
        res = run.profiler.end(done, dt)
        if res is not None:
            from .step_profile import table

            print(table(res), flush=True)
    capture_s = None
    if run.capture_due(done - 1):  # outside the step's time: its tokens/s stay the step's own
        t_cap = time.perf_counter()
        run.capture_graphs(done - 1)
        capture_s = time.perf_counter() - t_cap
    out = {
        "step": done,
        "train_loss": train_loss,
        "lr": rec["lr"],
        "tokens_per_s": tokens_per_step / dt,
        "step_time_s": dt,
        "peak_mem_gib": peak_memory_gib(run.device),
    }
    if grad_norm is not None:
        out["grad_norm"] = grad_norm
    if capture_s is not None:
        out["graph_capture_s"] = capture_s
    if profiled:
        out["profiled"] = True  # slowed by the profiler: not the run's tokens/s
    if t.peak_tflops:
        out["mfu"] = mfu(cfg.model, tokens_per_step / dt, run.world_size, t.peak_tflops)
    it, val = dt, None
    if done % t.eval_every == 0 or done == t.steps:
        t_eval = time.perf_counter()
        out["val_loss"] = val = run.evaluate()
        it += time.perf_counter() - t_eval
    if writer:
        writer.write(out)
    if bar:
        post = {"loss": f"{train_loss:.3f}", "tok/s": f"{out['tokens_per_s']:.0f}"}
        if "val_loss" in out:
            post["val"] = f"{out['val_loss']:.3f}"
        bar.set_postfix(post, refresh=False)
        bar.update(1)
    return it, val
