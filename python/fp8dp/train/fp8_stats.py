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
operands (FP32 products of both): fprop x w^T, dgrad dy w, wgrad dy^T x.

Under block scaling (fp8.recipe block) the casts are fp8dp's own CPU block casts
(_C.block_quantize: x and dy in 1x128 tiles along the GEMM's reduction dimension, their transposes
for the wgrad re-cast in tiles along the tokens, w in 128x128 blocks), dequantized exactly; fill is
then the mean over 1x128 row segments of amax * scale / fp8_max, and x and dy also report rel_err_t, the error of
the transposed cast the wgrad reads. For a projection whose output is several tensors under one scale
(qkv: q, k and v), dy_parts gives each part's place in the range, flushed share and errors.

It also checks fp8dp's own results against that emulation (*_kernel): the module's output, its
input gradient (through the norm's backward for a LayerNormLinear) and the weight gradient in
weight.main_grad. These differ only by the output's rounding (BF16: ~2^-9), the accumulation
(FP32, or the tensor cores' fast accumulation for fprop by default) and the norm computed twice;
a cast with the wrong scale or layout shows up as a difference of the size of the FP8 error.

It only reads: the run's numerics, and so its bit-exact resume, are those of a run without it.
Records go to <run_dir>/fp8_stats.jsonl, one line per module and probed step;
`python -m fp8dp.train.fp8_stats <run_dir>/fp8_stats.jsonl` prints the worst modules.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys

import torch
import torch.nn.functional as F

import fp8dp
from fp8dp import _C
from fp8dp.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

from .metrics import MetricsWriter, read_metrics

# format name -> (torch dtype, largest finite value)
FORMATS = {"E4M3": (torch.float8_e4m3fn, 448.0), "E5M2": (torch.float8_e5m2, 57344.0)}
ROLES = ("x", "w", "dy")  # the order of a delayed-scaling state's columns
GEMMS = ("fprop", "dgrad", "wgrad")
KERNELS = ("fprop_kernel", "dgrad_kernel", "wgrad_kernel")


def fake_cast(v: torch.Tensor, scale, fmt: str) -> torch.Tensor:
    """dequant(quant(v)) in FP32: v cast with `scale` into `fmt` (round to nearest even,
    saturating, as fp8dp's casts) and back."""
    dtype, fmax = FORMATS[fmt]
    return (v.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def quantize(v: torch.Tensor, scale: float, fmt: str) -> tuple:
    """(dequant(quant(v)) in FP32, stats dict) for one tensor cast with `scale` into `fmt`."""
    fmax = FORMATS[fmt][1]
    v = v.float()
    s = v * scale
    q = fake_cast(v, scale, fmt)
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


# Projections whose output is several tensors side by side, in equal contiguous column blocks
# (train/model.py: qkv's output is viewed as (3, heads, head_dim)). One per-tensor scale covers
# them all, so a part much smaller than the others sits low in the format's range: the probe
# reports each part's own numbers.
PARTS = {"qkv": ("q", "k", "v")}


def _parts(dy, qdy, names, dw, x) -> dict:
    """Per part of dy's columns: rms / amax of the whole tensor (how low the part sits in the
    range its scale was set for), the flushed share, dy's relative error, and the relative error
    of the part's rows of the FP8 weight gradient (dw: the emulated one; x: the exact input)."""
    out = {}
    amax = float(dy.abs().max())
    for i, (v, q) in enumerate(zip(dy.float().chunk(len(names), -1), qdy.chunk(len(names), -1))):
        nonzero = v != 0
        rec = {
            "rms_over_amax": float(v.pow(2).mean().sqrt()) / amax if amax > 0 else 0.0,
            "flushed": int((nonzero & (q == 0)).sum()) / max(1, int(nonzero.sum())),
            "rel_err": _rel(q, v),
        }
        if dw is not None:
            rows = dw.chunk(len(names), 0)[i]
            rec["wgrad"] = _rel(rows, v.t() @ x.float())
        out[names[i]] = rec
    return out


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(a - ref)) / den if den > 0 else 0.0


def block_quantize(v: torch.Tensor, fmt: str, qp, blocks: bool, transpose: bool) -> tuple:
    """Float8BlockScaling's cast of v [rows, cols] with fp8dp's own CPU kernel: (dequantized
    row-major cast, dequantized transposed cast viewed back as [rows, cols] or None, stats)."""
    fmax = FORMATS[fmt][1]
    v = v.float().contiguous()
    shape = _C.BlockShape.BLOCK_128x128 if blocks else _C.BlockShape.TILE_1x128
    c = _C.block_quantize(
        v,
        _C.Format.E4M3 if fmt == "E4M3" else _C.Format.E5M2,
        shape,
        power_2_scale=qp.power_2_scale,
        amax_epsilon=qp.amax_epsilon,
        transpose=transpose,
    )
    q = _C.block_dequantize(c.data, c.scale_inv, torch.float32)
    q_t = None
    if transpose and not blocks:  # a weight block serves both orientations
        q_t = _C.block_dequantize(c.data_t, c.scale_inv_t, torch.float32).t()
    # Each element's scale, from its tile's (or block's) scale_inv.
    rows, cols = v.shape
    si = c.scale_inv.repeat_interleave(128, 1)[:, :cols]
    if blocks:
        si = si.repeat_interleave(128, 0)[:rows]
    scaled = v.abs() / si
    tile_amax = torch.nn.functional.pad(scaled, (0, (-cols) % 128)).view(scaled.shape[0], -1, 128)
    nonzero = v != 0
    stats = {
        "format": fmt,
        "amax": float(v.abs().max()) if v.numel() else 0.0,
        "scale": None,
        "fill": float(tile_amax.amax(-1).mean()) / fmax if v.numel() else 0.0,
        # |v| / scale_inv, not |v| * scale as the cast computes it: a few FP32 ulps of slack so
        # that a tile's own amax (mapped onto fp8_max) does not count as saturated.
        "saturated": int((scaled > fmax * (1 + 2.0**-20)).sum()) / max(1, v.numel()),
        "flushed": int((nonzero & (q == 0)).sum()) / max(1, int(nonzero.sum())),
        "rel_err": _rel(q, v),
    }
    if q_t is not None:
        stats["rel_err_t"] = _rel(q_t, v)
    return q, q_t, stats


def _formats(recipe) -> tuple:
    """(forward format, gradient format) names of a recipe."""
    fmt = recipe.fp8_format.value
    return ("E4M3", "E4M3") if fmt == "E4M3" else ("E4M3", "E5M2")


def _gemm_input(m, x: torch.Tensor) -> torch.Tensor:
    """What the module's GEMM multiplies: x, or norm(x) for a LayerNormLinear, rounded to x's
    dtype as the fused norm rounds it before its FP8 cast (src/norm/norm_kernel.h)."""
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


def _join(parts, like=None) -> torch.Tensor:
    """q, k, v ([..., heads, head_dim] each; None: zeros of `like` = (shape, dtype, device)) as
    the [tokens, 3 * hidden] matrix the projection's output is."""
    shape, dtype, device = like if like is not None else (parts[0].shape, None, None)
    cols = shape[-2] * shape[-1]
    return torch.cat(
        [
            (t if t is not None else torch.zeros(shape, dtype=dtype, device=device)).reshape(
                -1, cols
            )
            for t in parts
        ],
        dim=1,
    )


class FP8Probe:
    """capture(step) wraps one micro-batch's forward and backward; the records are appended to
    `path` (a fresh file, or with truncate_after >= 0 the records of steps up to it kept, as
    metrics.jsonl on resume) at the end of the block. recipe: the run's DelayedScaling,
    Float8CurrentScaling or Float8BlockScaling (ValueError otherwise). exclude: the projection
    names that run outside FP8 (fp8.exclude: "qkv", ..., "head")."""

    def __init__(
        self, model: torch.nn.Module, recipe, path: str, exclude=(), truncate_after: int = -1
    ):
        if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)):
            raise ValueError(
                "train.fp8_stats_every: expected an fp8dp recipe (DelayedScaling, "
                f"Float8CurrentScaling or Float8BlockScaling), got {type(recipe).__name__}"
            )
        self.recipe = recipe
        self.block = isinstance(recipe, Float8BlockScaling)
        # As metrics.jsonl: a fresh run starts the file, a resumed one keeps its steps so far.
        self._out = MetricsWriter(path, truncate_after)
        self.fwd_fmt, self.bwd_fmt = _formats(recipe)
        # override_linear_precision: GEMMs emulated on the unquantized operands, no FP8 error
        # (per-tensor recipes only; block scaling runs every GEMM in FP8)
        override = (False,) * 3 if self.block else recipe.override_linear_precision
        self.fprop_hp, self.dgrad_hp, self.wgrad_hp = override
        self.modules = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, (fp8dp.Linear, fp8dp.LayerNormLinear))
            and name.rsplit(".", 1)[-1] not in exclude
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
        """(dequantized cast as the fprop / dgrad read it, the one the wgrad reads, stats); the
        casts None when delayed scaling has no scale yet."""
        if self.block:
            r = self.recipe
            qp = (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad)[role]
            q, q_t, stats = block_quantize(v, fmt, qp, blocks=role == 1, transpose=role != 1)
            return q, (q if q_t is None else q_t), stats
        scale, extra = self._scale(m, role, v, fmt)
        if scale is None:
            return None, None, None
        q, stats = quantize(v, scale, fmt)
        stats.update(extra)
        return q, q, stats

    @contextlib.contextmanager
    def capture(self, step: int):
        """Watch one micro-batch: its forward, backward and backward_dw() inside the block.
        The weight-gradient check reads weight.main_grad at the end of the block, so it holds
        for a micro-batch whose main_grad started at zero (the step's first, under no_sync)."""
        handles = []
        self._pending = {}
        for name, m in self.modules:
            handles.append(m.register_forward_pre_hook(self._pre_hook(name, step)))
            handles.append(m.register_forward_hook(self._post_hook(name)))
            handles.append(m.register_full_backward_hook(self._input_grad_hook(name)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._check_main_grads()
            self._write()

    def _pre_hook(self, name: str, step: int):
        @torch.no_grad()
        def hook(m, args):
            x_in = args[0].detach()
            x = _gemm_input(m, x_in).reshape(-1, m.in_features)
            w = m.weight.detach()
            qx, qx_t, sx = self._operand(m, 0, x, self.fwd_fmt)
            qw, _, sw = self._operand(m, 1, w, self.fwd_fmt)
            rec = {"step": step, "module": name, "x": sx, "w": sw}
            p = {"rec": rec, "x_in": x_in, "x": x, "w": w, "qx": qx, "qx_t": qx_t, "qw": qw}
            y = None
            if self.fprop_hp:
                y = x.float() @ w.float().t()
            elif qx is not None and qw is not None:
                y = qx @ qw.t()
                rec["fprop"] = _rel(y, x.float() @ w.float().t())
            if y is not None:
                p["y"] = y + m.bias.detach().float() if m.bias is not None else y
            self._pending[name] = p

        return hook

    def _post_hook(self, name: str):
        @torch.no_grad()
        def hook(m, args, out):
            if getattr(
                m, "qkv_heads", None
            ):  # q, k, v: the output matrix is the three side by side
                y = _join(out[:3])
            else:
                y = out[0] if isinstance(out, tuple) else out
            p = self._pending[name]
            emulated = p.pop("y", None)
            if emulated is not None:  # fp8dp's forward against the emulated one
                p["rec"]["fprop_kernel"] = _rel(
                    y.detach().float().reshape(emulated.shape), emulated
                )
            if getattr(m, "qkv_heads", None):
                # All three gradients at once (None for an output that got none), before the
                # projection's backward runs: a pre-hook on the node q, k and v share.
                # (The hook holds the outputs' shape, not the outputs: the node holds the hook.)
                like = (out[0].shape, out[0].dtype, out[0].device)
                if out[0].requires_grad:
                    out[0].grad_fn.register_prehook(
                        lambda gs: self._output_grad(name, m, _join(gs[:3], like=like))
                    )
            elif y.requires_grad:
                y.register_hook(lambda g: self._output_grad(name, m, g))

        return hook

    @torch.no_grad()
    def _output_grad(self, name, m, g) -> None:
        p = self._pending[name]
        rec, x, w, qx_t, qw = p["rec"], p["x"], p["w"], p["qx_t"], p["qw"]
        dy = g.detach().reshape(-1, m.out_features)
        qdy, qdy_t, sdy = self._operand(m, 2, dy, self.bwd_fmt)
        rec["dy"] = sdy
        if self.dgrad_hp:
            p["dx"] = dy.float() @ w.float()
        elif qdy is not None and qw is not None:
            p["dx"] = qdy @ qw
            rec["dgrad"] = _rel(p["dx"], dy.float() @ w.float())
        if self.wgrad_hp:
            p["dw"] = dy.float().t() @ x.float()
        elif qdy_t is not None and qx_t is not None:
            p["dw"] = qdy_t.t() @ qx_t
            rec["wgrad"] = _rel(p["dw"], dy.float().t() @ x.float())
        parts = PARTS.get(name.rsplit(".", 1)[-1])
        if parts and qdy is not None:
            rec["dy_parts"] = _parts(dy, qdy, parts, p.get("dw"), x)
        for k in ("x", "w", "qx", "qx_t", "qw"):
            del p[k]

    def _input_grad_hook(self, name: str):
        def hook(m, grad_input, grad_output):
            p = self._pending.get(name, {})
            if "dx" not in p or grad_input[0] is None:
                return None
            with torch.enable_grad():  # the norm's backward, for a LayerNormLinear
                x_in = p["x_in"].float().requires_grad_()
                normed = _gemm_input(m, x_in).reshape(-1, m.in_features)
                (ref,) = torch.autograd.grad(normed, x_in, p["dx"])
            p["rec"]["dgrad_kernel"] = _rel(grad_input[0].detach().float(), ref)
            del p["dx"], p["x_in"]
            return None

        return hook

    @torch.no_grad()
    def _check_main_grads(self) -> None:
        for name, m in self.modules:
            p = self._pending.get(name, {})
            main_grad = getattr(m.weight, "main_grad", None)
            if "dw" in p and main_grad is not None:
                p["rec"]["wgrad_kernel"] = _rel(main_grad.float().reshape(p["dw"].shape), p["dw"])

    def _write(self) -> None:
        for name, _ in self.modules:
            if name in self._pending:
                self._out.write(self._pending[name]["rec"])
        self._pending = {}

    def close(self) -> None:
        self._out.close()


def summarize(records: list, top: int = 10) -> str:
    """Markdown: the `top` largest FP8 errors (operands and GEMMs, any probed step), then the
    extremes that explain them (the fullest and emptiest range, the largest saturated and flushed
    shares) and the largest difference between fp8dp's results and the emulation."""
    errors, operands, kernels = [], [], []
    for r in records:
        where = (r["step"], r["module"])
        for key in ROLES:
            if r.get(key):
                errors.append((r[key]["rel_err"], *where, key))
                operands.append((r[key], *where, key))
        errors += [(r[k], *where, k) for k in GEMMS if k in r]
        kernels += [(r[k], *where, k) for k in KERNELS if k in r]
    errors.sort(key=lambda t: -t[0])
    out = ["| step | module | tensor / GEMM | relative error |", "|---:|---|---|---:|"]
    out += [f"| {step} | {mod} | {key} | {err:.4f} |" for err, step, mod, key in errors[:top]]

    def extreme(stat, pick, fmt):
        if not operands:
            return "none"
        s, step, mod, key = pick(operands, key=lambda t: t[0][stat])
        return f"{format(s[stat], fmt)} ({mod} {key}, step {step}, {s['format']})"

    out.append("")
    out.append(f"- fullest range (fill): {extreme('fill', max, '.3g')}")
    out.append(f"- emptiest range (fill): {extreme('fill', min, '.3g')}")
    out.append(f"- largest saturated share: {extreme('saturated', max, '.3g')}")
    out.append(f"- largest flushed share: {extreme('flushed', max, '.3g')}")
    if kernels:
        err, step, mod, key = max(kernels)
        out.append(f"- fp8dp against the emulation, largest: {err:.3g} ({mod} {key}, step {step})")
    out += _parts_table(records)
    return "\n".join(out)


def _parts_table(records: list) -> list:
    """Per probed step, each part's numbers averaged over the modules that have it (PARTS)."""
    by_step: dict = {}
    for r in records:
        for part, st in (r.get("dy_parts") or {}).items():
            by_step.setdefault(r["step"], {}).setdefault(part, []).append(st)
    if not by_step:
        return []
    keys = ("rms_over_amax", "flushed", "rel_err", "wgrad")
    out = [
        "",
        "Parts of one output, one scale (mean over the modules):",
        "",
        "| step | part | dy rms / amax | dy flushed | dy rel. error | wgrad rel. error |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for step in sorted(by_step):
        for part, sts in by_step[step].items():
            mean = [sum(st.get(k, math.nan) for st in sts) / len(sts) for k in keys]
            out.append(f"| {step} | {part} | " + " | ".join(f"{m:.3g}" for m in mean) + " |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8dp.train.fp8_stats", description=__doc__)
    p.add_argument("path", help="a run's fp8_stats.jsonl")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    try:
        records = read_metrics(args.path)
    except (OSError, ValueError) as e:
        print(
            f"fp8_stats: error: path: expected a readable fp8_stats.jsonl, got {e}", file=sys.stderr
        )
        return 2
    print(summarize(records, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
