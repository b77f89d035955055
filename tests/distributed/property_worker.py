"""torchrun worker of the randomized gradient-accounting property test (issue 12).

Each case is a random configuration drawn from one integer seed: a model graph of fp8dp.Linear /
fp8dp.LayerNormLinear, torch.nn.Linear and plain parameters (used through F.linear, matmul and
indexing), with tied weights across both kinds, parameters used twice in one forward, unused and
frozen parameters, bias on/off, fused / delayed weight gradients per module; 1-4 micro-batches (all
but the last under no_sync(), is_first_microbatch=(k == 0)), a backward_dw() schedule that FIFO
allows (any interleaving across modules, and deferral of a micro-batch's calls to a later window);
and a DDP configuration (overlap, distributed optimizer, AVG / pre-scale, grad_reduce_in_fp32,
ledger, NaN check, a small bucket_size). Every case runs a few steps: step 0 learns the readiness
counts, later steps launch buckets from the hooks.

Checks, on every rank and every step:
- each trainable parameter's reduced gradient (p.main_grad; with the distributed optimizer the
  rank's owned shards) equals the reference (below) within the tolerance of `grad_tolerance`;
- frozen parameters have no main_grad, and DDP-managed parameters have p.grad None after the sync;
- with the distributed optimizer (torch.optim.SGD, lr=LR), every parameter after step() equals
  p - LR * g_ref (the all-gathered full tensor on every rank); frozen parameters are unchanged.

The reference, computed on every rank from all ranks' micro-batches (the data is a function of the
case seed and the step):
- FP8 off: the same graph (same tying, same frozen set) written in plain torch float64 ops (linear,
  layer_norm / rms_norm, indexing), each rank's micro-batch losses mse / n_mb summed over ranks and
  micro-batches, gradients divided by the world size (mean over the global batch).
- FP8 on (Float8CurrentScaling, so no state carries across casts or steps): the same graph built
  from fp8dp modules, unfused, immediate wgrad, no DDP, is_first_microbatch=None (always a fresh
  weight cast), run single-process per rank per micro-batch in float32; the per-micro-batch
  gradients are summed (and divided by the world size) in float64. The FP8-quantized operands are
  therefore the same as in the DDP run. What this checks: that every use's gradient reaches
  main_grad exactly once whatever route it takes (autograd hook, fused GEMM, delayed GEMM, plain
  torch use of a tied weight), the micro-batch and rank sums, the averaging and the sharding, and
  that a cached FP8 weight is not stale. What it does not check: the FP8 numerics themselves
  (quantization, GEMM, the eager FP8 bias gradient), which are the same code on both sides and are
  tested against float64 in tests/python.

Not covered yet: parameters in bf16 / fp16 (every parameter is FP32, so grad_reduce_in_fp32 is
drawn but changes nothing), DelayedScaling (its scales carry state across steps and ranks; only
Float8CurrentScaling is drawn), double backward, an external consumer hooked before DDP, a
different backward_dw() schedule in each step (the windows are fixed per configuration, like a
pipeline schedule; the order inside a window varies), NCCL / CUDA. Pipeline stages (C10) are
the pipeline axis, property_pipeline.py (--pipeline-cases, PP 2 at even world sizes).

A configuration that the library may reject (see `may_reject`) must either pass or raise an
exception of the class listed there with a message naming the parameter or module; any other
exception, or a silent wrong gradient, fails the case.

Output: one JSON line per case and rank in --out (results_ws{W}_rank{R}.jsonl) with status
(pass / fail / error / rejected), the case seed, the configuration and the first mismatch.
Reproduce one case:  torchrun --standalone --nproc_per_node=W property_worker.py --case-seed S
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
import traceback
from datetime import timedelta

import property_pipeline
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fp8dp

T = 16  # tokens per micro-batch per rank (FP8 GEMMs need multiples of 16)
LR = 0.1
EPS = 1e-5
U32 = 2.0**-24  # unit roundoff of float32
COMM_TIMEOUT_S = 8.0  # a desynchronised case ends in an error, not a hang
BACKEND = "gloo"  # of the world group, and so of the pipeline cases' groups (make_groups)


# ---- the configuration generator -----------------------------------------------------------
def gen_config(case_seed: int, ws: int) -> dict:
    """A random configuration from one seed (JSON-serialisable). ws only shapes nothing but the
    record: the same seed gives the same graph at every world size."""
    rng = random.Random(case_seed)
    D = rng.choice([16, 16, 32])
    fp8 = rng.random() < 0.3
    pattern = rng.choice(["gpt_tie", "fp8_fp8_tie", "used_twice", "tl_tie", "random", "plain"])
    n_fp8 = rng.randint(1, 3)
    n_tl = rng.randint(0, 2)
    n_plain = rng.randint(0, 2)
    if pattern in ("gpt_tie",):
        n_plain = max(n_plain, 1)
    if pattern == "fp8_fp8_tie":
        n_fp8 = max(n_fp8, 2)
    if pattern == "tl_tie":
        n_tl = max(n_tl, 1)
    if pattern == "plain":  # no fp8dp module in the forward at all (an fp8dp module may be unused)
        n_plain = max(n_plain, 1)
    fp8_mods = []
    for _ in range(n_fp8):
        kind = rng.choice(["Linear", "LayerNormLinear"])
        fp8_mods.append(
            dict(
                kind=kind,
                norm=rng.choice(["LayerNorm", "RMSNorm"]) if kind == "LayerNormLinear" else None,
                bias=rng.random() < 0.6,
                fuse=rng.random() < 0.5,
                delay=rng.random() < 0.5,
                # LayerNormLinear only: the norm output also returned and used by plain code
                # (one more gradient path into the norm's parameters), 1 + gamma scaling
                ret_ln=kind == "LayerNormLinear" and rng.random() < 0.25,
                zcg=kind == "LayerNormLinear" and rng.random() < 0.25,
                # weight.zero_out_wgrad (C2 b: the fused route's stand-in is zero-filled)
                zero_out_wgrad=rng.random() < 0.15,
            )
        )
    tl_mods = [dict(bias=rng.random() < 0.6) for _ in range(n_tl)]

    # ops: what the forward runs, in order; each followed by tanh; some residual.
    def pick_op():
        choices = [("fp8", i) for i in range(n_fp8)] * 2 + [("tl", i) for i in range(n_tl)]
        for j in range(n_plain):
            choices += [("plain_linear", j), ("plain_matmul", j), ("embed", j)]
        if pattern == "plain":
            choices = [c for c in choices if c[0] != "fp8"] or [("plain_linear", 0)]
        return list(rng.choice(choices))

    ops = [pick_op() for _ in range(rng.randint(1, 4))]
    ties = []  # [target slot, source slot]: target's weight := source's parameter
    if pattern == "gpt_tie":
        # the embedding (plain parameter, indexed) and an fp8dp output head share one matrix
        j, i = rng.randrange(n_plain), rng.randrange(n_fp8)
        ops = [["embed", j]] + ops + [["fp8", i]]
        if rng.random() < 0.5:
            ties.append([["fp8", i], ["plain", j]])
        else:
            ties.append([["plain", j], ["fp8", i]])
    elif pattern == "fp8_fp8_tie":
        a, b = rng.sample(range(n_fp8), 2)
        ties.append([["fp8", b], ["fp8", a]])
        ops += [["fp8", a], ["fp8", b]]
        rng.shuffle(ops)
    elif pattern == "used_twice":
        op = pick_op()
        ops += [op, list(op)]
        rng.shuffle(ops)
    elif pattern == "tl_tie":
        i, t = rng.randrange(n_fp8), rng.randrange(n_tl)
        ties.append([["tl", t], ["fp8", i]] if rng.random() < 0.5 else [["fp8", i], ["tl", t]])
        ops += [["fp8", i], ["tl", t]]
        rng.shuffle(ops)
    # an occasional extra random tie (never a slot tied twice, never a cycle: sources untied)
    slots = [["fp8", i] for i in range(n_fp8)] + [["tl", i] for i in range(n_tl)]
    slots += [["plain", j] for j in range(n_plain)]
    if rng.random() < 0.25 and len(slots) >= 2:
        tgt, src = rng.sample(slots, 2)
        targets = [t for t, _ in ties]
        sources = [s for _, s in ties]
        if tgt not in targets and tgt not in sources and src not in targets:
            ties.append([tgt, src])
    residual = [rng.random() < 0.3 for _ in ops]
    # an op that runs only in some micro-batches (control flow): its parameters are unused in the
    # others (and, for "not_last", in the micro-batch whose readiness launches the buckets)
    when = ["all"] * len(ops)
    if rng.random() < 0.15:
        when[rng.randrange(len(ops))] = rng.choice(["not_last", "last_only"])
    # frozen: a few parameters (by module slot and parameter name) get requires_grad=False
    frozen = []
    if rng.random() < 0.3:
        cands = [["fp8", i, "weight"] for i in range(n_fp8)]
        cands += [["fp8", i, "bias"] for i in range(n_fp8) if fp8_mods[i]["bias"]]
        cands += [
            ["fp8", i, "layer_norm_weight"]
            for i in range(n_fp8)
            if fp8_mods[i]["kind"] == "LayerNormLinear"
        ]
        cands += [["tl", i, "weight"] for i in range(n_tl)]
        cands += [["plain", j, "weight"] for j in range(n_plain)]
        frozen = rng.sample(cands, min(len(cands), rng.randint(1, 2)))
    n_mb = rng.randint(1, 4)
    overlap = rng.random() < 0.6
    dist_opt = rng.random() < 0.5
    ddp = dict(
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=dist_opt,
        average_in_collective=rng.random() < 0.5,
        grad_reduce_in_fp32=rng.random() < 0.5,
        bucket_size=rng.choice([D * D // 2, D * D, 2 * D * D, 5 * D * D]),
        grad_ledger=rng.random() < 0.3,
        check_for_nan_in_grad=rng.random() < 0.2,
        # the parameter all-gather left in flight after step(); each module's forward waits
        overlap_param_gather=dist_opt and rng.random() < 0.4,
    )
    # backward_dw schedule: each queued entry of micro-batch k is popped in window w >= k (window
    # n_mb is after the loop, before finish_grad_sync); mostly w == k. The windows are fixed for
    # the configuration (like a pipeline schedule); the interleaving inside a window is random
    # every step.
    defer_p = rng.choice([0.0, 0.0, 0.3, 0.6])
    # is_first_microbatch: (k == 0) as the README's loop; rarely True only at the very first
    # micro-batch of the run and False ever after (C8: a weight changed by the optimizer since it
    # was cached must be re-quantized, never reused stale); rarely None.
    ifm = rng.choices(["k==0", "first_of_run", "none"], weights=[8, 1, 1])[0]
    return dict(
        case_seed=case_seed,
        ws=ws,
        D=D,
        fp8=fp8,
        pattern=pattern,
        fp8_mods=fp8_mods,
        tl_mods=tl_mods,
        n_plain=n_plain,
        ops=ops,
        residual=residual,
        when=when,
        ties=ties,
        frozen=frozen,
        n_mb=n_mb,
        steps=rng.choice([2, 3]),
        defer_p=defer_p,
        schedule_seed=rng.randrange(2**31),
        is_first_microbatch=ifm,
        # each micro-batch's input as [T, D] or [2, T/2, D] (modules flatten leading dims)
        input_3d=rng.random() < 0.25,
        forget_dw=rng.random() < 0.05,  # misuse: one backward_dw() left out in the last step
        ddp=ddp,
    )


def runs(c, j, k):
    """Whether op j runs in micro-batch k."""
    w = c.get("when", ["all"] * len(c["ops"]))[j]
    last = k == c["n_mb"] - 1
    return w == "all" or (w == "last_only") == last


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
                mods.append(fp8dp.Linear(D, D, **kw))
            else:
                mods.append(
                    fp8dp.LayerNormLinear(
                        D,
                        D,
                        normalization=m["norm"],
                        eps=EPS,
                        return_layernorm_output=m.get("ret_ln", False),
                        zero_centered_gamma=m.get("zcg", False),
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
            if spec.get("zero_out_wgrad"):
                m.weight.zero_out_wgrad = True
            if spec.get("zcg"):  # a non-trivial scale (1 + gamma, gamma initialised to 0)
                with torch.no_grad():
                    m.layer_norm_weight.normal_(0, 0.3)

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
            if kind == "fp8":
                z = self.fp8[i](h, is_first_microbatch=is_first_microbatch)
                if isinstance(z, tuple):  # return_layernorm_output: plain code uses the norm too
                    z = z[0] + 0.5 * z[1]
            elif kind == "tl":
                z = self.tl[i](h)
            elif kind == "plain_linear":
                z = F.linear(h, self.plain[i])
            elif kind == "plain_matmul":
                z = torch.matmul(h, self.plain[i])
            else:  # embed: a plain parameter used by indexing (an embedding lookup)
                z = h + self.plain[i][ids]
            z = torch.tanh(z)
            h = h + z if res else z
        return h


def ref_forward64(model: GenModel, R: dict, ids, x, k):
    """The graph of `model` in plain float64 torch ops for micro-batch k; R maps id(parameter) ->
    float64 leaf."""
    c = model.c
    h = x
    for j, ((kind, i), res) in enumerate(zip(c["ops"], c["residual"])):
        if not runs(c, j, k):
            continue
        if kind == "fp8":
            m = model.fp8[i]
            inp = h
            if isinstance(m, fp8dp.LayerNormLinear):
                g = R[id(m.layer_norm_weight)]
                if m.zero_centered_gamma:
                    g = 1 + g
                if m.normalization == "LayerNorm":
                    inp = F.layer_norm(h, (h.shape[-1],), g, R[id(m.layer_norm_bias)], m.eps)
                else:
                    inp = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + m.eps) * g
            z = F.linear(inp, R[id(m.weight)], R[id(m.bias)] if m.bias is not None else None)
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


RECIPE = fp8dp.Float8CurrentScaling()


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
            with fp8dp.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
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
    depth = len(c["ops"]) + 1
    K = max(c["D"], T)
    return 8 * ((n_terms + 2) + depth * K) * U32 * float(mag.max()) + 1e-30


def first_microbatch(c, step, k):
    mode = c.get("is_first_microbatch", "k==0")
    if mode == "none":
        return None
    if mode == "first_of_run":
        return step == 0 and k == 0
    return k == 0


# ---- the schedule of backward_dw() calls ---------------------------------------------------------
def queued_per_microbatch(c, model, k=None):
    """{fp8 module index: entries queued by micro-batch k's backward} (one per call of a delayed
    module whose weight requires grad; k=None: any op that runs in some micro-batch)."""
    out = {}
    for j, (kind, i) in enumerate(c["ops"]):
        if k is None and not any(runs(c, j, kk) for kk in range(c["n_mb"])):
            continue
        if k is not None and not runs(c, j, k):
            continue
        if kind == "fp8" and c["fp8_mods"][i]["delay"] and model.fp8[i].weight.requires_grad:
            out[i] = out.get(i, 0) + 1
    return out


def make_windows(c, model):
    """windows[w] = list of module indices popped in window w (w = k: after micro-batch k's
    backward; w = n_mb: after the loop). Fixed for the configuration."""
    rng = random.Random(c["schedule_seed"])
    n_mb = c["n_mb"]
    windows = [[] for _ in range(n_mb + 1)]
    for k in range(n_mb):
        for i, cnt in sorted(queued_per_microbatch(c, model, k).items()):
            for _ in range(cnt):
                w = k
                while w < n_mb and rng.random() < c["defer_p"]:
                    w += 1
                windows[w].append(i)
    return windows


# ---- may_reject: configurations the library may refuse -------------------------------------------
def may_reject(c, model):
    """(exception classes, [strings one of which the message must contain], reason) for a
    configuration the library may refuse with a clear error, or None when it must compute the right
    gradient."""
    if not any(p.requires_grad for p in model.parameters()):
        return (
            (ValueError,),
            ["at least one parameter that requires grad"],
            "every parameter frozen: nothing for DistributedDataParallel to do",
        )
    if c["forget_dw"] and any(queued_per_microbatch(c, model).values()):
        # issue 12 item 2, as the lead's fix reports it: a RuntimeError at finish_grad_sync()
        # naming the module ("... never computed by backward_dw(): 'fp8.0.weight' (1 queued,
        # module 'fp8.0')"), or the ledger's "missing" naming its weight when grad_ledger is on.
        mods = [f"'fp8.{i}" for i in queued_per_microbatch(c, model)]
        return (
            (RuntimeError,),
            mods,
            "forgotten backward_dw(): must be an error naming the module (issue 12 item 2)",
        )
    # Ties mixing routes (delayed / fused / immediate fp8dp uses, plain torch uses) are no longer
    # here: since the lead's grad-sink rework (2976c0b) they compute the right gradient
    # (41 of 41 such sampled cases), so a wrong gradient or an error there is a failure.
    return None


def weight_users(c, model):
    """id(weight parameter) -> list of its users' routes, for parameters used by >= 2 ops."""
    users = {}
    for kind, i in c["ops"]:
        if kind == "fp8":
            m = c["fp8_mods"][i]
            route = "fp8_delay" if m["delay"] else "fp8"
            route += "_fused" if m["fuse"] else ""
            p = model.fp8[i].weight
        elif kind == "tl":
            route, p = "torch", model.tl[i].weight
        else:
            route, p = "torch", model.plain[i]
        users.setdefault(id(p), []).append(route)
    return {k: v for k, v in users.items() if len(v) > 1}


