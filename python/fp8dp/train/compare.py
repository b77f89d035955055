"""Compare the runs of fp8dp.train.runs: FP8 (delayed, current) against FP8 off, and FP8 off against
the plain-torch DDP baseline.

    python -m fp8dp.train.compare RUN_BASE [--after 200] [--png docs/gpt350m_loss.png] [--check]

reads RUN_BASE/<run>/<kind>/metrics.jsonl (runs.RUNS), prints a Markdown table (also written to
RUN_BASE/compare.md, the numbers to compare.json) and plots the curves. With several seeds
(fp8dp.train.runs --seeds: RUN_BASE/seed<N>/<run>/...) every run's curve is the mean over its seeds
(those that also have FP8 off), and the gaps below are those of the mean curves; each seed's own
comparison is kept in compare.json. The gaps:

- final: |FP8 - off| / off of the validation loss at the last step both reached;
- curve: the largest |FP8 - off| / off over the validation losses at the steps > --after that
  both evaluated;
- torch: the largest |off - torch| / torch over the validation losses of the steps both
  evaluated (the baseline run is short), and the same over the train losses.

Throughput is the median tokens/s of the steps after the first --skip (compilation, allocator
warm-up); MFU the median of the logged per-step MFU; peak memory the largest logged value.
With --check the exit status is 1 when a gap exceeds --final-tol / --curve-tol.

Why seeds: two GPU runs of the 342M config with the same seed ended 0.72% apart (BENCHMARKS.md,
"Training runs"), more than the 0.25% target, so one pair of runs cannot decide it. Over n seeds
each FP8 run also gets its paired gap per seed, (FP8 - off) / off with the same seed (same
initial weights and data order), their mean and a 95% confidence interval (Student's t, n - 1
degrees of freedom), and FP8 off its own spread (standard deviation / mean of the final losses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from .metrics import read_metrics

# (run name, metrics subdirectory, label): what fp8dp.train.runs trains.
RUNS = (
    ("delayed", "fp8", "FP8 delayed (HYBRID)"),
    ("current", "fp8", "FP8 current"),
    ("block", "fp8", "FP8 block scaling (E4M3, 1x128 tiles)"),
    ("off", "nofp8", "FP8 off"),
    ("torch", "torch", "torch.nn + DDP"),
)
# The FP8 runs, each compared with FP8 off (block: trained only when runs.py --only names it).
FP8_RUNS = tuple(n for n, sub, _ in RUNS if sub == "fp8")
# The runs every comparison must have (the real-training runs' recipes); block is checked when run.
REQUIRED_FP8_RUNS = ("delayed", "current")


def load_runs(base: str) -> dict:
    """{name: metrics records} of the runs that exist under base."""
    out = {}
    for name, sub, _ in RUNS:
        path = os.path.join(base, name, sub, "metrics.jsonl")
        if os.path.exists(path):
            out[name] = read_metrics(path)
    return out


def _series(recs, key) -> dict:
    return {r["step"]: r[key] for r in recs if key in r}


def rel_gaps(a: dict, b: dict, after: int = -1) -> dict:
    """{step: |a - b| / |b|} over the steps > after that both hold."""
    return {s: abs(a[s] - b[s]) / abs(b[s]) for s in sorted(set(a) & set(b)) if s > after}


def summarize(recs, skip: int) -> dict:
    steps = [r for r in recs if "tokens_per_s" in r and r["step"] > skip]
    val = _series(recs, "val_loss")
    last = max(val) if val else None
    out = {
        "steps": max((r["step"] for r in recs), default=0),
        "final_step": last,
        "final_val_loss": val[last] if val else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps) if steps else None,
        "peak_mem_gib": max((r.get("peak_mem_gib", 0.0) for r in recs), default=None),
    }
    mfus = [r["mfu"] for r in steps if "mfu" in r]
    out["mfu"] = statistics.median(mfus) if mfus else None
    return out


def compare(runs: dict, after: int = 200, skip: int = 10) -> dict:
    """The numbers of the module docstring, from load_runs()'s records."""
    res = {"runs": {n: summarize(r, skip) for n, r in runs.items()}, "after": after}
    if "off" not in runs:
        return res
    off_val = _series(runs["off"], "val_loss")
    off = res["runs"]["off"]
    for name in FP8_RUNS:
        if name not in runs:
            continue
        val = _series(runs[name], "val_loss")
        common = sorted(set(val) & set(off_val))
        if not common:
            continue
        last = common[-1]
        curve = rel_gaps(val, off_val, after)
        r = res["runs"][name]
        r["final_gap_signed"] = (val[last] - off_val[last]) / off_val[last]
        r["final_gap"] = abs(r["final_gap_signed"])
        r["final_gap_step"] = last
        r["curve_gap"] = max(curve.values()) if curve else None
        r["curve_gap_step"] = max(curve, key=curve.get) if curve else None
        if r["tokens_per_s"] and off["tokens_per_s"]:
            r["speedup"] = r["tokens_per_s"] / off["tokens_per_s"]
    if "torch" in runs:
        r = res["runs"]["torch"]
        val_gap = rel_gaps(off_val, _series(runs["torch"], "val_loss"))
        train_gap = rel_gaps(
            _series(runs["off"], "train_loss"), _series(runs["torch"], "train_loss")
        )
        r["val_gap_to_off"] = max(val_gap.values()) if val_gap else None
        r["train_gap_to_off"] = max(train_gap.values()) if train_gap else None
        r["compared_steps"] = max(train_gap) if train_gap else 0
    return res


