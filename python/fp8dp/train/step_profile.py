"""Where a training step's time goes: ``python -m fp8dp.train --profile FIRST:COUNT`` profiles steps
FIRST .. FIRST+COUNT-1 of the run with torch.profiler (rank 0) and writes
<run>/<fp8|nofp8>/step_profile.json and a table on stdout: per step, the wall time, the time of the
device's work by category (GEMMs, attention, fp8dp's casts, norms and scaling, communication, the
optimizer, elementwise and copies) and the largest single kernels or operators.

On CUDA the work is the GPU kernels (their device time); on the CPU, the operators' own CPU time
(self time, so nothing is counted twice). Kernels on several streams can overlap, so on CUDA the
categories may add up to more than the wall time; what they leave of it is time the GPU waited for
the host or for nothing. The profiled steps are marked "profiled" in metrics.jsonl: the profiler
slows them, so their tokens/s are not the run's.

On CUDA it also gives the GPU's idle time per step and, by the phase of the step (phase(): zero
grad, data, forward, loss, backward, backward_dw, finish_grad_sync, clip_grad, optimizer,
loss_mean) the host was in when the kernel ending each gap was launched, which host work the GPU
waited for (idle_by_phase).

Why: the 342M run's FP8 reaches 1.24x FP8 off's tokens/s where the target is 1.35x
(BENCHMARKS.md, "Training runs"); this says where the rest of the time goes, in the real step
(12-15 ms per step of it the GPU waits for the host, 2026-12-05).
"""

from __future__ import annotations

import collections
import json
import os
import re

import torch

# (category, substrings of the lowercased kernel or operator name): the first match wins, so the
# more specific patterns come first (the norm kernels before the other fp8dp kernels, NCCL before
# copies).
CATEGORIES = (
    ("communication", ("nccl", "gloo", "all_reduce", "reduce_scatter", "all_gather", "c10d::")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")),
    ("norms", ("fp8dp::cuda::norm", "layernorm", "layer_norm", "rmsnorm", "rms_norm", "norm_fwd",
               "norm_bwd")),
    ("FP8 scaling", ("update_scaling", "current_scale", "amax")),
    ("fp8dp autograd nodes (host)", ("cppnode<fp8dp",)),
    ("FP8 casts", ("fp8dp::", "quantize", "cast_transpose", "act_kernel", "column_sum")),
    ("GEMMs", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm",
              "aten::bmm", "_scaled_mm")),
    ("optimizer", ("adam", "multi_tensor", "_foreach", "lerp", "optimizer")),
    ("elementwise and copies", ("elementwise", "reduce", "copy", "fill", "memset", "memcpy",
                                "aten::", "cat", "index", "gather", "scatter", "softmax",
                                "embedding", "nll", "gelu", "add", "mul")),
)  # fmt: skip


# cuBLASLt's Hopper kernels name their operand types after the architecture: q (E4M3) or r (E5M2)
# first for an FP8 GEMM (nvjet_sm90_qqtst, qrtst), t (bf16) for a 16-bit one (nvjet_sm90_tst).
_FP8_GEMM = re.compile(r"nvjet_sm\d+a?_[qr]")


def category(name: str) -> str:
    low = name.lower()
    if _FP8_GEMM.search(low):
        return "FP8 GEMMs"
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


PHASE = "fp8dp.train."  # the record_function ranges of the training step's phases (phase())


def phase(name: str):
    """A record_function range around one phase of the training step (loop._dp_step), by which
    idle_by_phase() attributes the GPU's idle time. A few microseconds of host time per range
    when no profiler runs."""
    return torch.profiler.record_function(PHASE + name)


def idle_by_phase(events, steps: int, min_gap_us: float = 5.0) -> dict:
    """The GPU's idle time per step (gaps of at least min_gap_us between the union of its
    kernels, from the first kernel to the last) and, per step phase, the part of it that ended
    while the host was in that phase: the phase that launched the kernel ending the gap, so the
    one the GPU waited for. Kernels and host ranges share the profiler's clock. Gaps that end
    outside every phase (between steps: metrics, evaluation, the profiler) go to "(between
    steps)"."""
    kernels = sorted(
        (ev.time_range.start, ev.time_range.end)
        for ev in events
        if ev.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(ev, "is_user_annotation", False)
    )
    phases = [
        (ev.time_range.start, ev.time_range.end, ev.name[len(PHASE) :])
        for ev in events
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith(PHASE)
    ]
    gaps = []
    if kernels:
        end = kernels[0][1]
        for a, b in kernels[1:]:
            if a - end >= min_gap_us:
                gaps.append((end, a))
            end = max(end, b)
    by = collections.defaultdict(float)
    for g0, g1 in gaps:
        # the innermost phase around the gap's end (phases do not overlap, but may nest)
        inside = [p for p in phases if p[0] <= g1 <= p[1]]
        name = max(inside)[2] if inside else "(between steps)"
        by[name] += (g1 - g0) / 1e3 / steps
    return {
        "idle_ms": sum(by.values()),
        "idle_by_phase_ms": dict(sorted(by.items(), key=lambda kv: -kv[1])),
    }


