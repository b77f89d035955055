"""Float8BlockScaling on one GPU: fp8dp.Linear forward+backward under block scaling
against torch.nn.Linear in BF16 (the baseline), fp8dp under delayed scaling, and TransformerEngine's
Linear under its Float8BlockScaling recipe when `import transformer_engine.pytorch` works and the
recipe is there. Every variant is timed interleaved in one process on identical inputs (one sample
= one step between two CUDA events, median reported; bench/cuda_timing.py).

One step = forward, backward with a fixed grad_output, gradients dropped, and for delayed scaling
the per-step scale update (block scaling has no scaling state to update).

    python3 bench/block_scaling_gpu.py [--shapes 8192x8192x8192,...] [--json out.json]

Target: Linear 8192^3 >= 1.50x BF16 under block scaling.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import (  # noqa: E402
    device_info,
    host_ms,
    peak_step_mib,
    print_table,
    time_interleaved,
    write_json,
)
from linear_step import make_step  # noqa: E402

import fp8dp  # noqa: E402

try:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    TE_BLOCK = getattr(te_recipe, "Float8BlockScaling", None)  # older TE lacks the recipe
    TE_REASON = None if TE_BLOCK else "this TransformerEngine has no Float8BlockScaling"
except Exception as e:  # noqa: BLE001  (any import failure means: no TE on this machine)
    te, te_recipe, TE_REASON = None, None, f"{type(e).__name__}: {e}"

TARGETS = {(8192, 8192, 8192): 1.50}


def te_step(module, x, dy, recipe):
    def step():
        xa = x.detach().requires_grad_(True)
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = module(xa)
        y.backward(dy)
        module.zero_grad(set_to_none=True)

    return step


def bench_shape(t, k, n, rounds, use_te):
    torch.manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    ours = fp8dp.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
    ours.load_state_dict(ref.state_dict())
    steps = {
        "bf16": make_step(ref, x, dy, None),
        "fp8dp_block": make_step(ours, x, dy, fp8dp.Float8BlockScaling()),
        "fp8dp_delayed": make_step(ours, x, dy, fp8dp.DelayedScaling(), update_scales=True),
    }
    if use_te:
        tl = te.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            tl.weight.copy_(ref.weight)
            tl.bias.copy_(ref.bias)
        steps["te_block"] = te_step(tl, x, dy, te_recipe.Float8BlockScaling())
    ms = time_interleaved(steps, warmup=3, rounds=rounds)
    flop = 3 * 2.0 * t * k * n
    return {
        "tokens": t,
        "in": k,
        "out": n,
        "target": TARGETS.get((t, k, n)),
        "variants": {
            v: {
                "ms": ms[v],
                "speedup": ms["bf16"] / ms[v],
                "tflops": flop / ms[v] / 1e9,
                "host_ms": host_ms(f),
                "peak_step_mib": peak_step_mib(f),
            }
            for v, f in steps.items()
        },
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x8192x8192,4096x4096x14336,4096x4096x4096")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-te", action="store_true", help="leave TransformerEngine out")
    ap.add_argument("--json", default="bench/results/block_scaling_gpu.json")
    args = ap.parse_args()
    use_te = te is not None and TE_REASON is None and not args.no_te
    if not use_te and not args.no_te:
        print(f"TransformerEngine block scaling: not available here ({TE_REASON})", flush=True)
    results = []
    for shape in args.shapes.split(","):
        t, k, n = (int(v) for v in shape.split("x"))
        print(f"[block_scaling_gpu] Linear {shape} ...", flush=True)
        try:
            results.append(bench_shape(t, k, n, args.rounds, use_te))
        except Exception as e:  # one shape failing must not hide the others
            print(f"{shape}: FAILED {type(e).__name__}: {e}", flush=True)
            results.append({"tokens": t, "in": k, "out": n, "error": f"{type(e).__name__}: {e}"})
        torch.cuda.empty_cache()
    rows = [
        [
            f"{r['tokens']}x{r['in']}x{r['out']}",
            v,
            f"{d['ms']:.3f}",
            f"{d['speedup']:.2f}x",
            f"{d['tflops']:.0f}",
            f"{d['host_ms']:.3f}",
            f"{d['peak_step_mib']:.0f}",
            (r["target"] or "-") if v == "fp8dp_block" else "",
        ]
        for r in results
        if "error" not in r
        for v, d in r["variants"].items()
    ]
    print_table(
        "Linear forward+backward: block scaling vs torch BF16 (interleaved, one process)",
        [
            "tokens x in x out",
            "variant",
            "ms",
            "vs bf16",
            "TFLOP/s",
            "host ms",
            "peak MiB",
            "target",
        ],
        rows,
    )
    write_json(args.json, {"device": device_info(), "te": TE_REASON or "yes", "results": results})


if __name__ == "__main__":
    main()
