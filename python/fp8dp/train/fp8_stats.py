"""Where FP8 loses information, layer by layer: the question to answer before any tuning when an
FP8 run falls behind its BF16 twin (configs/gpt350m.yaml, 2026-12-04: 10% behind at step 2,000).

For one micro-batch every train.fp8_stats_every steps, FP8Probe reads each fp8dp projection's
three GEMM operands in their own precision (the input x as the GEMM sees it, after the
LayerNormLinear's norm; the weight w; the output gradient dy), the scale the run's recipe casts
each with (delayed: the module's state, with its amax history; current: fp8_max / amax /
2**margin of the tensor itself), and what the cast does to it, emulated with torch's float8
dtypes (round to nearest even, saturating, as fp8dp's casts):

- fill: amax * scale / fp8_max, the share of the format's range the largest value uses (> 1: the
  top of the tensor saturates; << 1: a stale or loose scale wastes range),
- saturated: the share of values whose scaled magnitude exceeds fp8_max,
- flushed: the share of non-zero values that the cast turns into zero (underflow),
- rel_err: ||dequant(quant(v)) - v|| / ||v||,

and the relative error of the three GEMMs in FP8 against the same GEMMs of the unquantized
operands (FP32 products of both): fprop x w^T, dgrad dy w, wgrad dy^T x. Block scaling (a scale
per tile) is not emulated here.

It only reads: the run's numerics, and so its bit-exact resume, are those of a run without it.
Records go to <run_dir>/fp8_stats.jsonl, one line per module and probed step;
`python -m fp8dp.train.fp8_stats <run_dir>/fp8_stats.jsonl` prints the worst modules.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys

import torch
import torch.nn.functional as F

import fp8dp
from fp8dp.recipe import DelayedScaling, Float8CurrentScaling

# format name -> (torch dtype, largest finite value)
FORMATS = {"E4M3": (torch.float8_e4m3fn, 448.0), "E5M2": (torch.float8_e5m2, 57344.0)}
ROLES = ("x", "w", "dy")  # the order of a delayed-scaling state's columns
GEMMS = ("fprop", "dgrad", "wgrad")


def quantize(v: torch.Tensor, scale: float, fmt: str) -> tuple:
    """(dequant(quant(v)) in FP32, stats dict) for one tensor cast with `scale` into `fmt`."""
    dtype, fmax = FORMATS[fmt]
    v = v.float()
    s = v * scale
    q = s.clamp(-fmax, fmax).to(dtype).float() / scale
    nonzero = v != 0
    n = max(1, int(nonzero.sum()))
    amax = float(v.abs().max()) if v.numel() else 0.0
    return q, {
        "format": fmt,
        "amax": amax,
        "scale": float(scale),
        "fill": amax * scale / fmax,
        "saturated": int((s.abs() > fmax).sum()) / max(1, v.numel()),
        "flushed": int((nonzero & (q == 0)).sum()) / n,
        "rel_err": _rel(q, v),
    }


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(a - ref)) / den if den > 0 else 0.0


def _formats(recipe) -> tuple:
    """(forward format, gradient format) names of a per-tensor recipe."""
    fmt = recipe.fp8_format.value
    return ("E4M3", "E4M3") if fmt == "E4M3" else ("E4M3", "E5M2")


def _gemm_input(m, x: torch.Tensor) -> torch.Tensor:
    """What the module's GEMM multiplies: x, or norm(x) for a LayerNormLinear."""
    if not isinstance(m, fp8dp.LayerNormLinear):
        return x
    g = m.layer_norm_weight.float() + (1.0 if m.zero_centered_gamma else 0.0)
    xf = x.float()
    if m.normalization == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + m.eps) * g
    else:
        b = m.layer_norm_bias.float() if m.layer_norm_bias is not None else None
        y = F.layer_norm(xf, (xf.shape[-1],), g, b, m.eps)
    return y.to(x.dtype)


