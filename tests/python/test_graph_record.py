"""fp8dp.make_graphed_callables on the CPU: everything but the CUDA graph itself.

- The argument errors (ValueError naming the argument, before any work) and the clear RuntimeError
  for valid arguments on a machine without CUDA.
- GraphRecord (src/modules/graph_record.h) with real layers, no mocks: while a record is active the
  layers keep their fused route under autograd.grad (which make_graphed_callables captures the
  backward with), report what a replay must repeat (the delayed amaxes' observed mark, stateless
  recipes, grad_added_to_main_grad), and a capture phase takes back the mark the capture itself
  left. replay_forward / replay_backward re-issue each effect.
- The FP8 state's capture readiness and its in-place restore (the graph reads it by address).

The CUDA half (capture, replay against eager bit for bit) is tests/python/test_graphed_cuda.py.

Mutation evidence (2026-12-05, each change built and run, then restored): plan_wgrad without the
record exception fails the two fused-route tests and the grad_added test; GraphRecord::end without
putting the saved mark back fails the two observed-mark tests; ScalingState::restore never in
place fails the in-place test; replay_backward without the grad_added call fails its test;
route_wgrad queueing the task under a backward capture fails the two template tests and the
missing-graph test; before_backward without the queued check fails the two template tests.
"""

import pytest
import torch

import fp8dp
from fp8dp import _C

IN, OUT, TOKENS = 32, 48, 32


def _observed() -> bool:
    return bool(_C.fp8_registry_signature()[1])


def _recipes_noted() -> bool:
    return _C.fp8_registry_signature()[3] != -1


def _fresh_step_state():
    """No observation and no noted recipe pending (what update_fp8_scales leaves)."""
    fp8dp.update_fp8_scales()
    assert not _observed() and not _recipes_noted()


def _layer(kind="Linear", **kw):
    torch.manual_seed(0)
    if kind == "Linear":
        return fp8dp.Linear(IN, OUT, **kw)
    return fp8dp.LayerNormLinear(IN, OUT, **kw)


def _train_step(m, recipe):
    x = torch.randn(TOKENS, IN, requires_grad=True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(x)
    y.backward(torch.randn_like(y))
    fp8dp.update_fp8_scales()


class _Active:
    def __init__(self, record, phase):
        self.record, self.phase = record, phase

    def __enter__(self):
        self.record.begin(self.phase)
        return self.record

    def __exit__(self, *exc):
        self.record.end()
        return False


# ---- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, x: fp8dp.make_graphed_callables(lambda t: t, (x,)), "modules: expected"),
        (lambda m, x: fp8dp.make_graphed_callables((), ()), "non-empty tuple"),
        (lambda m, x: fp8dp.make_graphed_callables((m, 3), ((x,), (x,))), r"modules\[1\]"),
        (lambda m, x: fp8dp.make_graphed_callables(m, (x,), num_warmup_iters=0), "num_warmup"),
        (lambda m, x: fp8dp.make_graphed_callables(m, (x,), num_warmup_iters=True), "num_warmup"),
        (lambda m, x: fp8dp.make_graphed_callables(m, x), "sample_args: expected a non-empty"),
        (lambda m, x: fp8dp.make_graphed_callables(m, ()), "sample_args: expected a non-empty"),
        (lambda m, x: fp8dp.make_graphed_callables(m, (x, 2.0)), r"sample_args\[1\]: expected"),
        (lambda m, x: fp8dp.make_graphed_callables((m,), (x,)), r"sample_args\[0\]: expected"),
        (lambda m, x: fp8dp.make_graphed_callables((m, m), ((x,),)), "one tuple of tensors"),
        (lambda m, x: fp8dp.make_graphed_callables((m, m), ((x,), (x,))), "captured once"),
    ],
)
def test_argument_errors(call, match):
    m, x = _layer(), torch.randn(TOKENS, IN)
    with pytest.raises(ValueError, match=match):
        call(m, x)


def test_refused_layers_and_modules():
    x = torch.randn(TOKENS, IN)
    m = _layer(delay_wgrad_compute=True)
    y = m(x.clone().requires_grad_(True))
    y.backward(torch.randn_like(y))
    with pytest.raises(ValueError, match="1 weight gradient.s. queued; run backward_dw"):
        fp8dp.make_graphed_callables(m, (x,))
    m.backward_dw()
    seq = torch.nn.Sequential(_layer())
    seq.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="hooks"):
        fp8dp.make_graphed_callables(seq, (x,))
    m = _layer()
    m.register_buffer("b", torch.zeros(2, requires_grad=True))
    with pytest.raises(ValueError, match="buffer 'b' requires grad"):
        fp8dp.make_graphed_callables(m, (x,))


