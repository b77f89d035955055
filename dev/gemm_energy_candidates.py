"""cuBLASLt's FP8 GEMM candidates ranked by sustained time and energy per call, against the autotuned pick.

Usage: python3 dev/gemm_energy_candidates.py [--max-algos 8] [--seconds 0.4] [--json out.json]
fp8dp's plan cache times each heuristic candidate over a few short bursts (5 rounds of 3 calls) and
keeps the fastest. On the H200 the FP8 layers run at the 700 W power limit, where a step's time
follows its energy: a kernel that is fastest in a short burst at full clock may not be the one
that does a call for the fewest joules. This runs every candidate of the GEMMs of `Linear` 8192^3
and of the 4096-wide GPT stack (fprop with fast accumulation and bias; dgrad and wgrad with split
accumulation; E4M3 input / weight, E5M2 gradient, BF16 out, as the layers issue them) back to back
on its own for `seconds`, and reports ms and mJ per call from the GPU's energy counter.
"""

import argparse
import os
import sys

import torch

# The shared timing helpers (and the models these experiments time) live in bench/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import (  # noqa: E402
    EnergyCounter,
    device_info,
    print_table,
    time_sustained,
    write_json,
)
from gemm_accum_choice import GEMMS, fp8_gemm_calls, operands  # noqa: E402

import fp8dp  # noqa: E402

_C = fp8dp._C


def bench_gemm(name, a_shape, b_shape, split, bias_n, max_algos, seconds, energy):
    a, b, bias = operands(a_shape, b_shape, split, bias_n)
    m, kk = a_shape
    n = b_shape[0]
    flop = 2.0 * m * n * kk
    reps = max(1, int(4e12 / flop))  # ~4 TFLOP per block: a few ms
    call = fp8_gemm_calls(a, b, bias, split, 1)
    block = fp8_gemm_calls(a, b, bias, split, reps)

    def plan_of(override):
        _C._gemm_clear_cache()
        _C._gemm_set_candidates(max_algos, override)
        call()
        torch.cuda.synchronize()
        (plan,) = _C._gemm_plans()
        return plan

    auto = plan_of(-1)
    rows = []
    for i in range(auto["candidates"]):
        try:
            plan = plan_of(i)
        except RuntimeError as e:  # a candidate the heuristic offered but that does not run
            rows.append({"index": i, "error": str(e).splitlines()[0]})
            print(f"  candidate {i}: does not run", flush=True)
            continue
        r = time_sustained(block, energy, seconds=seconds, warm_s=seconds / 2)
        g = r["gpu"] or {}
        print(f"  candidate {i}: {r['ms'] / reps:.4f} ms  {plan['config']}", flush=True)
        rows.append(
            {
                "index": i,
                "config": plan["config"],
                "ms": r["ms"] / reps,
                "mj": r["joules_per_step"] * 1e3 / reps if "joules_per_step" in r else None,
                "watts": r.get("watts"),
                "sm_mhz": g["sm_clock_mhz"]["median"] if g else None,
                "tflops": flop * reps / r["ms"] / 1e9,
            }
        )
    _C._gemm_set_candidates(8, -1)
    _C._gemm_clear_cache()
    ok = [r for r in rows if "ms" in r]
    picked = next(r for r in ok if r["index"] == auto["pick"])
    for r in ok:
        r["speedup_vs_pick"] = picked["ms"] / r["ms"]
        if r["mj"] is not None and picked["mj"] is not None:
            r["energy_vs_pick"] = picked["mj"] / r["mj"]
    return {
        "gemm": name,
        "m": m,
        "n": n,
        "k": kk,
        "split": split,
        "bias": bias_n is not None,
        "autotune_pick": auto["pick"],
        "candidates": rows,
        "best_sustained": min(ok, key=lambda r: r["ms"])["index"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-algos", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=0.4, help="measured seconds per candidate")
    ap.add_argument("--only", default="", help="run the GEMMs whose name contains this")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not fp8dp.cuda_available():
        print("gemm_energy_candidates: skipped, no CUDA build of fp8dp or no GPU")
        return
    energy = EnergyCounter()
    if energy.why:
        print(f"gemm_energy_candidates: no energy counter ({energy.why}); times only")
    todo = [g for g in GEMMS if args.only in g[0]]
    results = []
    for i, g in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] {g[0]}", flush=True)
        res = bench_gemm(*g, args.max_algos, args.seconds, energy)
        results.append(res)
        print_table(
            f"{res['gemm']} (m={res['m']} n={res['n']} k={res['k']}), autotune picks {res['autotune_pick']}",
            ["#", "config", "ms", "TF/s", "mJ", "W", "SM MHz", "speed vs pick", "energy vs pick"],
            [
                (
                    [r["index"], r.get("error", "")[:60]] + ["-"] * 7
                    if "error" in r
                    else [
                        r["index"],
                        r["config"],
                        f"{r['ms']:.4f}",
                        f"{r['tflops']:.0f}",
                        f"{r['mj']:.1f}" if r["mj"] is not None else "-",
                        f"{r['watts']:.0f}" if r["watts"] is not None else "-",
                        f"{r['sm_mhz']:.0f}" if r["sm_mhz"] is not None else "-",
                        f"{r['speedup_vs_pick']:.3f}x",
                        f"{r['energy_vs_pick']:.3f}x" if "energy_vs_pick" in r else "-",
                    ]
                )
                for r in res["candidates"]
            ],
        )
    write_json(
        args.json,
        {
            "benchmark": "gemm_energy_candidates",
            **device_info(),
            "command": "python3 dev/gemm_energy_candidates.py " + " ".join(sys.argv[1:]),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