class FP8Probe:
    """capture(step) wraps one micro-batch's forward and backward; the records are appended to
    `path` when the backward has passed every probed module. recipe: the run's DelayedScaling or
    Float8CurrentScaling (ValueError otherwise). exclude: names of modules that run outside FP8."""

    def __init__(self, model: torch.nn.Module, recipe, path: str, exclude=()):
        if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
            raise ValueError(
                "train.fp8_stats_every: expected fp8.recipe delayed or current (per-tensor "
                f"scales), got {type(recipe).__name__}"
            )
        self.recipe, self.path = recipe, path
        self.fwd_fmt, self.bwd_fmt = _formats(recipe)
        self.modules = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, (fp8dp.Linear, fp8dp.LayerNormLinear)) and name not in exclude
        ]
        self._pending = {}

    def _scale(self, m, role: int, v: torch.Tensor, fmt: str) -> tuple:
        """(scale, extra stats): the state's scale and amax-history max (delayed), or the
        tensor's own current scale; None when a delayed state is not initialised yet."""
        if isinstance(self.recipe, DelayedScaling):
            st = m.get_extra_state()
            if st is None or not bool(st["initialized"][role]):
                return None, {}
            hist = st["amax_history"][:, role]
            return float(st["scale"][role]), {"history_max": float(hist.max())}
        amax = float(v.abs().max()) if v.numel() else 0.0
        if not amax > 0 or not math.isfinite(amax):
            return None, {}
        return FORMATS[fmt][1] / amax / 2.0**self.recipe.margin, {}

    def _operand(self, m, role: int, v: torch.Tensor, fmt: str):
        scale, extra = self._scale(m, role, v, fmt)
        if scale is None:
            return None, None
        q, stats = quantize(v, scale, fmt)
        stats.update(extra)
        return q, stats

    @contextlib.contextmanager
    def capture(self, step: int):
        handles = []
        self._pending = {}

        def pre_hook(name):
            @torch.no_grad()
            def hook(m, args):
                x = _gemm_input(m, args[0].detach()).reshape(-1, m.in_features)
                w = m.weight.detach()
                qx, sx = self._operand(m, 0, x, self.fwd_fmt)
                qw, sw = self._operand(m, 1, w, self.fwd_fmt)
                rec = {"step": step, "module": name, "x": sx, "w": sw}
                if qx is not None and qw is not None:
                    rec["fprop"] = _rel(qx @ qw.t(), x.float() @ w.float().t())
                self._pending[name] = (rec, x, w, qx, qw)

            return hook

        def post_hook(name):
            def hook(m, args, out):
                y = out[0] if isinstance(out, tuple) else out
                if y.requires_grad:
                    y.register_hook(lambda g: self._backward(name, m, g))

            return hook

        for name, m in self.modules:
            handles.append(m.register_forward_pre_hook(pre_hook(name)))
            handles.append(m.register_forward_hook(post_hook(name)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._write()

    @torch.no_grad()
    def _backward(self, name, m, g) -> None:
        rec, x, w, qx, qw = self._pending[name]
        dy = g.detach().reshape(-1, m.out_features)
        qdy, sdy = self._operand(m, 2, dy, self.bwd_fmt)
        rec["dy"] = sdy
        if qdy is not None and qw is not None:
            rec["dgrad"] = _rel(qdy @ qw, dy.float() @ w.float())
        if qdy is not None and qx is not None:
            rec["wgrad"] = _rel(qdy.t() @ qx, dy.float().t() @ x.float())
        self._pending[name] = (rec, None, None, None, None)  # the operands are no longer needed

    def _write(self) -> None:
        with open(self.path, "a") as f:
            for name, _ in self.modules:
                if name in self._pending:
                    f.write(json.dumps(self._pending[name][0]) + "\n")
        self._pending = {}


def summarize(records: list, top: int = 10) -> str:
    """The worst (module, operand or GEMM) pairs by relative error, over every probed step, and
    the largest saturated and flushed shares: a Markdown table."""
    rows = []
    for r in records:
        for key in ROLES:
            s = r.get(key)
            if s:
                rows.append(
                    (
                        s["rel_err"],
                        r["step"],
                        r["module"],
                        key,
                        s["fill"],
                        s["saturated"],
                        s["flushed"],
                    )
                )
        for key in GEMMS:
            if key in r:
                rows.append((r[key], r["step"], r["module"], key, None, None, None))
    rows.sort(key=lambda t: -t[0])
    out = ["| step | module | tensor / GEMM | rel. error | fill | saturated | flushed |"]
    out.append("|---:|---|---|---:|---:|---:|---:|")
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for err, step, mod, key, fill, sat, fl in rows[:top]:
        out.append(
            f"| {step} | {mod} | {key} | {err:.4f} | {fmt(fill, '.3g')} | {fmt(sat, '.2e')} "
            f"| {fmt(fl, '.2e')} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8dp.train.fp8_stats", description=__doc__)
    p.add_argument("path", help="a run's fp8_stats.jsonl")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    try:
        with open(args.path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        print(
            f"fp8_stats: error: path: expected a readable fp8_stats.jsonl, got {e}", file=sys.stderr
        )
        return 2
    print(summarize(records, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