# ---- one case ----------------------------------------------------------------------------------
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


def run_case(c, group, found):
    """Runs configuration c to its end (every rank runs the same collectives whatever the checks
    find, so a mismatch on one rank does not desynchronise the others); appends each check's
    first mismatch to `found`."""
    agree = lambda bad: bad and found.append(bad)  # noqa: E731
    rank = group.rank()
    torch.manual_seed(c["case_seed"])
    model = GenModel(c)
    named = distinct_params(model)
    name_of = {id(p): n for n, p in named}
    per_mb = queued_per_microbatch(c, model)
    windows = make_windows(c, model)
    any_delay = any(m["delay"] for m in c["fp8_mods"])
    cfg = fp8dp.DistributedDataParallelConfig(delay_wgrad_compute=any_delay, **c["ddp"])
    ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
    ddp._sync.communicator().set_timeout(COMM_TIMEOUT_S)
    opt = None
    if c["ddp"]["use_distributed_optimizer"]:
        opt = fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=LR)
    ddp_params = {n for n, p in named if p.requires_grad}
    # frozen: no main_grad
    bad = None
    for n, p in named:
        if not p.requires_grad and hasattr(p, "main_grad"):
            bad = bad or dict(step=-1, what="frozen parameter has main_grad", param=n)
    agree(bad)
    rng = random.Random(c["schedule_seed"] + 1)
    n_mb = c["n_mb"]
    checks = 0
    opg = c["ddp"].get("overlap_param_gather", False)
    pending = None  # (step, {name: (expected parameter, tolerance)}) of the last step()

    def check_params(pend):
        bad = None
        for n, p in named:
            exp, tol = pend[1][n]
            bad = bad or first_mismatch(pend[0], "param after step", n, p.detach(), exp, tol)
        agree(bad)

    for step in range(c["steps"]):
        data = make_data(c, step)
        ids, x, y = data
        forget = c["forget_dw"] and step == c["steps"] - 1 and any(per_mb.values())
        forget_at = None
        if forget:
            nonempty = [w for w in range(n_mb + 1) if windows[w]]
            forget_at = (rng.choice(nonempty), 0)
        (opt.zero_grad() if opt is not None else ddp.zero_grad_buffer())

        def pop_window(w):
            order = list(windows[w])
            rng.shuffle(order)
            for j, i in enumerate(order):
                if forget_at == (w, j):
                    continue
                model.fp8[i].backward_dw()

        for k in range(n_mb):
            ctx = ddp.no_sync() if k < n_mb - 1 else contextlib.nullcontext()
            r = rank * n_mb + k
            model.microbatch = k
            with ctx:
                with fp8dp.fp8_autocast(enabled=c["fp8"], fp8_recipe=RECIPE):
                    out = ddp(ids[r], x[r], is_first_microbatch=first_microbatch(c, step, k))
                if k == 0:
                    # The parameters this step uses, read after the first forward: with
                    # overlap_param_gather that forward must have waited for the all-gather
                    # (else it computed with stale values and the gradients below differ).
                    if pending is not None:
                        check_params(pending)
                        pending = None
                    before = {n: p.detach().double().clone() for n, p in named}
                    ref, mag = reference(c, model, data)
                loss = mse(out, y[r]) / n_mb
                if loss.requires_grad:  # else every parameter on the path is frozen
                    loss.backward()
                pop_window(k)
        pop_window(n_mb)
        ddp.finish_grad_sync()
        # -- gradients
        bad = None
        if opt is not None:
            sync = ddp._sync
            params = ddp._params
            for s in sync.owned_shards():
                n = name_of[id(params[s.param])]
                exp = ref[n].flatten()[s.param_offset : s.param_offset + s.numel]
                bad = bad or first_mismatch(
                    step,
                    "main_grad shard",
                    n,
                    sync.grad_shard(s),
                    exp,
                    grad_tolerance(c, mag[n]),
                    dict(shard_offset=s.param_offset, shard_numel=s.numel),
                )
                checks += 1
        else:
            for n, p in named:
                if not p.requires_grad:
                    continue
                bad = bad or first_mismatch(
                    step, "main_grad", n, p.main_grad, ref[n], grad_tolerance(c, mag[n])
                )
                checks += 1
        for n, p in named:
            if n in ddp_params and p.grad is not None:
                bad = bad or dict(step=step, what="p.grad is not None after the sync", param=n)
            if not p.requires_grad and hasattr(p, "main_grad"):
                bad = bad or dict(step=step, what="frozen parameter has main_grad", param=n)
        for i in per_mb:
            if model.fp8[i].need_backward_dw() and not forget:
                bad = bad or dict(step=step, what="queue not empty", param=f"fp8.{i}")
        if forget:
            # every queued item was popped but one: the library must have raised by now
            bad = dict(
                step=step,
                what="forgotten backward_dw() passed silently",
                param=f"fp8.{windows[forget_at[0]][0]}",
                mismatch_then=bad,
            )
        agree(bad)
        # -- the step (distributed optimizer): p - LR * g_ref on every rank, frozen unchanged
        if opt is not None:
            opt.step()
            exp = {}
            for n, p in named:
                if p.requires_grad:
                    # the gradient's tolerance, scaled, plus the FP32 rounding of p - LR * g
                    # (half an ulp of the result, <= 2^-24 |p| each for the product and the sum)
                    tol = LR * grad_tolerance(c, mag[n]) + 2 * U32 * float(before[n].abs().max())
                    exp[n] = (before[n] - LR * ref[n], tol)
                else:
                    exp[n] = (before[n], 0.0)
                checks += 1
            pending = (step, exp)
            if not opg:
                check_params(pending)
                pending = None
    if pending is not None:
        opt.finish_param_sync()
        check_params(pending)
    return checks


