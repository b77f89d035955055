"""python -m fp8dp.train --config configs/demo.yaml  (under torchrun --nproc_per_node=N)

Trains the demo GPT with fp8dp modules, DistributedDataParallel and DistributedOptimizer. Rank 0
shows a progress bar, writes <out.dir>/fp8/metrics.jsonl (or nofp8/ with fp8.enabled=false) and
plots <out.dir>/loss.png, which also shows the other run when it exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch.distributed as dist

from .config import load_config
from .flops import flops_per_token, param_counts
from .loop import setup_distributed, train
from .metrics import plot_losses
from .step_profile import parse_range


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fp8dp.train", description=__doc__.split("\n")[0])
    p.add_argument(
        "--config", default="configs/demo.yaml", help="YAML config (default: %(default)s)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key (repeatable), e.g. --set train.steps=50",
    )
    p.add_argument(
        "--compare-bf16",
        action="store_true",
        help="after the FP8 run, train the same config with FP8 off and plot both",
    )
    p.add_argument(
        "--save",
        metavar="DIR",
        help="write a checkpoint to DIR at the end "
        "(and to DIR/step_NNNNNN every train.save_every steps)",
    )
    p.add_argument(
        "--resume", metavar="DIR", help="continue bit-exactly from the checkpoint in DIR"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        help="where the ranks run (run.device; overrides the config and --set): cuda is one GPU "
        "per rank, cpu runs gloo; auto (the default) picks cuda when fp8dp has CUDA and torch "
        "sees a GPU",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        help="torch.distributed backend (run.backend; overrides the config and --set): auto "
        "(the default) is nccl on cuda, gloo on cpu",
    )
    p.add_argument(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="stop after this step (with --save: checkpoint there; --resume continues bit-exactly "
        "on the same schedule, which train.steps decides)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="stop at the last step boundary that leaves room for the checkpoint within SECONDS "
        "of training (with --save; for GPU commands of limited length)",
    )
    p.add_argument(
        "--profile",
        metavar="FIRST:COUNT",
        help="profile COUNT steps from step FIRST (rank 0): the device's time per step by "
        "category into <run>/step_profile.json and stdout (fp8dp.train.step_profile)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


# How long a rank other than 0 waits before it exits with an error that every rank meets (a bad
# flag, config or device request): torchrun stops all ranks once one has exited with an error, so a
# rank 1 that exited first stopped rank 0 before it printed, and the job failed without a word (the
# one-GPU H200, 2026-12-04). Rank 0 prints and exits at once; torchrun then ends the waiting ranks.
_FAIL_WAIT_S = 30.0


def _fail(e: Exception) -> int:
    if os.environ.get("RANK", "0") == "0":
        # One line, whatever the exception's text: a launcher's log shows one line per rank.
        print(f"fp8dp.train: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(_FAIL_WAIT_S)
    return 2


def _check_flags(args) -> None:
    """The command-line flags that do not fit together (ValueError naming the flag)."""
    if args.profile is not None:
        parse_range(args.profile)
    if args.compare_bf16 and (args.save or args.resume):
        raise ValueError(
            "--compare-bf16: expected no --save or --resume (it trains two "
            f"runs), got {'--save' if args.save else '--resume'}"
        )
    for flag, value, ok, expected in (
        ("--stop-at", args.stop_at, args.stop_at is None or args.stop_at >= 1, "a step >= 1"),
        (
            "--time-budget",
            args.time_budget,
            args.time_budget is None or args.time_budget > 0,
            "seconds > 0",
        ),
    ):
        if not ok:
            raise ValueError(f"{flag}: expected {expected}, got {value}")
        if value is not None and not args.save:
            raise ValueError(
                f"{flag}: expected --save DIR too (a run that stops early continues from its "
                "checkpoint with --resume DIR), got no --save"
            )


def _runs(cfg, compare_bf16: bool) -> list:
    """The configs to train: cfg, and with --compare-bf16 the same with FP8 off."""
    if not compare_bf16:
        return [cfg]
    if not cfg.fp8.enabled:
        raise ValueError("--compare-bf16: expected a config with fp8.enabled true, got false")
    return [cfg, dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, enabled=False))]


def _print_header(name: str, run_cfg, world: int, backend: str) -> None:
    """Rank 0's first line of a run: layout, model size, steps; and the fp8.* keys not read."""
    par = run_cfg.parallel
    layout = (
        f", PP {par.pipeline_parallel_size} x DP "
        f"{world // par.pipeline_parallel_size} ({par.schedule})"
        if par.pipeline_parallel_size > 1
        else ""
    )
    n = param_counts(run_cfg.model)
    print(
        f"[fp8dp.train] {name}: {world} rank(s), {backend}{layout}, "
        f"{run_cfg.model.n_layer} layers x {run_cfg.model.d_model}, "
        f"{n['total'] / 1e6:.1f}M parameters ({n['gemm'] / 1e6:.1f}M in GEMMs, "
        f"{flops_per_token(run_cfg.model) / 1e9:.3g} GFLOP/token), "
        f"{run_cfg.train.steps} steps",
        flush=True,
    )
    unused = run_cfg.fp8.unused_keys()
    if unused:
        print(
            f"[fp8dp.train] {name}: not read under fp8.recipe "
            f"{run_cfg.fp8.recipe}: {', '.join(unused)}",
            flush=True,
        )


