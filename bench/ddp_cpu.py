"""CPU/gloo DDP step (forward, backward, gradient all-reduce) on 2 ranks:
fp8dp.DistributedDataParallel against torch.nn.parallel.DistributedDataParallel on the same
model, data and bucket size.

Variants run interleaved (A B C A B C ...) on identical inputs so that load from other processes
hits them alike; each reported time is the median over rank 0's steps (every step ends with the
gradients reduced, so both ranks' times agree). Launches itself under torchrun when run directly:

    PYTHONPATH=python .venv/bin/python bench/ddp_cpu.py [--layers 8 --hidden 1024 --tokens 256]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from machine import cpu_name
from torch import nn
from torchrun_launch import main_or_worker


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size, MiB of FP32")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", default="bench/results/ddp_cpu.json")
    return ap.parse_args()


def worker(args) -> None:
    import fp8dp

    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
    bucket = int(args.bucket_mb * 2**20 / 4)
    variants = {}
    tmodel = copy.deepcopy(base)
    variants["torch DDP"] = (
        nn.parallel.DistributedDataParallel(tmodel, bucket_cap_mb=args.bucket_mb),
        lambda m: m.zero_grad(set_to_none=True),
        lambda m: None,
    )
    for name, dist_opt in (("fp8dp DDP (all-reduce)", False), ("fp8dp DDP (reduce-scatter)", True)):
        cfg = fp8dp.DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=dist_opt, bucket_size=bucket
        )
        m = fp8dp.DistributedDataParallel(copy.deepcopy(base), cfg)
        variants[name] = (m, lambda m: m.zero_grad_buffer(), lambda m: m.finish_grad_sync())
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    dy = torch.randn(args.tokens, args.hidden, generator=g)
    times = {k: [] for k in variants}
    for it in range(args.warmup + args.iters):
        for name, (model, zero, finish) in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            zero(model)
            model(x).backward(dy)
            finish(model)
            dt = time.perf_counter() - t0
            if it >= args.warmup:
                times[name].append(dt)
    if rank == 0:
        params = sum(p.numel() for p in base.parameters())
        ref = statistics.median(times["torch DDP"])
        rows = []
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append(
                {
                    "variant": name,
                    "median_ms": med * 1e3,
                    "min_ms": min(ts) * 1e3,
                    "torch_over_this": ref / med,
                }
            )
            print(
                f"{name:30s} median {med * 1e3:8.1f} ms  min {min(ts) * 1e3:8.1f} ms  "
                f"speed vs torch DDP {ref / med:5.2f}x"
            )
        out = {
            "benchmark": "ddp_cpu",
            "date": datetime.date.today().isoformat(),
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "world_size": ws,
            "layers": args.layers,
            "hidden": args.hidden,
            "tokens_per_rank": args.tokens,
            "parameters": params,
            "bucket_elements": bucket,
            "iters": args.iters,
            "load_average": os.getloadavg(),
            "results": rows,
        }
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    dist.destroy_process_group()


def main() -> None:
    args = parse()
    main_or_worker(__file__, args.nproc, worker, args)


if __name__ == "__main__":
    main()
