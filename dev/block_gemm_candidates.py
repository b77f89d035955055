"""cuBLASLt's block-scaled FP8 GEMM candidates against the per-tensor FP8 GEMM of the same shape.

Usage: python3 dev/block_gemm_candidates.py [--max-algos 32] [--only wgrad] [--json out.json]

Under Float8BlockScaling the 4096-wide GPT stack's GEMMs take about 30% longer than under delayed
scaling (dev/profile_gpt_block.py: every block GEMM ran cuBLASLt's 128x128 tile, where per-tensor
FP8 picks 256x128 or 128x160). This asks whether another of the heuristic's candidates is faster:
for the GEMMs of Linear 8192^3 and of the 4096-wide stack (dev/gemm_accum_choice.py's shapes;
fprop and dgrad with 1x128 tiles x 128x128 blocks, wgrad with tiles on both operands, E4M3, BF16
out, wgrad into FP32 with beta = 1 as the layers issue it), each candidate runs on its own for
`seconds` (bench/cuda_timing.time_sustained) next to the autotuned per-tensor FP8 GEMM (split
accumulation, as dgrad and wgrad run).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import EnergyCounter, device_info, time_sustained, write_json  # noqa: E402
from gemm_accum_choice import GEMMS  # noqa: E402

import fp8dp  # noqa: E402

_C = fp8dp._C
TILE, BLOCK = _C.BlockShape.TILE_1x128, _C.BlockShape.BLOCK_128x128


def block_calls(name, a_shape, b_shape, reps):
    """`reps` block-scaled GEMMs of this role; the per-tensor FP8 GEMM of the same shape."""
    wgrad = name.endswith("wgrad")
    a = torch.randn(*a_shape, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(*b_shape, device="cuda", dtype=torch.bfloat16) * 0.05
    qa = _C.block_quantize(a, _C.Format.E4M3, TILE)
    qb = _C.block_quantize(b, _C.Format.E4M3, TILE if wgrad else BLOCK)
    out = torch.zeros(a_shape[0], b_shape[0], device="cuda", dtype=torch.float32)
    s = torch.tensor([0.05], device="cuda")
    fa, fb = a.to(torch.float8_e4m3fn), (b * 20).to(torch.float8_e4m3fn)

    def blk():
        for _ in range(reps):
            if wgrad:
                _C.gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out=out, accumulate=True)
            else:
                _C.gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out_dtype=torch.bfloat16)

    def tensor():
        for _ in range(reps):
            if wgrad:
                _C.gemm(fa, fb, s, s, out=out, accumulate=True, use_split_accumulator=True)
            else:
                _C.gemm(fa, fb, s, s, out_dtype=torch.bfloat16, use_split_accumulator=True)

    return blk, tensor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-algos", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--only", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not fp8dp.cuda_available():
        print("block_gemm_candidates: skipped, no CUDA build of fp8dp or no GPU")
        return
    energy = EnergyCounter()
    results = []
    for name, a_shape, b_shape, _split, _bias in GEMMS:
        if args.only not in name:
            continue
        m, k = a_shape
        n = b_shape[0]
        flop = 2.0 * m * n * k
        reps = max(1, int(4e12 / flop))
        blk, tensor = block_calls(name, a_shape, b_shape, reps)
        _C._gemm_clear_cache()
        _C._gemm_set_candidates(8, -1)
        t_tensor = time_sustained(tensor, energy, seconds=args.seconds, warm_s=0.15)["ms"] / reps
        tensor_plan = _C._gemm_plans()[0]
        _C._gemm_clear_cache()
        _C._gemm_set_candidates(args.max_algos, -1)
        blk()
        torch.cuda.synchronize()
        auto = _C._gemm_plans()[0]
        rows = []
        for i in range(auto["candidates"]):
            _C._gemm_clear_cache()
            _C._gemm_set_candidates(args.max_algos, i)
            try:
                blk()
                torch.cuda.synchronize()
            except RuntimeError as e:
                rows.append({"index": i, "error": str(e).splitlines()[0]})
                continue
            cfg = _C._gemm_plans()[0]["config"]
            ms = time_sustained(blk, energy, seconds=args.seconds, warm_s=0.15)["ms"] / reps
            rows.append({"index": i, "config": cfg, "ms": ms, "tflops": flop / ms / 1e9})
        _C._gemm_set_candidates(8, -1)
        _C._gemm_clear_cache()
        ok = [r for r in rows if "ms" in r]
        best = min(ok, key=lambda r: r["ms"])
        pick = next((r for r in ok if r["index"] == auto["pick"]), None)
        print(
            f"{name:24s} m={m} n={n} k={k}: per-tensor {t_tensor:.4f} ms ({tensor_plan['config']}); "
            f"block pick #{auto['pick']} of {auto['candidates']} "
            f"{pick['ms'] if pick else float('nan'):.4f} ms, best #{best['index']} "
            f"{best['ms']:.4f} ms ({best['config']}), block/tensor {best['ms'] / t_tensor:.3f}",
            flush=True,
        )
        for r in ok:
            print(f"    #{r['index']:2d} {r['ms']:.4f} ms {r['config']}")
        results.append(
            {
                "gemm": name,
                "m": m,
                "n": n,
                "k": k,
                "tensor_ms": t_tensor,
                "tensor_config": tensor_plan["config"],
                "block_pick": auto["pick"],
                "block_candidates": rows,
            }
        )
    if args.json:
        write_json(args.json, {"device": device_info(), "results": results})


if __name__ == "__main__":
    main()
