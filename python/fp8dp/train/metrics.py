"""Rank 0's outputs: metrics as JSON lines and a PNG of train/validation loss against step.

One run directory holds up to two runs of the same config, ``fp8/`` and ``nofp8/`` (FP8 off, the
parameter dtype's plain GEMMs); the plot shows whichever exist, so an FP8 run is drawn next to its
baseline whenever both have been run.
"""

from __future__ import annotations

import json
import os

RUN_NAMES = ("fp8", "nofp8")


class MetricsWriter:
    """Appends one JSON object per line; ``truncate_after`` drops lines past a resumed step."""

    def __init__(self, path: str, truncate_after: int = -1):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        keep = []
        if truncate_after >= 0 and os.path.exists(path):
            # A resumed run rewrites the steps after its checkpoint; earlier lines stay.
            keep = [r for r in read_metrics(path) if r["step"] <= truncate_after]
        self._f = open(path, "w")
        for rec in keep:
            self.write(rec)

    def write(self, rec: dict) -> None:
        self._f.write(json.dumps(rec, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(run_dir: str, out_png: str, labels: dict) -> str:
    """Train and validation loss of every run found under run_dir into one PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"fp8": "tab:blue", "nofp8": "tab:orange"}
    for name in RUN_NAMES:
        path = os.path.join(run_dir, name, "metrics.jsonl")
        if not os.path.exists(path):
            continue
        recs = read_metrics(path)
        train = [(r["step"], r["train_loss"]) for r in recs if "train_loss" in r]
        val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        label = labels.get(name, name)
        if train:
            ax.plot(*zip(*train), color=colors[name], alpha=0.35, lw=1, label=f"{label} train")
        if val:
            ax.plot(*zip(*val), color=colors[name], marker="o", ms=3, lw=2, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title("fp8dp GPT demo")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
