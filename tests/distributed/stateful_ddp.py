"""One rank's side of the stateful DDP lifecycle test: the system under test (a Net wrapped in
fp8dp.DistributedDataParallel, optionally with fp8dp.DistributedOptimizer) and the float64 model
of what each call must do (stateful_model.py), one method per call (`op_*`).

Every rank runs the same op with the same arguments (the leader broadcasts them: stateful_rules.py)
on its own data; each op returns (tag, failure) where tag says what happened ("done", "refused")
and failure is None or a one-line description of how the rank's state differs from the model.
The model keeps every rank's state (each rank's parameters and local gradient sums), computed
from every rank's data, so that each rank checks the reduced values on its own.

What a call must do is decided by the model from the phase of the iteration (contract C11):
- "ok": the call must succeed and leave the state the model computes;
- "refuse": the call must raise ValueError or RuntimeError (fp8dp's own, not a collective's
  timeout) and leave every piece of state bit-identical: main_grad, the parameters, their .grad,
  the delayed-wgrad queues, the optimizer's masters and inner state, and the phase when fp8dp
  exposes one (`_sync.phase`);
- "may_refuse": either of the two (C11 allows "does the right thing or refuses"), where the right
  thing is then checked at the next comparison;
- "raise" (the nan family: a NaN or Inf gradient found by check_for_nan_in_grad): the call must
  raise fp8dp's error on every rank. Either nothing changed (no collective of the iteration had
  launched), or the iteration is in phase 'failed' and only zero_grad_buffer() goes on.
"""

from __future__ import annotations

import contextlib
import copy
import re
from datetime import timedelta

import stateful_model as sm
import torch
import torch.distributed as dist
import torch.utils.checkpoint as tcp

import fp8dp

COMM_TIMEOUT_S = 8.0  # a desynchronised sequence ends in an error, not a hang
REFUSAL = (ValueError, RuntimeError)
NOT_A_REFUSAL = ("gloo", "timed out", "Timed out", "Connection", "NCCL")


def refusal_problem(e: BaseException) -> str | None:
    """Why exception e is not an acceptable refusal (None: it is one)."""
    msg = f"{type(e).__name__}: {e}"
    if not isinstance(e, REFUSAL):
        return f"raised {msg[:400]} (a refusal is a ValueError or RuntimeError)"
    if any(s in str(e) for s in NOT_A_REFUSAL):
        return f"failed inside a collective instead of refusing: {msg[:400]}"
    return None


class IterModel:
    """The phase of the iteration as the model sees it (the same on every rank)."""

    def __init__(self):
        self.mb = 0  # micro-batches accepted since the last zero
        self.sync_mb = False  # one of them ran outside no_sync()
        self.n_sync_mb = 0  # how many ran outside no_sync()
        self.started = False  # start_grad_sync() called
        self.finished = False  # finish_grad_sync() (or step()) done
        self.stepped = False  # the optimizer stepped since the last zero
        self.poisoned = set()  # ranks that added a NaN gradient since the last zero (nan family)
        self.failed = False  # a finish raised after launching: phase 'failed' until the zero


