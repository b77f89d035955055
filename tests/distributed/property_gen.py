"""The configuration generator of the gradient-accounting property test (property_worker.py):
a random configuration from one integer seed, and what a configuration implies without running it
(which micro-batches run an op, the backward_dw() windows, what the library may refuse)."""

from __future__ import annotations

import random

T = 16  # tokens per micro-batch per rank (FP8 GEMMs need multiples of 16)
LR = 0.1
EPS = 1e-5
U32 = 2.0**-24  # unit roundoff of float32
COMM_TIMEOUT_S = 8.0  # a desynchronised case ends in an error, not a hang
BACKEND = "gloo"  # of the world group, and so of the pipeline cases' groups (make_groups)


# ---- the configuration generator -----------------------------------------------------------
def _gen_shape(rng: random.Random) -> tuple:
    """Width, FP8 on or off, the graph's pattern and how many modules of each kind it has."""
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
    return D, fp8, pattern, n_fp8, n_tl, n_plain


def _gen_fp8_module(rng: random.Random) -> dict:
    kind = rng.choice(["Linear", "LayerNormLinear"])
    return dict(
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


def _gen_ops_and_ties(rng: random.Random, pattern: str, n_fp8: int, n_tl: int, n_plain: int):
    """What the forward runs, in order (each op followed by tanh), and the weight ties."""

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
    return ops, ties


def _gen_frozen(rng: random.Random, fp8_mods: list, n_tl: int, n_plain: int) -> list:
    """A few parameters (by module slot and parameter name) with requires_grad=False."""
    if rng.random() >= 0.3:
        return []
    n_fp8 = len(fp8_mods)
    cands = [["fp8", i, "weight"] for i in range(n_fp8)]
    cands += [["fp8", i, "bias"] for i in range(n_fp8) if fp8_mods[i]["bias"]]
    cands += [
        ["fp8", i, "layer_norm_weight"]
        for i in range(n_fp8)
        if fp8_mods[i]["kind"] == "LayerNormLinear"
    ]
    cands += [["tl", i, "weight"] for i in range(n_tl)]
    cands += [["plain", j, "weight"] for j in range(n_plain)]
    return rng.sample(cands, min(len(cands), rng.randint(1, 2)))


def _gen_ddp(rng: random.Random, D: int) -> dict:
    overlap = rng.random() < 0.6
    dist_opt = rng.random() < 0.5
    return dict(
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


def gen_config(case_seed: int, ws: int) -> dict:
    """A random configuration from one seed (JSON-serialisable). ws only shapes nothing but the
    record: the same seed gives the same graph at every world size. The draws happen in one fixed
    order (the helpers above, called in sequence), so a seed names the same case in every
    version that keeps that order."""
    rng = random.Random(case_seed)
    D, fp8, pattern, n_fp8, n_tl, n_plain = _gen_shape(rng)
    fp8_mods = [_gen_fp8_module(rng) for _ in range(n_fp8)]
    tl_mods = [dict(bias=rng.random() < 0.6) for _ in range(n_tl)]
    ops, ties = _gen_ops_and_ties(rng, pattern, n_fp8, n_tl, n_plain)
    residual = [rng.random() < 0.3 for _ in ops]
    # an op that runs only in some micro-batches (control flow): its parameters are unused in the
    # others (and, for "not_last", in the micro-batch whose readiness launches the buckets)
    when = ["all"] * len(ops)
    if rng.random() < 0.15:
        when[rng.randrange(len(ops))] = rng.choice(["not_last", "last_only"])
    frozen = _gen_frozen(rng, fp8_mods, n_tl, n_plain)
    n_mb = rng.randint(1, 4)
    ddp = _gen_ddp(rng, D)
    # backward_dw schedule: each queued entry of micro-batch k is popped in window w >= k (window
    # n_mb is after the loop, before finish_grad_sync); mostly w == k. The windows are fixed for
    # the configuration (like a pipeline schedule); the interleaving inside a window is random
    # every step.
    defer_p = rng.choice([0.0, 0.0, 0.3, 0.6])
    # is_first_microbatch: (k == 0) as the README's loop; rarely True only at the very first
    # micro-batch of the run and False ever after (C8: a weight changed by the optimizer since it
    # was cached must be re-quantized, never reused stale); rarely None.
    ifm = rng.choices(["k==0", "first_of_run", "none"], weights=[8, 1, 1])[0]
    c = dict(
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
    # FP8 recipe (drawn last, so that the fields above keep their values for a seed): per-tensor
    # current scaling or Float8BlockScaling; neither keeps state across casts, so the twin that
    # makes the reference casts the same bytes.
    c["recipe"] = rng.choice(["current", "block"]) if fp8 else "current"
    _gen_mlp(rng, c)
    _gen_defer_nan(rng, c)
    _gen_residual_in(rng, c)
    _gen_out_act(rng, c)
    _gen_in_act(rng, c)
    return c


def _gen_defer_nan(rng: random.Random, c: dict) -> None:
    """ddp.defer_nan_check where the config allows it (the NaN check and the distributed
    optimizer, no ledger): the flags launched at each finish and read at the next, the optimizer
    (fused SGD) stepping with them as found_inf. Drawn after everything else, so the fields above
    keep their values for a seed."""
    d = c["ddp"]
    if d["check_for_nan_in_grad"] and d["use_distributed_optimizer"] and not d["grad_ledger"]:
        d["defer_nan_check"] = rng.random() < 0.5


def _gen_mlp(rng: random.Random, c: dict) -> None:
    """Some LayerNormLinear slots become a LayerNormMLP (norm -> fc1 -> activation -> fc2, D -> D
    through an FFN of 2 D; fc1 and fc2 each keep their own queue, route and bucket place). Drawn
    after everything else, so the fields above keep their values for a seed. Only slots that no
    tie or frozen entry names: a tie or a freeze addresses one [D, D] weight, and an MLP has two
    of other shapes."""
    named = {tuple(s[:2]) for tie in c["ties"] for s in tie} | {(f[0], f[1]) for f in c["frozen"]}
    for i, m in enumerate(c["fp8_mods"]):
        if m["kind"] != "LayerNormLinear":
            continue
        if rng.random() < 0.6 and ("fp8", i) not in named:
            m.update(kind="LayerNormMLP", act=rng.choice(["gelu", "swiglu"]), ret_ln=False)


def _gen_residual_in(rng: random.Random, c: dict) -> None:
    """res_in: a norm's layer hands its input on as the residual, whose gradient the norm's
    backward then adds to x's (LayerNormLinear's return_layernorm_input; LayerNormMLP's
    residual=x, the MLP's own input). Drawn last, as _gen_mlp, so that earlier fields keep their
    values for a seed."""
    for m in c["fp8_mods"]:
        if m["kind"] != "Linear":
            m["res_in"] = rng.random() < 0.3


def _gen_out_act(rng: random.Random, c: dict) -> None:
    """out_act: a Linear or LayerNormLinear applies a GELU to its output (activation="gelu": under
    FP8 its derivative inside the cast of the output gradient). Drawn last, so that earlier fields
    keep their values for a seed. Mutation (2026-12-06, restored): the layer's high-precision
    route without the derivative fails 12 of the 83 world-size-1 configurations of seed 61206
    against the float64 reference (FP8 on, the reference is a twin with the same layers)."""
    for m in c["fp8_mods"]:
        if not is_mlp(m) and rng.random() < 0.25:
            m["out_act"] = "gelu"


def _gen_in_act(rng: random.Random, c: dict) -> None:
    """in_act: a Linear applies a GELU to its input (input_activation="gelu": under FP8 inside the
    cast of the GEMM's input; its backward returns dgrad times the derivative). Not with out_act.
    Drawn last, so that earlier fields keep their values for a seed. Mutation (2026-12-07,
    restored): the layer's backward returning dgrad without the derivative fails 4 of the 83
    world-size-1 configurations of seed 0 against the float64 reference."""
    for m in c["fp8_mods"]:
        if m["kind"] == "Linear" and not m.get("out_act") and rng.random() < 0.25:
            m["in_act"] = "gelu"


def is_mlp(m: dict) -> bool:
    return m["kind"] == "LayerNormMLP"


def fp8_weight(model, i):
    """The weight that tells whether fp8 slot i queues weight gradients: its own, or fc1's for a
    LayerNormMLP (whose slots are never frozen, so fc1 and fc2 agree)."""
    m = model.fp8[i]
    return m.fc1.weight if hasattr(m, "fc1") else m.weight


def runs(c, j, k):
    """Whether op j runs in micro-batch k."""
    w = c.get("when", ["all"] * len(c["ops"]))[j]
    last = k == c["n_mb"] - 1
    return w == "all" or (w == "last_only") == last


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
        if kind == "fp8" and c["fp8_mods"][i]["delay"] and fp8_weight(model, i).requires_grad:
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
        # A forgotten backward_dw() is reported as a RuntimeError at finish_grad_sync()
        # naming the module ("... never computed by backward_dw(): 'fp8.0.weight' (1 queued,
        # module 'fp8.0')"), or the ledger's "missing" naming its weight when grad_ledger is on.
        mods = [f"'fp8.{i}" for i in queued_per_microbatch(c, model)]
        return (
            (RuntimeError,),
            mods,
            "forgotten backward_dw(): must be an error naming the module (C3)",
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
            p = fp8_weight(model, i)
        elif kind == "tl":
            route, p = "torch", model.tl[i].weight
        else:
            route, p = "torch", model.plain[i]
        users.setdefault(id(p), []).append(route)
    return {k: v for k, v in users.items() if len(v) > 1}
