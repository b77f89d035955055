"""C11: the DDP iteration is a state machine (accumulating -> sync_started -> finished -> stepped
-> zero_grad_buffer() -> accumulating). Misordered calls are refused before they change anything;
the right order gives the float64 reference. One process (a gloo group of one): these are the
refusals and the readiness that need no second rank; tests/distributed/cases_phases.py has the
cases where the damage needs ranks (scale_gradients in flight, the parameter all-gather).

Tolerances: the models are FP32 with dp = 1, so main_grad is the sum over micro-batches of FP32
backprop gradients; against a float64 reference each element errs by a few FP32 roundings per
layer (k <= 24 products per dot product, 3 layers, 3 micro-batches): rtol 1e-5, atol 2^-17 bound
them (the FP32 summation bound of tests/distributed/cases_ddp.py). The FP8 readiness test compares
against the same fp8dp modules without DDP, fusion or delay: identical quantization, so only the
FP32 accumulation order differs (same bound).

Mechanism removed:
- Readiness by golden counts only (the tree before C11, tried 2026-12-03 with the same model and
  sequence in a scratch script): every delay=True case fails, "bucket(s) still incomplete ...
  '0.bias' (ready 1 of 2)" for off->on and "'2.bias' was reported ready 2 times ... but 1" for
  on->off; plain and fused pass there (their counts do not depend on FP8).
- Run one by one on 2026-12-03 (H1b; each guard disabled by an environment switch in a scratch
  build that was not committed): the forward refusal (begin_microbatch's phase check) removed ->
  the no_sync / start_grad_sync / forgotten-zero tests fail with "DID NOT RAISE RuntimeError";
  the stale-.grad slot ignored -> test_stale_grad_at_wrap_is_refused "DID NOT RAISE ValueError";
  zero_grad_buffer() not clearing .grad -> both test_zero_grad_clears_grad cases fail at
  "all(p.grad is None ...)"; copy_shards() not marking the step -> the forgotten-zero test gets
  "forward with grad enabled in phase 'finished'" where 'stepped' is expected; start_grad_sync()
  without its finished early return -> nothing here fails (with dp = 1 a second reduction is an
  identity and the phase stays 'finished'): tests/cpp/test_grad_sync.cpp counts the launches and
  catches it; readiness's exact counting of queued gradients replaced by
  learned marks -> the four delay=True FP8-switch cases fail ("a gradient of parameter '2.bias'
  arrived in phase 'sync_started'" or "assert 'accumulating' == 'sync_started'"). enter_no_sync()
  without its check is caught by tests/cpp/test_grad_sync.cpp (no_sync() after the finish).
  The H1b tests at the end name their own mutations.
"""

import contextlib
import copy
import itertools

import pytest
import torch
from torch import nn

import fp8dp

TOL = dict(rtol=1e-5, atol=2.0**-17)
N_MB = 3


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 5))


def batch(step, n_mb=N_MB):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n_mb, 4, 12, generator=g), torch.randn(n_mb, 4, 5, generator=g)


def loss_of(out, y):
    return ((out - y) ** 2).mean()


def reference(model, x, y, mbs):
    """float64 gradients of the sum of the micro-batches' losses, one per parameter."""
    ref = copy.deepcopy(model).double()
    ref.zero_grad()
    for k in mbs:
        loss_of(ref(x[k].double()), y[k].double()).backward()
    return [p.grad for p in ref.parameters()]


def check(ddp, ref):
    for p, r in zip(ddp._params, ref):
        torch.testing.assert_close(p.main_grad.double(), r, **TOL)


def wrap(model, group, **kw):
    kw = {"bucket_size": 100, "overlap_grad_reduce": True, **kw}
    cfg = fp8dp.DistributedDataParallelConfig(**kw)
    return fp8dp.DistributedDataParallel(model, cfg, process_group=group)


def iteration(ddp, x, y):
    """The right order: every micro-batch but the last under no_sync()."""
    ddp.zero_grad_buffer()
    for k in range(N_MB):
        with ddp.no_sync() if k < N_MB - 1 else contextlib.nullcontext():
            loss_of(ddp(x[k]), y[k]).backward()
    ddp.finish_grad_sync()