def _print_outcome(name: str, summary: dict, run_dir: str, args) -> None:
    """Rank 0's last line of a run: nothing to train, where to continue, or the losses."""
    if summary["start_step"] == summary["steps"]:
        print(
            f"[fp8dp.train] {name}: the checkpoint in {args.resume} is at step "
            f"{summary['steps']} = train.steps, nothing to train (continue with "
            f"--set train.steps=N)",
            flush=True,
        )
    elif not summary["complete"]:
        print(
            f"[fp8dp.train] {name}: stopped after step {summary['stopped_at']} of "
            f"{summary['steps']}; continue with --resume {args.save}",
            flush=True,
        )
    else:
        print(
            f"[fp8dp.train] {name}: val loss {summary['first_val_loss']} -> "
            f"{summary['last_val_loss']:.4f}; metrics {run_dir}/metrics.jsonl",
            flush=True,
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    # --device / --backend are run.device / run.backend, applied after --set: the flag wins.
    flags = [f"run.{k}={getattr(args, k)}" for k in ("device", "backend") if getattr(args, k)]
    try:
        _check_flags(args)
        cfg = load_config(args.config, args.set + flags)  # errors name the key, before any work
        rank, world, device, backend = setup_distributed(cfg.run)  # errors before it joins
    except (ValueError, OSError) as e:
        return _fail(e)
    try:
        cfg.check_world_size(world)
        for run_cfg in _runs(cfg, args.compare_bf16):
            name = "fp8" if run_cfg.fp8.enabled else "nofp8"
            run_dir = os.path.join(run_cfg.out.dir, name)
            if rank == 0:
                _print_header(name, run_cfg, world, backend)
            summary = train(
                run_cfg,
                run_dir,
                rank=rank,
                world_size=world,
                device=device,
                save=args.save,
                resume=args.resume,
                progress=not args.no_progress,
                stop_at=args.stop_at,
                time_budget_s=args.time_budget,
                profile=parse_range(args.profile) if args.profile else None,
            )
            if rank == 0:
                _print_outcome(name, summary, run_dir, args)
        if rank == 0:
            dtype = cfg.model.params_dtype
            png = plot_losses(
                cfg.out.dir,
                os.path.join(cfg.out.dir, "loss.png"),
                {"fp8": f"FP8 ({cfg.fp8.recipe})", "nofp8": f"no FP8 ({dtype})"},
            )
            print(f"[fp8dp.train] plot {png}", flush=True)
        dist.barrier()  # rank 0's files are complete before any rank exits
    except ValueError as e:  # a config or checkpoint that does not fit this job
        return _fail(e)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
