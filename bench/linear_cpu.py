"""CPU forward+backward of fp8dp.Linear (plain, FP8 delayed, FP8 current) against torch.nn.Linear.

Shows what FP8 emulation costs on the CPU (quantize passes, transposes, dequantize before an FP32
GEMM); there is no target. Variants run interleaved (A B C D A B C D ...) on identical inputs so
that load from other processes hits them alike; each reported time is the median.

    PYTHONPATH=python .venv/bin/python bench/linear_cpu.py [--tokens 2048 --in 1024 --out 1024]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
from linear_step import make_step
from machine import cpu_name

import fp8dp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--in", dest="in_features", type=int, default=1024)
    ap.add_argument("--out", dest="out_features", type=int, default=1024)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="bench/results/linear_cpu.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    t, k, n = args.tokens, args.in_features, args.out_features
    x = torch.randn(t, k, dtype=dtype)
    dy = torch.randn(t, n, dtype=dtype)
    ref = torch.nn.Linear(k, n, dtype=dtype)
    ours = fp8dp.Linear(k, n, params_dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    variants = {
        "torch.nn.Linear": make_step(ref, x, dy, None),
        "fp8dp.Linear (no FP8)": make_step(ours, x, dy, None),
        "fp8dp.Linear FP8 delayed": make_step(ours, x, dy, fp8dp.DelayedScaling()),
        "fp8dp.Linear FP8 current": make_step(ours, x, dy, fp8dp.Float8CurrentScaling()),
    }
    times = {name: [] for name in variants}
    for i in range(args.warmup + args.iters):
        for name, step in variants.items():
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times[name].append(dt)
    base = statistics.median(times["torch.nn.Linear"])
    flops = 3 * 2 * t * k * n  # fprop + dgrad + wgrad
    results = []
    for name, ts in times.items():
        med = statistics.median(ts)
        results.append(
            {
                "variant": name,
                "median_ms": med * 1e3,
                "min_ms": min(ts) * 1e3,
                "gflops": flops / med / 1e9,
                "time_vs_torch": med / base,
            }
        )
    record = {
        "benchmark": "linear_cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "PYTHONPATH=python .venv/bin/python bench/linear_cpu.py "
        f"--tokens {t} --in {k} --out {n} --dtype {args.dtype} --iters {args.iters}",
        "shape": {"tokens": t, "in": k, "out": n, "dtype": args.dtype},
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "results": results,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
    print(f"{t}x{k}x{n} {args.dtype}, {record['threads']} threads, {record['cpu']}")
    for r in results:
        print(
            f"  {r['variant']:<28} {r['median_ms']:9.2f} ms  {r['gflops']:7.1f} GFLOP/s  "
            f"{r['time_vs_torch']:5.2f}x torch time"
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
