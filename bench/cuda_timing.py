"""Shared helpers of the CUDA benchmarks: interleaved event timing and result tables.

Variants are timed interleaved (A B A B ...) on identical inputs, because clocks drift within a
run; each sample is one call between two CUDA events and the median is reported.
"""

import ctypes
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
        index = str(visible_gpu_index())
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


def visible_gpu_index():
    """NVML / nvidia-smi index of torch's device 0 (CUDA_VISIBLE_DEVICES may renumber them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


class EnergyCounter:
    """The GPU's cumulative energy counter (NVML's nvmlDeviceGetTotalEnergyConsumption, millijoules
    since the driver loaded), read through ctypes so that no Python package is needed. joules() is
    None where the NVML library or the counter is missing (then `why` says which)."""

    def __init__(self):
        self.handle, self.why = None, None
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
            if self.lib.nvmlInit_v2() != 0:
                raise OSError("nvmlInit_v2 failed")
            h = ctypes.c_void_p()
            if self.lib.nvmlDeviceGetHandleByIndex_v2(visible_gpu_index(), ctypes.byref(h)) != 0:
                raise OSError("nvmlDeviceGetHandleByIndex_v2 failed")
            self.handle = h
            if self.joules() is None:
                raise OSError("nvmlDeviceGetTotalEnergyConsumption is not supported")
        except (OSError, AttributeError) as e:
            self.handle, self.why = None, str(e)

    def joules(self):
        if self.handle is None:
            return None
        mj = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)) != 0:
            return None
        return mj.value / 1e3


def time_sustained(step, energy, seconds=1.5, warm_s=0.5):
    """`step` run back to back on its own: warm_s seconds to let the clock settle at this step's own
    power, then about `seconds` measured. Returns ms per step (wall clock over the block, the GPU
    kept busy because the host runs ahead), joules per step and mean watts from the energy counter
    (None without one), and the SM clock / power samples of the measured block. The warm-up is
    bounded by the wall clock and sets the measured block's step count, so no estimate is needed."""
    t0, warm_steps = time.perf_counter(), 0
    while warm_steps < 2 or time.perf_counter() - t0 < warm_s:
        step()
        warm_steps += 1
    torch.cuda.synchronize()
    est_ms = (time.perf_counter() - t0) * 1e3 / warm_steps
    n = max(3, int(seconds * 1e3 / est_ms))
    torch.cuda.synchronize()
    with GpuSampler() as gpu:
        e0, t0 = energy.joules(), time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        e1, t1 = energy.joules(), time.perf_counter()
    out = {"steps": n, "ms": (t1 - t0) * 1e3 / n, "gpu": gpu.summary()}
    if e0 is not None and e1 is not None:
        out["joules_per_step"] = (e1 - e0) / n
        out["watts"] = (e1 - e0) / (t1 - t0)
    return out


def alone_vs(alone, name, base):
    """Fields of variant `name` from time_sustained results `alone` (name -> result) against the
    baseline variant `base`: its result, its speed-up alone, and its energy ratio (the baseline's
    joules per step over its own; absent without an energy counter)."""
    a, b = alone[name], alone[base]
    out = {"alone": a, "alone_speedup": b["ms"] / a["ms"]}
    if "joules_per_step" in a and "joules_per_step" in b:
        out["energy_ratio"] = b["joules_per_step"] / a["joules_per_step"]
    return out


def alone_cells(v):
    """Table cells (ms, speed-up, J/step, W, energy ratio, SM MHz) of alone_vs's fields `v`."""
    a = v["alone"]
    g = a.get("gpu") or {}
    return [
        f"{a['ms']:.3f}",
        f"{v['alone_speedup']:.2f}x",
        f"{a['joules_per_step']:.2f}" if "joules_per_step" in a else "-",
        f"{a['watts']:.0f}" if "watts" in a else "-",
        f"{v['energy_ratio']:.2f}x" if "energy_ratio" in v else "-",
        f"{g['sm_clock_mhz']['median']:.0f}" if g else "-",
    ]


ALONE_HEADER = ["ms", "vs base", "J/step", "W", "base J / J", "MHz"]


def host_ms(step, n=5):
    """Median CPU time to enqueue one step (no synchronisation inside); a step whose host time is
    close to its GPU time is host-bound."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


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
