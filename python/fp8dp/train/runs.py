"""The convergence runs of one config, in chunks that fit a limited command:

    python -m fp8dp.train.runs --config configs/gpt350m.yaml [--budget 540] [--nproc 1]
        [--device cuda] [--out runs/gpt350m] [--torch-steps 200] [--seeds 1234,1,2] [--set k=v ...]

trains, with the same seed and data order, FP8 delayed scaling (HYBRID), FP8 current scaling and
FP8 off (the config's fp8.* overridden, nothing else; `--only block` adds Float8BlockScaling to
the runs already trained), then --torch-steps steps of the same model
in plain torch.nn + torch DDP (torch_ref.py). Each fp8dp run continues from its checkpoint
(<out>/<run>/ckpt, --resume, bit-exact) and stops with --time-budget before this command's
--budget seconds are spent; run the same command again until it prints "all runs complete" (exit
status 0; 3 = run again). Then it compares them (compare.py: table, gaps, plot).

--seeds S1,S2,...: the same runs once per seed (train.seed=S, which sets the initial weights and
the data order), under <out>/seed<S>/, seed by seed (every run of S1 before any of S2, so that an
interrupted series still holds complete pairs); the torch baseline on the first seed only. The
comparison then uses each run's mean curve over seeds and the paired gaps per seed (compare.py):
two runs of one seed on the GPU differ by more than the 0.25% target.

--resume-check N trains N steps of the FP8 run (config as given) straight through and again as
N/2 steps, --stop-at, then --resume to N, and says whether every logged loss, gradient norm and
both ranks' checkpoints (model with FP8 state, optimizer shards) are bit-identical: bit-exact
resume shown at the config's own size (out: <out>/resume_check).

Budget: each launch gets the seconds left minus --launch-slack (start-up, checkpoint load and the
final checkpoint are outside the training loop's own estimate); a run is not started with less
than --min-chunk seconds left.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from . import compare as cmp
from .config import load_config

# name -> the config overrides that make the run (compare.RUNS names the same runs)
VARIANTS = {
    "delayed": ["fp8.enabled=true", "fp8.recipe=delayed"],
    "current": ["fp8.enabled=true", "fp8.recipe=current"],
    # Float8BlockScaling (E4M3 in 1x128 tiles, 128x128 weight blocks): not in --only's default;
    # `--only block` adds it to runs already trained.
    "block": ["fp8.enabled=true", "fp8.recipe=block"],
    "off": ["fp8.enabled=false"],
}


def _step_of(ckpt: str) -> int:
    try:
        with open(os.path.join(ckpt, "meta.json")) as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return 0


def _complete(base: str, name: str, steps: int) -> bool:
    """Whether run `name` under base finished all `steps` (its summary.json says so), so that a
    finished run whose checkpoint was deleted (gigabytes at 342M) is not trained again."""
    sub = "nofp8" if name == "off" else "fp8"
    try:
        with open(os.path.join(base, name, sub, "summary.json")) as f:
            s = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(s.get("complete")) and s.get("steps") == steps


def _torchrun(nproc: int, module: str, args: list, timeout: float) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]
    print("[runs] " + " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return 124


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8dp.train.runs", description=__doc__)
    p.add_argument("--config", default="configs/gpt350m.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", help="base directory of the runs (default: the config's out.dir)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (one per GPU); default 1")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for this command")
    p.add_argument("--launch-slack", type=float, default=90.0)
    p.add_argument("--min-chunk", type=float, default=150.0)
    p.add_argument("--torch-steps", type=int, default=200, help="0: no torch baseline")
    p.add_argument("--only", default="delayed,current,off,torch", help="runs to train")
    p.add_argument("--after", type=int, default=200, help="compare: curve gap after this step")
    p.add_argument("--png", help="compare: plot path (default <out>/compare.png)")
    p.add_argument("--resume-check", type=int, metavar="N", help="see the module docstring")
    p.add_argument("--seeds", help="comma-separated train.seed values: see the module docstring")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    cfg = load_config(args.config, args.set)  # a bad config fails here, before any launch
    base = args.out or cfg.out.dir
    steps = cfg.train.steps
    only = args.only.split(",")
    unknown = [n for n in only if n not in (*VARIANTS, "torch")]
    if unknown:
        print(f"[runs] error: --only: unknown runs {unknown}", file=sys.stderr)
        return 2
    seeds = None
    if args.seeds is not None:
        try:
            seeds = [int(x) for x in args.seeds.split(",")]
        except ValueError:
            seeds = []
        if not seeds or len(set(seeds)) != len(seeds):
            print(
                f"[runs] error: --seeds: expected distinct integers separated by commas, got "
                f"{args.seeds!r}",
                file=sys.stderr,
            )
            return 2
    common = ["--config", args.config, "--device", args.device]
    for item in args.set:
        common += ["--set", item]

    def left() -> float:
        return args.budget - (time.monotonic() - t0)

    if args.resume_check:
        return resume_check(args, common, os.path.join(base, "resume_check"), left)

    if seeds is None:
        rc = train_runs(args, common, base, only, steps, left, with_torch=True)
    else:
        for i, seed in enumerate(seeds):
            print(f"[runs] seed {seed} ({i + 1} of {len(seeds)})", flush=True)
            seeded = common + ["--set", f"train.seed={seed}"]
            rc = train_runs(
                args, seeded, os.path.join(base, f"seed{seed}"), only, steps, left, i == 0
            )
            if rc != 0:
                break
    if rc != 0:
        return rc
    print("[runs] all runs complete; comparing", flush=True)
    cmp_args = [base, "--after", str(args.after)] + (["--png", args.png] if args.png else [])
    cmp.main(cmp_args)
    return 0


def train_runs(args, common: list, base: str, only: list, steps: int, left, with_torch) -> int:
    """Trains (or continues) the runs of `only` under base: 0 when all are complete, 3 when this
    command's budget ran out first, another status on a failure."""
    for name, overrides in VARIANTS.items():
        if name not in only:
            continue
        ckpt = os.path.join(base, name, "ckpt")
        while _step_of(ckpt) < steps and not _complete(base, name, steps):
            if left() < args.min_chunk:
                print(
                    f"[runs] {name}: at step {_step_of(ckpt)} of {steps}; "
                    f"{left():.0f} s left: run this command again",
                    flush=True,
                )
                return 3
            before = _step_of(ckpt)
            run = common + ["--no-progress", "--save", ckpt]
            run += [
                a for o in overrides + [f"out.dir={os.path.join(base, name)}"] for a in ("--set", o)
            ]
            run += ["--time-budget", f"{left() - args.launch_slack:.0f}"]
            if before > 0:
                run += ["--resume", ckpt]
            rc = _torchrun(args.nproc, "fp8dp.train", run, timeout=max(1.0, left()))
            if rc != 0:
                print(f"[runs] {name}: exit status {rc}; stopping", file=sys.stderr)
                return rc if rc != 3 else 1
            if _step_of(ckpt) <= before:
                print(f"[runs] {name}: no progress from step {before}; stopping", file=sys.stderr)
                return 1
        print(f"[runs] {name}: complete ({steps} steps)", flush=True)
    if "torch" in only and args.torch_steps > 0 and with_torch:
        summary = os.path.join(base, "torch", "torch", "summary.json")
        if not os.path.exists(summary):
            if left() < args.min_chunk:
                print(f"[runs] torch: {left():.0f} s left: run this command again", flush=True)
                return 3
            run = common + ["--steps", str(args.torch_steps), "--set", f"out.dir={base}/torch"]
            rc = _torchrun(args.nproc, "fp8dp.train.torch_ref", run, timeout=max(1.0, left()))
            if rc != 0:
                print(f"[runs] torch: exit status {rc}; run this command again", file=sys.stderr)
                return 3 if rc == 124 else 1
    return 0


