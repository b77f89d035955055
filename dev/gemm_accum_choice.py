"""FP8 GEMMs of the layers: fast against split (FP32-promoted) accumulation, per shape.

Usage: python3 dev/gemm_accum_choice.py [--gemms fprop,backward] [--json out.json]
fprop: the layers' forward GEMM (E4M3 x E4M3 -> BF16 with a BF16 bias, fp8dp's autotuned cuBLASLt)
asks for fast accumulation, as TransformerEngine's recipe does. Split accumulation is never less
accurate; this measures whether it is ever faster, at the forward shapes of bench/linear_gpu.py and
bench/gpt_block_gpu.py.
backward: dgrad and wgrad (E5M2 gradient x E4M3 -> BF16) split-accumulate by default (the recipes'
split_accumulator_dgrad / _wgrad); this measures what fast accumulation there would save, at the
backward shapes of `Linear` 8192^3 and the 4096-wide GPT stack (their sum per stack step is
printed).
Each sample is `reps` back-to-back calls (several milliseconds, so the clock reacts to each
variant's power), the two variants interleaved.
"""

import argparse
import os
import sys

import torch

# The shared timing helpers (and the models these experiments time) live in bench/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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


def layer_gemms(label, t, k, n):
    """(name, a [m, k'], b [n', k'], split, bias) of a layer with t tokens, k in, n out; split is the
    layers' default accumulation (fast in fprop, split in dgrad / wgrad)."""
    return [
        (f"{label} fprop", (t, k), (n, k), False, n),
        (f"{label} dgrad", (t, n), (k, n), True, None),
        (f"{label} wgrad", (n, t), (k, t), True, None),
    ]


# Linear 8192^3 and the 4096-wide GPT stack's layers: 4096 tokens, (name, in, out).
STACK_4096 = (
    ("qkv", 4096, 12288),
    ("proj", 4096, 4096),
    ("fc1", 4096, 16384),
    ("fc2", 16384, 4096),
)
GEMMS = layer_gemms("Linear 8192^3", 8192, 8192, 8192)
for _name, _k, _n in STACK_4096:
    GEMMS += layer_gemms(f"{_name} 4096", 4096, _k, _n)


def operands(a_shape, b_shape, grad, bias_n):
    """Random FP8 operands: a is an E5M2 gradient when `grad` (dgrad / wgrad), else E4M3."""
    a_dt = torch.float8_e5m2 if grad else torch.float8_e4m3fn
    a = (torch.randn(*a_shape, device="cuda") * 20).to(a_dt)
    b = (torch.randn(*b_shape, device="cuda") * 20).to(torch.float8_e4m3fn)
    bias = None if bias_n is None else torch.randn(bias_n, device="cuda").to(torch.bfloat16)
    return a, b, bias


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


def bench_operands(label, a, b, bias):
    m, k = a.shape
    n = b.shape[0]
    reps = max(1, int(4e12 / (2.0 * m * n * k)))  # ~4 TFLOP per sample: a few ms
    variants = {
        "fast": fp8_gemm_calls(a, b, bias, False, reps),
        "split": fp8_gemm_calls(a, b, bias, True, reps),
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


def bench_shape(label, m, n, k):
    return bench_operands(label, *operands((m, k), (n, k), False, n))


def backward_todo():
    """(label, a_shape, b_shape) of every dgrad / wgrad GEMM in GEMMS."""
    return [(g[0], g[1], g[2]) for g in GEMMS if not g[0].endswith("fprop")]


def stack_saving_ms(rows, layers=4):
    """What fast accumulation in dgrad and wgrad saves per step of the 4096 x 4 GPT stack, from the
    per-call times of its layers' backward GEMMs (one call each per layer and step)."""
    per_layer = sum(r["split_ms"] - r["fast_ms"] for r in rows if " 4096 " in r["shape"])
    return {"layers": layers, "saved_ms_per_step": per_layer * layers}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemms", default="fprop,backward", help="fprop and/or backward")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not fp8dp.cuda_available():
        print("gemm_accum_choice: skipped, no CUDA build of fp8dp or no GPU")
        return
    which = set(args.gemms.split(","))
    unknown = which - {"fprop", "backward"}
    if unknown:
        ap.error(f"--gemms: expected fprop and/or backward, got {sorted(unknown)}")
    rows, back = [], []
    with GpuSampler() as gpu:
        if "fprop" in which:
            for i, sh in enumerate(SHAPES):
                print(f"[fprop {i + 1}/{len(SHAPES)}] {sh[0]}", flush=True)
                rows.append(bench_shape(*sh))
        if "backward" in which:
            todo = backward_todo()
            for i, (label, a_shape, b_shape) in enumerate(todo):
                print(f"[backward {i + 1}/{len(todo)}] {label}", flush=True)
                a, b, _ = operands(a_shape, b_shape, True, None)
                back.append(bench_operands(label, a, b, None))
    table(rows, "FP8 forward GEMM (+bias, BF16 out): fast vs split accumulation")
    table(back, "FP8 dgrad / wgrad GEMM (E5M2 x E4M3, BF16 out): fast vs split accumulation")
    saving = stack_saving_ms(back) if back else None
    if saving:
        print(
            f"4096 x 4 GPT stack: fast dgrad / wgrad accumulation would save "
            f"{saving['saved_ms_per_step']:.3f} ms of GEMM time per step"
        )
    write_json(
        args.json,
        {
            "benchmark": "gemm_accum_choice",
            **device_info(),
            "command": " ".join(["python3"] + sys.argv),
            "gpu_during_timing": gpu.summary(),
            "results": rows,
            "backward": back,
            "stack_4096x4_backward_saving": saving,
        },
    )


def table(rows, title):
    if not rows:
        return
    print_table(
        title,
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


if __name__ == "__main__":
    main()