def run_one(c, group):
    """Runs the case and classifies its outcome."""
    t0 = time.perf_counter()
    res = dict(case_seed=c["case_seed"], ws=c["ws"], rank=group.rank(), config=c)
    if c.get("pattern") == "pipeline":
        return run_one_pipeline(c, res, t0)
    model_for_reject = None
    try:
        torch.manual_seed(c["case_seed"])
        model_for_reject = GenModel(c)
        rej = may_reject(c, model_for_reject)
    except Exception as e:  # the generator or model construction itself failed
        res.update(
            status="error",
            error=f"{type(e).__name__}: {e}",
            traceback=traceback.format_exc()[-3000:],
        )
        return res
    res["may_reject"] = None if rej is None else rej[2]
    if os.environ.get("FP8DP_PROPERTY_TRACE_S"):  # debugging a slow case: where is it?
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["FP8DP_PROPERTY_TRACE_S"]))
    WORST.clear()
    try:
        found = []
        res["checks"] = run_case(c, group, found)
        if found:
            res.update(status="fail", mismatch=found[0], n_mismatches=len(found))
        else:
            res["status"] = "pass"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        if rej is not None and isinstance(e, rej[0]) and any(s in str(e) for s in rej[1]):
            res.update(status="rejected", error=msg[:2000])
        else:
            res.update(status="error", error=msg[:2000], traceback=traceback.format_exc()[-3000:])
    res["seconds"] = round(time.perf_counter() - t0, 3)
    res["worst_err_over_tol"] = {k: round(v, 4) for k, v in WORST.items()}
    return res