def parse_range(text: str) -> tuple:
    """'FIRST:COUNT' -> (first, count), both >= 1 (ValueError naming --profile otherwise)."""
    try:
        first, count = (int(x) for x in text.split(":"))
    except ValueError:
        first = count = 0
    if first < 1 or count < 1:
        raise ValueError(
            f"--profile: expected FIRST:COUNT (the first step to profile, counted from 1, and how "
            f"many), both >= 1, got {text!r}"
        )
    return first, count


class StepProfiler:
    """Profiles the steps [first, first + count) (1-based step numbers, as metrics.jsonl's)."""

    def __init__(self, first: int, count: int, device, path: str):
        self.first, self.count, self.path = first, count, path
        self.cuda = torch.device(device).type == "cuda"
        self.prof = None
        self.walls = []

    def wants(self, step: int) -> bool:
        return self.first <= step < self.first + self.count

    def begin(self, step: int) -> None:
        if step == self.first:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()

    def end(self, step: int, wall_s: float):
        """After step `step` (its wall time, device synchronised by the caller); writes the
        profile after the last one and returns it (else None)."""
        self.walls.append(wall_s)
        if step != self.first + self.count - 1 or self.prof is None:
            return None
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.stop()
        events = self.prof.events()
        res = summarize(events, self.count, self.walls, self.cuda)
        if self.cuda:
            res.update(idle_by_phase(events, self.count))
        res["steps"] = [self.first, self.first + self.count - 1]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(res, f, indent=1)
        self.prof = None
        return res


def summarize(events, steps: int, walls: list, cuda: bool, top: int = 40) -> dict:
    """Per step: wall ms, the device's work in ms by category and its largest items."""
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in events:
        # A user annotation (record_function: "Optimizer.step#AdamW.step") also shows on the GPU
        # timeline, spanning the kernels it launched, which are counted themselves: counting it
        # too put the optimizer's time in twice (2026-12-05, H100: 10 of its 21 ms).
        # (On the CPU a range's self time is the Python between its operators: not an operator
        # either.)
        if getattr(ev, "is_user_annotation", False):
            continue
        if cuda and ev.device_type == torch.autograd.DeviceType.CUDA:
            ms = ev.device_time / 1e3
        elif not cuda and ev.device_type == torch.autograd.DeviceType.CPU:
            ms = ev.self_cpu_time_total / 1e3
        else:
            continue
        per[ev.name][0] += ms / steps
        per[ev.name][1] += 1 / steps
    cats = collections.defaultdict(float)
    for name, (ms, _) in per.items():
        cats[category(name)] += ms
    total = sum(cats.values())
    wall = 1e3 * sum(walls) / len(walls)
    items = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "device": "cuda" if cuda else "cpu",
        "what": "GPU kernels' device time" if cuda else "CPU operators' self time",
        "wall_ms": wall,
        "work_ms": total,
        "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "top": [
            {"name": n, "ms": ms, "per_step": calls, "category": category(n)}
            for n, (ms, calls) in items
        ],
    }


def table(res: dict) -> str:
    lines = [
        f"steps {res['steps'][0]}..{res['steps'][1]}: {res['wall_ms']:.2f} ms per step (wall), "
        f"{res['work_ms']:.2f} ms of {res['what']}",
        f"{'category':>24s} {'ms/step':>9s} {'of wall':>8s}",
    ]
    for cat, ms in res["categories_ms"].items():
        lines.append(f"{cat:>24s} {ms:9.2f} {100 * ms / res['wall_ms']:7.1f}%")
    if "idle_ms" in res:
        lines.append(f"GPU idle {res['idle_ms']:.2f} ms per step; ended in phase:")
        for name, ms in res["idle_by_phase_ms"].items():
            lines.append(f"{name:>24s} {ms:9.2f}")
    lines.append("largest:")
    for t in res["top"]:
        lines.append(f"{t['ms']:9.3f} ms {t['per_step']:6.1f}x  [{t['category']}] {t['name'][:90]}")
    return "\n".join(lines)