# Student's t, two-sided 95%, for 1..30 degrees of freedom (then the normal's 1.96): the
# interval's width for the few seeds a GPU session affords.
# fmt: off
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)
# fmt: on


def t975(dof: int) -> float:
    if dof < 1:
        raise ValueError(f"t975: dof: expected >= 1, got {dof}")
    return _T975[dof - 1] if dof <= len(_T975) else 1.96


def seed_dirs(base: str) -> dict:
    """{seed: directory} of a multi-seed base (runs.py --seeds writes BASE/seed<N>/<run>/...);
    empty when BASE holds the runs themselves."""
    out = {}
    if os.path.isdir(base):
        for d in os.listdir(base):
            if d.startswith("seed") and d[4:].lstrip("-").isdigit():
                out[int(d[4:])] = os.path.join(base, d)
    return dict(sorted(out.items()))


def mean_records(per_seed: list) -> list:
    """One run's records over seeds: its validation and train losses averaged at the steps every
    seed logged them, and every seed's throughput, MFU and memory (which summarize() pools)."""
    out = {}
    for key in ("val_loss", "train_loss"):
        series = [_series(recs, key) for recs in per_seed]
        for s in sorted(set.intersection(*(set(v) for v in series))) if series else []:
            out.setdefault(s, {"step": s})[key] = statistics.fmean(v[s] for v in series)
    pooled = [
        {k: r[k] for k in ("step", "tokens_per_s", "mfu", "peak_mem_gib") if k in r}
        for recs in per_seed
        for r in recs
        if "tokens_per_s" in r or "peak_mem_gib" in r
    ]
    return sorted(out.values(), key=lambda r: r["step"]) + pooled


def compare_seeds(per_seed: dict, after: int = 200, skip: int = 10) -> dict:
    """compare() over seeds ({seed: load_runs()}): each run through its mean curve over the seeds
    that also have FP8 off (all of its seeds for FP8 off itself), the paired final gaps at the
    last step of the mean curves, and each run's spread of final losses over seeds."""
    seeds = sorted(per_seed)
    res = {
        "after": after,
        "seeds": seeds,
        "per_seed": {str(s): compare(per_seed[s], after, skip) for s in seeds},
        "runs": {},
    }
    for name, _, _ in RUNS:
        have = [s for s in seeds if name in per_seed[s]]
        if not have:
            continue
        if name == "torch":  # the baseline runs on one seed: that seed's comparison
            res["runs"]["torch"] = res["per_seed"][str(have[0])]["runs"]["torch"]
            continue
        use = [s for s in have if "off" in per_seed[s]] or have
        pair = {name: mean_records([per_seed[s][name] for s in use])}
        if name != "off" and "off" in per_seed[use[0]]:
            pair["off"] = mean_records([per_seed[s]["off"] for s in use])
        r = compare(pair, after, skip)["runs"][name]
        r["seeds"] = use
        step = r.get("final_gap_step", r["final_step"])
        finals = [_series(per_seed[s][name], "val_loss").get(step) for s in use]
        if step is not None and len(use) >= 2:
            r["final_val_loss_sd"] = statistics.stdev(finals)
            r["final_spread"] = r["final_val_loss_sd"] / statistics.fmean(finals)
        if name != "off" and "final_gap_step" in r:
            offs = [_series(per_seed[s]["off"], "val_loss")[step] for s in use]
            gaps = [(a - b) / b for a, b in zip(finals, offs)]
            r["paired_gaps"] = gaps
            r["paired_gap_mean"] = statistics.fmean(gaps)
            if len(gaps) >= 2:
                half = t975(len(gaps) - 1) * statistics.stdev(gaps) / len(gaps) ** 0.5
                r["paired_gap_ci95"] = [r["paired_gap_mean"] - half, r["paired_gap_mean"] + half]
        res["runs"][name] = r
    return res


