"""The CPU reference benchmarks in one run (`make bench`): each benchmark in its own process, one
after the other, a progress line before and after each, and a summary at the end.

    PYTHONPATH=python .venv/bin/python bench/run_cpu.py [--full] [--only quantize_cpu,ddp_cpu]

Default (quick): every benchmark at its own shapes with fewer iterations (a few minutes on 2
cores), JSON into bench/results/quick/, so the reference files that BENCHMARKS.md cites are not
overwritten by short runs. --full: each benchmark's own defaults, JSON into bench/results/<name>.json
(the reference files: run it on a quiet machine). --smoke: tiny shapes and 1-2 iterations, only to
show that every benchmark still runs (tests/python/test_bench_layout.py). The GPU reference
benchmarks run through scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (quick arguments, smoke arguments). Quick keeps each benchmark's shapes and cuts its
# iterations; smoke also shrinks the shapes. accounting_cpu needs 2 iterations at least (it reports
# a 10th percentile); FP8 training needs tokens (rows) in multiples of 16.
BENCHES = {
    "quantize_cpu": (["--reps", "11"], ["--rows", "64", "--cols", "64", "--reps", "1"]),
    "linear_cpu": (
        ["--iters", "5", "--warmup", "1"],
        ["--tokens", "32", "--in", "32", "--out", "32", "--iters", "1", "--warmup", "0"],
    ),
    "accounting_cpu": (
        ["--iters", "20", "--warmup", "3"],
        ["--layers", "2", "--hidden", "16", "--iters", "2", "--warmup", "0"],
    ),
    "ddp_cpu": (
        ["--iters", "5", "--warmup", "1"],
        ["--layers", "2", "--hidden", "32", "--tokens", "16", "--iters", "1", "--warmup", "0"],
    ),
    "pipeline_bubble_cpu": (
        ["--iters", "3", "--warmup", "1"],
        ["--hidden", "16", "--rows", "16", "--iters", "1", "--warmup", "0"],
    ),
}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="each benchmark's own iteration counts")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes: does every one still run")
    ap.add_argument(
        "--only", default="", help="comma-separated names (default: all): " + ", ".join(BENCHES)
    )
    ap.add_argument(
        "--out", help="JSON folder (default: bench/results/quick, --full: bench/results)"
    )
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(
            f"--only: unknown benchmark(s) {unknown}; the CPU reference benchmarks are {list(BENCHES)}"
        )
    if args.out is None:
        results = os.path.join(HERE, "results")
        args.out = results if args.full else os.path.join(results, "quick")
    return args, names


def command(name: str, args) -> list[str]:
    quick, smoke = BENCHES[name]
    extra = [] if args.full else smoke if args.smoke else quick
    json_path = os.path.join(args.out, f"{name}.json")
    return [sys.executable, os.path.join(HERE, f"{name}.py"), *extra, "--json", json_path]


def main(argv=None) -> int:
    args, names = parse(argv)
    mode = "full" if args.full else "smoke" if args.smoke else "quick"
    print(f"[bench] {len(names)} CPU benchmark(s), {mode}, JSON into {args.out}", flush=True)
    done = []
    t_all = time.perf_counter()
    for k, name in enumerate(names, 1):
        cmd = command(name, args)
        print(f"[bench {k}/{len(names)}] {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)  # its output streams through: the benchmark's own table
        secs = time.perf_counter() - t0
        print(
            f"[bench {k}/{len(names)}] {name}: {'ok' if rc == 0 else f'FAILED rc={rc}'} in {secs:.0f} s",
            flush=True,
        )
        done.append((name, rc, secs))
    print(f"[bench] summary ({time.perf_counter() - t_all:.0f} s):")
    for name, rc, secs in done:
        print(f"  {name:22s} {'ok' if rc == 0 else f'FAILED rc={rc}':>12s} {secs:6.0f} s")
    return 0 if all(rc == 0 for _, rc, _ in done) else 1


if __name__ == "__main__":
    sys.exit(main())
