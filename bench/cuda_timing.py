"""Shared helpers of the CUDA benchmarks: interleaved event timing and result tables.

Variants are timed interleaved (A B A B ...) on identical inputs, because clocks drift within a
run; each sample is one call between two CUDA events and the median is reported.
"""

import json
import os
import statistics
import subprocess
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


class GpuSampler:
    """The SM clock (MHz) and board power (W) of the benchmark's GPU, sampled every `period_ms` by
    `nvidia-smi -lms` while the `with` block runs. A step timed at lower clocks (power or thermal
    limits under a long run) looks slower for a reason outside its kernels; the summary says
    whether that happened. summary() is None where nvidia-smi is missing or printed nothing."""

    def __init__(self, period_ms=100):
        self.period_ms = period_ms
        self.proc = None
        self.samples = []

    def __enter__(self):
        # nvidia-smi counts every GPU of the host; CUDA_VISIBLE_DEVICES may renumber them for torch.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        index = visible if visible.isdigit() else "0"
        cmd = [
            "nvidia-smi",
            "--query-gpu=clocks.sm,power.draw",
            "--format=csv,noheader,nounits",
            f"-lms={self.period_ms}",
            f"--id={index}",
        ]
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return False
        self.proc.terminate()
        try:
            out = self.proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out = self.proc.communicate()[0]
        for line in out.splitlines():
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:  # "[N/A]" or a partial last line
                continue
            self.samples.append((clock, power))
        return False

    def summary(self):
        if not self.samples:
            return None
        clocks = [c for c, _ in self.samples]
        power = [w for _, w in self.samples]
        return {
            "samples": len(self.samples),
            "sm_clock_mhz": {
                "median": statistics.median(clocks),
                "min": min(clocks),
                "max": max(clocks),
            },
            "power_w": {"median": statistics.median(power), "max": max(power)},
        }


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
