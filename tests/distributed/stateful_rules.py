"""The rules of the stateful lifecycle test (contracts C11-C15): hypothesis's RuleBasedStateMachine
generates sequences of API calls; every rank runs each call and compares its state with the
float64 model (stateful_ddp.py, stateful_pipeline.py).

Ranks in lockstep. Hypothesis runs on rank 0 only (the leader); each rule broadcasts its call
(name and drawn arguments) on a control group, every rank runs it (Driver.execute), and the ranks
all-gather their outcomes, so every rank agrees on pass / fail after every call and a failure on
one rank never leaves the others waiting in a collective (the DDP's own group has a short timeout,
and is replaced after any failure). Why not one hypothesis engine per rank with a shared seed:
the engine's shrinking stops at a wall-clock deadline (MAX_SHRINKING_SECONDS), so engines on
two ranks can choose different next calls; one leader makes the sequence identical by
construction, and the seed (printed) and `derandomize` still make a run repeatable.

Families: a family is a set of rules (a contract's mechanism and the legal calls around it); FAMILY
selects which rules the machine may draw. `lifecycle` is the legal lifecycle (micro-batches inside /
outside no_sync, backward_dw, start / finish_grad_sync, scale_gradients, zero_grad_buffer, optimizer
step and zero_grad, checkpoint round trips, broadcast_params, FP8 on or off per machine); `phases`
adds calls in the wrong phase, each of which must be refused before any state changes
(C11 — phases); `fp8` switches FP8 on and off between iterations (C11: readiness per route);
`params` changes parameters outside step() under the distributed optimizer and loads bad optimizer
state (C13 — masters follow parameters); `autograd` runs micro-batches under activation
checkpointing / save_on_cpu and autograd.grad on fused and delayed weights (C14 — autograd-native
saving); `agree` builds DDPs whose ranks disagree on one config field (C12 — ranks agree); `nan`
poisons micro-batches on one rank under check_for_nan_in_grad, with and without defer_nan_check
(the flags agreed across ranks, the step skipped on the device, the report at the next finish or
check_deferred(); C11's refusals); `all` draws from every DDP family at once but nan (its NaN
would reach the parameters of a DDP without the check); `pipeline` is the pipeline machine
(stateful_pipeline.py: PP 2 x DP 2, the distributed optimizer, a weight shared by the first and
the last stage, C15 — shared across stages)."""

from __future__ import annotations

import os
import traceback

import stateful_ddp as sd
import stateful_model as sm
import torch.distributed as dist
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

TRACE = bool(os.environ.get("FP8DP_STATEFUL_TRACE"))
FAMILIES = ("lifecycle", "phases", "fp8", "params", "autograd", "agree", "nan", "all")


class Stats:
    examples = 0  # machines built (sequences run)
    steps = 0  # calls run
    ops: dict = {}  # call -> [runs, refused]