@pytest.mark.skipif(fp8dp.cuda_available(), reason="the error without CUDA")
def test_valid_arguments_without_cuda_raise_clearly():
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device: "):
        fp8dp.make_graphed_callables(_layer(), (torch.randn(TOKENS, IN),))


# ---- GraphRecord: what the layers report and what a replay re-issues ------------------------


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
def test_fused_route_is_kept_under_an_active_record(kind):
    """make_graphed_callables captures the backward through autograd.grad, which would otherwise
    return the weight gradient unfused (C14): under a record the GEMM accumulates into main_grad
    and autograd gets the stand-in, as in a plain backward."""
    m = _layer(kind, fuse_wgrad_accumulation=True)
    m.weight.main_grad = torch.zeros(OUT, IN)
    m.weight.zero_out_wgrad = True  # a zero stand-in (else uninitialised memory)
    x = torch.randn(TOKENS, IN, requires_grad=True)
    dy = torch.randn(TOKENS, OUT)

    y = m(x)
    (dw_plain,) = torch.autograd.grad(y, [m.weight], dy)
    assert torch.count_nonzero(m.weight.main_grad) == 0, "C14 without a record: main_grad untouched"

    rec = _C.GraphRecord()
    with _Active(rec, _C.GraphPhase.WARMUP):
        y = m(x)
        (dw_rec,) = torch.autograd.grad(y, [m.weight], dy)
    # The same GEMM on the same operands: main_grad (zero before) holds exactly dW.
    assert torch.equal(m.weight.main_grad, dw_plain)
    assert m.weight.grad_added_to_main_grad
    assert torch.count_nonzero(dw_plain) > 0
    assert torch.count_nonzero(dw_rec) == 0, "autograd got the stand-in, not the gradient"


def test_capture_phases_record_the_observed_mark_and_take_it_back():
    m = _layer()
    recipe = fp8dp.DelayedScaling()
    _train_step(m, recipe)  # scales set
    _fresh_step_state()
    x = torch.randn(TOKENS, IN, requires_grad=True)
    rec = _C.GraphRecord()
    with _Active(rec, _C.GraphPhase.FORWARD), fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(x)
    assert rec.forward_observed and not rec.backward_observed
    assert not _observed(), "the capture's own mark is taken back"
    with _Active(rec, _C.GraphPhase.BACKWARD):
        y.backward(torch.randn_like(y))  # the grad_output cast records an amax
    assert rec.backward_observed and not _observed()

    use = rec.replay_forward()
    assert _observed()
    fp8dp.update_fp8_scales()
    assert not _observed()
    rec.replay_backward(use)
    assert _observed()
    fp8dp.update_fp8_scales()


def test_a_phase_puts_back_an_earlier_mark():
    m = _layer()
    recipe = fp8dp.DelayedScaling()
    _train_step(m, recipe)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        m(torch.randn(TOKENS, IN))  # an eager forward of this step: observed
    assert _observed()
    rec = _C.GraphRecord()
    with _Active(rec, _C.GraphPhase.FORWARD):
        pass  # nothing captured
    assert not rec.forward_observed
    assert _observed(), "the step's real observation survives the capture"
    fp8dp.update_fp8_scales()


def test_stateless_recipe_is_noted_for_replays():
    m = _layer()
    _fresh_step_state()
    recipe = fp8dp.Float8CurrentScaling()
    rec = _C.GraphRecord()
    with _Active(rec, _C.GraphPhase.FORWARD), fp8dp.fp8_autocast(fp8_recipe=recipe):
        m(torch.randn(TOKENS, IN, requires_grad=True))
    fp8dp.update_fp8_scales()  # forgets what the capture noted
    assert not _recipes_noted()
    rec.replay_forward()
    assert _recipes_noted(), "a replayed forward joins the next cross-rank recipe check (C9)"
    fp8dp.update_fp8_scales()


def test_grad_added_is_set_again_at_each_backward_replay():
    m = _layer(fuse_wgrad_accumulation=True)
    m.weight.main_grad = torch.zeros(OUT, IN)
    x = torch.randn(TOKENS, IN, requires_grad=True)
    y = m(x)
    rec = _C.GraphRecord()
    with _Active(rec, _C.GraphPhase.BACKWARD):
        torch.autograd.grad(y, [m.weight, x], torch.randn_like(y))
    assert rec.grad_added_count == 1
    m.weight.grad_added_to_main_grad = False  # as a loop resets it with the buffer
    rec.replay_backward(rec.replay_forward())
    assert m.weight.grad_added_to_main_grad
    plain = _C.GraphRecord()
    with _Active(plain, _C.GraphPhase.BACKWARD):
        m2 = _layer()
        y2 = m2(x)
        torch.autograd.grad(y2, [m2.weight], torch.randn_like(y2))
    assert plain.grad_added_count == 0, "an unfused layer has nothing to re-issue"