def test_phases_of_an_iteration(group):
    model = mlp()
    ddp = wrap(model, group, use_distributed_optimizer=True)
    opt = fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.0)
    x, y = batch(0)
    iteration(ddp, x, y)  # iteration 1 learns the readiness counts
    assert ddp.phase == "finished"
    opt.step()
    assert ddp.phase == "stepped"
    opt.zero_grad()
    assert ddp.phase == "accumulating"
    for k in range(N_MB - 1):
        with ddp.no_sync():
            loss_of(ddp(x[k]), y[k]).backward()
        assert ddp.phase == "accumulating"
    loss_of(ddp(x[N_MB - 1]), y[N_MB - 1]).backward()
    assert ddp.phase == "sync_started"  # overlap: every bucket launched during backward
    ddp.finish_grad_sync()
    assert ddp.phase == "finished"
    check(ddp, reference(model, x, y, range(N_MB)))


def test_no_sync_around_all_but_the_first_is_refused(group):
    """Case 1: the first micro-batch outside no_sync() completes and launches the buckets (once
    readiness is learned); a later micro-batch would add onto reduced values."""
    model = mlp()
    ddp = wrap(model, group)
    x, y = batch(0)
    iteration(ddp, x, y)
    ddp.zero_grad_buffer()
    loss_of(ddp(x[0]), y[0]).backward()
    assert ddp.phase == "sync_started"
    with ddp.no_sync():  # allowed (an earlier micro-batch's backward_dw() may run in it) ...
        with pytest.raises(RuntimeError, match=r"Only the LAST micro-batch of an iteration runs"):
            ddp(x[1])  # ... but not a micro-batch
    with pytest.raises(RuntimeError, match=r"Only the LAST micro-batch of an iteration runs"):
        ddp(x[1])
    # Nothing changed: finishing gives micro-batch 0's gradient alone.
    ddp.finish_grad_sync()
    check(ddp, reference(model, x, y, [0]))
    # Evaluation stays allowed in every phase.
    with torch.no_grad():
        ddp(x[1])
    iteration(ddp, x, y)  # and the right order works after zero_grad_buffer()
    check(ddp, reference(model, x, y, range(N_MB)))


def test_start_grad_sync_before_the_last_microbatch_is_refused(group):
    """Case 2: start_grad_sync() launches every bucket; the next micro-batch is refused."""
    model = mlp()
    ddp = wrap(model, group)
    x, y = batch(1)
    with ddp.no_sync():
        loss_of(ddp(x[0]), y[0]).backward()
    ddp.start_grad_sync()
    assert ddp.phase == "sync_started"
    with pytest.raises(RuntimeError, match=r"forward with grad enabled in phase 'sync_started'"):
        ddp(x[1])
    ddp.finish_grad_sync()
    check(ddp, reference(model, x, y, [0]))
    ddp.start_grad_sync()  # after the finish: a no-op, not a second reduction
    assert ddp.phase == "finished"
    check(ddp, reference(model, x, y, [0]))


def test_forgotten_zero_with_the_distributed_optimizer_is_refused(group):
    """Case 7: forward/backward/step, then forward again without zero_grad."""
    model = mlp()
    ddp = wrap(model, group, use_distributed_optimizer=True)
    opt = fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.1)
    x, y = batch(2)
    iteration(ddp, x, y)
    opt.step()
    params = [p.detach().clone() for p in ddp._params]
    grads = [p.main_grad.clone() for p in ddp._params]
    with pytest.raises(RuntimeError, match=r"phase 'stepped'.*zero_grad_buffer\(\)"):
        ddp(x[0])
    with pytest.raises(RuntimeError, match=r"scale_gradients\(\) in phase 'stepped'"):
        ddp.scale_gradients(0.5)
    for p, q, g in zip(ddp._params, params, grads):
        assert torch.equal(p, q) and torch.equal(p.main_grad, g)
    opt.zero_grad()
    iteration(ddp, x, y)  # gradients at the stepped parameters
    check(ddp, reference(model, x, y, range(N_MB)))


