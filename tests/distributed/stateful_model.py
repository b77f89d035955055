"""The float64 model of the stateful lifecycle test (stateful_rules.py): the network, its data and
what one micro-batch must contribute to each parameter's gradient, with the tolerance of the
comparison derived from the numerics.

The network is a chain of linear layers (fp8dp.Linear with any mix of bias / fused / delayed
weight gradient, and torch.nn.Linear) with no activation, and the loss is linear in the output:
loss = sum(out * G) * 2^-4. Every gradient is then a multilinear polynomial in the data, and the
same graph evaluated on the absolute values of every operand gives, per element, the sum of the
absolute values of its monomials (`mag`): the quantity that bounds every rounding error below.

Data are exact in FP32 by construction: inputs are integers in [-2, 2], G in {-1, 0, 1}, initial
weights multiples of 2^-4 in [-1/4, 1/4], biases multiples of 2^-3: until the first optimizer step
every product and sum is exact in FP32 (at most 14 significant bits), so the tolerances below are
upper bounds that the FP8-off run meets with error 0 in most checks.

Tolerances (elementwise; u = 2^-24, the FP32 unit roundoff):
- FP32 (FP8 off, or the FP8 run against its twin): every monomial passes at most `depth` GEMM
  reductions of length <= max(D, T) and the accumulation over n_terms micro-batch contributions
  (ranks x micro-batches, the fused GEMM's beta = 1 sum, the 1/dp pre-scale), so
  |err| <= (depth * max(D, T) + n_terms + 4) u mag (Higham's gamma_n bound, first order); a
  factor 2 covers the second-order terms. A lost or doubled micro-batch moves an element by its
  contribution, which is >= 2^-4 (the smallest non-zero product of the data), while the bound is
  ~2^-14 mag: detectable unless mag is 1000x the contribution, which the data's size excludes.
- FP8 on, the twin against float64 exact math: each quantized factor v (E4M3 input and weight,
  E5M2 grad_output; current scaling maps the tensor's amax to the format's max) is cast with
  |err| <= eps |v| + eta amax (round to nearest: eps = 2^-4 for E4M3's 3 mantissa bits, 2^-3 for
  E5M2's 2; eta = half the smallest subnormal over the format's max: 2^-10 / 448 and 2^-17 /
  57344). Propagated through the chain by evaluating the absolute graph with each quantized
  factor inflated to |v| (1 + eps) + eta amax(|v|) (`fp8_bound`), minus the plain one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fp8dp

D = 16  # features (FP8 GEMMs take multiples of 16)
T = 16  # tokens per micro-batch per rank
LOSS_SCALE = 2.0**-4
U32 = 2.0**-24
E4M3 = (2.0**-4, 2.0**-10 / 448.0)  # (eps, eta) as in the module docstring
E5M2 = (2.0**-3, 2.0**-17 / 57344.0)
RECIPE = fp8dp.Float8CurrentScaling()  # no scaling state across casts: the twin casts alike


def layer_names(layers) -> list:
    """Parameter names of the chain, in named_parameters order."""
    out = []
    for i, spec in enumerate(layers):
        out.append(f"layers.{i}.weight")
        if spec["bias"]:
            out.append(f"layers.{i}.bias")
    return out


class Net(nn.Module):
    """The chain; `layers` is a list of dicts {kind: "fp8" | "torch", bias, fuse, delay}."""

    def __init__(self, layers, twin: bool = False):
        super().__init__()
        mods = []
        for spec in layers:
            if spec["kind"] == "fp8":
                fuse = spec["fuse"] and not twin
                delay = spec["delay"] and not twin
                mods.append(
                    fp8dp.Linear(
                        D,
                        D,
                        bias=spec["bias"],
                        fuse_wgrad_accumulation=fuse,
                        delay_wgrad_compute=delay,
                    )
                )
            else:
                mods.append(nn.Linear(D, D, bias=spec["bias"]))
        self.layers = nn.ModuleList(mods)

    def forward(self, x, is_first_microbatch=None):
        for m in self.layers:
            if isinstance(m, fp8dp.Linear):
                x = m(x, is_first_microbatch=is_first_microbatch)
            else:
                x = m(x)
        return x


def initial_params(layers, seed: int) -> dict:
    """Exact dyadic start values {name: float64 tensor} (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, spec in enumerate(layers):
        out[f"layers.{i}.weight"] = torch.randint(-4, 5, (D, D), generator=g).double() * 2.0**-4
        if spec["bias"]:
            out[f"layers.{i}.bias"] = torch.randint(-2, 3, (D,), generator=g).double() * 2.0**-3
    return out


def other_params(layers, seed: int, rank: int) -> dict:
    """Weights a checkpoint load or a rank-local overwrite brings in: exact, and different from
    the start values (and per rank when asked)."""
    p = initial_params(layers, seed * 7 + 3 + 1000 * rank)
    return {n: v * 2 + 2.0**-5 for n, v in p.items()}


def microbatch_data(seed: int, k: int, rank: int):
    """(x [T, D], G [T, D]) of global micro-batch k on `rank`, exact small integers (float32)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + k) * 64 + rank)
    x = torch.randint(-2, 3, (T, D), generator=g).float()
    G = torch.randint(-1, 2, (T, D), generator=g).float()
    return x, G


def loss_of(out, G):
    return (out * G).sum() * LOSS_SCALE


class _InflateGrad(torch.autograd.Function):
    """Identity forward; backward inflates the (non-negative) incoming gradient as an FP8 cast of
    grad_output may err: g (1 + eps) + eta max(g)."""

    @staticmethod
    def forward(ctx, t, eps, eta):
        ctx.eps, ctx.eta = eps, eta
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * (1 + ctx.eps) + ctx.eta * g.max(), None, None


def _chain64(layers, P, x, G, mode: str):
    """The chain in float64 on leaves P {name: tensor}; returns (loss, leaves). mode "plain": the
    exact math; "abs": every operand replaced by its absolute value (mag); "fp8": "abs" with each
    FP8 cast's error inflated (module docstring)."""
    leaves = {}
    for n, v in P.items():
        leaves[n] = (v.abs() if mode != "plain" else v).clone().requires_grad_(True)
    h = x.double().abs() if mode != "plain" else x.double()
    g = G.double().abs() if mode != "plain" else G.double()

    def inflate(t, fmt):
        eps, eta = fmt
        return t * (1 + eps) + eta * t.detach().max()

    for i, spec in enumerate(layers):
        w = leaves[f"layers.{i}.weight"]
        b = leaves.get(f"layers.{i}.bias")
        fp8 = mode == "fp8" and spec["kind"] == "fp8"
        if fp8:
            h = _InflateGrad.apply(F.linear(inflate(h, E4M3), inflate(w, E4M3)), *E5M2)
            h = h + b if b is not None else h
        else:
            h = F.linear(h, w, b)
    return (h * g).sum() * LOSS_SCALE, leaves


def forward64(layers, P, x):
    """(the chain's output in float64, the same on absolute values: its FP32 bound's magnitude)."""
    h, a = x.double(), x.double().abs()
    for i, spec in enumerate(layers):
        b = P.get(f"layers.{i}.bias")
        h = F.linear(h, P[f"layers.{i}.weight"], b)
        a = F.linear(a, P[f"layers.{i}.weight"].abs(), b.abs() if b is not None else None)
    return h, a


def grads64(layers, P, x, G, mode="plain") -> dict:
    loss, leaves = _chain64(layers, P, x, G, mode)
    names = list(leaves)
    gs = torch.autograd.grad(loss, [leaves[n] for n in names])
    return dict(zip(names, gs))


def twin_grads(layers, P, x, G) -> dict:
    """Gradients of one micro-batch with FP8 on, from a standalone copy of the chain (unfused,
    immediate weight gradient, no DDP, current scaling: the same FP8 bytes as the wrapped run),
    as float64. What the lifecycle must add up; its FP8 numerics are checked against float64
    separately (fp8_bound)."""
    net = Net(layers, twin=True)
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(P[n].float())
    with fp8dp.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
        out = net(x, is_first_microbatch=None)
    loss_of(out, G).backward()
    return {n: p.grad.double() for n, p in net.named_parameters()}


class Contribution:
    """What one micro-batch on one rank adds to each parameter: grad {name: float64} and mag
    {name: float64} (the FP32 bound's magnitude)."""

    def __init__(self, layers, P, x, G, fp8: bool):
        self.mag = grads64(layers, P, x, G, "abs")
        exact = grads64(layers, P, x, G, "plain")
        self.fp8_violation = None
        if fp8:
            self.grad = twin_grads(layers, P, x, G)
            infl = grads64(layers, P, x, G, "fp8")
            for n in exact:
                bound = (infl[n] - self.mag[n]) + fp32_tol(infl[n], len(layers), 1)
                err = (self.grad[n] - exact[n]).abs()
                if bool((err > bound).any()):
                    i = int(torch.argmax(err - bound))
                    self.fp8_violation = (
                        f"FP8 gradient of {n} off float64 by more than the E4M3/E5M2 bound: "
                        f"element {i}: {float(self.grad[n].flatten()[i])} vs "
                        f"{float(exact[n].flatten()[i])}, bound {float(bound.flatten()[i])}"
                    )
                    break
            self.mag = infl  # the twin's operands are the quantized ones: their magnitude
        else:
            self.grad = exact


def fp32_tol(mag: torch.Tensor, depth: int, n_terms: int) -> torch.Tensor:
    """Elementwise FP32 bound (module docstring)."""
    return 2 * (depth * max(D, T) + n_terms + 4) * U32 * mag


def first_mismatch(what: str, got: torch.Tensor, exp: torch.Tensor, tol) -> str | None:
    """None when |got - exp| <= tol everywhere, else a one-line description of the worst. A NaN
    or Inf in got where the model is finite is a mismatch (`err > tol` alone is False for NaN);
    where the model holds NaN (a gradient the nan family poisoned) got must be NaN or Inf."""
    got = got.detach().double().reshape(exp.shape)
    err = (got - exp).abs()
    tol = tol if isinstance(tol, torch.Tensor) else torch.full_like(exp, float(tol))
    bad = torch.where(torch.isnan(exp), torch.isfinite(got), ~(err <= tol))
    if not bool(bad.any()):
        return None
    score = torch.where(bad, (err - tol).nan_to_num(nan=float("inf")), float("-inf"))
    i = int(torch.argmax(score.flatten()))
    return (
        f"{what}: element {i} is {float(got.flatten()[i])!r}, expected "
        f"{float(exp.flatten()[i])!r} (error {float(err.flatten()[i]):.3g}, tolerance "
        f"{float(tol.flatten()[i]):.3g}; {int(bad.sum())} of {bad.numel()} elements off)"
    )
