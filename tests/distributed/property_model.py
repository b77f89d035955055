"""The model a configuration describes (GenModel), its float64 reference gradients, their
tolerance, and the comparison that records the first mismatch (property_worker.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from property_gen import EPS, U32, T, is_mlp, runs
from torch import nn

import fp8dp


# ---- the model ---------------------------------------------------------------------------------
class GenModel(nn.Module):
    """The graph of a configuration. fp8dp modules in `fp8`, torch.nn.Linear in `tl`, plain
    [D, D] parameters in `plain` (ParameterList). forward(ids, x): h = x, then each op h = tanh(op
    (h)) (+ h when residual)."""

    def __init__(self, c: dict, fuse_and_delay: bool = True):
        super().__init__()
        D = c["D"]
        self.c = c
        mods = []
        for m in c["fp8_mods"]:
            kw = dict(
                bias=m["bias"],
                fuse_wgrad_accumulation=m["fuse"] and fuse_and_delay,
                delay_wgrad_compute=m["delay"] and fuse_and_delay,
            )
            if m["kind"] == "Linear":
                mods.append(
                    fp8dp.Linear(
                        D,
                        D,
                        activation=m.get("out_act") or None,
                        input_activation=m.get("in_act") or None,
                        **kw,
                    )
                )
            elif is_mlp(m):
                mods.append(
                    fp8dp.LayerNormMLP(
                        D,
                        2 * D,
                        activation=m["act"],
                        normalization=m["norm"],
                        eps=EPS,
                        zero_centered_gamma=m.get("zcg", False),
                        **kw,
                    )
                )
            else:
                mods.append(
                    fp8dp.LayerNormLinear(
                        D,
                        D,
                        normalization=m["norm"],
                        eps=EPS,
                        return_layernorm_output=m.get("ret_ln", False),
                        return_layernorm_input=m.get("res_in", False),
                        zero_centered_gamma=m.get("zcg", False),
                        activation=m.get("out_act") or None,
                        **kw,
                    )
                )
        self.fp8 = nn.ModuleList(mods)
        self.tl = nn.ModuleList([nn.Linear(D, D, bias=m["bias"]) for m in c["tl_mods"]])
        self.plain = nn.ParameterList(
            [nn.Parameter(torch.randn(D, D) / math.sqrt(D)) for _ in range(c["n_plain"])]
        )
        for tgt, src in c["ties"]:
            self._set_weight(tgt, self._weight(src))
        for kind, i, name in c["frozen"]:
            p = self.plain[i] if kind == "plain" else getattr(self._module(kind, i), name)
            p.requires_grad_(False)
        for m, spec in zip(self.fp8, c["fp8_mods"]):
            gemms = (m.fc1, m.fc2) if is_mlp(spec) else (m,)
            if spec.get("zero_out_wgrad"):
                for g in gemms:
                    g.weight.zero_out_wgrad = True
            if spec.get("zcg"):  # a non-trivial scale (1 + gamma, gamma initialised to 0)
                with torch.no_grad():
                    gemms[0].layer_norm_weight.normal_(0, 0.3)

    def _module(self, kind, i):
        return self.fp8[i] if kind == "fp8" else self.tl[i]

    def _weight(self, slot):
        kind, i = slot
        return self.plain[i] if kind == "plain" else self._module(kind, i).weight

    def _set_weight(self, slot, p):
        kind, i = slot
        if kind == "plain":
            self.plain[i] = p
        else:
            self._module(kind, i).weight = p

    microbatch = 0  # set by the caller before each forward: which ops run (see runs())

    def forward(self, ids, x, is_first_microbatch=None):
        h = x
        for j, ((kind, i), res) in enumerate(zip(self.c["ops"], self.c["residual"])):
            if not runs(self.c, j, self.microbatch):
                continue
            skip = h  # what a residual adds back
            if kind == "fp8" and isinstance(self.fp8[i], fp8dp.LayerNormMLP):
                # res_in: the MLP's own input as its residual (added in fc2's epilogue, its
                # gradient in the norm's backward): mlp(h) + h.
                res_in = self.c["fp8_mods"][i].get("res_in", False)
                z = self.fp8[i](
                    h, is_first_microbatch=is_first_microbatch, residual=h if res_in else None
                )
            elif kind == "fp8":
                z = self.fp8[i](h, is_first_microbatch=is_first_microbatch)
                if isinstance(z, tuple):
                    z = list(z)
                    if self.fp8[i].return_layernorm_input:  # h handed on: the residual below
                        skip = z.pop()
                    # return_layernorm_output: plain code uses the norm too
                    z = z[0] + 0.5 * z[1] if len(z) > 1 else z[0]
            elif kind == "tl":
                z = self.tl[i](h)
            elif kind == "plain_linear":
                z = F.linear(h, self.plain[i])
            elif kind == "plain_matmul":
                z = torch.matmul(h, self.plain[i])
            else:  # embed: a plain parameter used by indexing (an embedding lookup)
                z = h + self.plain[i][ids]
            z = torch.tanh(z)
            h = skip + z if res else z
        return h


def ref_forward64(model: GenModel, R: dict, ids, x, k):
    """The graph of `model` in plain float64 torch ops for micro-batch k; R maps id(parameter) ->
    float64 leaf."""
    c = model.c
    h = x
    for j, ((kind, i), res) in enumerate(zip(c["ops"], c["residual"])):
        if not runs(c, j, k):
            continue
        if kind == "fp8" and isinstance(model.fp8[i], fp8dp.LayerNormMLP):
            z = _mlp_forward64(model.fp8[i], R, h)
            if c["fp8_mods"][i].get("res_in", False):
                z = z + h
        elif kind == "fp8":
            m = model.fp8[i]
            inp = h
            if isinstance(m, fp8dp.LayerNormLinear):
                inp = _norm64(m, R, h)
            elif m.input_activation == "gelu":  # in_act
                inp = F.gelu(h)
            z = F.linear(inp, R[id(m.weight)], R[id(m.bias)] if m.bias is not None else None)
            if m.activation == "gelu":  # out_act
                z = F.gelu(z)
            if isinstance(m, fp8dp.LayerNormLinear) and m.return_layernorm_output:
                z = z + 0.5 * inp
        elif kind == "tl":
            m = model.tl[i]
            z = F.linear(h, R[id(m.weight)], R[id(m.bias)] if m.bias is not None else None)
        elif kind == "plain_linear":
            z = F.linear(h, R[id(model.plain[i])])
        elif kind == "plain_matmul":
            z = torch.matmul(h, R[id(model.plain[i])])
        else:
            z = h + R[id(model.plain[i])][ids]
        z = torch.tanh(z)
        h = h + z if res else z
    return h


def _norm64(m, R, h):
    """A LayerNormLinear's (or an MLP's fc1's) norm in float64."""
    g = R[id(m.layer_norm_weight)]
    if m.zero_centered_gamma:
        g = 1 + g
    if m.normalization == "LayerNorm":
        return F.layer_norm(h, (h.shape[-1],), g, R[id(m.layer_norm_bias)], m.eps)
    return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + m.eps) * g