def test_stale_grad_at_wrap_is_refused(group):
    """Case 5: a .grad left from a backward before wrapping would be added to main_grad."""
    model = mlp()
    x, y = batch(3)
    loss_of(model(x[0]), y[0]).backward()
    with pytest.raises(ValueError, match=r"parameter '0.weight' on rank 0 has a .grad left"):
        wrap(model, group)
    model.zero_grad(set_to_none=True)
    ddp = wrap(model, group)
    iteration(ddp, x, y)
    check(ddp, reference(model, x, y, range(N_MB)))


@pytest.mark.parametrize("via", ["ddp", "optimizer"])
def test_zero_grad_clears_grad(group, via):
    """Case 5: a .grad set during an iteration (by the user, or autograd outside the hooks) must
    not reach the next iteration's main_grad."""
    model = mlp()
    ddp = wrap(model, group, use_distributed_optimizer=via == "optimizer")
    opt = fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.0) if via == "optimizer" else None
    x, y = batch(4)
    iteration(ddp, x, y)
    for p in ddp._params:
        p.grad = torch.full_like(p, 1000.0)
    (opt.zero_grad if opt else ddp.zero_grad_buffer)()
    assert all(p.grad is None for p in ddp._params)
    for k in range(N_MB):
        with ddp.no_sync() if k < N_MB - 1 else contextlib.nullcontext():
            loss_of(ddp(x[k]), y[k]).backward()
    ddp.finish_grad_sync()
    check(ddp, reference(model, x, y, range(N_MB)))


# ---- Case 6: FP8 switched between iterations ---------------------------------------------------
def fp8_model(fuse, delay):
    torch.manual_seed(0)
    return nn.Sequential(
        fp8dp.Linear(16, 32, bias=True, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay),
        nn.Tanh(),
        fp8dp.LayerNormLinear(
            32, 16, bias=True, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay
        ),
    )


ROUTES = {"plain": (False, False), "fused": (True, False), "delayed": (False, True)}
ROUTES["fused_delayed"] = (True, True)


@pytest.mark.parametrize(
    "order, route",
    list(itertools.product(["off_on", "on_off"], ROUTES)),
)
def test_fp8_switch_keeps_readiness_exact(group, fp8_states_released, order, route):
    """Case 6: readiness learnt in an FP8-off iteration must hold in an FP8-on one and back (the
    bias gradient is eager in FP8 mode, made by the deferred GEMM without it: C4). Three
    iterations (off, on, off or the reverse) with overlap; each main_grad against the same modules
    without DDP, fusion or delay."""
    fuse, delay = ROUTES[route]
    modes = [False, True, False] if order == "off_on" else [True, False, True]
    model, ref = fp8_model(fuse, delay), fp8_model(False, False)
    ddp = wrap(model, group, delay_wgrad_compute=delay, bucket_size=400)
    recipe = fp8dp.DelayedScaling()
    g = torch.Generator().manual_seed(5)
    for it, fp8 in enumerate(modes):
        x = torch.randn(2, 16, 16, generator=g)
        ddp.zero_grad_buffer()
        ref.zero_grad()
        for k in range(2):
            with ddp.no_sync() if k == 0 else contextlib.nullcontext():
                with fp8dp.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                    out, out_ref = ddp(x[k]), ref(x[k])
                (out**2).mean().backward()
                (out_ref**2).mean().backward()
                if delay:
                    model[2].backward_dw()
                    model[0].backward_dw()
        if delay and it > 0:
            # The delayed weights' buckets waited for backward_dw(); after it all launched.
            assert ddp.phase == "sync_started"
        ddp.finish_grad_sync()
        for p, r, name in zip(ddp._params, ref.parameters(), ddp._names):
            torch.testing.assert_close(
                p.main_grad, r.grad.float(), **TOL, msg=lambda m, n=name, i=it: f"{i} {n}: {m}"
            )