class DDPLifecycle:
    def __init__(self, spec: dict, group, ctrl):
        self.spec = spec
        self.group, self.ctrl = group, ctrl
        self.rank, self.ws = group.rank(), group.size()
        self.layers = spec["layers"]
        self.names = sm.layer_names(self.layers)
        self.seed = spec["seed"]
        self.fp8 = spec["fp8"]
        self.k = 0  # global micro-batch counter (the data index)
        P0 = sm.initial_params(self.layers, self.seed)
        self.P = [dict(P0) for _ in range(self.ws)]  # model parameters per rank (float64)
        torch.manual_seed(self.seed)
        self.net = sm.Net(self.layers)
        with torch.no_grad():
            for n, p in self.net.named_parameters():
                p.copy_(P0[n].float())
        self.delayed = [i for i, s in enumerate(self.layers) if s["kind"] == "fp8" and s["delay"]]
        cfg = fp8dp.DistributedDataParallelConfig(
            overlap_grad_reduce=spec["overlap"],
            use_distributed_optimizer=spec["dist_opt"],
            average_in_collective=spec["avg"],
            bucket_size=spec["bucket_size"],
            delay_wgrad_compute=bool(self.delayed),
            grad_ledger=spec.get("ledger", False),
            grad_reduce_wire=spec.get("wire", "fp32"),
            check_for_nan_in_grad=spec.get("nan_check", False),
            defer_nan_check=spec.get("defer", False),
        )
        self.ddp = fp8dp.DistributedDataParallel(self.net, cfg, process_group=group)
        self.ddp._sync.communicator().set_timeout(COMM_TIMEOUT_S)
        self.params = dict(self.net.named_parameters())
        self.opt = None
        if spec["dist_opt"]:
            # fused: the SGD that skips its step on the device when told (found_inf), which
            # defer_nan_check needs; the same update as the default SGD, bit for bit
            fused = dict(fused=True) if spec.get("defer") else {}
            self.opt = fp8dp.DistributedOptimizer(torch.optim.SGD, self.ddp, lr=spec["lr"], **fused)
        self.it = IterModel()
        self.learned_sync_mb = 0  # micro-batches outside no_sync() in fp8dp's learning iteration
        self.zero_model()
        self.stale = False  # a .grad set by op_stale_grad, until the next zero
        self.saved = None  # (model state_dict, optimizer state_dict, P) of save_checkpoint
        self._post = []  # checks across ranks, run after the call (run_post_checks)
        # defer_nan_check: the ranks whose NaN the last finished iteration reduced, which the next
        # finish_grad_sync() (or check_deferred()) must report; it outlives zero_grad_buffer()
        self.pending = set()

    # ---- the model's gradient state ------------------------------------------------------------
    def zero_model(self):
        z = lambda: {n: torch.zeros_like(v) for n, v in self.P[0].items()}  # noqa: E731
        self.S = [z() for _ in range(self.ws)]  # local main_grad sums per rank
        self.M = [z() for _ in range(self.ws)]  # their magnitudes (the tolerance's)
        self.terms = 0  # contributions per element so far (for the bound)
        self.fifo = {i: [] for i in self.delayed}  # per delayed layer: queued contributions
        self.fifo_no_sync = {i: [] for i in self.delayed}  # ... and whether under no_sync()
        self.R = None  # the reduced gradient after finish (float64), and its magnitude
        self.RM = None
        self.it = IterModel()

    def dw_pending(self) -> int:
        return sum(len(q) for q in self.fifo.values())

    def maybe_launched(self) -> bool:
        """Some bucket may have started its collective (C5: with overlap_grad_reduce a micro-batch
        outside no_sync() completes the buckets)."""
        it = self.it
        return it.started or it.finished or (self.spec["overlap"] and it.sync_mb)

    def _split(self, contrib: sm.Contribution):
        """(now, deferred): which parameters' gradients a backward delivers at once and which
        the layer's backward_dw() delivers (C2/C3/C4: a delayed layer's weight always later; its
        bias at once in FP8 mode, where the bias gradient is eager, later without FP8)."""
        now, later = {}, {i: {} for i in self.delayed}
        for n in self.names:
            i = int(n.split(".")[1])
            deferred = i in self.delayed and (n.endswith("weight") or not self.fp8)
            (later[i] if deferred else now)[n] = (contrib.grad[n], contrib.mag[n])
        return now, later

    def _add(self, r, parts):
        for n, (g, m) in parts.items():
            self.S[r][n] = self.S[r][n] + g
            self.M[r][n] = self.M[r][n] + m

    def tol_local(self, n):
        return sm.fp32_tol(self.M[self.rank][n], len(self.layers) + 1, self.terms + 2)

    def tol_reduced(self, n):
        return sm.fp32_tol(self.RM[n], len(self.layers) + 1, self.terms + 2)

    # ---- snapshots: "refused before changing anything" --------------------------------------
    def snapshot(self) -> dict:
        s = {
            "main_grad": [p.main_grad.detach().clone() for p in self.ddp._params],
            "params": {n: p.detach().clone() for n, p in self.params.items()},
            "grad": {n: None if p.grad is None else p.grad.clone() for n, p in self.params.items()},
            "queues": [self.net.layers[i]._core.queued_wgrads for i in self.delayed],
            "phase": getattr(self.ddp._sync, "phase", None),
        }
        if self.opt is not None:
            s["masters"] = [m.detach().clone() for m in self.opt._masters]
            s["opt"] = copy.deepcopy(self.opt.optimizer.state_dict())
        return s

    def changed(self, before: dict) -> str | None:
        after = self.snapshot()
        for i, (a, b) in enumerate(zip(before["main_grad"], after["main_grad"])):
            if not _same(a, b):
                return f"main_grad of '{self.ddp._names[i]}' changed"
        for n in before["params"]:
            if not torch.equal(before["params"][n], after["params"][n]):
                return f"parameter '{n}' changed"
            ga, gb = before["grad"][n], after["grad"][n]
            if (ga is None) != (gb is None) or (ga is not None and not torch.equal(ga, gb)):
                return f".grad of '{n}' changed"
        if before["queues"] != after["queues"]:
            return f"delayed-wgrad queues changed: {before['queues']} -> {after['queues']}"
        if before["phase"] != after["phase"]:
            return f"phase changed: {before['phase']!r} -> {after['phase']!r}"
        if "masters" in before:
            for i, (a, b) in enumerate(zip(before["masters"], after["masters"])):
                if a.dtype != b.dtype or not torch.equal(a, b):
                    return f"optimizer master {i} changed"
            if _flat_state(before["opt"]) != _flat_state(after["opt"]):
                return "the inner optimizer's state or settings changed"
        return None

    def attempt(self, expectation: str, fn, what: str):
        """Runs fn under `expectation` ("ok" / "refuse" / "may_refuse"). Returns (tag, failure,
        result): tag "done" or "refused"."""
        before = self.snapshot() if expectation != "ok" else None
        self._last_error = None
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 (classified below)
            if expectation == "ok":
                return "refused", f"{what}: raised {type(e).__name__}: {str(e)[:600]}", None
            bad = refusal_problem(e)
            if bad:
                return "refused", f"{what}: {bad}", None
            self._last_error = str(e)
            if expectation == "raise" and getattr(self.ddp._sync, "phase", None) == "failed":
                self.it.failed = True  # launched: main_grad is not reduced, zero is next
                return "refused", None, None
            ch = self.changed(before)
            if ch:
                return "refused", f"{what} was refused but not before changing state: {ch}", None
            return "refused", None, None
        if expectation in ("refuse", "raise"):
            return "done", f"{what} was accepted; it must be refused before changing state", res
        return "done", None, res

    # ---- checks ----------------------------------------------------------------------------------
    def check_local(self) -> str | None:
        """Before any bucket launched: main_grad holds this rank's local sums."""
        if self.maybe_launched():
            return None
        for n in self.names:
            bad = sm.first_mismatch(
                f"main_grad of '{n}' (local sum of {self.it.mb} micro-batch(es))",
                self.params[n].main_grad,
                self.S[self.rank][n],
                self.tol_local(n),
            )
            if bad:
                return bad
        return None

    def check_reduced(self) -> str | None:
        """After finish_grad_sync(): the mean over ranks (C6); with the distributed optimizer only
        this rank's owned shards hold it."""
        if self.opt is not None or self.spec["dist_opt"]:
            names = self.ddp._names
            for s in self.ddp.owned_shards():
                n = names[s.param]
                sl = slice(s.param_offset, s.param_offset + s.numel)
                bad = sm.first_mismatch(
                    f"reduced gradient shard of '{n}' [{s.param_offset}:+{s.numel}]",
                    self.ddp.grad_shard(s),
                    self.R[n].flatten()[sl],
                    self.tol_reduced(n).flatten()[sl],
                )
                if bad:
                    return bad
        else:
            for n in self.names:
                bad = sm.first_mismatch(
                    f"reduced main_grad of '{n}'",
                    self.params[n].main_grad,
                    self.R[n],
                    self.tol_reduced(n),
                )
                if bad:
                    return bad
        for n, p in self.params.items():
            if p.grad is not None:
                return f"'{n}'.grad is not None after finish_grad_sync (C2 a: the hook clears it)"
        return None

    def gather_params(self):
        """Every rank's parameters (test-side collective on the control group)."""
        flat = torch.cat([self.params[n].detach().double().flatten() for n in self.names])
        out = [torch.empty_like(flat) for _ in range(self.ws)]
        dist.all_gather(out, flat, group=self.ctrl)
        res = []
        for f in out:
            d, o = {}, 0
            for n in self.names:
                k = self.params[n].numel()
                d[n] = f[o : o + k].view(self.params[n].shape).clone()
                o += k
            res.append(d)
        return res

    # The checks across ranks gather every rank's parameters on the control group. An op only
    # queues them (check_params, check_ranks_identical: always an op's last word); the Driver runs
    # them on every rank after the ranks have agreed on the call's outcome (run_post_checks).
    # Gathering inside the op, after a check that failed on one rank only, left the other rank
    # alone in the collective: gloo aborted ("op.preamble.length <= op.nbytes. 3200 vs 4",
    # docs/stateful_testing.md item 12) instead of the failure being reported.
    def check_params(self, what: str, tol_of=None) -> None:
        self._post.append((what, tol_of))

    def check_ranks_identical(self, what) -> None:
        self._post.append((what, "identical"))

    def run_post_checks(self) -> str | None:
        """The queued checks, then "the ranks' parameters are identical" (between calls), on one
        gather; the first failure, or None. A collective: every rank calls it."""
        got = self.gather_params()
        posts, self._post = self._post, []
        for what, tol_of in posts:
            bad = (
                self._identical(got, what)
                if tol_of == "identical"
                else self._params_match(got, what, tol_of)
            )
            if bad:
                return bad
        return self._identical(got, "between calls")

    def _params_match(self, got, what: str, tol_of) -> str | None:
        """Each rank's parameters against the model; then the model adopts the FP32 values (it
        was within the bound), so the next step's bound does not grow with the step count."""
        for r in range(self.ws):
            for n in self.names:
                tol = tol_of(n) if tol_of else 0.0
                bad = sm.first_mismatch(
                    f"{what}: parameter '{n}' on rank {r}", got[r][n], self.P[r][n], tol
                )
                if bad:
                    return bad
        self.P = [dict(g) for g in got]
        return None

    def _identical(self, got, what) -> str | None:
        for r in range(1, self.ws):
            for n in self.names:
                if not torch.equal(got[0][n], got[r][n]):
                    return f"{what}: parameter '{n}' differs between rank 0 and rank {r}"
        return None

    # ---- ops ----------------------------------------------------------------------------------------
    def expect_microbatch(self) -> str:
        it = self.it
        if it.started or it.finished or it.stepped:
            # C11: a gradient never lands in a bucket whose collective has started; after the
            # step only zero_grad_buffer() starts the next iteration.
            return "refuse"
        if it.sync_mb:
            # The micro-batch outside no_sync() is the iteration's last (C5); with
            # overlap_grad_reduce its hooks may have started the buckets. Another one: refused
            # (before any state changes), or accepted and counted. (Found by the long run, seed 2:
            # with overlap off fp8dp refuses it inside backward, "reported ready 2 times".)
            return "may_refuse"
        return "ok"

    def _forward(self, x, ifm, ckpt, save_on_cpu):
        def run(inp):
            return self.ddp(inp, is_first_microbatch=ifm)

        ctx = torch.autograd.graph.save_on_cpu() if save_on_cpu else contextlib.nullcontext()
        with ctx, fp8dp.fp8_autocast(enabled=self.fp8, fp8_recipe=sm.RECIPE):
            if ckpt == "nonreentrant":
                return tcp.checkpoint(run, x, use_reentrant=False)
            if ckpt == "reentrant":
                return tcp.checkpoint(run, x.requires_grad_(True), use_reentrant=True)
            return run(x)

    def op_microbatch(self, no_sync, dw_now, ifm, ckpt="none", save_on_cpu=False, poison=None):
        """poison (the nan family): the rank whose output gradient is NaN in this micro-batch, so
        that every gradient it adds (now and in its backward_dw()) is NaN."""
        k = self.k
        self.k += 1
        x, G = sm.microbatch_data(self.seed, k, self.rank)
        if poison == self.rank:
            G = G * float("nan")
        exp = self.expect_microbatch()
        queued_before = [self.net.layers[i]._core.queued_wgrads for i in self.delayed]

        def run():
            with self.ddp.no_sync() if no_sync else contextlib.nullcontext():
                out = self._forward(x, ifm, ckpt, save_on_cpu)
                sm.loss_of(out, G).backward()
                now = [self.net.layers[i]._core.queued_wgrads for i in self.delayed]
                if dw_now:
                    for j, i in enumerate(self.delayed):
                        for _ in range(now[j] - queued_before[j]):
                            self.net.layers[i].backward_dw()
            return now

        tag, bad, queued = self.attempt(exp, run, f"micro-batch {k} (no_sync={no_sync})")
        if bad or tag == "refused":
            return tag, bad
        # the model: every rank's contribution, delivered now or queued for backward_dw()
        for r in range(self.ws):
            xr, Gr = sm.microbatch_data(self.seed, k, r)
            c = sm.Contribution(self.layers, self.P[r], xr, Gr, self.fp8)
            if c.fp8_violation:
                return tag, c.fp8_violation
            if r == poison:  # the clean contribution's bound; NaN values
                c.grad = {n: torch.full_like(g, float("nan")) for n, g in c.grad.items()}
            now, later = self._split(c)
            self._add(r, now)
            for i in self.delayed:
                if r == 0:
                    self.fifo[i].append([None] * self.ws)
                    self.fifo_no_sync[i].append(no_sync)
                self.fifo[i][-1][r] = later[i]
        self.terms += 1
        for j, i in enumerate(self.delayed):
            if queued[j] - queued_before[j] != 1:
                return tag, (
                    f"layer {i}: one backward queued {queued[j] - queued_before[j]} weight "
                    "gradient(s), expected 1 (C3)"
                )
        self.it.mb += 1
        if poison is not None:
            self.it.poisoned.add(poison)
        self.it.sync_mb |= not no_sync
        self.it.n_sync_mb += not no_sync
        if dw_now:
            for i in self.delayed:
                self._pop_model(i)
        return tag, self.check_local()

    def _pop_model(self, i):
        self.fifo_no_sync[i].pop(0)
        parts = self.fifo[i].pop(0)
        for r in range(self.ws):
            self._add(r, parts[r])

    def op_backward_dw(self, layer, same_context=True):
        """backward_dw() of the oldest queued entry; same_context: inside no_sync() when that
        entry's micro-batch ran inside it (as fp8dp.pipeline runs an early micro-batch's W step);
        else outside, whatever the micro-batch was (readiness must still be exact: C11)."""
        ctx = (
            self.ddp.no_sync()
            if same_context and self.fifo_no_sync[layer][0]
            else contextlib.nullcontext()
        )

        def run():
            with ctx:
                self.net.layers[layer].backward_dw()

        tag, bad, _ = self.attempt("ok", run, f"backward_dw() (same_context={same_context})")
        if bad:
            return tag, bad
        self._pop_model(layer)
        return tag, self.check_local()

    def _learn_sync_mb(self):
        """A finish that reduced: the first one after a micro-batch outside no_sync() is where
        fp8dp learned its readiness counts."""
        if self.learned_sync_mb == 0 and self.it.sync_mb:
            self.learned_sync_mb = self.it.n_sync_mb

    def op_start_grad_sync(self):
        tag, bad, _ = self.attempt("ok", self.ddp.start_grad_sync, "start_grad_sync()")
        self.it.started = True
        return tag, bad

    def _reduce_model(self):
        self.R = {n: sum(self.S[r][n] for r in range(self.ws)) / self.ws for n in self.names}
        self.RM = {n: sum(self.M[r][n] for r in range(self.ws)) / self.ws for n in self.names}

    def expect_finish(self) -> str:
        if self.dw_pending():
            return "refuse"  # C5: an incomplete bucket at finish is an error naming it
        if self.it.failed:
            return "refuse"  # phase 'failed': only zero_grad_buffer() goes on
        if not self.it.finished:
            # check_for_nan_in_grad: the ranks agree on the flags, then all raise. With
            # defer_nan_check the finish reports the previous finished iteration's NaN (and
            # reduces this one's); without, this iteration's. Before any collective of the
            # iteration launched the refusal changes nothing; after, the phase is 'failed'.
            if self.spec.get("defer") and self.pending:
                return "raise"
            if self.spec.get("nan_check") and not self.spec.get("defer") and self.it.poisoned:
                return "raise"
        # fp8dp learns how often each parameter is reported ready per iteration from the first
        # iteration that finishes with a micro-batch outside no_sync(). When that one ran several
        # outside it (a misuse it accepted, microbatch_in_wrong_phase), a later iteration with
        # another number of them is incomplete at finish, refused with an error naming the
        # parameters (phases family, seed 12: learned 2, then 1 -> "ready 1 of 2").
        learned = self.learned_sync_mb
        if learned > 1 and self.it.sync_mb and self.it.n_sync_mb != learned:
            return "may_refuse"
        # An iteration without a micro-batch outside no_sync() (none at all, or all inside) is not
        # a partial one: finish_grad_sync() reduces what is there, in every iteration (as
        # Megatron's does). Was "may_refuse" while fp8dp refused it after the first iteration
        # (docs/stateful_testing.md, finding 3; fixed by H1b).
        return "ok"

    def _after_nan_raise(self) -> str | None:
        """A finish that raised for NaN: the message names every flagged rank; a deferred report
        is consumed (the next finish reduces); a clean refusal left the iteration as it was."""
        reported = self.pending if self.spec.get("defer") else self.it.poisoned
        msg = self._last_error or ""
        # this rank's own NaN with its parameters' names; the other ranks by number
        named = {int(r) for r in re.findall(r"rank (\d+) has NaN or Inf", msg)}
        for group in re.findall(r"rank\(s\) ([\d, ]+) found errors", msg):
            named |= {int(r) for r in group.replace(",", " ").split()}
        if named != reported:
            return (
                f"the NaN error names rank(s) {sorted(named)}, not {sorted(reported)}: {msg[:400]}"
            )
        if self.spec.get("defer"):
            self.pending = set()
        return None

    def _finished_model(self):
        """The model of a finish that reduced (explicit, or inside step())."""
        if not self.it.finished:
            self._learn_sync_mb()
            self._reduce_model()
            if self.spec.get("defer"):
                self.pending = set(self.it.poisoned)
        self.it.finished = True

    def op_finish_grad_sync(self):
        exp = self.expect_finish()
        tag, bad, _ = self.attempt(exp, self.ddp.finish_grad_sync, "finish_grad_sync()")
        if exp == "raise" and tag == "refused" and not bad:
            return tag, self._after_nan_raise()
        if bad or tag == "refused":
            return tag, bad
        self._finished_model()
        return tag, self.check_reduced()

    def op_check_deferred(self):
        """defer_nan_check: raise now (naming the ranks) if the last finished iteration reduced a
        NaN, and consume it; else a no-op. Never changes main_grad, the parameters or the phase."""
        exp = "refuse" if self.pending else "ok"
        tag, bad, _ = self.attempt(exp, self.ddp.check_deferred, "check_deferred()")
        if exp == "refuse" and tag == "refused" and not bad:
            return tag, self._after_nan_raise()
        return tag, bad

    def op_scale_gradients(self, f):
        it = self.it
        if it.stepped and self.opt is not None:
            # C11: after the distributed optimizer's step (copy_shards() after the finish) the
            # factor could no longer act; refused. (A plain SGD step on main_grad is invisible to
            # fp8dp: scaling then is the user's business and does what it says.)
            exp = "refuse"
        elif it.finished:
            exp = "ok"
        elif self.maybe_launched():
            exp = "may_refuse"  # wait for the collectives in flight, then scale; or refuse
        else:
            exp = "ok"
        tag, bad, _ = self.attempt(
            exp, lambda: self.ddp.scale_gradients(f), f"scale_gradients({f})"
        )
        if bad or tag == "refused":
            return tag, bad
        if it.finished:
            for n in self.names:
                self.R[n] = self.R[n] * f
                self.RM[n] = self.RM[n] * abs(f)
            return tag, self.check_reduced()
        for r in range(self.ws):
            for n in self.names:
                self.S[r][n] = self.S[r][n] * f
                self.M[r][n] = self.M[r][n] * abs(f)
        return tag, self.check_local()

    def op_zero(self, via_opt):
        in_flight = self.maybe_launched() and not self.it.finished and not self.it.failed
        exp = "may_refuse" if in_flight else "ok"
        fn = self.opt.zero_grad if (via_opt and self.opt is not None) else self.ddp.zero_grad_buffer
        tag, bad, _ = self.attempt(exp, fn, "zero_grad()" if via_opt else "zero_grad_buffer()")
        if bad or tag == "refused":
            return tag, bad
        self.zero_model()
        self.stale = False
        for n, p in self.params.items():
            if bool(p.main_grad.count_nonzero()):
                return tag, f"main_grad of '{n}' not zero after zero_grad_buffer()"
            if p.grad is not None:
                return tag, f"'{n}'.grad is not None after zero_grad_buffer() (C11 — phases)"
        return tag, None

    def op_step(self):
        """The optimizer step: fp8dp.DistributedOptimizer(SGD), or without it a plain SGD step on
        main_grad after finish_grad_sync() (what a Megatron-style loop does)."""
        lr = self.spec["lr"]
        exp = "may_refuse" if self.it.stepped else self.expect_finish()

        def run():
            if self.opt is not None:
                self.opt.step()
            else:
                self.ddp.finish_grad_sync()
                with torch.no_grad():
                    for p in self.ddp._params:
                        p.sub_(lr * p.main_grad)

        tag, bad, _ = self.attempt(exp, run, "optimizer step()")
        if exp == "raise" and tag == "refused" and not bad:
            return tag, self._after_nan_raise()
        if bad or tag == "refused":
            return tag, bad
        self._finished_model()
        self.it.stepped = True
        bad = self.check_reduced()
        if bad:
            return tag, bad
        if self.spec.get("defer") and self.it.poisoned:
            # found_inf: the fused SGD skipped the step on the device on every rank; the copy and
            # the all-gather wrote the same values back (bit for bit)
            self.check_params("after a step with NaN (skipped)")
            self.check_ranks_identical("after a step with NaN (skipped)")
            return tag, None
        for r in range(self.ws):
            self.P[r] = {n: self.P[r][n] - lr * self.R[n] for n in self.names}
        # the gradient's bound times lr, plus the FP32 rounding of p - lr g (two roundings)
        self.check_params(
            "after step()",
            lambda n: lr * self.tol_reduced(n) + 2 * sm.U32 * self.P[0][n].abs() + 1e-30,
        )
        self.check_ranks_identical("after step()")
        return tag, None

    def op_set_fp8(self, on):
        self.fp8 = on
        return "done", None

    def op_save_checkpoint(self):
        sd = copy.deepcopy(self.ddp.state_dict())
        osd = copy.deepcopy(self.opt.state_dict()) if self.opt is not None else None
        self.saved = (sd, osd, [dict(p) for p in self.P])
        return "done", None

    def op_load_checkpoint(self):
        sd, osd, P = self.saved

        def run():
            self.ddp.load_state_dict(copy.deepcopy(sd))
            if self.opt is not None:
                self.opt.load_state_dict(copy.deepcopy(osd))

        before = [p.main_grad.clone() for p in self.ddp._params]
        tag, bad, _ = self.attempt("ok", run, "checkpoint load (model + optimizer)")
        if bad:
            return tag, bad
        self.P = [dict(p) for p in P]
        for i, p in enumerate(self.ddp._params):
            if not _same(before[i], p.main_grad):
                return tag, f"main_grad of '{self.ddp._names[i]}' changed by the checkpoint load"
        return tag, self.check_params("after the checkpoint load")

    def op_broadcast_params(self):
        tag, bad, _ = self.attempt(
            "ok", lambda: self.ddp.broadcast_params(0), "broadcast_params(0)"
        )
        if bad:
            return tag, bad
        self.P = [dict(self.P[0]) for _ in range(self.ws)]
        return tag, self.check_params("after broadcast_params(0)")

    # ---- phases (C11): more cases ----------------------------------------------------------------
    def op_stale_grad(self, name):
        """A .grad left on a parameter by code outside DDP; the next zero_grad_buffer() /
        zero_grad() must clear it (C11 — phases), so that it never reaches main_grad."""
        with torch.no_grad():
            self.params[name].grad = torch.full_like(self.params[name], 7.0)
        self.stale = True
        return "done", None

    def op_shard_update_then_forward(self, delta):
        """copy_shards(); start_param_sync(); forward with overlap_param_gather=False: the forward
        must wait for the all-gather (the docstring's promise; C11 — phases)."""
        k = self.k
        self.k += 1
        x, _ = sm.microbatch_data(self.seed, k, self.rank)

        def run():
            # what DistributedOptimizer.step() does before it touches the masters: a master whose
            # parameter was written outside step() takes the new value first (C13). Without it
            # the 'all' family's copy_into_param + this rule wrote back the old weight + delta
            # (seed 7): the rule stands for the optimizer's own update, not a stale one.
            self.opt._refresh_moved_masters()
            masters = self.opt._masters
            with torch.no_grad():
                for m in masters:
                    m.add_(delta)
                self.ddp.copy_shards(masters)
                self.ddp.start_param_sync()
                with fp8dp.fp8_autocast(enabled=self.fp8, fp8_recipe=sm.RECIPE):
                    return self.ddp(x)

        tag, bad, out = self.attempt("ok", run, "copy_shards(); start_param_sync(); forward")
        if bad:
            return tag, bad
        # copy_shards() after finish_grad_sync() is the optimizer step of those gradients
        # (GradSync's phase 'stepped'; model finding of H1b: it was not modelled)
        self.it.stepped = self.it.stepped or self.it.finished
        for r in range(self.ws):
            self.P[r] = {n: v + delta for n, v in self.P[r].items()}
        if not self.fp8:
            exp, mag = sm.forward64(self.layers, self.P[self.rank], x)
            bad = sm.first_mismatch(
                "forward output right after start_param_sync()",
                out,
                exp,
                sm.fp32_tol(mag, len(self.layers) + 1, 1),
            )
            if bad:
                return tag, bad
        # master + delta rounds once in FP32 when the sum leaves the master's binade (found when
        # new rules shifted the phases family's draws: 0.2498... + 0.125, off by 2^-26)
        return tag, self.check_params(
            "after copy_shards + start_param_sync + forward",
            lambda n: sm.U32 * self.P[0][n].abs(),
        )

    # ---- params (C13 — masters follow parameters): parameters changed outside step() -------------
    def _load_fn(self, new):
        sd = {n: new[n].float() for n in self.names}
        return lambda: self.ddp.load_state_dict(sd, strict=False)

    def op_load_weights(self, per_rank, k):
        """The model's weights replaced through load_state_dict (a fine-tuning start); per_rank:
        each rank loads its own, then broadcast_params(0) makes them rank 0's."""
        new = [
            sm.other_params(self.layers, self.seed + k, r if per_rank else 0)
            for r in range(self.ws)
        ]

        def run():
            self._load_fn(new[self.rank])()
            if per_rank:
                self.ddp.broadcast_params(0)

        tag, bad, _ = self.attempt("ok", run, "load_state_dict(new weights)")
        if bad:
            return tag, bad
        self.P = [dict(new[0 if per_rank else r]) for r in range(self.ws)]
        return tag, self.check_params("after loading new weights")

    def op_copy_into_param(self, name, k):
        new = sm.other_params(self.layers, self.seed + k, 0)[name]

        def run():
            with torch.no_grad():
                self.params[name].copy_(new.float())

        tag, bad, _ = self.attempt("ok", run, f"'{name}'.copy_(new values)")
        if bad:
            return tag, bad
        for r in range(self.ws):
            self.P[r] = dict(self.P[r], **{name: new.clone()})
        return tag, self.check_params("after an in-place copy_")

    def op_reload_model_params(self, name, k):
        """A write the version counters cannot see (through .data), then Megatron's explicit
        DistributedOptimizer.reload_model_params()."""
        new = sm.other_params(self.layers, self.seed + k, 0)[name]

        def run():
            reload = getattr(self.opt, "reload_model_params", None)
            if reload is None:
                raise AssertionError("DistributedOptimizer has no reload_model_params() (C13)")
            self.params[name].data.copy_(new.float())
            reload()

        tag, bad, _ = self.attempt("ok", run, "reload_model_params()")
        if bad:
            return tag, bad
        for r in range(self.ws):
            self.P[r] = dict(self.P[r], **{name: new.clone()})
        return tag, self.check_params("after reload_model_params()")

    def bad_optimizer_state(self, kind):
        good = copy.deepcopy(self.opt.state_dict())
        if kind == "adam":  # another optimizer's state, of the right shapes
            ms = [torch.nn.Parameter(m.detach().clone()) for m in self.opt._masters] or [
                torch.nn.Parameter(torch.zeros(0))
            ]
            adam = torch.optim.Adam(ms, lr=1e-3)
            for m in ms:
                m.grad = torch.ones_like(m)
            adam.step()
            good["optimizer"] = adam.state_dict()
        elif kind == "bf16_masters":
            good["masters"] = [m.to(torch.bfloat16) for m in good["masters"]]
        elif kind == "short_master":
            good["masters"] = [m[:-1] for m in good["masters"]]
        elif kind == "missing_key":
            del good["shards"]
        return good

    def op_bad_optimizer_load(self, kind):
        bad_sd = self.bad_optimizer_state(kind)
        tag, bad, _ = self.attempt(
            "refuse", lambda: self.opt.load_state_dict(bad_sd), f"optimizer load_state_dict({kind})"
        )
        return tag, bad

    # ---- autograd (C14 — autograd-native saving) -------------------------------------------------
    def op_autograd_grad(self, layer):
        """torch.autograd.grad(loss, weight) through the bare module: the gradient returned as
        for nn.Linear and nothing else touched (main_grad, the queues), or refused before any
        state changes."""
        k = self.k
        self.k += 1
        x, G = sm.microbatch_data(self.seed, k, self.rank)
        w = self.net.layers[layer].weight
        before = self.snapshot()

        def run():
            with fp8dp.fp8_autocast(enabled=self.fp8, fp8_recipe=sm.RECIPE):
                out = self.net(x)
            return torch.autograd.grad(sm.loss_of(out, G), [w])[0]

        tag, bad, g = self.attempt("may_refuse", run, f"autograd.grad(loss, layers.{layer}.weight)")
        if bad or tag == "refused":
            return tag, bad
        ch = self.changed(before)
        if ch:
            return tag, f"autograd.grad(loss, layers.{layer}.weight) changed state: {ch}"
        n = f"layers.{layer}.weight"
        c = sm.Contribution(self.layers, self.P[self.rank], x, G, self.fp8)
        if g is None:
            return tag, f"autograd.grad returned None for '{n}'"
        return tag, sm.first_mismatch(
            f"autograd.grad of '{n}'", g, c.grad[n], sm.fp32_tol(c.mag[n], len(self.layers) + 1, 2)
        )

    # ---- agree (C12 — ranks agree) ---------------------------------------------------------------
    DISAGREE = {
        "average_in_collective": (False, True),
        "grad_reduce_wire": ("fp32", "bf16"),
        "bucket_size": (256, 512),
        "overlap_grad_reduce": (False, True),
        "use_distributed_optimizer": (False, True),
        "check_for_nan_in_grad": (False, True),
        "grad_reduce_in_fp32": (True, False),
        "grad_ledger": (False, True),
        "pad_buckets_for_high_nccl_busbw": (False, True),
        "comm_backend": ("auto", "process_group"),
        "nccl_blocking_wait": (False, True),
    }

    def op_build_disagreeing(self, field):
        """Another DDP over a fresh copy of the net, its config differing in one field on the
        odd ranks: every rank must raise, naming the field, at construction (no hang, no abort,
        no wrong mean later)."""
        value = self.DISAGREE[field][self.rank % 2]
        net = sm.Net(self.layers)
        kw = dict(delay_wgrad_compute=bool(self.delayed), bucket_size=256)
        kw[field] = value
        cfg = fp8dp.DistributedDataParallelConfig(**kw)
        made = []

        def run():
            made.append(fp8dp.DistributedDataParallel(net, cfg, process_group=self.group))

        tag, bad, _ = self.attempt(
            "refuse", run, f"DistributedDataParallel(config.{field} per rank)"
        )
        if (
            tag == "refused"
            and not bad
            and self._last_error is not None
            and field not in self._last_error
        ):
            bad = f"the refusal does not name the field '{field}': {self._last_error[:300]}"
        made.clear()
        return tag, bad

    def op_invariants(self):
        """Always true between calls: the queues as the model has them; p.grad of a DDP parameter
        None (the hooks move every gradient into main_grad). (The ranks' parameters identical:
        run_post_checks.)"""
        for j, i in enumerate(self.delayed):
            q = self.net.layers[i]._core.queued_wgrads
            if q != len(self.fifo[i]):
                return (
                    "done",
                    f"layer {i} has {q} queued weight gradient(s), the model {len(self.fifo[i])}",
                )
        for n, p in self.params.items():
            if p.grad is not None and not self.stale:
                return "done", f"'{n}'.grad is not None between calls"
        return "done", None

    def close(self) -> bool:
        """Waits for collectives the sequence left in flight (a parameter all-gather, buckets
        started but not finished), then drops the DDP. Returns False when that failed: the group
        is then out of step and is replaced."""
        ok = True
        try:
            if self.ddp._sync.param_sync_pending:
                self.ddp._sync.finish_param_sync()
            if (
                self.maybe_launched()
                and not self.it.finished
                and not self.it.failed
                and not self.dw_pending()
            ):
                self.ddp.finish_grad_sync()
        except Exception:  # noqa: BLE001 (the sequence already failed, or will be replaced)
            ok = False
        self.opt = None
        self.ddp = None
        return ok


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same values, NaN where the other has NaN (a poisoned gradient is
    unchanged although NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])


def _flat_state(sd) -> list:
    """A comparable form of a torch.optim state_dict: (key path, value) with tensors as tuples."""
    out = []

    def walk(path, v):
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(path + (str(k),), v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(path + (i,), x)
        elif isinstance(v, torch.Tensor):
            out.append((path, str(v.dtype), tuple(v.shape), tuple(v.flatten().tolist())))
        else:
            out.append((path, repr(v)))

    walk((), sd)
    return out


def new_group(ws_timeout_s: float = COMM_TIMEOUT_S):
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=ws_timeout_s))
