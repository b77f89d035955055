"""fp8dp.Linear forward+backward in FP8 (DelayedScaling) vs torch.nn.Linear in BF16, interleaved, on
one GPU; plus the three FP8 GEMMs of the step alone, to show the share of time outside GEMMs, and
the peak memory of one step against the BF16 layer.

    python3 bench/linear_gpu.py [--json out.json]

Shapes (tokens, in, out): Linear 8192x8192x8192, 4096x4096x14336, 16384x4096x4096, 4096x4096x4096
(host-bound: every FP8 layer's fixed costs show there), and LayerNormLinear 8192x4096->14336 against
torch's nn.LayerNorm + nn.Linear. One step = forward, backward with a fixed grad_output, and (FP8)
update_fp8_scales(), as in training. Then each of the three runs alone for ~1 s, with its energy per
step from the GPU's counter (bench/cuda_timing.py: at the power limit the time follows the energy).
Targets: >= 1.85x BF16 at 8192^3, >= 1.3x at
4096x4096x14336, >= 1.0x at 4096^3, >= 1.68x for the LayerNormLinear.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import (  # noqa: E402
    ALONE_HEADER,
    EnergyCounter,
    alone_cells,
    alone_vs,
    device_info,
    host_ms,
    peak_step_mib,
    print_table,
    time_interleaved,
    time_sustained,
    write_json,
)
from linear_step import make_step  # noqa: E402

import fp8dp  # noqa: E402

_C = fp8dp._C
# (tokens, in, out, LayerNormLinear?)
SHAPES = [
    (8192, 8192, 8192, False),
    (4096, 4096, 14336, False),
    (16384, 4096, 4096, False),
    (4096, 4096, 4096, False),
    (8192, 4096, 14336, True),
]
TARGETS = {
    (8192, 8192, 8192, False): 1.85,
    (4096, 4096, 14336, False): 1.3,
    (4096, 4096, 4096, False): 1.0,
    (8192, 4096, 14336, True): 1.68,
}


def gemms_alone(t, k, n):
    """fprop [t,k]x[n,k]^T, dgrad [t,n]x[k,n]^T, wgrad [n,t]x[k,t]^T on FP8 operands (E4M3 input and
    weight, E5M2 gradient), BF16 out, as the FP8 layer issues them (TN, cached transposes)."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    x = (torch.randn(t, k, device="cuda") * 20).to(e4)
    w = (torch.randn(n, k, device="cuda") * 20).to(e4)
    dy = (torch.randn(t, n, device="cuda") * 20).to(e5)
    xt, wt, dyt = x.t().contiguous(), w.t().contiguous(), dy.t().contiguous()
    s = torch.tensor([0.05], device="cuda")

    def run():
        _C._gemm_cuda(
            x,
            w,
            a_scale_inv=s,
            b_scale_inv=s,
            out_dtype=torch.bfloat16,
            use_split_accumulator=False,
        )
        _C._gemm_cuda(dy, wt, a_scale_inv=s, b_scale_inv=s, out_dtype=torch.bfloat16)
        _C._gemm_cuda(dyt, xt, a_scale_inv=s, b_scale_inv=s, out_dtype=torch.bfloat16)

    return run


