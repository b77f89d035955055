"""FP8 GEMM: fp8dp's cuBLASLt GEMM vs torch._scaled_mm on the same FP8 inputs, interleaved.

Usage: python3 bench/gemm_cuda.py [--json out.json]
Both compute out[m, n] = (a * sa) · (b * sb)ᵀ in BF16 from E4M3 operands with per-tensor scales,
once with the exact FP32 (split) accumulator and once with fast accumulation. Target:
>= 1.0x torch._scaled_mm, aim 1.05x through per-shape algorithm selection.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import device_info, print_table, time_interleaved, write_json  # noqa: E402

import fp8dp  # noqa: E402

_C = fp8dp._C
SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (16384, 4096, 4096)]  # m, n, k


def bench_shape(m, n, k, fast):
    a = (torch.randn(m, k, device="cuda") * 50).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda") * 50).to(torch.float8_e4m3fn)
    sa = torch.tensor([0.02], device="cuda")
    sb = torch.tensor([0.03], device="cuda")
    bt = b.t()  # [k, n] column-major: the layout _scaled_mm wants for its second operand

    def ours():
        return _C._gemm_cuda(
            a,
            b,
            a_scale_inv=sa,
            b_scale_inv=sb,
            out_dtype=torch.bfloat16,
            use_split_accumulator=not fast,
        )

    def torch_mm():
        return torch._scaled_mm(
            a, bt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    # Same math: the two results agree to BF16 rounding (checked before timing).
    diff = (ours().float() - torch_mm().float()).abs().max().item()
    ref_max = torch_mm().float().abs().max().item()
    ms = time_interleaved({"fp8dp": ours, "torch._scaled_mm": torch_mm}, warmup=5, rounds=30)
    flop = 2.0 * m * n * k
    return {
        "m": m,
        "n": n,
        "k": k,
        "fast_accum": fast,
        "fp8dp_ms": ms["fp8dp"],
        "torch_ms": ms["torch._scaled_mm"],
        "fp8dp_tflops": flop / ms["fp8dp"] / 1e9,
        "torch_tflops": flop / ms["torch._scaled_mm"] / 1e9,
        "speedup": ms["torch._scaled_mm"] / ms["fp8dp"],
        "max_abs_diff": diff,
        "max_abs_out": ref_max,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = [bench_shape(m, n, k, fast) for fast in (False, True) for m, n, k in SHAPES]
    rows = [
        [
            f"{r['m']}x{r['n']}x{r['k']}",
            "fast" if r["fast_accum"] else "split",
            f"{r['fp8dp_tflops']:.0f}",
            f"{r['torch_tflops']:.0f}",
            f"{r['speedup']:.3f}x",
            f"{r['max_abs_diff']:.3g}/{r['max_abs_out']:.3g}",
        ]
        for r in results
    ]
    print_table(
        "FP8 GEMM E4M3 x E4M3 -> BF16 (TFLOP/s)",
        ["m x n x k", "accum", "fp8dp", "_scaled_mm", "speedup", "maxdiff/max"],
        rows,
    )
    write_json(
        args.json, {"device": device_info(), "command": " ".join(sys.argv), "results": results}
    )


if __name__ == "__main__":
    main()
