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


class _Case:
    """One configuration run step by step against its float64 reference: setup, then per step the
    micro-batches (forward, backward, the backward_dw windows), the gradient checks and the
    optimizer step with its parameter check. Every rank makes the same calls whatever the checks
    find; each check's first mismatch goes to `found`."""

    def __init__(self, c, group, found):
        self.c, self.found = c, found
        self.rank = group.rank()
        torch.manual_seed(c["case_seed"])
        self.model = GenModel(c)
        self.named = distinct_params(self.model)
        self.name_of = {id(p): n for n, p in self.named}
        self.per_mb = queued_per_microbatch(c, self.model)
        self.windows = make_windows(c, self.model)
        any_delay = any(m["delay"] for m in c["fp8_mods"])
        cfg = fp8dp.DistributedDataParallelConfig(delay_wgrad_compute=any_delay, **c["ddp"])
        self.ddp = fp8dp.DistributedDataParallel(self.model, cfg, process_group=group)
        self.ddp._sync.communicator().set_timeout(COMM_TIMEOUT_S)
        self.opt = None
        if c["ddp"]["use_distributed_optimizer"]:
            # defer_nan_check needs an optimizer that skips on the device: fused SGD (the same
            # update as the default SGD for plain SGD at this learning rate, bit for bit)
            fused = {"fused": True} if c["ddp"].get("defer_nan_check") else {}
            self.opt = fp8dp.DistributedOptimizer(torch.optim.SGD, self.ddp, lr=LR, **fused)
        self.ddp_params = {n for n, p in self.named if p.requires_grad}
        # frozen: no main_grad
        bad = None
        for n, p in self.named:
            if not p.requires_grad and hasattr(p, "main_grad"):
                bad = bad or dict(step=-1, what="frozen parameter has main_grad", param=n)
        self.agree(bad)
        self.rng = random.Random(c["schedule_seed"] + 1)
        self.n_mb = c["n_mb"]
        self.checks = 0
        self.opg = c["ddp"].get("overlap_param_gather", False)
        self.pending = None  # (step, {name: (expected parameter, tolerance)}) of the last step()

    def agree(self, bad):
        if bad:
            self.found.append(bad)

    def check_params(self, pend):
        bad = None
        for n, p in self.named:
            exp, tol = pend[1][n]
            bad = bad or first_mismatch(pend[0], "param after step", n, p.detach(), exp, tol)
        self.agree(bad)

    def pop_window(self, w, forget_at):
        order = list(self.windows[w])
        self.rng.shuffle(order)
        for j, i in enumerate(order):
            if forget_at == (w, j):
                continue
            self.model.fp8[i].backward_dw()

    def microbatches(self, step, data, forget_at):
        """Forward, backward and the backward_dw window of every micro-batch; the reference of
        the step's parameters (read after the first forward) in self.ref / self.mag / self.before.
        """
        c, ddp, model = self.c, self.ddp, self.model
        ids, x, y = data
        for k in range(self.n_mb):
            ctx = ddp.no_sync() if k < self.n_mb - 1 else contextlib.nullcontext()
            r = self.rank * self.n_mb + k
            model.microbatch = k
            with ctx:
                with fp8dp.fp8_autocast(enabled=c["fp8"], fp8_recipe=recipe_of(c)):
                    out = ddp(ids[r], x[r], is_first_microbatch=first_microbatch(c, step, k))
                if k == 0:
                    # The parameters this step uses, read after the first forward: with
                    # overlap_param_gather that forward must have waited for the all-gather
                    # (else it computed with stale values and the gradients below differ).
                    if self.pending is not None:
                        self.check_params(self.pending)
                        self.pending = None
                    self.before = {n: p.detach().double().clone() for n, p in self.named}
                    self.ref, self.mag = reference(c, model, data)
                loss = mse(out, y[r]) / self.n_mb
                if loss.requires_grad:  # else every parameter on the path is frozen
                    loss.backward()
                self.pop_window(k, forget_at)
        self.pop_window(self.n_mb, forget_at)

    def check_grads(self, step, forget, forget_at):
        """main_grad (or this rank's shards of it) against the reference, and what must hold
        after the sync: no .grad left, frozen parameters without main_grad, the queues empty."""
        c, ref, mag = self.c, self.ref, self.mag
        bad = None
        if self.opt is not None:
            sync = self.ddp._sync
            params = self.ddp._params
            for s in sync.owned_shards():
                n = self.name_of[id(params[s.param])]
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
                self.checks += 1
        else:
            for n, p in self.named:
                if not p.requires_grad:
                    continue
                bad = bad or first_mismatch(
                    step, "main_grad", n, p.main_grad, ref[n], grad_tolerance(c, mag[n])
                )
                self.checks += 1
        for n, p in self.named:
            if n in self.ddp_params and p.grad is not None:
                bad = bad or dict(step=step, what="p.grad is not None after the sync", param=n)
            if not p.requires_grad and hasattr(p, "main_grad"):
                bad = bad or dict(step=step, what="frozen parameter has main_grad", param=n)
        for i in self.per_mb:
            if self.model.fp8[i].need_backward_dw() and not forget:
                bad = bad or dict(step=step, what="queue not empty", param=f"fp8.{i}")
        if forget:
            # every queued item was popped but one: the library must have raised by now
            bad = dict(
                step=step,
                what="forgotten backward_dw() passed silently",
                param=f"fp8.{self.windows[forget_at[0]][0]}",
                mismatch_then=bad,
            )
        self.agree(bad)

    def optimizer_step(self, step):
        """The distributed optimizer's step: p - LR * g_ref on every rank, frozen unchanged,
        checked now or (overlap_param_gather) after the next forward."""
        self.opt.step()
        exp = {}
        for n, p in self.named:
            if p.requires_grad:
                # the gradient's tolerance, scaled, plus the FP32 rounding of p - LR * g
                # (half an ulp of the result, <= 2^-24 |p| each for the product and the sum)
                tol = LR * grad_tolerance(self.c, self.mag[n])
                tol += 2 * U32 * float(self.before[n].abs().max())
                exp[n] = (self.before[n] - LR * self.ref[n], tol)
            else:
                exp[n] = (self.before[n], 0.0)
            self.checks += 1
        self.pending = (step, exp)
        if not self.opg:
            self.check_params(self.pending)
            self.pending = None

    def step(self, step):
        c = self.c
        data = make_data(c, step)
        forget = c["forget_dw"] and step == c["steps"] - 1 and any(self.per_mb.values())
        forget_at = None
        if forget:
            nonempty = [w for w in range(self.n_mb + 1) if self.windows[w]]
            forget_at = (self.rng.choice(nonempty), 0)
        (self.opt.zero_grad() if self.opt is not None else self.ddp.zero_grad_buffer())
        self.microbatches(step, data, forget_at)
        self.ddp.finish_grad_sync()
        self.check_grads(step, forget, forget_at)
        if self.opt is not None:
            self.optimizer_step(step)

    def finish(self):
        if self.pending is not None:
            self.opt.finish_param_sync()
            self.check_params(self.pending)


def run_case(c, group, found):
    """Runs configuration c to its end (every rank runs the same collectives whatever the checks
    find, so a mismatch on one rank does not desynchronise the others); appends each check's
    first mismatch to `found`. Returns the number of checks made."""
    case = _Case(c, group, found)
    for step in range(c["steps"]):
        case.step(step)
    case.finish()
    return case.checks


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