def bench_shape(t, k, n, ln, rounds, energy):
    torch.manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    if ln:
        norm = torch.nn.LayerNorm(k, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.Sequential(norm, lin)
        ours = fp8dp.LayerNormLinear(k, n, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            ours.layer_norm_weight.copy_(norm.weight)
            ours.layer_norm_bias.copy_(norm.bias)
            ours.weight.copy_(lin.weight)
            ours.bias.copy_(lin.bias)
    else:
        ref = lin
        ours = fp8dp.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
        ours.load_state_dict(ref.state_dict())
    bf16 = make_step(ref, x, dy, None)
    fp8 = make_step(ours, x, dy, fp8dp.DelayedScaling(), update_scales=True)
    gemm = gemms_alone(t, k, n)
    ms = time_interleaved({"bf16": bf16, "fp8": fp8, "gemm": gemm}, warmup=3, rounds=rounds)
    mem_bf16, mem_fp8 = peak_step_mib(bf16), peak_step_mib(fp8)
    flop = 3 * 2.0 * t * k * n
    alone = {}
    if energy is not None:
        fns = {"bf16": bf16, "fp8": fp8, "gemm": gemm}
        runs = {v: time_sustained(f, energy, seconds=1.0, warm_s=0.3) for v, f in fns.items()}
        alone = {v: alone_vs(runs, v, "bf16") for v in fns}
    return {
        "layer": "LayerNormLinear" if ln else "Linear",
        "tokens": t,
        "in": k,
        "out": n,
        "bf16_ms": ms["bf16"],
        "fp8_ms": ms["fp8"],
        "fp8_gemms_ms": ms["gemm"],
        "speedup": ms["bf16"] / ms["fp8"],
        "target": TARGETS.get((t, k, n, ln)),
        "fp8_tflops": flop / ms["fp8"] / 1e9,
        "bf16_tflops": flop / ms["bf16"] / 1e9,
        "share_outside_gemms": 1.0 - ms["gemm"] / ms["fp8"],
        # CPU time to enqueue one step: where the FP8 step's is close to the BF16 step's GPU time,
        # the interleaved sample that follows the BF16 step can wait on the host.
        "host_ms_bf16": host_ms(bf16),
        "host_ms_fp8": host_ms(fp8),
        "peak_step_mib_bf16": mem_bf16,
        "peak_step_mib_fp8": mem_fp8,
        "alone": alone,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/linear_gpu.json")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--no-alone", action="store_true", help="skip the sustained per-variant energy blocks"
    )
    args = ap.parse_args()
    energy = None if args.no_alone else EnergyCounter()
    if energy is not None and energy.why:
        print(f"energy counter: not readable here ({energy.why}); joules are left out", flush=True)
    results = []
    for t, k, n, ln in SHAPES:
        print(f"[linear_gpu] {'LayerNormLinear' if ln else 'Linear'} {t}x{k}x{n} ...", flush=True)
        try:
            results.append(bench_shape(t, k, n, ln, args.rounds, energy))
        except Exception as e:  # one shape failing must not hide the others
            print(f"{t}x{k}x{n}: FAILED {type(e).__name__}: {e}", flush=True)
            results.append({"tokens": t, "in": k, "out": n, "error": f"{type(e).__name__}: {e}"})
        torch.cuda.empty_cache()
    rows = [
        [
            r["layer"],
            f"{r['tokens']}x{r['in']}x{r['out']}",
            f"{r['bf16_ms']:.3f}",
            f"{r['fp8_ms']:.3f}",
            f"{r['speedup']:.2f}x",
            r["target"] or "-",
            f"{r['fp8_gemms_ms']:.3f}",
            f"{100 * r['share_outside_gemms']:.0f}%",
            f"{r['host_ms_fp8']:.3f}/{r['host_ms_bf16']:.3f}",
            f"{r['peak_step_mib_fp8']:.0f}/{r['peak_step_mib_bf16']:.0f}",
        ]
        for r in results
        if "error" not in r
    ]
    print_table(
        "fp8dp FP8 (delayed) vs torch BF16 (nn.Linear, nn.LayerNorm + nn.Linear), forward+backward",
        [
            "layer",
            "tokens x in x out",
            "bf16 ms",
            "fp8 ms",
            "speedup",
            "target",
            "gemms ms",
            "outside",
            "host ms fp8/bf16",
            "peak MiB fp8/bf16",
        ],
        rows,
    )
    alone_rows = [
        [r["layer"], f"{r['tokens']}x{r['in']}x{r['out']}", v] + alone_cells(a)
        for r in results
        for v, a in r.get("alone", {}).items()
    ]
    if alone_rows:
        print_table(
            "Each alone, sustained (~1 s): bf16 layer, fp8 layer, the fp8 GEMMs; base = bf16",
            ["layer", "tokens x in x out", "variant"] + ALONE_HEADER,
            alone_rows,
        )
    write_json(
        args.json,
        {
            "benchmark": "linear_gpu",
            **device_info(),
            "command": "python3 bench/linear_gpu.py",
            "results": results,
            # The cuBLASLt plans the run's autotuning chose (shape, heuristic index, configuration):
            # two runs' picks can be compared when their GEMM times differ.
            "gemm_plans": _C._gemm_plans(),
        },
    )
    sys.exit(0 if all("error" not in r for r in results) else 1)


if __name__ == "__main__":
    main()