# ---- finish_grad_sync(): what is partial, and what a refusal may change (H1b) ------------------
def delayed_model():
    """Two delayed-wgrad Linears (FP8 off: high-precision GEMMs, so the float64 reference of
    reference() holds with TOL); their weight and bias gradients come from backward_dw()."""
    torch.manual_seed(0)
    return nn.Sequential(
        fp8dp.Linear(12, 24, delay_wgrad_compute=True),
        nn.Tanh(),
        fp8dp.Linear(24, 5, delay_wgrad_compute=True),
    )


def plain_twin(model):
    """The same weights in nn.Linear (fp8dp.Linear computes x W^T + b), for reference()."""
    twin = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 5))
    with torch.no_grad():
        for i in (0, 2):
            twin[i].weight.copy_(model[i].weight)
            twin[i].bias.copy_(model[i].bias)
    return twin


def microbatch(ddp, x, y, no_sync, dw=(0, 2)):
    """One micro-batch; backward_dw() right after its backward for the layers in dw."""
    with ddp.no_sync() if no_sync else contextlib.nullcontext():
        loss_of(ddp(x), y).backward()
        for i in dw:
            ddp.module[i].backward_dw()


def state(ddp):
    """What a refusal must leave as it was: main_grad, the phase, the delayed-wgrad queues."""
    return (
        [p.main_grad.clone() for p in ddp._params],
        ddp.phase,
        [m._core.queued_wgrads for m in ddp.module if isinstance(m, fp8dp.Linear)],
    )


def assert_same_state(before, after):
    assert after[1] == before[1], f"phase changed: {before[1]!r} -> {after[1]!r}"
    assert after[2] == before[2], f"delayed-wgrad queues changed: {before[2]} -> {after[2]}"
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b), "main_grad changed"


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", ["all_no_sync", "none"])
def test_iteration_without_reports_is_reduced(group, overlap, kind):
    """An iteration with no readiness report (every micro-batch inside no_sync(), or none at all)
    is not a partial one: finish_grad_sync() reduces what was accumulated, in every iteration as
    in the first (and as Megatron's finish_grad_sync without overlap). Stateful finding 3: it was
    accepted in iteration 1 and refused later ("bucket(s) still incomplete ... a skipped
    backward_dw()?"), and the refusal left the phase 'failed'.

    Mutation (run 2026-12-03): the any_reported() condition removed from local_errors() -> all 4
    cases fail in finish_grad_sync() with RuntimeError "bucket(s) still incomplete, these
    parameters were not reported ready as often as in the first iteration: '0.weight' (ready 0
    of 1) ..." (and, with this branch's refusal, "nothing changed": the phase stays).
    """
    model = mlp()
    ddp = wrap(model, group, overlap_grad_reduce=overlap)
    x, y = batch(5)
    for _ in range(2):  # the first iteration learns the counts; the second has them
        iteration(ddp, x, y)
    check(ddp, reference(model, x, y, range(N_MB)))
    ddp.zero_grad_buffer()
    mbs = range(N_MB) if kind == "all_no_sync" else []
    for k in mbs:
        with ddp.no_sync():
            loss_of(ddp(x[k]), y[k]).backward()
    ddp.finish_grad_sync()
    assert ddp.phase == "finished"
    if mbs:
        check(ddp, reference(model, x, y, mbs))
    else:
        assert all(not p.main_grad.count_nonzero() for p in ddp._params)  # exact: nothing added
    iteration(ddp, x, y)  # and the next iteration is a normal one
    check(ddp, reference(model, x, y, range(N_MB)))


