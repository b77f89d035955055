"""How many steps behind FP8 off a run is, along the way: for each evaluation of a run, the step at
which the FP8 off curve first reached the same validation loss (linear between its evaluations),
subtracted from the run's step. A run that only starts its fast loss drop later, and then learns
as fast, keeps a constant lag; a run that learns more slowly per step falls further behind.

    python3 dev/loss_lag.py [--steps 500,800,1000,1200,1500,1800,2000]

Reads the stored 342M curves (bench/results/gpt350m_runs.json: FP8 off, delayed, current, from
2026-12-04; gpt350m_runs_2000_variants.json: the 2026-12-05 variants) and prints one row per run.
No GPU: the runs were on the H200 (BENCHMARKS.md, "Training runs").
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


def load_runs():
    base = json.load(open(os.path.join(RESULTS, "gpt350m_runs.json")))["curves"]
    runs = {name: _points(base[name]["val_loss"]) for name in ("delayed", "current")}
    variants = json.load(open(os.path.join(RESULTS, "gpt350m_runs_2000_variants.json")))
    for name, curve in variants["val_loss"].items():
        runs[name] = _points(curve)
    return _points(base["off"]["val_loss"]), runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="500,800,1000,1200,1500,1800,2000")
    a = ap.parse_args()
    steps = [int(s) for s in a.steps.split(",")]
    off, runs = load_runs()
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
