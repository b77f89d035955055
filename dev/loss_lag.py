"""How many steps behind FP8 off a run is, along the way: for each evaluation of a run, the step at
which the FP8 off curve first reached the same validation loss (linear between its evaluations),
subtracted from the run's step. A run that only starts its fast loss drop later, and then learns
as fast, keeps a constant lag; a run that learns more slowly per step falls further behind.

    python3 dev/loss_lag.py [--steps 500,800,1000,1200,1500,1800,2000] [--runs head_bf16]
    python3 dev/loss_lag.py --png docs/gpt350m_gaps.png   # every head-in-BF16 run's gap, plotted

Reads the stored 342M curves (bench/results/gpt350m_runs.json: FP8 off, delayed, current, from
2026-12-04, and gpt350m_runs_2000_variants.json: the 2026-12-05 variants, all with the head in
FP8; --runs head_bf16: gpt350m_runs_head.json, seed 1234; --runs seed2:
gpt350m_runs_seed2_h100.json; both with block scaling and, seed 2, E4M3 gradients from
gpt350m_runs_block_e4m3_h100.json, and delayed scaling with the forward GEMMs' accumulation
promoted from gpt350m_fprop_split_h100.json, 12-06) and prints one row per run. --png plots the relative gap to
FP8 off of the same seed at every evaluation, for every head-in-BF16 run of both seeds. No GPU
(BENCHMARKS.md, "Training runs").
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
    if which in ("head_bf16", "seed2"):
        late = _load("gpt350m_runs_block_e4m3_h100.json")["val_loss"]
        promoted = _load("gpt350m_fprop_split_h100.json")["val_loss"]
    if which == "head_bf16":
        v = _load("gpt350m_runs_head.json")["val_loss"]
        return _points(v["off2"]), {
            "delayed": _points(v["head"]),
            "current": _points(v["currenthead"]),
            "block": _points(late["block_seed1234"]),
            "delayed_promoted": _points(promoted["fprop_seed1234"]),
        }
    if which == "seed2":
        v = _load("gpt350m_runs_seed2_h100.json")["val_loss"]
        runs = {k: _points(v[k]) for k in ("delayed", "current")}
        runs["block"] = _points(late["block_seed2"])
        runs["delayed_e4m3"] = _points(late["delayed_e4m3_seed2"])
        # Against the 12-05 FP8 off run of seed 2, as every run of this set (0.7% above the
        # 12-06 one at step 2,000, which BENCHMARKS.md's table uses).
        runs["delayed_promoted"] = _points(promoted["fprop_seed2"])
        return _points(v["off"]), runs
    base = _load("gpt350m_runs.json")["curves"]
    runs = {name: _points(base[name]["val_loss"]) for name in ("delayed", "current")}
    for name, curve in _load("gpt350m_runs_2000_variants.json")["val_loss"].items():
        runs[name] = _points(curve)
    return _points(base["off"]["val_loss"]), runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="500,800,1000,1200,1500,1800,2000")
    ap.add_argument("--runs", choices=("head_fp8", "head_bf16", "seed2"), default="head_fp8")
    ap.add_argument("--png", help="plot every head-in-BF16 run's gap to FP8 off (both seeds)")
    a = ap.parse_args()
    if a.png:
        return plot_gaps(a.png)
    steps = [int(s) for s in a.steps.split(",")]
    off, runs = load_runs(a.runs)
    print("steps behind FP8 off (its step at the same validation loss):")
    print(f"{'run':18s}" + "".join(f"{s:>7d}" for s in steps))
    for name, curve in runs.items():
        at = dict(curve)
        cells = []
        for s in steps:
            reached = step_reached(off, at[s]) if s in at else None
            cells.append(f"{'':>7s}" if reached is None else f"{s - reached:7.0f}")
        print(f"{name:18s}" + "".join(cells))


def plot_gaps(path: str) -> None:
    """Relative gap of the validation loss to FP8 off of the same seed, per evaluation from step
    200 (before, the curves are level), one line per head-in-BF16 run; the band is the gap
    between two FP8 off runs of seed 1234 (12-04 and 12-05), their run-to-run spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {
        "delayed": "C0",
        "current": "C1",
        "block": "C2",
        "delayed_e4m3": "C3",
        "delayed_promoted": "C4",
    }
    for seed, style in (("head_bf16", "-"), ("seed2", "--")):
        off, runs = load_runs(seed)
        ref = dict(off)
        label_seed = "seed 1234" if seed == "head_bf16" else "seed 2"
        for name, curve in runs.items():
            pts = [(s, 100 * (v - ref[s]) / ref[s]) for s, v in curve if s in ref and s >= 200]
            lw = 2.2 if name == "delayed_promoted" else 1.2  # the config's recipe since 12-06
            ax.plot(*zip(*pts), style, color=colors[name], lw=lw, label=f"{name}, {label_seed}")
    off12_04 = dict(_points(_load("gpt350m_runs.json")["curves"]["off"]["val_loss"]))
    off12_05 = dict(_points(_load("gpt350m_runs_head.json")["val_loss"]["off2"]))
    pts = [(s, 100 * (off12_04[s] - v) / v) for s, v in sorted(off12_05.items()) if s >= 200]
    ax.plot(*zip(*pts), ":", color="0.4", label="FP8 off, 12-04 run vs 12-05 run (seed 1234)")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.axhspan(-0.25, 0.25, color="0.85", label="target ±0.25%")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss vs FP8 off of the same seed (%)")
    ax.set_title("342M GPT, head in BF16: FP8 recipes against FP8 off")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot {path}")


if __name__ == "__main__":
    main()