class Driver:
    """Runs calls on every rank in lockstep (module docstring)."""

    def __init__(self, ctrl, builders: dict):
        self.ctrl = ctrl
        self.rank, self.ws = dist.get_rank(), dist.get_world_size()
        self.builders = builders  # op name -> callable(driver, **kw) returning the SUT
        self.group = None
        self.life = None
        self.broken = True  # build a fresh group for the first machine

    def call(self, op: str, kw: dict):
        """Leader: send the call to every rank, run it here, return (ok, failure text)."""
        dist.broadcast_object_list([(op, kw)], src=0, group=self.ctrl)
        return self.execute(op, kw)

    def follow(self) -> None:
        """Follower: run calls until the leader says stop."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.ctrl)
            op, kw = box[0]
            if op == "stop":
                return
            self.execute(op, kw)

    def stop(self) -> None:
        dist.broadcast_object_list([("stop", {})], src=0, group=self.ctrl)

    def execute(self, op: str, kw: dict):
        Stats.steps += 1
        if TRACE:  # every call, flushed: the last lines name the call a dying rank was in
            print(f"[stateful rank {self.rank}] {op} {kw}", flush=True)
        try:
            if op in self.builders:
                self._teardown()
                if self.broken:  # the old group may hold a half-run collective
                    if self.group is not None:
                        dist.destroy_process_group(self.group)
                    self.group = sd.new_group()
                    self.broken = False
                self.life = self.builders[op](self, **kw)
                tag, bad = "done", None
                if hasattr(self.life, "build_outcome"):
                    tag, bad = self.life.build_outcome
            elif op == "teardown":
                self._teardown()
                tag, bad = "done", None
            else:
                tag, bad = getattr(self.life, "op_" + op)(**kw)
            if not bad and self.life is not None and hasattr(self.life, "op_invariants"):
                bad = self.life.op_invariants()[1]
        except Exception as e:  # noqa: BLE001 (a bug of the test or an unexpected escape)
            tag = "error"
            bad = f"{op}: {type(e).__name__}: {str(e)[:800]}\n{traceback.format_exc()[-2000:]}"
        count = Stats.ops.setdefault(op, [0, 0])
        count[0] += 1
        count[1] += tag == "refused"
        post = self.life is not None and hasattr(self.life, "run_post_checks")
        outs = [None] * self.ws
        dist.all_gather_object(outs, (tag, bad, post), group=self.ctrl)
        fails = [f"rank {r}: {b}" for r, (_, b, _) in enumerate(outs) if b]
        tags = [t for t, _, _ in outs]
        if len(set(tags)) > 1:
            fails.append(f"ranks disagree on the outcome of {op}: {tags}")
        if all(p for _, _, p in outs):
            # the checks across ranks (a gather on this control group), on every rank whatever
            # the call's outcome was on each: a collective only some ranks enter aborts gloo
            try:
                late = self.life.run_post_checks()
            except Exception as e:  # noqa: BLE001 (reported like a failed check)
                late = f"{op}: checks across ranks: {type(e).__name__}: {str(e)[:800]}"
            lates = [None] * self.ws
            dist.all_gather_object(lates, late, group=self.ctrl)
            fails += [f"rank {r}: {b}" for r, b in enumerate(lates) if b and not outs[r][1]]
        elif post:
            self.life._post.clear()
        if fails:
            self.broken = True
        return (not fails), "\n".join(fails)

    def _teardown(self):
        if self.life is not None:
            if not self.life.close():
                self.broken = True
            self.life = None


def build_ddp(driver, spec):
    return sd.DDPLifecycle(spec, driver.group, driver.ctrl)


BUILDERS = {"build": build_ddp}

# ---- the DDP machine -----------------------------------------------------------------------------
LAYER = st.fixed_dictionaries(
    dict(
        kind=st.sampled_from(["fp8", "fp8", "torch"]),
        bias=st.booleans(),
        fuse=st.booleans(),
        delay=st.booleans(),
    )
)


@st.composite
def ddp_spec(draw, family):
    dist_opt = True if family == "params" else draw(st.booleans())
    return dict(
        seed=draw(st.integers(0, 2**20)),
        layers=draw(st.lists(LAYER, min_size=1, max_size=3)),
        overlap=draw(st.booleans()),
        dist_opt=dist_opt,
        avg=draw(st.booleans()),
        bucket_size=draw(st.sampled_from([sm.D * sm.D // 2, sm.D * sm.D, 4 * sm.D * sm.D])),
        lr=draw(st.sampled_from([0.0, 2.0**-6])),
        fp8=draw(st.booleans()),
        ledger=family in ("autograd", "all") and draw(st.booleans()),
        nan_check=family == "nan",
        # drawn only for the nan family, last: the other families' specs draw as before
        defer=family == "nan" and dist_opt and draw(st.booleans()),
    )


def _on(*fams):
    """Precondition: the machine is built and its family is one of fams (or "all", unless fams is
    the nan family alone); while a stale .grad is set (phases) or the iteration failed (nan),
    only zero_grad may follow."""
    return lambda self: (
        self.built
        and (self.FAMILY in fams or (self.FAMILY == "all" and fams != ("nan",)))
        and not self.L.stale
        and not self.L.it.failed
    )


ANY = ("lifecycle", "phases", "fp8", "params", "autograd", "agree", "nan")


class DDPMachine(RuleBasedStateMachine):
    FAMILY = "lifecycle"
    DRIVER: Driver = None

    def __init__(self):
        super().__init__()
        self.built = False
        Stats.examples += 1

    def call(self, op, **kw):
        ok, msg = self.DRIVER.call(op, kw)
        assert ok, msg

    @property
    def L(self) -> sd.DDPLifecycle:
        return self.DRIVER.life

    def teardown(self):
        self.DRIVER.call("teardown", {})

    # -- construction
    @initialize(spec=st.deferred(lambda: ddp_spec(DDPMachine.FAMILY)))
    def build(self, spec):
        self.call("build", spec=spec)
        self.built = True

    # -- the legal lifecycle
    def _quiet(self):
        """No delayed wgrad pending and no collective in flight (a call there is a misuse)."""
        L = self.L
        in_flight = L.maybe_launched() and not L.it.finished and not L.it.failed
        return L.dw_pending() == 0 and not in_flight

    @precondition(lambda self: _on(*ANY)(self) and self.L.expect_microbatch() == "ok")
    @rule(
        no_sync=st.booleans(),
        dw_now=st.booleans(),
        ifm=st.sampled_from([None, True, False]),
    )
    def microbatch(self, no_sync, dw_now, ifm):
        # backward_dw() pops the oldest entry: right after a backward it is this micro-batch's
        # only when nothing older waits (else an earlier micro-batch's W runs in this one's
        # no_sync context: the phases family's backward_dw_outside_no_sync; long run seed 3)
        dw_now = dw_now and self.L.dw_pending() == 0
        self.call("microbatch", no_sync=no_sync, dw_now=dw_now, ifm=ifm)

    @precondition(lambda self: _on(*ANY)(self) and self.L.expect_microbatch() == "ok")
    @rule(dw_now=st.booleans())
    def microbatch_no_sync(self, dw_now):
        """(a second rule for micro-batches: hypothesis draws rules uniformly, and a lifecycle is
        mostly micro-batches)"""
        dw_now = dw_now and self.L.dw_pending() == 0  # (see microbatch)
        self.call("microbatch", no_sync=True, dw_now=dw_now, ifm=None)

    @precondition(lambda self: _on(*ANY)(self) and self.L.dw_pending() > 0)
    @rule(data=st.data())
    def backward_dw(self, data):
        layer = data.draw(st.sampled_from([i for i, q in self.L.fifo.items() if q]))
        self.call("backward_dw", layer=layer)

    @precondition(
        lambda self: _on(*ANY)(self)
        and self.L.it.mb >= 1
        and self.L.dw_pending() == 0
        and not (self.L.it.started or self.L.it.finished)
    )
    @rule()
    def start_grad_sync(self):
        self.call("start_grad_sync")

    @precondition(lambda self: _on(*ANY)(self) and self.L.dw_pending() == 0)
    @rule()
    def finish_grad_sync(self):
        self.call("finish_grad_sync")

    @precondition(lambda self: _on(*ANY)(self) and self.L.it.finished)
    @rule(f=st.sampled_from([0.5, 0.25, 2.0, 3.0]))
    def scale_gradients(self, f):
        self.call("scale_gradients", f=f)

    @precondition(
        lambda self: self.built
        and self._quiet()
        and (self.L.stale or self.L.it.failed or _on(*ANY)(self))
    )
    @rule(via_opt=st.booleans())
    def zero_grad(self, via_opt):
        self.call("zero", via_opt=via_opt)

    @precondition(lambda self: _on(*ANY)(self) and self._quiet() and not self.L.it.stepped)
    @rule()
    def step(self):
        self.call("step")

    # (the calls below come after a step: hypothesis draws rules uniformly, and the lifecycle's
    # substance is micro-batches, syncs and steps)
    @precondition(lambda self: _on(*ANY)(self) and self._quiet() and self.L.it.stepped)
    @rule()
    def save_checkpoint(self):
        self.call("save_checkpoint")

    @precondition(
        lambda self: _on(*ANY)(self)
        and self._quiet()
        and self.L.saved is not None
        and self.L.it.stepped
    )
    @rule()
    def load_checkpoint(self):
        self.call("load_checkpoint")

    @precondition(lambda self: _on(*ANY)(self) and self._quiet() and self.L.it.stepped)
    @rule()
    def broadcast_params(self):
        self.call("broadcast_params")

    @invariant()
    def model_consistent(self):
        """The model's own phase is coherent (rank 0, no collective; the ranks' states are
        compared with the model by every call, Driver.execute + DDPLifecycle.op_invariants)."""
        if self.built:
            it = self.L.it
            assert not it.stepped or it.finished, "model: stepped without finishing"
            assert (self.L.R is not None) == it.finished, "model: reduced values vs phase"
            assert all(
                len(q) <= it.mb for q in self.L.fifo.values()
            ), "model: queue > micro-batches"

    # -- phases (C11 — phases): calls in the wrong phase
    @precondition(
        lambda self: _on("phases")(self)
        and self.L.expect_microbatch() != "ok"
        and self.L.dw_pending() == 0
    )
    @rule(no_sync=st.booleans(), ifm=st.sampled_from([None, True, False]))
    def microbatch_in_wrong_phase(self, no_sync, ifm):
        self.call("microbatch", no_sync=no_sync, dw_now=True, ifm=ifm)

    @precondition(lambda self: _on("phases")(self) and self.L.dw_pending() > 0)
    @rule(data=st.data())
    def backward_dw_outside_no_sync(self, data):
        """An earlier micro-batch's deferred backward_dw() run outside no_sync()."""
        layer = data.draw(st.sampled_from([i for i, q in self.L.fifo.items() if q]))
        self.call("backward_dw", layer=layer, same_context=False)

    @precondition(lambda self: _on("phases")(self) and self.L.dw_pending() > 0)
    @rule()
    def finish_with_backward_dw_pending(self):
        self.call("finish_grad_sync")

    # scale_gradients() before finish_grad_sync(): in flight (the case) or before any
    # launch (found by the long run: main_grad is left unscaled, docs/stateful_testing.md)
    @precondition(
        lambda self: _on("phases")(self) and not self.L.it.finished and not self.L.it.stepped
    )
    @rule(f=st.sampled_from([0.5, 3.0]))
    def scale_gradients_in_flight(self, f):
        self.call("scale_gradients", f=f)

    @precondition(
        lambda self: _on("phases")(self) and self.L.dw_pending() == 0 and self.L.it.stepped
    )
    @rule()
    def step_again(self):
        self.call("step")

    @precondition(lambda self: _on("phases")(self) and self._quiet() and not self.L.stale)
    @rule(data=st.data())
    def stale_grad(self, data):
        self.call("stale_grad", name=data.draw(st.sampled_from(self.L.names)))

    @precondition(
        lambda self: _on("phases")(self)
        and self.L.opt is not None
        and self.L.it.mb == 0
        and self._quiet()
    )
    @rule(delta=st.sampled_from([2.0**-3, -(2.0**-2)]))
    def shard_update_then_forward(self, delta):
        self.call("shard_update_then_forward", delta=delta)

    # -- params (C13 — masters follow parameters): parameters changed outside step() (the
    # distributed optimizer)
    @precondition(lambda self: _on("params")(self) and self.L.opt is not None and self._quiet())
    @rule(per_rank=st.booleans(), k=st.integers(0, 3))
    def load_weights(self, per_rank, k):
        self.call("load_weights", per_rank=per_rank, k=k)

    @precondition(lambda self: _on("params")(self) and self.L.opt is not None and self._quiet())
    @rule(data=st.data(), k=st.integers(0, 3))
    def copy_into_param(self, data, k):
        self.call("copy_into_param", name=data.draw(st.sampled_from(self.L.names)), k=k)

    @precondition(lambda self: _on("params")(self) and self.L.opt is not None and self._quiet())
    @rule(data=st.data(), k=st.integers(0, 3))
    def reload_model_params(self, data, k):
        self.call("reload_model_params", name=data.draw(st.sampled_from(self.L.names)), k=k)

    @precondition(lambda self: _on("params")(self) and self.L.opt is not None and self._quiet())
    @rule(kind=st.sampled_from(["adam", "bf16_masters", "short_master", "missing_key"]))
    def bad_optimizer_load(self, kind):
        self.call("bad_optimizer_load", kind=kind)

    # -- autograd (C14 — autograd-native saving)
    @precondition(lambda self: _on("autograd")(self) and self.L.expect_microbatch() == "ok")
    @rule(
        no_sync=st.booleans(),
        dw_now=st.booleans(),
        ckpt=st.sampled_from(["none", "nonreentrant", "reentrant"]),
        save_on_cpu=st.booleans(),
    )
    def microbatch_checkpointed(self, no_sync, dw_now, ckpt, save_on_cpu):
        dw_now = dw_now and self.L.dw_pending() == 0  # (see microbatch)
        self.call(
            "microbatch",
            no_sync=no_sync,
            dw_now=dw_now,
            ifm=None,
            ckpt=ckpt,
            save_on_cpu=save_on_cpu,
        )

    @precondition(lambda self: _on("autograd")(self) and self._quiet())
    @rule(data=st.data())
    def autograd_grad(self, data):
        self.call("autograd_grad", layer=data.draw(st.integers(0, len(self.L.layers) - 1)))

    # -- agree (C12 — ranks agree): ranks that disagree on one config field
    @precondition(lambda self: _on("agree")(self) and self._quiet())
    @rule(field=st.sampled_from(sorted(sd.DDPLifecycle.DISAGREE)))
    def build_disagreeing(self, field):
        self.call("build_disagreeing", field=field)

    # -- fp8 (C11): FP8 on / off between iterations
    @precondition(lambda self: _on("fp8")(self) and self.L.it.mb == 0 and self.L.dw_pending() == 0)
    @rule(on=st.booleans())
    def set_fp8(self, on):
        self.call("set_fp8", on=on)

    # -- nan (check_for_nan_in_grad, defer_nan_check): a NaN gradient on one rank
    @precondition(lambda self: _on("nan")(self) and self.L.expect_microbatch() == "ok")
    @rule(no_sync=st.booleans(), dw_now=st.booleans(), report=st.booleans(), data=st.data())
    def microbatch_poisoned(self, no_sync, dw_now, report, data):
        """report: check_deferred() first, as the training loop does before a checkpoint (the
        rule below alone was seldom drawn: hypothesis enables a random subset of the rules per
        sequence)."""
        dw_now = dw_now and self.L.dw_pending() == 0  # (see microbatch)
        poison = data.draw(st.integers(0, self.L.ws - 1))
        if report and self.L.spec["defer"]:
            self.call("check_deferred")
        self.call("microbatch", no_sync=no_sync, dw_now=dw_now, ifm=None, poison=poison)

    @precondition(lambda self: _on("nan")(self) and self.L.spec["defer"])
    @rule()
    def deferred_report(self):
        """check_deferred(): what the training loop calls before a checkpoint and at the end."""
        self.call("check_deferred")