def run_one_pipeline(c, res, t0):
    """A pipeline case (property_pipeline.py): nothing in it may be rejected."""
    WORST.clear()
    try:
        found = []
        res["checks"] = property_pipeline.run_case(sys.modules[__name__], c, found, COMM_TIMEOUT_S)
        if found:
            res.update(status="fail", mismatch=found[0], n_mismatches=len(found))
        else:
            res["status"] = "pass"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        res.update(status="error", error=msg[:2000], traceback=traceback.format_exc()[-3000:])
    res["seconds"] = round(time.perf_counter() - t0, 3)
    res["worst_err_over_tol"] = {k: round(v, 4) for k, v in WORST.items()}
    return res


def gen_any_config(case_seed: int, ws: int) -> dict:
    if property_pipeline.is_pipeline_seed(case_seed):
        return property_pipeline.gen_pipeline_config(sys.modules[__name__], case_seed, ws)
    return gen_config(case_seed, ws)


def case_seeds(seed: int, n: int, ws: int):
    rng = random.Random(seed * 7919 + ws)
    return [rng.randrange(2**31) for _ in range(n)]


# ---- shrinking a failing configuration ---------------------------------------------------------
def signature(res) -> str:
    """What kind of failure a result is, to keep while shrinking: the status and the mismatch's
    kind or the exception's class and first words."""
    if res["status"] == "fail":
        return "fail: " + res["mismatch"]["what"].replace(" shard", "")
    if res["status"] in ("error", "rejected"):
        msg = res["error"]
        return res["status"] + ": " + " ".join(msg.replace("'", " ").split()[:4])
    return res["status"]


