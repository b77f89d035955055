"""Which CUDA kernels one training step of a single module runs, and how long each takes: the
block-scaled Linear and the fused LayerNormMLP against the separate modules.
torch.profiler over a few steps after warm-up; per case the top kernels by total CUDA time.

    python3 dev/profile_modules.py [--cases linear_block,mlp_gelu_fp8,...] [--json out.json]
    python3 dev/profile_modules.py --cases linear_block,linear_delayed --runtime
    python3 dev/profile_modules.py --cases mlp_gelu_fp8,sep_gelu_fp8 --mlp-shape 1536x8192
    ncu ... python3 dev/profile_modules.py --cases mlp_gelu_fp8 --plain --steps 1   # gpu_check dev_ncu

--runtime adds the wall time per step (events, steps back to back) and the host's CUDA runtime
calls per step (synchronizes, allocations, attribute sets): the block-scaled Linear 8192^3 ran its
kernels in 3.1 ms but took 3.77 ms per step (H100, 2026-12-05), where delayed scaling's kernels
fill its step; a runtime call that waits would show here.

--plain runs the steps with no profiler (for Nsight Compute, which cannot share CUPTI with
torch.profiler); --mlp-shape WIDTHxTOKENS sets the MLP cases' width and tokens (default
2048x4096; the 342M model's is 1536x8192, one micro-batch).
"""

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from layernorm_mlp_gpu import SeparateMLP, ffn_of  # noqa: E402
from linear_step import make_step  # noqa: E402

import fp8dp  # noqa: E402


def linear_case(recipe, t=8192, k=8192, n=8192):
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    m = fp8dp.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
    return make_step(m, x, dy, recipe, update_scales=isinstance(recipe, fp8dp.DelayedScaling))


MLP_SHAPE = [2048, 4096]  # width, tokens (--mlp-shape)


def mlp_case(fused, act, fp8):
    h, tokens = MLP_SHAPE
    ffn = ffn_of(h, act)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    if fused:
        norm = "LayerNorm" if act == "gelu" else "RMSNorm"
        m = fp8dp.LayerNormMLP(
            h, ffn, bias=act == "gelu", activation=act, normalization=norm,
            params_dtype=torch.bfloat16, device="cuda",
        )  # fmt: skip
    else:
        m = SeparateMLP(h, ffn, act)
    recipe = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID) if fp8 else None
    return make_step(m, x, dy, recipe, update_scales=fp8)


CASES = {
    "linear_block": lambda: linear_case(fp8dp.Float8BlockScaling()),
    "linear_delayed": lambda: linear_case(fp8dp.DelayedScaling()),
    "mlp_gelu_fp8": lambda: mlp_case(True, "gelu", True),
    "sep_gelu_fp8": lambda: mlp_case(False, "gelu", True),
    "mlp_gelu_off": lambda: mlp_case(True, "gelu", False),
    "sep_gelu_off": lambda: mlp_case(False, "gelu", False),
}


def runtime_calls(step, steps: int) -> dict:
    """Wall ms per step (steps back to back between two events) and the CUDA runtime API calls the
    host makes per step, by name: count and host ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    calls = {}
    for e in prof.key_averages():
        if e.key.startswith("cuda") or e.key.startswith("cu"):
            calls[e.key] = [e.count / steps, e.cpu_time_total / steps / 1e3]
    calls = dict(sorted(calls.items(), key=lambda kv: -kv[1][1]))
    print(f"\n== wall {wall:.3f} ms per step; CUDA runtime calls per step (count, host ms):")
    for k, (n, ms) in list(calls.items())[:12]:
        print(f"  {n:6.1f}x {ms:8.3f} ms  {k}")
    return {"wall_ms": wall, "runtime_calls": calls}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--json", default=None)
    ap.add_argument("--runtime", action="store_true", help="wall time and CUDA runtime calls")
    ap.add_argument("--plain", action="store_true", help="no profiler: for ncu")
    ap.add_argument("--mlp-shape", default="2048x4096", help="WIDTHxTOKENS of the MLP cases")
    args = ap.parse_args()
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: expected names from {sorted(CASES)}, got {unknown}")
    try:
        MLP_SHAPE[:] = [int(v) for v in args.mlp_shape.lower().split("x")]
        assert len(MLP_SHAPE) == 2 and min(MLP_SHAPE) > 0
    except (ValueError, AssertionError):
        ap.error(f"--mlp-shape: expected WIDTHxTOKENS (positive integers), got {args.mlp_shape!r}")
    out = {}
    for name in args.cases.split(","):
        step = CASES[name]()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        if args.plain:  # the kernels alone, for an outside profiler
            torch.cuda.nvtx.range_push(name)
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            print(f"== {name}: {args.steps} plain step(s)", flush=True)
            del step
            torch.cuda.empty_cache()
            continue
        if args.runtime:
            out[name + "_runtime"] = runtime_calls(step, args.steps)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                rows.append((t / args.steps / 1e3, e.count // args.steps, e.key[:110]))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"\n== {name}: {total:.3f} ms of kernels per step", flush=True)
        for ms, n, key in rows[: args.top]:
            print(f"  {ms:8.3f} ms  {n:3d}x  {key}")
        out[name] = {"kernel_ms": total, "top": rows[: args.top]}
        del step
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