def table_seeds(res: dict) -> str:
    """The Markdown table of compare_seeds()'s result."""
    pct = lambda v: "–" if v is None else f"{100 * v:+.3f}%"  # noqa: E731
    lines = [
        "| run | seeds | final val loss, mean ± sd | gap of the means | paired gap, mean "
        f"[95% CI] | max gap of the means after step {res['after']} | tokens/s | vs FP8 off | "
        "MFU | peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, _, label in RUNS:
        r = res["runs"].get(name)
        if r is None or name == "torch":
            continue
        sd = r.get("final_val_loss_sd")
        ci = r.get("paired_gap_ci95")
        paired = pct(r.get("paired_gap_mean")) + (f" [{pct(ci[0])}, {pct(ci[1])}]" if ci else "")
        lines.append(
            f"| {label} | {len(r['seeds'])} | {_fmt(r['final_val_loss'], '.4f')}"
            f"{'' if sd is None else f' ± {sd:.4f}'} | "
            f"{pct(r.get('final_gap_signed'))} | {paired if name != 'off' else '–'} | "
            f"{_common_cells(r)} |"
        )
    return "\n".join(lines)


def _fmt(v, spec):
    return "–" if v is None else format(v, spec)


def _share(v, spec) -> str:
    """A fraction as a percentage ("12.345%"), or "–"."""
    return "–" if v is None else format(100 * v, spec) + "%"


def _common_cells(r: dict) -> str:
    """The cells both tables end with: curve gap, tokens/s, speed-up, MFU, peak memory."""
    return (
        f"{_share(r.get('curve_gap'), '.3f')} | {_fmt(r['tokens_per_s'], ',.0f')} | "
        f"{_fmt(r.get('speedup'), '.2f')}{'' if r.get('speedup') is None else '×'} | "
        f"{_share(r['mfu'], '.1f')} | {_fmt(r['peak_mem_gib'], '.1f')}"
    )


def table(res: dict) -> str:
    """The Markdown table of compare()'s result."""
    lines = [
        "| run | steps | final val loss | gap to FP8 off (final) | max gap after step "
        f"{res['after']} | tokens/s | vs FP8 off | MFU | peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, _, label in RUNS:
        r = res["runs"].get(name)
        if r is None:
            continue
        final = r.get("final_gap")
        if name == "torch" and r.get("val_gap_to_off") is not None:
            final = r["val_gap_to_off"]
        lines.append(
            f"| {label} | {r['steps']} | {_fmt(r['final_val_loss'], '.4f')} | "
            f"{_share(final, '.3f')} | {_common_cells(r)} |"
        )
    return "\n".join(lines)


def plot(runs: dict, res: dict, out_png: str, title: str) -> str:
    """Validation (markers) and train (faint) loss of every run, and below it the relative gap of
    each FP8 run's validation loss to FP8 off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "delayed": "tab:blue",
        "current": "tab:green",
        "block": "tab:purple",
        "off": "tab:orange",
        "torch": "k",
    }
    labels = {n: lab for n, _, lab in RUNS}
    fig, (ax, gx) = plt.subplots(
        2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
    )
    for name, recs in runs.items():
        tr = sorted(_series(recs, "train_loss").items())
        va = sorted(_series(recs, "val_loss").items())
        if tr:
            ax.plot(*zip(*tr), color=colors[name], alpha=0.25, lw=0.8)
        if va:
            ax.plot(*zip(*va), color=colors[name], marker="o", ms=3, lw=1.5, label=labels[name])
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if "off" in runs:
        off = _series(runs["off"], "val_loss")
        for name in FP8_RUNS:
            if name in runs:
                val = _series(runs[name], "val_loss")
                steps = sorted(set(val) & set(off))
                gx.plot(
                    steps,
                    [100 * (val[s] - off[s]) / off[s] for s in steps],
                    color=colors[name],
                    marker="o",
                    ms=3,
                    label=labels[name],
                )
        gx.axhline(0, color="k", lw=0.6)
        for y in (-0.25, 0.25):
            gx.axhline(y, color="gray", lw=0.6, ls="--")
        gx.axvline(res["after"], color="gray", lw=0.6, ls=":")
    gx.set_ylabel("val gap to FP8 off (%)")
    gx.set_xlabel("step")
    gx.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def check(res: dict, final_tol: float, curve_tol: float) -> list:
    """The targets missed, one line each (empty: all met). A required run that is missing is a
    miss; an optional one (block) is checked only when it was trained."""
    bad = []
    for name in FP8_RUNS:
        if name not in res["runs"] and name not in REQUIRED_FP8_RUNS:
            continue
        r = res["runs"].get(name, {})
        if r.get("final_gap") is None:
            bad.append(f"{name}: no validation loss to compare with FP8 off")
            continue
        if r["final_gap"] > final_tol:
            bad.append(
                f"{name}: final validation gap {100 * r['final_gap']:.3f}% > "
                f"{100 * final_tol:.3f}% (step {r['final_gap_step']})"
            )
        if r.get("curve_gap") is not None and r["curve_gap"] > curve_tol:
            bad.append(
                f"{name}: validation gap {100 * r['curve_gap']:.3f}% at step "
                f"{r['curve_gap_step']} > {100 * curve_tol:.3f}%"
            )
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8dp.train.compare", description=__doc__)
    p.add_argument("base", help="the runs' base directory (fp8dp.train.runs --out)")
    p.add_argument("--after", type=int, default=200, help="curve gap over steps > this")
    p.add_argument("--skip", type=int, default=10, help="steps left out of the throughput")
    p.add_argument("--final-tol", type=float, default=0.0025, help="default 0.25%%")
    p.add_argument("--curve-tol", type=float, default=0.01, help="default 1%%")
    p.add_argument("--png", help="plot path (default BASE/compare.png)")
    p.add_argument("--title", default="fp8dp GPT: FP8 against FP8 off")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    seeds = seed_dirs(args.base)
    per_seed = {s: r for s, r in ((s, load_runs(d)) for s, d in seeds.items()) if r}
    runs = load_runs(args.base) if not seeds else {}
    if not runs and not per_seed:
        print(f"fp8dp.train.compare: error: no runs under {args.base}", file=sys.stderr)
        return 2
    if per_seed:
        res = compare_seeds(per_seed, args.after, args.skip)
        md = table_seeds(res)
        # the plot: every run's mean curve (its seeds in the table)
        runs = {
            n: mean_records([per_seed[s][n] for s in res["runs"][n]["seeds"]])
            for n in res["runs"]
            if n != "torch"
        }
    else:
        res = compare(runs, args.after, args.skip)
        md = table(res)
    bad = check(res, args.final_tol, args.curve_tol)
    res["missed"] = bad
    png = plot(runs, res, args.png or os.path.join(args.base, "compare.png"), args.title)
    with open(os.path.join(args.base, "compare.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.base, "compare.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(md)
    for name in FP8_RUNS:
        r = res["runs"].get(name, {})
        if r.get("final_gap") is not None:
            over = f" (means over seeds {r['seeds']})" if per_seed else ""
            print(
                f"{name}: |FP8 - off| / off = {100 * r['final_gap']:.3f}% at step "
                f"{r['final_gap_step']}{over}; max after step {args.after}: "
                f"{_fmt(None if r['curve_gap'] is None else 100 * r['curve_gap'], '.3f')}%"
            )
        if r.get("paired_gap_ci95"):
            lo, hi = r["paired_gap_ci95"]
            print(
                f"{name}: paired gap {100 * r['paired_gap_mean']:+.3f}%, 95% CI "
                f"[{100 * lo:+.3f}%, {100 * hi:+.3f}%] over {len(r['paired_gaps'])} seeds"
            )
    if res["runs"].get("off", {}).get("final_spread") is not None:
        o = res["runs"]["off"]
        print(
            f"off: final validation loss {o['final_val_loss']:.4f} ± {o['final_val_loss_sd']:.4f} "
            f"(sd / mean {100 * o['final_spread']:.3f}%) over seeds {o['seeds']}"
        )
    t = res["runs"].get("torch", {})
    if t.get("train_gap_to_off") is not None:
        print(
            f"torch: FP8 off vs torch.nn + DDP over {t['compared_steps']} steps: largest "
            f"relative gap of the train loss {t['train_gap_to_off']:.2e}, of the validation loss "
            f"{_fmt(t['val_gap_to_off'], '.2e')}"
        )
    print(f"plot {png}")
    for line in bad:
        print(f"MISSED {line}")
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