def _drop_fp8(c, i):
    """c without fp8 module i (when nothing refers to it), indices renumbered."""

    def ref(kind, j):
        return kind == "fp8" and j == i

    if any(ref(*op) for op in c["ops"]) or any(ref(*s) for t in c["ties"] for s in t):
        return None
    if any(ref(f[0], f[1]) for f in c["frozen"]):
        return None
    d = json.loads(json.dumps(c))
    del d["fp8_mods"][i]
    fix = lambda s: [s[0], s[1] - 1] + s[2:] if s[0] == "fp8" and s[1] > i else s  # noqa: E731
    d["ops"] = [fix(o) for o in d["ops"]]
    d["ties"] = [[fix(a), fix(b)] for a, b in d["ties"]]
    d["frozen"] = [fix(f) for f in d["frozen"]]
    return d if d["fp8_mods"] else None


def _drop_simple(c, key, kind, i):
    """c without torch.nn.Linear / plain parameter i (when nothing refers to it)."""

    def ref(s):
        return s[0] == kind or (
            kind == "plain" and s[0] in ("plain_linear", "plain_matmul", "embed")
        )

    if any(ref(o) and o[1] == i for o in c["ops"]):
        return None
    if any(s[0] == kind and s[1] == i for t in c["ties"] for s in t):
        return None
    if any(f[0] == kind and f[1] == i for f in c["frozen"]):
        return None
    d = json.loads(json.dumps(c))
    if key == "n_plain":
        d["n_plain"] -= 1
    else:
        del d[key][i]
    fix = lambda s: [s[0], s[1] - 1] + s[2:] if ref(s) and s[1] > i else s  # noqa: E731
    d["ops"] = [fix(o) for o in d["ops"]]
    d["ties"] = [[fix(a), fix(b)] for a, b in d["ties"]]
    d["frozen"] = [fix(f) for f in d["frozen"]]
    return d


