"""Host cost of fp8dp's gradient accounting on the CPU: one DDP step (forward, backward,
backward_dw of every layer, finish_grad_sync) of a stack of small fp8dp.Linear layers on one gloo
rank, where host work dominates (worst case for the checks' share). Variants, interleaved A B A B
in one process on identical inputs, each its own model and DDP:

  default   the default config: the checks that are always on (parameters still in their buffers,
            queued wgrads delivered, the bound layer's weight identity, the FP8 weight's version)
  ledger    grad_ledger=True (opt-in: graph walk per forward, bookkeeping per arrival)

Then the always-on buffer check alone (GradSync.check_params_in_buffers, through DDP's GradSync
in fp8dp._C). Run it against two builds (PYTHONPATH) to compare trees. Prints the median step
time per variant and writes JSON:

    PYTHONPATH=python .venv/bin/python bench/accounting_cpu.py [--layers 24 --hidden 64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from machine import cpu_name

import fp8dp


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--fused", action="store_true", help="fuse_wgrad_accumulation=True")
    ap.add_argument("--json", default="bench/results/accounting_cpu.json")
    return ap.parse_args()


def build(args, ledger: bool):
    torch.manual_seed(0)
    layers = [
        fp8dp.Linear(
            args.hidden, args.hidden, delay_wgrad_compute=True, fuse_wgrad_accumulation=args.fused
        )
        for _ in range(args.layers)
    ]
    model = torch.nn.Sequential(*layers)
    kw = dict(delay_wgrad_compute=True, overlap_grad_reduce=True)
    if ledger:
        kw["grad_ledger"] = True
    ddp = fp8dp.DistributedDataParallel(model, fp8dp.DistributedDataParallelConfig(**kw))
    return ddp, layers


PHASES = ("forward", "backward", "backward_dw", "zero+finish")


def step(ddp, layers, xs) -> dict:
    """One step; seconds per phase (summed over micro-batches)."""
    t = dict.fromkeys(PHASES, 0.0)
    c = time.perf_counter
    t0 = c()
    ddp.zero_grad_buffer()
    t["zero+finish"] += c() - t0
    for k, x in enumerate(xs):
        ctx = ddp.no_sync() if k < len(xs) - 1 else _null()
        with ctx:
            t0 = c()
            loss = ddp(x).sum()
            t1 = c()
            loss.backward()
            t2 = c()
            for m in reversed(layers):
                m.backward_dw()
            t3 = c()
        t["forward"] += t1 - t0
        t["backward"] += t2 - t1
        t["backward_dw"] += t3 - t2
    t0 = c()
    ddp.finish_grad_sync()
    t["zero+finish"] += c() - t0
    return t


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    variants = {"default": build(args, False), "ledger": build(args, True)}
    xs = [torch.randn(args.tokens, args.hidden) for _ in range(args.micro_batches)]
    times = {name: [] for name in variants}
    phases = {name: {p: [] for p in PHASES} for name in variants}
    for i in range(args.warmup + args.iters):
        for name, (ddp, layers) in variants.items():
            t = step(ddp, layers, xs)
            if i >= args.warmup:
                times[name].append(sum(t.values()))
                for p in PHASES:
                    phases[name][p].append(t[p])
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    # The 10th percentile: on a shared machine the least-disturbed steps compare best.
    p10 = {n: statistics.quantiles(v, n=10)[0] * 1e3 for n, v in times.items()}
    phase_p10 = {
        n: {p: statistics.quantiles(v, n=10)[0] * 1e6 for p, v in ph.items()}
        for n, ph in phases.items()
    }
    base = med["default"]
    print(
        f"{args.layers} x fp8dp.Linear({args.hidden}), {args.micro_batches} micro-batches of "
        f"{args.tokens} tokens, delayed wgrad{', fused' if args.fused else ''}, 1 gloo rank"
    )
    for n, m in med.items():
        print(
            f"  {n:8s} median {m:8.3f} ms  ({m / base:.3f}x default), 10th percentile "
            f"{p10[n]:8.3f} ms ({p10[n] / p10['default']:.3f}x); per phase (us, p10): "
            + ", ".join(f"{p} {v:.0f}" for p, v in phase_p10[n].items())
        )
    # The always-on buffer check alone: one call per forward.
    ddp = variants["default"][0]
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        ddp._sync.check_params_in_buffers()
    per = (time.perf_counter() - t0) / n * 1e6
    print(
        f"  check_params_in_buffers: {per:.2f} us per forward "
        f"({per * args.micro_batches / (base * 1e3) * 100:.3f}% of a step)"
    )
    out = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": cpu_name(),
        "torch": torch.__version__,
        "args": vars(args),
        "median_ms": med,
        "p10_ms": p10,
        "phase_p10_us": phase_p10,
        "check_params_in_buffers_us": per,
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