@pytest.mark.parametrize("overlap", [False, True])
def test_refused_finish_before_any_launch_changes_nothing(group, overlap):
    """finish_grad_sync() with a backward_dw() still pending is refused; no bucket collective
    had run (overlap off, or the one bucket still waiting for that gradient), so the refusal
    leaves main_grad, the queue and the phase as they were, and the caller recovers by running
    the backward_dw() and finishing again (stateful finding 1: the queue went 1 -> 0 and the phase
    to 'failed').

    Mutations (run 2026-12-03, both cases): the queue cleared on refusal as before
    (undelivered_locked() after local_errors()) -> "delayed-wgrad queues changed: [1, 0] -> [0,
    0]"; refuse_finish_locked() abandoning the iteration whatever was launched -> the message
    says "had already launched ... (phase 'failed')" instead of "nothing changed" (regex
    mismatch).
    """
    model = delayed_model()
    twin = plain_twin(model)
    ddp = wrap(model, group, overlap_grad_reduce=overlap, bucket_size=10**6)
    x, y = batch(6)
    for _ in range(2):
        ddp.zero_grad_buffer()
        microbatch(ddp, x[0], y[0], no_sync=True)
        microbatch(ddp, x[1], y[1], no_sync=False)
        ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    microbatch(ddp, x[0], y[0], no_sync=True)
    microbatch(ddp, x[1], y[1], no_sync=False, dw=(2,))  # layer 0's backward_dw() forgotten
    before = state(ddp)
    assert before[1:] == ("accumulating", [1, 0])
    with pytest.raises(
        RuntimeError, match=r"(?s)never computed by backward_dw\(\): '0.weight'.*nothing changed"
    ):
        ddp.finish_grad_sync()
    assert_same_state(before, state(ddp))
    model[0].backward_dw()
    ddp.finish_grad_sync()
    assert ddp.phase == "finished"
    check(ddp, reference(twin, x, y, [0, 1]))


@pytest.mark.parametrize("overlap", [False, True])
def test_partial_iteration_is_refused(group, overlap):
    """A PARTIAL iteration (a backward outside no_sync() that reached only the last layer, via
    backward(inputs=...)) is an error naming the parameters not reported. Overlap off: nothing
    launched, so nothing changes. Overlap on: the last layer's bucket completed and launched its
    collective, so main_grad is partly reduced: phase 'failed', and the message says
    zero_grad_buffer() and redo the iteration; after that the next iteration is exact.

    Mutations (run 2026-12-03): refuse_finish_locked() never abandoning -> overlap on fails with
    "phase is 'accumulating', expected 'failed'"; always abandoning -> overlap off fails with
    "phase changed: 'accumulating' -> 'failed'".
    """
    model = mlp()
    ddp = wrap(model, group, overlap_grad_reduce=overlap)
    x, y = batch(7)
    iteration(ddp, x, y)
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        loss_of(ddp(x[0]), y[0]).backward()
    loss_of(ddp(x[1]), y[1]).backward(inputs=[model[2].weight, model[2].bias])
    before = state(ddp)
    assert before[1] == ("sync_started" if overlap else "accumulating")
    with pytest.raises(RuntimeError, match=r"(?s)still incomplete.*'0.weight' \(ready 0 of 1\)"):
        ddp.finish_grad_sync()
    if overlap:
        assert ddp.phase == "failed", f"phase is {ddp.phase!r}, expected 'failed'"
        with pytest.raises(RuntimeError, match=r"phase 'failed'.*zero_grad_buffer\(\)"):
            ddp.finish_grad_sync()
    else:
        assert_same_state(before, state(ddp))
    iteration(ddp, x, y)
    check(ddp, reference(model, x, y, range(N_MB)))


def test_second_microbatch_outside_no_sync_is_refused_at_its_forward(group):
    """Overlap off: nothing launches during backward, so a second micro-batch outside no_sync()
    passed the phase check and was refused by readiness inside its backward ("reported ready 2
    times"), after backward had queued its weight gradients (stateful finding 8). Its forward is
    refused instead, before anything changes; evaluation under no_grad() stays allowed, and
    finishing gives the first micro-batch's gradient alone.

    Mutation (run 2026-12-03): the first_at_golden() check removed from begin_microbatch() ->
    "DID NOT RAISE RuntimeError" at the forward. (On main, 69b1bfa, the backward then raises
    "'2.weight' was reported ready 2 times" and leaves a queued entry behind: queue 0 -> 1, so
    the next finish_grad_sync() is refused too.)
    """
    model = delayed_model()
    twin = plain_twin(model)
    ddp = wrap(model, group, overlap_grad_reduce=False)
    x, y = batch(8)
    ddp.zero_grad_buffer()
    microbatch(ddp, x[0], y[0], no_sync=False)
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    microbatch(ddp, x[0], y[0], no_sync=False)
    before = state(ddp)
    with pytest.raises(RuntimeError, match=r"outside no_sync\(\) after the iteration's last"):
        ddp(x[1])
    assert_same_state(before, state(ddp))
    with torch.no_grad():
        ddp(x[1])
    ddp.finish_grad_sync()
    check(ddp, reference(twin, x, y, [0]))


