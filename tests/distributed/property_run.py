"""The runner of the gradient-accounting property test (property_worker.py): which cases a
launch runs, one case on every rank with its checks, and the classification of its outcome."""

from __future__ import annotations

import contextlib
import os
import random
import time
import traceback
from datetime import timedelta

import property_pipeline
import torch
import torch.distributed as dist
from property_gen import (
    COMM_TIMEOUT_S,
    LR,
    U32,
    gen_config,
    make_windows,
    may_reject,
    queued_per_microbatch,
)
from property_model import (
    WORST,
    GenModel,
    distinct_params,
    first_microbatch,
    first_mismatch,
    grad_tolerance,
    make_data,
    mse,
    recipe_of,
    reference,
)

import fp8dp


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
                with fp8dp.fp8_autocast(enabled=c["fp8"], fp8_recipe=recipe_of(c)):
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
        res["checks"] = property_pipeline.run_case(c, found, COMM_TIMEOUT_S)
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
        return property_pipeline.gen_pipeline_config(case_seed, ws)
    return gen_config(case_seed, ws)


def case_seeds(seed: int, n: int, ws: int):
    rng = random.Random(seed * 7919 + ws)
    return [rng.randrange(2**31) for _ in range(n)]


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