def _mlp_forward64(mlp, R, h):
    """LayerNormMLP in float64: norm -> fc1 -> GELU (erf form) or SwiGLU ([gate | up]) -> fc2."""
    fc1, fc2 = mlp.fc1, mlp.fc2
    b = lambda m: R[id(m.bias)] if m.bias is not None else None  # noqa: E731
    a = F.linear(_norm64(fc1, R, h), R[id(fc1.weight)], b(fc1))
    if mlp.activation == "gelu":
        a = F.gelu(a)
    else:
        gate, up = a.chunk(2, -1)
        a = F.silu(gate) * up
    return F.linear(a, R[id(fc2.weight)], b(fc2))


def mse(out, y):
    return ((out - y) ** 2).mean()


def make_data(c, step):
    g = torch.Generator().manual_seed(c["case_seed"] * 1009 + step)
    n = c["ws"] * c["n_mb"]
    D = c["D"]
    lead = (2, T // 2) if c.get("input_3d") else (T,)
    ids = torch.randint(0, D, (n, *lead), generator=g)
    x = torch.randn(n, *lead, D, generator=g)
    y = torch.randn(n, *lead, D, generator=g)
    return ids, x, y


def distinct_params(model):
    """(name, parameter) once per parameter object, in named_parameters order (frozen included)."""
    return list(model.named_parameters())


def recipe_of(c):
    """The case's FP8 recipe (property_gen.py draws it; older regressions lack it: current)."""
    if c.get("recipe", "current") == "block":
        return fp8dp.Float8BlockScaling()
    return fp8dp.Float8CurrentScaling()


def reference(c, model, step_data):
    """Float64 reference gradients {name: tensor} (None for frozen) and magnitudes {name: A} where
    A = sum over ranks and micro-batches of |per-micro-batch gradient|, elementwise (for the
    tolerance)."""
    ids, x, y = step_data
    ws, n_mb = c["ws"], c["n_mb"]
    named = distinct_params(model)
    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in named if p.requires_grad}
    mag = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in named if p.requires_grad}
    if not c["fp8"]:
        R = {id(p): p.detach().double().clone().requires_grad_(p.requires_grad) for _, p in named}
        for r in range(ws * n_mb):
            loss = (
                mse(ref_forward64(model, R, ids[r], x[r].double(), r % n_mb), y[r].double()) / n_mb
            )
            if not loss.requires_grad:
                continue
            grads = torch.autograd.grad(
                loss, [R[id(p)] for n, p in named if p.requires_grad], allow_unused=True
            )
            for (n, _), g in zip([(n, p) for n, p in named if p.requires_grad], grads):
                if g is not None:
                    total[n] += g
                    mag[n] += g.abs()
    else:
        twin = GenModel(c, fuse_and_delay=False)
        tnamed = dict(twin.named_parameters())
        assert list(tnamed) == [n for n, _ in named], (list(tnamed), [n for n, _ in named])
        with torch.no_grad():
            for n, p in named:
                tnamed[n].copy_(p.detach())
        for r in range(ws * n_mb):
            twin.zero_grad(set_to_none=True)
            twin.microbatch = r % n_mb
            with fp8dp.fp8_autocast(enabled=True, fp8_recipe=recipe_of(c)):
                out = twin(ids[r], x[r], is_first_microbatch=None)
            loss = mse(out, y[r]) / n_mb
            if loss.requires_grad:
                loss.backward()
            for n in total:
                g = tnamed[n].grad
                if g is not None:
                    total[n] += g.double()
                    mag[n] += g.double().abs()
    for n in total:
        total[n] /= ws
        mag[n] /= ws
    return total, mag