@pytest.mark.parametrize("overlap", [False, True])
def test_learning_iteration_with_two_synced_microbatches(group, overlap):
    """The first iteration ran two micro-batches outside no_sync() (a misuse that iteration cannot
    tell: it is the one that learns how often each parameter is reported ready), the next one
    runs one: its finish_grad_sync() is refused, naming the parameters ("ready 1 of 2") and the
    likely cause, and changes nothing; one more micro-batch outside no_sync() then completes the
    iteration with both micro-batches' gradients. (Stateful phases family, seed 12; the model
    expected the finish to succeed. The refusal is kept: counting one report as two would
    reduce buckets whose other uses have not arrived.)"""
    model = mlp()
    ddp = wrap(model, group, overlap_grad_reduce=overlap)
    x, y = batch(9)
    ddp.zero_grad_buffer()
    for k in range(2):
        loss_of(ddp(x[k]), y[k]).backward()
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    loss_of(ddp(x[0]), y[0]).backward()
    before = state(ddp)
    with pytest.raises(
        RuntimeError, match=r"(?s)ready 1 of 2.*fewer micro-batches outside no_sync\(\)"
    ):
        ddp.finish_grad_sync()
    assert_same_state(before, state(ddp))
    loss_of(ddp(x[1]), y[1]).backward()
    ddp.finish_grad_sync()
    check(ddp, reference(model, x, y, [0, 1]))


