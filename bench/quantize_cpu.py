"""CPU quantize throughput, FP32 -> E4M3: fp8dp's one-pass kernel (alone and with the transposed copy)
against the naive torch path (amax, multiply, .to(float8)) and a plain copy, in one run.

Variants run interleaved (A B C D A B C D ...) on the same input so that clock and load drift hit all of
them alike; each reports the median time. Bandwidth counts the bytes a variant must move at least:
quantize reads 4 B and writes 1 B per element (2 B with the transposed copy); the copy reads and writes
4 B each. The naive path is rated on the same 5 B per element as our quantize, so its GB/s shows the
throughput a user gets for the same job.

    PYTHONPATH=python .venv/bin/python bench/quantize_cpu.py            # 4096 x 4096, 31 repetitions
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
from machine import cpu_name

import fp8dp
from fp8dp import _C


def naive_quantize(x: torch.Tensor, scale: torch.Tensor):
    amax = x.abs().amax()
    return (x * scale).to(torch.float8_e4m3fn), amax


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=31, help="timed repetitions of every variant")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    # --json as every benchmark names it; --out, the name it had first, still works.
    ap.add_argument("--json", "--out", dest="json", default="bench/results/quantize_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols)
    dst = torch.empty_like(x)
    scale = torch.tensor([448.0]) / x.abs().max()
    e4m3 = _C.Format.E4M3

    # The comparison only means something if the outputs agree: same bytes, same amax.
    ours = _C.quantize(x, scale, e4m3, transpose=True)
    ref, ref_amax = naive_quantize(x, scale)
    if not torch.equal(ours.data.view(torch.uint8), ref.view(torch.uint8)):
        raise SystemExit("fp8dp.quantize and the torch path disagree; not benchmarking")
    if not torch.equal(ours.data_t.view(torch.uint8), ref.view(torch.uint8).t()):
        raise SystemExit("transposed copy is not the transpose of the row-major bytes")
    if ours.amax.item() != ref_amax.item():
        raise SystemExit("amax differs from torch's")

    n = x.numel()
    variants = {
        "fp8dp quantize": (lambda: _C.quantize(x, scale, e4m3), 5 * n),
        "fp8dp quantize+transpose": (lambda: _C.quantize(x, scale, e4m3, transpose=True), 6 * n),
        "torch naive (amax, mul, .to)": (lambda: naive_quantize(x, scale), 5 * n),
        "copy (dst.copy_(src))": (lambda: dst.copy_(x), 8 * n),
    }
    for fn, _ in variants.values():  # warm-up: page faults, thread pool start
        fn()
        fn()
    load_before = os.getloadavg()[0]
    times = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, (fn, _) in variants.items():
            times[name].append(timed(fn))

    rows = {}
    for name, (_, nbytes) in variants.items():
        med = statistics.median(times[name])
        rows[name] = {
            "median_ms": med * 1e3,
            "min_ms": min(times[name]) * 1e3,
            "bytes": nbytes,
            "gb_per_s": nbytes / med / 1e9,
        }
    q = rows["fp8dp quantize"]
    copy_bw = rows["copy (dst.copy_(src))"]["gb_per_s"]
    naive_ms = rows["torch naive (amax, mul, .to)"]["median_ms"]
    for r in rows.values():
        r["speedup_vs_naive"] = naive_ms / r["median_ms"]
        r["fraction_of_copy_bw"] = r["gb_per_s"] / copy_bw

    print(
        f"FP32 -> E4M3, {args.rows} x {args.cols}, {args.threads} threads, "
        f"median of {args.reps} interleaved repetitions"
    )
    print(f"{'variant':<30} {'ms':>8} {'GB/s':>7} {'x naive':>8} {'of copy BW':>10}")
    for name, r in rows.items():
        print(
            f"{name:<30} {r['median_ms']:8.2f} {r['gb_per_s']:7.2f} "
            f"{r['speedup_vs_naive']:8.2f} {r['fraction_of_copy_bw']:10.0%}"
        )
    print(f"1-min load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    ok_naive = q["speedup_vs_naive"] >= 3.0
    ok_copy = q["fraction_of_copy_bw"] >= 0.5
    print(
        f"targets: >= 3x naive: {'met' if ok_naive else 'MISSED'}; "
        f">= 50% of copy bandwidth: {'met' if ok_copy else 'MISSED'}"
    )

    result = {
        "benchmark": "quantize_cpu",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads},
        # other processes on the machine skew the absolute numbers; the ratios less so
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
        "torch": torch.__version__,
        "fp8dp": fp8dp.__version__,
        "shape": [args.rows, args.cols],
        "reps": args.reps,
        "results": rows,
        "targets": {"speedup_vs_naive>=3": ok_naive, "fraction_of_copy_bw>=0.5": ok_copy},
    }
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
