"""How many steps behind FP8 off a run is, along the way: for each evaluation of a run, the step at
which the FP8 off curve first reached the same validation loss (linear between its evaluations),
subtracted from the run's step. A run that only starts its fast loss drop later, and then learns
as fast, keeps a constant lag; a run that learns more slowly per step falls further behind.

    python3 dev/loss_lag.py [--steps 500,800,1000,1200,1500,1800,2000] [--runs head_bf16]

Reads the stored 342M curves (bench/results/gpt350m_runs.json: FP8 off, delayed, current, from
2026-12-04, and gpt350m_runs_2000_variants.json: the 2026-12-05 variants, all with the head in
FP8; --runs head_bf16: gpt350m_runs_head.json, seed 1234; --runs seed2:
gpt350m_runs_seed2_h100.json) and prints one row per run. No GPU (BENCHMARKS.md, "Training
runs").
"""

import argparse
import json
import os

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results"
)


def _points(v):
    items = v.items() if isinstance(v, dict) else v
    return sorted((int(s), float(loss)) for s, loss in items)


def step_reached(curve, loss):
    """First step at which `curve` ([(step, loss)], falling) reaches `loss`, or None."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if l0 >= loss >= l1:
            return s0 if l0 == l1 else s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)
    return None


def _load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def load_runs(which: str = "head_fp8"):
    """(FP8 off curve, {run: curve}) of one set of stored runs: "head_fp8" (12-04 and the 12-05
    variants, the head in FP8), "head_bf16" (seed 1234, the head in BF16, 12-05 H200) or "seed2"
    (train.seed=2, the head in BF16, 12-05 H100), each against FP8 off of the same seed."""
    if which == "head_bf16":
        v = _load("gpt350m_runs_head.json")["val_loss"]
        return _points(v["off2"]), {
            "delayed": _points(v["head"]),
            "current": _points(v["currenthead"]),
        }
    if which == "seed2":
        v = _load("gpt350m_runs_seed2_h100.json")["val_loss"]
        return _points(v["off"]), {k: _points(v[k]) for k in ("delayed", "current")}
    base = _load("gpt350m_runs.json")["curves"]
    runs = {name: _points(base[name]["val_loss"]) for name in ("delayed", "current")}
    for name, curve in _load("gpt350m_runs_2000_variants.json")["val_loss"].items():
        runs[name] = _points(curve)
    return _points(base["off"]["val_loss"]), runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="500,800,1000,1200,1500,1800,2000")
    ap.add_argument("--runs", choices=("head_fp8", "head_bf16", "seed2"), default="head_fp8")
    a = ap.parse_args()
    steps = [int(s) for s in a.steps.split(",")]
    off, runs = load_runs(a.runs)
    print("steps behind FP8 off (its step at the same validation loss):")
    print(f"{'run':12s}" + "".join(f"{s:>7d}" for s in steps))
    for name, curve in runs.items():
        at = dict(curve)
        cells = []
        for s in steps:
            reached = step_reached(off, at[s]) if s in at else None
            cells.append(f"{'':>7s}" if reached is None else f"{s - reached:7.0f}")
        print(f"{name:12s}" + "".join(cells))


if __name__ == "__main__":
    main()