def shrink_candidates(c):
    """Simpler variants of c, roughly most simplifying first."""

    def with_(**kw):
        d = json.loads(json.dumps(c))
        d.update(kw)
        return d

    out = []
    if c["fp8"]:
        out.append(with_(fp8=False))
    if c["n_mb"] > 1:
        out.append(with_(n_mb=1))
        out.append(with_(n_mb=c["n_mb"] - 1))
    if c["steps"] > 1:
        out.append(with_(steps=1))
    if c["defer_p"]:
        out.append(with_(defer_p=0.0))
    if c["forget_dw"]:
        out.append(with_(forget_dw=False))
    if c.get("is_first_microbatch", "k==0") != "k==0":
        out.append(with_(is_first_microbatch="k==0"))
    for i in range(len(c["ops"])):
        if len(c["ops"]) > 1:
            d = with_()
            del d["ops"][i]
            del d["residual"][i]
            if "when" in d:
                del d["when"][i]
            out.append(d)
    for i in range(len(c["fp8_mods"])):
        d = _drop_fp8(c, i)
        if d:
            out.append(d)
    for i in range(len(c["tl_mods"])):
        d = _drop_simple(c, "tl_mods", "tl", i)
        if d:
            out.append(d)
    for i in range(c["n_plain"]):
        d = _drop_simple(c, "n_plain", "plain", i)
        if d:
            out.append(d)
    for i in range(len(c["ties"])):
        d = with_()
        del d["ties"][i]
        out.append(d)
    for i in range(len(c["frozen"])):
        d = with_()
        del d["frozen"][i]
        out.append(d)
    for i, w in enumerate(c.get("when", [])):
        if w != "all":
            d = with_()
            d["when"][i] = "all"
            out.append(d)
    for i, r in enumerate(c["residual"]):
        if r:
            d = with_()
            d["residual"][i] = False
            out.append(d)
    for i, m in enumerate(c["fp8_mods"]):
        for key, val in (("kind", "Linear"), ("bias", False), ("fuse", False), ("delay", False)):
            if m[key] != val:
                d = with_()
                d["fp8_mods"][i][key] = val
                if val == "Linear":
                    d["fp8_mods"][i].update(norm=None, ret_ln=False, zcg=False)
                    d["frozen"] = [
                        f
                        for f in d["frozen"]
                        if not (f[0] == "fp8" and f[1] == i and f[2].startswith("layer"))
                    ]
                out.append(d)
    if c.get("input_3d"):
        out.append(with_(input_3d=False))
    for i, m in enumerate(c["fp8_mods"]):
        for key in ("ret_ln", "zcg", "zero_out_wgrad"):
            if m.get(key):
                d = with_()
                d["fp8_mods"][i][key] = False
                out.append(d)
    for i, m in enumerate(c["tl_mods"]):
        if m["bias"]:
            d = with_()
            d["tl_mods"][i]["bias"] = False
            out.append(d)
    if c["ddp"].get("overlap_param_gather"):
        d = with_()
        d["ddp"]["overlap_param_gather"] = False
        out.append(d)
    for key in (
        "overlap_grad_reduce",
        "use_distributed_optimizer",
        "average_in_collective",
        "grad_reduce_in_fp32",
        "grad_ledger",
        "check_for_nan_in_grad",
    ):
        if c["ddp"][key]:
            d = with_()
            d["ddp"][key] = False
            if key == "use_distributed_optimizer":
                d["ddp"]["overlap_param_gather"] = False
            out.append(d)
    if c["D"] != 16:
        d = with_(D=16)
        d["ddp"]["bucket_size"] = min(d["ddp"]["bucket_size"], 5 * 256)
        out.append(d)
    return out