def test_one_active_record_at_a_time():
    a, b = _C.GraphRecord(), _C.GraphRecord()
    with _Active(a, _C.GraphPhase.WARMUP):
        assert _C.graph_record_active()
        with pytest.raises(RuntimeError, match="another capture of fp8dp layers"):
            b.begin(_C.GraphPhase.FORWARD)
    assert not _C.graph_record_active()


def test_same_autocast_compares_every_field():
    with fp8dp.fp8_autocast(fp8_recipe=fp8dp.DelayedScaling()):
        a = _C.autocast_current()
    with fp8dp.fp8_autocast(fp8_recipe=fp8dp.DelayedScaling()):
        b = _C.autocast_current()
    with fp8dp.fp8_autocast(fp8_recipe=fp8dp.DelayedScaling(amax_history_len=16)):
        c = _C.autocast_current()
    with fp8dp.fp8_autocast(fp8_recipe=fp8dp.Float8CurrentScaling()):
        d = _C.autocast_current()
    with fp8dp.fp8_autocast(enabled=False):
        off = _C.autocast_current()
    assert _C.same_autocast(a, b)
    assert not _C.same_autocast(a, c) and not _C.same_autocast(a, d)
    assert not _C.same_autocast(a, off) and _C.same_autocast(off, _C.autocast_current())


# ---- the FP8 state: ready for capture, restored in place ------------------------------------


def test_capture_refusal_names_what_is_missing():
    recipe = fp8dp.DelayedScaling()
    m = _layer()
    assert "has not cast in FP8" in m._core.fp8_capture_refusal(recipe.to_cpp(), True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        m(torch.randn(TOKENS, IN))  # a forward without backward: no grad_output scale
    assert m._core.fp8_capture_refusal(recipe.to_cpp(), False) == ""
    assert "no scale for grad_output" in m._core.fp8_capture_refusal(recipe.to_cpp(), True)
    _train_step(m, recipe)
    assert m._core.fp8_capture_refusal(recipe.to_cpp(), True) == ""
    short = fp8dp.DelayedScaling(amax_history_len=16)
    assert "amax_history_len=16" in m._core.fp8_capture_refusal(short.to_cpp(), True)
    e4m3 = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.E4M3)
    assert "E4M3/E5M2 but the recipe asks for E4M3/E4M3" in m._core.fp8_capture_refusal(
        e4m3.to_cpp(), True
    )