def mlp_acts(c) -> list:
    """The activation of every LayerNormMLP op of configuration c, one entry per op."""
    mods = c["fp8_mods"]
    return [mods[i]["act"] for kind, i in c["ops"] if kind == "fp8" and is_mlp(mods[i])]


def out_acts(c) -> int:
    """How many ops run a Linear / LayerNormLinear with an output activation (out_act) or a Linear
    with an input activation (in_act): each one more elementwise stage."""
    mods = c["fp8_mods"]
    return sum(
        1
        for kind, i in c["ops"]
        if kind == "fp8" and (mods[i].get("out_act") or mods[i].get("in_act"))
    )


def grad_tolerance(c, mag: torch.Tensor) -> float:
    """Absolute tolerance for one parameter's reduced FP32 gradient against the float64 reference.

    Derivation (FP32 unit roundoff u = 2^-24; |fl(sum of n terms) - sum| <= n u sum|terms|): the
    reduced gradient is a sum of n_terms = ws * n_mb * uses per-use contributions (uses <= number
    of ops), accumulated into main_grad, pre-scaled and reduced in an order the reference does not
    follow: <= (n_terms + 2) u A, with A the sum of the contributions' magnitudes. Each
    contribution is itself an FP32 computation: a chain of at most depth = ops GEMMs / norms of
    inner size <= max(D, T) (the weight gradient sums T tokens), each erring by <= K u times the
    sum of its products' magnitudes; the backward chain passes each relative error on through the
    tanh derivatives (<= 1) and weights of norm ~1, so we bound the sum of products by max(A)
    (tensor-wide, since a cancelling element has small A but not small products) and the
    per-contribution error by depth * K * u * max(A). A factor 8 covers the unproven parts (the
    norm backward, the products bound); each result records its worst error / tolerance
    (worst_err_over_tol) so that the headroom is measured, not assumed. FP8 on:
    both sides cast the same values to the same FP8 bytes, so only the FP32 accumulation orders
    differ and the same bound holds. Against what the test looks for this is tight: a lost or
    doubled use moves the gradient by ~max(A) / n_terms, more than 100x the tolerance."""
    n_terms = c["ws"] * c["n_mb"] * len(c["ops"])
    # A LayerNormMLP op is two GEMMs deep, with inner sizes up to its fc1 width (2 D, or 4 D for
    # SwiGLU's [gate | up]) and an activation between them whose derivative is at most ~1.13.
    # An output or input activation (out_act, in_act) adds one more elementwise stage of
    # derivative <= ~1.13.
    acts = c["mlp_acts"] if "mlp_acts" in c else mlp_acts(c)
    n_out_acts = c["out_acts"] if "out_acts" in c else out_acts(c)
    depth = len(c["ops"]) + 1 + len(acts) + n_out_acts
    K = max([c["D"], T] + [(4 if a == "swiglu" else 2) * c["D"] for a in acts])
    return 8 * ((n_terms + 2) + depth * K) * U32 * float(mag.max()) + 1e-30


def first_microbatch(c, step, k):
    mode = c.get("is_first_microbatch", "k==0")
    if mode == "none":
        return None
    if mode == "first_of_run":
        return step == 0 and k == 0
    return k == 0


WORST = {}  # check kind -> largest error / tolerance of the case's passing elements (headroom)


def first_mismatch(step, what, name, got, exp, tol, extra=None):
    err = (got.double() - exp).abs()
    bad = err > tol
    if tol > 0 and err.numel():
        key = what.replace(" shard", "")
        WORST[key] = max(WORST.get(key, 0.0), float((err * ~bad).max()) / tol)
    if not bad.any():
        return None
    idx = int(torch.nonzero(bad.flatten())[0])
    info = dict(
        step=step,
        what=what,
        param=name,
        index=idx,
        observed=float(got.double().flatten()[idx]),
        expected=float(exp.flatten()[idx]),
        max_abs_err=float(err.max()),
        tol=tol,
        n_bad=int(bad.sum()),
        numel=int(bad.numel()),
        ratio_to_expected_norm=float(got.double().norm() / max(exp.norm(), 1e-30)),
    )
    if extra:
        info.update(extra)
    return info