class Runner:
    """Runs cases on every rank of the job together; replaces the case process group after any
    rank raised (a collective may then be pending on some ranks only)."""

    def __init__(self):
        self.ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=COMM_TIMEOUT_S))

    def run(self, c):
        res = run_one(c, self.group)
        flag = torch.tensor([1 if res["status"] in ("error", "rejected") else 0])
        dist.all_reduce(flag, group=self.ctrl)
        if int(flag) and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=COMM_TIMEOUT_S))
            property_pipeline.reset_groups()
        return res

    def anywhere(self, ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0])
        dist.all_reduce(t, group=self.ctrl)
        return int(t) > 0

    def shrink(self, c, sig, budget=150):
        """Greedy: take the first simpler variant that still fails with signature `sig` on some
        rank, until none does (or `budget` runs)."""
        runs = 0
        improved = True
        while improved and runs < budget:
            improved = False
            for d in shrink_candidates(c):
                runs += 1
                if self.anywhere(signature(self.run(d)) == sig):
                    c, improved = d, True
                    break
                if runs >= budget:
                    break
        return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=int(os.environ.get("FP8DP_PROPERTY_SEED", 0)))
    ap.add_argument("--cases", type=int, default=20, help="cases in this launch")
    ap.add_argument(
        "--case-seed", type=int, action="append", default=[], help="run only this case (repeatable)"
    )
    ap.add_argument(
        "--config-json",
        default=None,
        help="run this configuration (a JSON object as written in the results)",
    )
    ap.add_argument(
        "--regressions",
        default=None,
        help="also run the named minimal configurations of this JSON file (a list of "
        "{name, why, world_size, config}) whose world size is this one's, first",
    )
    ap.add_argument(
        "--pipeline-cases",
        type=int,
        default=0,
        help="also run this many generated pipeline cases (PP 2; even world sizes only)",
    )
    ap.add_argument(
        "--shrink",
        action="store_true",
        help="shrink every failing case to a minimal configuration that fails alike",
    )
    ap.add_argument("--out", default=None, help="folder for the JSON results (one file per rank)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=60))
    rank, ws = dist.get_rank(), dist.get_world_size()
    if args.config_json:
        c = json.loads(args.config_json)
        c["ws"] = ws
        configs = [c]
    else:
        seeds = args.case_seed or case_seeds(args.seed, args.cases, ws)
        if not args.case_seed and ws % property_pipeline.PP == 0:
            seeds += property_pipeline.pipeline_case_seeds(args.seed, args.pipeline_cases, ws)
        configs = [gen_any_config(cs, ws) for cs in seeds]
        if args.regressions:
            with open(args.regressions) as f:
                named = json.load(f)
            for i, r in enumerate(named):  # negative seeds: no clash with generated cases
                r["config"].update(ws=ws, case_seed=-1 - i, pattern=r["name"])
            # each at the world size it was found at
            configs = [r["config"] for r in named if r.get("world_size", 1) == ws] + configs
    if rank == 0:
        print(f"[property] world size {ws}, seed {args.seed}, {len(configs)} cases", flush=True)
    runner = Runner()
    out = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out = open(os.path.join(args.out, f"results_ws{ws}_rank{rank}.jsonl"), "w")
    n_bad = 0
    for c in configs:
        res = runner.run(c)
        cs = c["case_seed"]
        bad = res["status"] in ("fail", "error")
        n_bad += bad
        if args.shrink and c.get("pattern") != "pipeline" and runner.anywhere(bad):
            sig = signature(res) if bad else None
            # every rank shrinks the same signature: the first failing rank's
            sigs = [None] * ws
            dist.all_gather_object(sigs, sig, group=runner.ctrl)
            sig = next(s for s in sigs if s)
            res["shrunk"] = dict(signature=sig, config=runner.shrink(c, sig))
        line = (
            f"[rank {rank}/{ws}] {res['status'].upper()} case_seed={cs} "
            f"({res.get('seconds', 0)} s)"
        )
        if res["status"] == "fail":
            line += " " + json.dumps(res["mismatch"])
        elif res["status"] in ("error", "rejected"):
            line += " " + res["error"][:300]
        if args.verbose or res["status"] != "pass" or rank == 0:
            print(line, flush=True)  # every case's seed, so that any one reruns alone
        if out:
            out.write(json.dumps(res) + "\n")
            out.flush()
    if out:
        out.close()
    dist.barrier(group=runner.ctrl)
    dist.destroy_process_group()
    sys.exit(1 if n_bad else 0)


if __name__ == "__main__":
    main()