def resume_check(args, common: list, out: str, left) -> int:
    """--resume-check: N steps straight against N/2 + N/2 through --stop-at and --resume."""
    import torch

    n = args.resume_check
    if n < 2:
        print(f"[runs] error: --resume-check: expected a step count >= 2, got {n}", file=sys.stderr)
        return 2
    full, part = os.path.join(out, "full"), os.path.join(out, "part")
    launches = [
        (full, ["--stop-at", str(n)]),
        (part, ["--stop-at", str(n // 2)]),
        (part, ["--stop-at", str(n), "--resume", os.path.join(part, "ckpt")]),
    ]
    for d, extra in launches:
        run = common + ["--no-progress", "--save", os.path.join(d, "ckpt"), "--set", f"out.dir={d}"]
        rc = _torchrun(args.nproc, "fp8dp.train", run + extra, timeout=max(1.0, left()))
        if rc != 0:
            print(f"[runs] resume check: exit status {rc}", file=sys.stderr)
            return 1
    sub = "fp8" if load_config(args.config, args.set).fp8.enabled else "nofp8"
    keys = ("step", "train_loss", "grad_norm", "val_loss", "lr")

    def metrics(d):
        recs = cmp.read_metrics(os.path.join(d, sub, "metrics.jsonl"))
        return [{k: r.get(k) for k in keys} for r in recs]

    diffs = [] if metrics(full) == metrics(part) else ["metrics.jsonl"]
    ranks = sorted(f for f in os.listdir(os.path.join(full, "ckpt")) if f.endswith(".pt"))
    for f in ranks:
        a = torch.load(os.path.join(full, "ckpt", f), weights_only=False)
        b = torch.load(os.path.join(part, "ckpt", f), weights_only=False)
        for key in ("model", "optimizer"):
            if not _identical(a[key], b[key]):
                diffs.append(f"{f}:{key}")
    verdict = "bit-identical" if not diffs else f"DIFFERENT: {', '.join(diffs)}"
    print(f"[runs] resume check, {n} steps straight vs {n // 2} + {n - n // 2}: {verdict}")
    return 0 if not diffs else 1


def _identical(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b


if __name__ == "__main__":
    sys.exit(main())
