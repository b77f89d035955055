"""Forward GEMMs of the FP8 layers: fast against split (FP32-promoted) accumulation, per shape.

Usage: python3 bench/gemm_accum_choice.py [--json out.json]
The layers' forward GEMM (E4M3 x E4M3 -> BF16 with a BF16 bias, fp8dp's autotuned cuBLASLt) asks
for fast accumulation, as TransformerEngine's recipe does. Split accumulation is never less
accurate; this measures whether it is ever faster, at the forward shapes of bench/linear_gpu.py and
bench/gpt_block_gpu.py. Each sample is `reps` back-to-back calls (several milliseconds, so the
clock reacts to each variant's power), the two variants interleaved.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import (  # noqa: E402
    GpuSampler,
    device_info,
    print_table,
    time_interleaved,
    write_json,
)

import fp8dp  # noqa: E402

_C = fp8dp._C
# (label, tokens m, out n, in k): Linear 8192^3, LayerNormLinear 8192x4096->14336, and the GPT
# stacks' QKV / proj / fc1 / fc2 at 4096 tokens.
SHAPES = [("Linear 8192^3", 8192, 8192, 8192), ("LNLinear 14336", 8192, 14336, 4096)]
for h in (2048, 4096, 8192):
    SHAPES += [
        (f"qkv {h}", 4096, 3 * h, h),
        (f"proj {h}", 4096, h, h),
        (f"fc1 {h}", 4096, 4 * h, h),
        (f"fc2 {h}", 4096, h, 4 * h),
    ]


def fp8_gemm_calls(a, b, bias, split, reps):
    """A closure making `reps` back-to-back FP8 GEMM calls a · bᵀ (+ bias) -> BF16, scale_inv 0.05
    on both operands, with split (FP32-promoted) or fast accumulation."""
    s = torch.tensor([0.05], device="cuda")

    def run():
        for _ in range(reps):
            _C._gemm_cuda(
                a,
                b,
                a_scale_inv=s,
                b_scale_inv=s,
                bias=bias,
                out_dtype=torch.bfloat16,
                use_split_accumulator=split,
            )

    return run


def bench_shape(label, m, n, k):
    x = (torch.randn(m, k, device="cuda") * 20).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda") * 20).to(torch.float8_e4m3fn)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    reps = max(1, int(4e12 / (2.0 * m * n * k)))  # ~4 TFLOP per sample: a few ms
    variants = {
        "fast": fp8_gemm_calls(x, w, bias, False, reps),
        "split": fp8_gemm_calls(x, w, bias, True, reps),
    }
    ms = time_interleaved(variants, warmup=2, rounds=15)
    flop = 2.0 * m * n * k
    return {
        "shape": label,
        "m": m,
        "n": n,
        "k": k,
        "fast_ms": ms["fast"] / reps,
        "split_ms": ms["split"] / reps,
        "fast_tflops": flop * reps / ms["fast"] / 1e9,
        "split_tflops": flop * reps / ms["split"] / 1e9,
        "split_over_fast": ms["fast"] / ms["split"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    if not fp8dp.cuda_available():
        print("gemm_accum_choice: skipped, no CUDA build of fp8dp or no GPU")
        return
    rows = []
    with GpuSampler() as gpu:
        for i, sh in enumerate(SHAPES):
            print(f"[{i + 1}/{len(SHAPES)}] {sh[0]}", flush=True)
            rows.append(bench_shape(*sh))
    print_table(
        "FP8 forward GEMM (+bias, BF16 out): fast vs split accumulation",
        [
            "shape",
            "m",
            "n",
            "k",
            "fast ms",
            "split ms",
            "fast TF/s",
            "split TF/s",
            "split speed-up",
        ],
        [
            [
                r["shape"],
                r["m"],
                r["n"],
                r["k"],
                f"{r['fast_ms']:.3f}",
                f"{r['split_ms']:.3f}",
                f"{r['fast_tflops']:.0f}",
                f"{r['split_tflops']:.0f}",
                f"{r['split_over_fast']:.3f}x",
            ]
            for r in rows
        ],
    )
    write_json(
        args.json,
        {
            "benchmark": "gemm_accum_choice",
            **device_info(),
            "command": "python3 bench/gemm_accum_choice.py",
            "gpu_during_timing": gpu.summary(),
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
