"""Shared helpers of the CUDA benchmarks: interleaved event timing and result tables.

Variants are timed interleaved (A B A B ...) on identical inputs, because clocks drift within a
run; each sample is one call between two CUDA events and the median is reported.
"""

import json
import statistics
import time

import torch


def time_interleaved(variants, warmup=3, rounds=20):
    """variants: {name: zero-arg callable}. Returns {name: median milliseconds}."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            samples[name].append((start, end))
    torch.cuda.synchronize()
    return {n: statistics.median(s.elapsed_time(e) for s, e in ev) for n, ev in samples.items()}


def peak_step_mib(step):
    """MiB that one call of `step` allocates at its peak, above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def device_info():
    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": p.name,
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def print_table(title, header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    for r in [header] + rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths)))


def write_json(path, payload):
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