def test_earlier_backward_dw_in_its_no_sync_context_after_a_launch(group):
    """Overlap on: micro-batch 0 under no_sync() defers its backward_dw(); micro-batch 1's
    backward (outside) completes and launches layer 0's bucket (phase sync_started). Micro-batch
    0's deferred backward_dw() then runs in its own context, no_sync() (as a pipeline's W step of
    an early micro-batch does): it delivers into layer 2's bucket, which still waits for micro-batch
    1's, so it is accepted; the result is exact. (Stateful finding, fp8 family seed 2 after 630
    sequences: no_sync() was refused in phase 'sync_started'.)

    Mutation (run 2026-12-03): enter_no_sync() refusing sync_started again -> RuntimeError
    "no_sync() in phase 'sync_started'" at the with statement (here and in
    test_no_sync_around_all_but_the_first_is_refused).
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(12, 24), nn.Tanh(), fp8dp.Linear(24, 5, delay_wgrad_compute=True)
    )
    twin = plain_twin(model)
    ddp = wrap(model, group)
    x, y = batch(9)
    for it in range(2):
        ddp.zero_grad_buffer()
        microbatch(ddp, x[0], y[0], no_sync=True, dw=())
        microbatch(ddp, x[1], y[1], no_sync=False, dw=())
        if it == 1:
            assert ddp.phase == "sync_started"  # layer 0's bucket launched
        with ddp.no_sync():
            model[2].backward_dw()  # micro-batch 0's entry
        model[2].backward_dw()  # micro-batch 1's: completes layer 2's bucket
        ddp.finish_grad_sync()
        check(ddp, reference(twin, x, y, [0, 1]))


def test_scale_gradients_before_any_launch(group):
    """scale_gradients() between backward and finish_grad_sync(), overlap off (nothing launched)
    and the last layer's backward_dw() still pending: main_grad *= factor at once (exact: a
    factor of 0.5 is a power of two), and the gradient delivered afterwards is added unscaled.
    Stateful finding 7 (found at 5598b43, "main_grad left unscaled"): not reproduced on main
    (69b1bfa) nor here; this pins it.

    Mutation (run 2026-12-03): GradSync::scale_gradients() made a no-op for the accumulating
    phase -> "main_grad of '0.weight' is not 0.5 x its value before".
    """
    model = nn.Sequential(
        fp8dp.Linear(12, 24), nn.Tanh(), fp8dp.Linear(24, 5, delay_wgrad_compute=True)
    )
    twin = plain_twin(model)
    ddp = wrap(model, group, overlap_grad_reduce=False)
    x, y = batch(10)
    for _ in range(2):  # the second iteration with the counts learnt
        ddp.zero_grad_buffer()
        microbatch(ddp, x[0], y[0], no_sync=False, dw=())
        assert ddp.phase == "accumulating"
        before = [p.main_grad.clone() for p in ddp._params]
        ddp.scale_gradients(0.5)
        for n, p, b in zip(ddp._names, ddp._params, before):
            assert torch.equal(
                p.main_grad, 0.5 * b
            ), f"main_grad of '{n}' is not 0.5 x its value before"
        model[2].backward_dw()
        ddp.finish_grad_sync()
    ref = reference(twin, x, y, [0])
    for i, n in enumerate(ddp._names):
        ref[i] = ref[i] * (0.5 if n.startswith("0.") else 1.0)
    check(ddp, ref)


def fused_model(delay):
    """Two fused-wgrad Linears (FP8 off, so reference() holds with TOL): their weight gradients are
    accumulated into main_grad by the GEMM itself (beta = 1), in backward or in backward_dw()."""
    torch.manual_seed(0)
    kw = dict(fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    return nn.Sequential(fp8dp.Linear(12, 24, **kw), nn.Tanh(), fp8dp.Linear(24, 5, **kw))


def test_fused_gemm_into_a_launched_bucket_is_refused_before_it_writes(group):
    """Overlap on, fused wgrad in backward. Micro-batch 0's forward runs under no_sync(), then
    micro-batch 1's forward and backward outside it: every bucket completes and launches. Micro-
    batch 0's backward, run late in its own no_sync() context, would have the GEMM accumulate its
    weight gradient into a bucket that is being reduced. The layer asks the sink first
    (GradSink::check_accepting), so the refusal comes before the grad_output cast and the GEMM:
    main_grad, the phase ('sync_started', not 'failed') and the queues are as they were, and
    finish_grad_sync() reduces micro-batch 1's gradient, exact against float64.

    Without the check_accepting() call in LinearFunction::backward (the tree before it), the GEMM
    writes first and deliver() refuses after, marking the iteration failed: this test then fails
    at assert_same_state ("phase changed: 'sync_started' -> 'failed'"). (Derived from the code
    path, not run as a separate mutation build: the 2-core machine was saturated.) backward_dw()
    asks the sink the same way before it pops its queue (LinearCore::backward_dw); no public call
    order reaches that refusal today (start_grad_sync() and finish_grad_sync() refuse while
    entries are queued, and a bucket completes only with its queued deliveries), so it is defense
    that keeps "refused before anything changes" true by construction.
    """
    model = fused_model(delay=False)
    twin = plain_twin(model)
    ddp = wrap(model, group, bucket_size=40)
    x, y = batch(11)
    # The first iteration in the right order: readiness learns its counts (nothing launches
    # during a first iteration's backward).
    ddp.zero_grad_buffer()
    microbatch(ddp, x[0], y[0], no_sync=True, dw=())
    microbatch(ddp, x[1], y[1], no_sync=False, dw=())
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        loss0 = loss_of(ddp(x[0]), y[0])
    microbatch(ddp, x[1], y[1], no_sync=False, dw=())
    assert ddp.phase == "sync_started"
    before = state(ddp)
    with ddp.no_sync(), pytest.raises(RuntimeError, match=r"arrived in phase 'sync_started'"):
        loss0.backward()
    assert_same_state(before, state(ddp))
    ddp.finish_grad_sync()
    check(ddp, reference(twin, x, y, [1]))
