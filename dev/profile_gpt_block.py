"""Where one step of bench/gpt_block_gpu.py's GPT block stack spends its GPU time: per variant, the
kernels grouped by name (total ms per step, launches per step) and the launch count per step, from
torch.profiler. The tool behind the GPT stack's kernel and host work: it says which kernels a variant
runs that the torch BF16 baseline does not, and how many launches each layer costs.

    python3 dev/profile_gpt_block.py [--shape 8192x2] [--variants bf16,fp8dp_off,fp8dp_delayed]
                                       [--steps 3] [--top 25] [--host] [--json out.json]

Variants are bench/gpt_block_gpu.py's modes, the graphed ones (bf16_graphed,
fp8dp_delayed_graphed, fp8dp_delayed_mg_graphed) and main_grad ones (*_mg) included.
--host adds the host side: CPU time per step by operator (self time: the operator's own work,
not its children's), to say where a variant's enqueue time goes.
"""

import argparse
import collections
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

# The shared timing helpers (and the models these experiments time) live in bench/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import GpuSampler  # noqa: E402
from gpt_block_gpu import ARCHS, BATCH, GELU_PLACES, SEQ, make_model, make_step  # noqa: E402


def kernel_table(step, steps, host=False):
    """({kernel name: [ms per step, launches per step]}, {CPU operator: [self ms per step, calls
    per step]} or None, the GPU's clocks and power meanwhile (cuda_timing.GpuSampler) or None)
    over `steps` profiled steps."""
    for _ in range(3):  # warm-up: autotuning, allocator, first casts
        step()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    with GpuSampler(period_ms=20) as gpu, profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0.0, 0])
    cpu = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name][0] += ev.device_time / 1e3 / steps
            agg[ev.name][1] += 1
        elif host:
            cpu[ev.name][0] += ev.self_cpu_time_total / 1e3 / steps
            cpu[ev.name][1] += 1
    per_step = lambda d: {k: [v[0], v[1] / steps] for k, v in d.items()}  # noqa: E731
    return per_step(agg), (per_step(cpu) if host else None), gpu.summary()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x2", help="hidden x layers")
    ap.add_argument("--arch", default="gpt", choices=ARCHS, help="block architecture")
    ap.add_argument("--variants", default="bf16,fp8dp_off,fp8dp_delayed")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--host", action="store_true", help="also CPU time per operator")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    hidden, layers = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(1)
    x = torch.randn(SEQ, BATCH, hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(SEQ, BATCH, hidden, device="cuda", dtype=torch.bfloat16) * 1e-2
    ref = make_model(hidden, layers, "torch", arch=args.arch)
    out = {"shape": args.shape, "arch": args.arch, "variants": {}}
    for v in args.variants.split(","):
        base = v.partition("@")[0]  # "bf16@index": the same stack with the old QKV split
        gelu = next((p for p in GELU_PLACES[1:] if base.endswith(f"_{p}gelu")), GELU_PLACES[0])
        # "*_mg": weights with FP32 main_grad (fuse_wgrad_accumulation); "*_graphed": a model of
        # its own, whose forward the capture replaces (bf16_graphed a torch one).
        lib = "torch" if base.startswith("bf16") else base.split("_")[0]
        model = (
            ref
            if base == "bf16"
            else make_model(
                hidden,
                layers,
                lib,
                None if lib == "torch" else ref,
                arch=args.arch,
                gelu=gelu,
                main_grad="_mg" in base,
            )
        )
        step, _ = make_step(model, x, dy, v)
        table, cpu, gpu = kernel_table(step, args.steps, args.host)
        total = sum(ms for ms, _ in table.values())
        launches = sum(n for _, n in table.values())
        out["variants"][v] = {
            "kernel_ms": total,
            "launches": launches,
            "kernels": table,
            "gpu_during_profile": gpu,
        }
        clock = f", SM clock {gpu['sm_clock_mhz']['median']:.0f} MHz median" if gpu else ""
        print(
            f"\n== {v} {args.shape}: {total:.2f} ms of kernels per step, "
            f"{launches:.0f} launches per step ({launches / layers:.0f} per layer){clock}"
        )
        for name, (ms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {ms:8.3f} ms  {n:5.0f}x  {name[:150]}")
        if cpu is not None:
            out["variants"][v]["host_ops"] = cpu
            host_total = sum(ms for ms, _ in cpu.values())
            print(f"  -- host: {host_total:.2f} ms of CPU (self) time per step under the profiler")
            for name, (ms, n) in sorted(cpu.items(), key=lambda kv: -kv[1][0])[: args.top]:
                print(f"  {ms:8.3f} ms  {n:5.0f}x  {name[:150]}")
        if model is not ref:
            del model
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