def test_zero_first_gradient_leaves_the_role_unready():
    m = _layer()
    recipe = fp8dp.DelayedScaling()
    x = torch.randn(TOKENS, IN, requires_grad=True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(x)
    y.backward(torch.zeros_like(y))  # C7: an all-zero amax chooses no scale
    assert "no scale for grad_output" in m._core.fp8_capture_refusal(recipe.to_cpp(), True)
    fp8dp.update_fp8_scales()


def test_restore_writes_in_place_when_the_shape_matches():
    m = _layer()
    recipe = fp8dp.DelayedScaling(amax_history_len=8)
    _train_step(m, recipe)
    saved = m.get_extra_state()
    ptrs = [t.data_ptr() for t in (m._core.amax_history, m._core.scale, m._core.scale_inv)]
    _train_step(m, recipe)
    assert not torch.equal(m._core.amax_history.cpu(), saved["amax_history"])
    m.set_extra_state(saved)
    assert [t.data_ptr() for t in (m._core.amax_history, m._core.scale, m._core.scale_inv)] == ptrs
    for k in ("amax_history", "scale", "scale_inv"):
        assert torch.equal(getattr(m._core, k).cpu(), saved[k]), k
    other = dict(saved, amax_history=torch.zeros(4, 3))
    m.set_extra_state(other)  # another history length: new tensors
    assert m._core.amax_history.shape == (4, 3)
    assert m._core.amax_history.data_ptr() != ptrs[0]


# ---- delayed weight gradients: templates at capture, queued again at each replay -------------


@pytest.mark.parametrize("fp8", [False, True], ids=["fp8_off", "delayed_scaling"])
def test_delayed_wgrad_is_a_template_and_each_replay_queues_it(fp8):
    """The backward capture keeps the queued GEMM as a template (nothing queued), capture_wgrad
    runs it once (the GPU captures that run), and every backward replay queues a task whose run
    calls the dw graph's replay and hands copies of its results to backward_dw(): weight.grad,
    the FP8-off bias backfill (C4) and the hooks, as eagerly. On the CPU the replay call has
    nothing to replay: the operands have not changed, so the captured results are this
    micro-batch's."""
    recipe = fp8dp.DelayedScaling()
    eager, m = _layer(delay_wgrad_compute=True), _layer(delay_wgrad_compute=True)
    if fp8:
        for mod in (eager, m):
            torch.manual_seed(5)  # the same first step, so the same scales
            _train_step(mod, recipe)
            mod.backward_dw()
            for p in mod.parameters():
                p.grad = None
        fp8dp.update_fp8_scales()
    ctx = (lambda: fp8dp.fp8_autocast(fp8_recipe=recipe)) if fp8 else torch.enable_grad
    x = torch.randn(TOKENS, IN)
    dy = torch.randn(TOKENS, OUT)
    with ctx():
        ye = eager(x.clone().requires_grad_(True))
    ye.backward(dy)
    eager.backward_dw()

    hooks = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: hooks.append(1))
    rec = _C.GraphRecord()
    with ctx():
        y = m(x.clone().requires_grad_(True))
    with _Active(rec, _C.GraphPhase.BACKWARD):
        torch.autograd.grad(y, [m.weight, m.bias], dy, allow_unused=True)
    assert m._core.queued_wgrads == 0 and rec.wgrad_count == 1
    rec.capture_wgrad(0)
    replays = []
    rec.set_wgrad_replay(0, lambda: replays.append(1))
    with pytest.raises(ValueError, match=r"index must be in \[0, 1\), got 1"):
        rec.capture_wgrad(1)

    for mb in range(2):  # two micro-batches accumulate, each its own copy of the result
        use = rec.replay_forward()
        rec.before_backward(use)
        rec.replay_backward(use)
        assert m._core.queued_wgrads == 1
        with pytest.raises(RuntimeError, match="call backward_dw.. after each backward"):
            rec.before_forward()
        with pytest.raises(RuntimeError, match="call backward_dw.. after each backward"):
            rec.before_backward(rec.replay_forward())
        m.backward_dw()
        assert len(replays) == mb + 1 and len(hooks) == mb + 1
        assert torch.equal(m.weight.grad, (mb + 1) * eager.weight.grad), f"mb {mb}: weight"
        if fp8:  # the FP8 bias gradient goes to autograd in backward (C4): nothing backfilled
            assert m.bias.grad is None
        else:
            assert torch.equal(m.bias.grad, (mb + 1) * eager.bias.grad), f"mb {mb}: bias"
    if fp8:
        fp8dp.update_fp8_scales()


def test_replay_needs_the_dw_graph():
    m = _layer(delay_wgrad_compute=True)
    y = m(torch.randn(TOKENS, IN, requires_grad=True))
    rec = _C.GraphRecord()
    with _Active(rec, _C.GraphPhase.BACKWARD):
        y.backward(torch.randn_like(y))
    with pytest.raises(RuntimeError, match="weight-gradient graph was never captured"):
        rec.before_backward(rec.replay_forward())


def test_warm_up_runs_and_drops_queued_wgrads():
    """make_graphed_callables' warm-up: the GEMMs run (their plans), nothing is delivered."""
    m = _layer(delay_wgrad_compute=True)
    hooks = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: hooks.append(1))
    y = m(torch.randn(TOKENS, IN, requires_grad=True))
    y.backward(torch.randn_like(y))
    assert m._core.queued_wgrads == 1
    m._core.warm_queued_wgrads()
    assert m._core.queued_wgrads == 0 and m.weight.grad is None and not hooks


def test_a_replaced_fp8_state_is_refused_before_a_replay():
    m = _layer()
    recipe = fp8dp.DelayedScaling(amax_history_len=8)
    _train_step(m, recipe)
    rec = _C.GraphRecord()
    rec.watch_state(m._core)
    rec.before_forward()
    m.set_extra_state(m.get_extra_state())  # in place: the graphs still read it
    rec.before_forward()
    m.set_extra_state(dict(m.get_extra_state(), amax_history=torch.zeros(4, 3)))
    with pytest.raises(RuntimeError, match="FP8 scaling state was replaced since capture"):
        rec.before_forward()
