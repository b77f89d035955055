"""Where the host time of one layer step goes: fp8dp.Linear (FP8, delayed scaling) against torch BF16.

Usage: python3 dev/host_profile.py [--tokens 4096 --inp 4096 --out 4096] [--json out.json]
At Linear 4096^3 the FP8 step is host-bound on the H200 machine (bench/linear_gpu.py's "host ms"
column): its CPU enqueue time exceeds the GPU time of the step. This prints, for each variant, the
enqueue time per step, the Python functions by own time (cProfile over `steps` steps) and the
operators and CUDA runtime calls by own CPU time (torch.profiler over one step), so that the host
cost can be cut where it is.
"""

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

# The shared timing helpers (and the models these experiments time) live in bench/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import device_info, host_ms, write_json  # noqa: E402
from linear_step import make_step  # noqa: E402

import fp8dp  # noqa: E402


def profile(step, steps):
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    enqueue_ms = host_ms(step, n=21)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as p:
        step()
        torch.cuda.synchronize()
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    kernels = sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"enqueue_ms": enqueue_ms, "python": s.getvalue(), "ops": table, "gpu_events": kernels}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--inp", type=int, default=4096)
    ap.add_argument("--out", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not fp8dp.cuda_available():
        print("host_profile: skipped, no CUDA build of fp8dp or no GPU")
        return
    t, k, n = args.tokens, args.inp, args.out
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    ours = fp8dp.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
    variants = {
        "bf16": make_step(ref, x, dy, None),
        "fp8": make_step(ours, x, dy, fp8dp.DelayedScaling(), update_scales=True),
    }
    out = {}
    for name, step in variants.items():
        r = profile(step, args.steps)
        out[name] = r
        print(
            f"\n===== {name}: {r['enqueue_ms']:.3f} ms to enqueue one step, "
            f"{r['gpu_events']} GPU events"
        )
        print(r["python"])
        print(r["ops"])
    write_json(
        args.json,
        {"benchmark": "host_profile", **device_info(), "shape": [t, k, n], "results": out},
    )


if __name__ == "__main__":
    main()
