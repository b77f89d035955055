"""fp8dp.make_graphed_callables on a GPU: replays against the same steps run eagerly on a copy,
bit for bit (torch.equal) — outputs, input gradients, parameter gradients, main_grad, and after
each update_fp8_scales() the amax histories and scales — over three steps of two micro-batches
each, for every fp8dp layer, delayed and current scaling, plain, fused, delayed and fused +
delayed weight gradients (backward_dw() after each backward); a stack mixing fp8dp and torch modules; two callables captured together. And what
the CPU cannot show: a graph alone in the process marks its amaxes observed at every replay (no
eager copy's mark to hide a missing one), and the replay-time refusals. Skipped without a GPU.

Not yet run on a GPU when written (2026-12-05, no GPU lent that session); the host half is
tests/python/test_graph_record.py.
"""

import contextlib
import copy

import pytest
import torch
from _process_group import world_of_one

import fp8dp

pytestmark = pytest.mark.skipif(
    not fp8dp.cuda_available(), reason="needs a CUDA GPU and fp8dp built with CUDA"
)

H, TOKENS = 256, 64
RECIPES = {
    "delayed": lambda: fp8dp.DelayedScaling(amax_history_len=4),
    "current": lambda: fp8dp.Float8CurrentScaling(),
}
KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP-gelu", "LayerNormMLP-swiglu"]


def _fp8_layers(m):
    return [x for x in m.modules() if isinstance(x, (fp8dp.Linear, fp8dp.LayerNormLinear))]


WGRADS = {
    "plain": {},
    "fused": dict(fuse_wgrad_accumulation=True),
    "delayed": dict(delay_wgrad_compute=True),
    "fused+delayed": dict(fuse_wgrad_accumulation=True, delay_wgrad_compute=True),
}


def _layer(kind, wgrad="plain"):
    torch.manual_seed(0)
    kw = dict(params_dtype=torch.bfloat16, device="cuda", **WGRADS[wgrad])
    if kind == "Linear":
        return fp8dp.Linear(H, H, **kw)
    if kind == "LayerNormLinear":
        return fp8dp.LayerNormLinear(H, H, **kw)
    return fp8dp.LayerNormMLP(H, 2 * H, activation=kind.split("-")[1], **kw)


def _give_main_grads(m):
    for layer in _fp8_layers(m):
        if layer.fuse_wgrad_accumulation:
            layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)


def _inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, dy


def _step(m, x, dy, recipe):
    xr = x.clone().requires_grad_(True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(xr)
    y.backward(dy)
    for layer in _fp8_layers(m):  # C3: each queued weight gradient, after its backward
        if layer.need_backward_dw():
            layer.backward_dw()
    return y, xr.grad


def _clear(m):
    for p in m.parameters():
        p.grad = None
    for layer in _fp8_layers(m):
        mg = getattr(layer.weight, "main_grad", None)
        if mg is not None:
            mg.zero_()  # in place: the graph accumulates into this tensor


def _assert_same_state(eager, graphed, where):
    for (n, pe), pg in zip(eager.named_parameters(), graphed.parameters()):
        fused_weight = getattr(pe, "main_grad", None) is not None
        if fused_weight:  # the stand-in's values mean nothing (grad_added_to_main_grad)
            assert torch.equal(pe.main_grad, pg.main_grad), f"{where}: {n}.main_grad"
            assert pg.grad_added_to_main_grad, f"{where}: {n}.grad_added_to_main_grad"
        elif pe.grad is None:
            assert pg.grad is None, f"{where}: {n}.grad"
        else:
            assert torch.equal(pe.grad, pg.grad), f"{where}: {n}.grad"
    for le, lg in zip(_fp8_layers(eager), _fp8_layers(graphed)):
        for k in ("amax_history", "scale", "scale_inv"):
            te, tg = getattr(le._core, k), getattr(lg._core, k)
            assert (te is None) == (tg is None) and (
                te is None or torch.equal(te, tg)
            ), f"{where}: {le._core.name}.{k}"


def _graph_copy(eager, recipe, **graph_kw):
    """One eager step on both copies (delayed scaling needs scales before capture), then the
    copy is graphed (graph_kw: make_graphed_callables' keyword arguments)."""
    graphed = copy.deepcopy(eager)
    _give_main_grads(eager)
    _give_main_grads(graphed)
    x, dy = _inputs(1)
    for m in (eager, graphed):
        _step(m, x, dy, recipe)
        _clear(m)
    fp8dp.update_fp8_scales()
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        fp8dp.make_graphed_callables(graphed, (x.clone().requires_grad_(True),), **graph_kw)
    return graphed


def _steps_match(eager, graphed, recipe, steps):
    """`steps` steps of one micro-batch on both copies: outputs and input gradients equal, then
    after update_fp8_scales() the gradients and FP8 states."""
    for step in range(steps):
        x, dy = _inputs(step + 2)
        ye, dxe = _step(eager, x, dy, recipe)
        yg, dxg = _step(graphed, x, dy, recipe)
        assert torch.equal(ye, yg) and torch.equal(dxe, dxg), f"step {step}"
        fp8dp.update_fp8_scales()
        _assert_same_state(eager, graphed, f"step {step}")
        _clear(eager)
        _clear(graphed)


@pytest.mark.parametrize("wgrad", list(WGRADS))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", KINDS)
def test_replays_match_eager_bit_for_bit(kind, recipe_name, wgrad):
    recipe = RECIPES[recipe_name]()
    eager = _layer(kind, wgrad)
    graphed = _graph_copy(eager, recipe)
    for step in range(3):
        for mb in range(2):  # the second micro-batch accumulates into .grad / main_grad
            x, dy = _inputs(10 * step + mb + 2)
            ye, dxe = _step(eager, x, dy, recipe)
            yg, dxg = _step(graphed, x, dy, recipe)
            assert torch.equal(ye, yg), f"step {step} mb {mb}: output"
            assert torch.equal(dxe, dxg), f"step {step} mb {mb}: input gradient"
        fp8dp.update_fp8_scales()
        _assert_same_state(eager, graphed, f"step {step}")
        with torch.no_grad():  # an optimizer-like write, in place, on both copies
            for pe, pg in zip(eager.parameters(), graphed.parameters()):
                pe.mul_(0.99)
                pg.mul_(0.99)
        _clear(eager)
        _clear(graphed)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP-gelu"])
def test_handed_over_grads_match_eager(kind):
    """clone_param_grads_on_return=False: .grad is the graph's static buffer (no copy), the same
    values as the eager step's, bit for bit, over three steps that clear .grad between them; a
    backward before clearing is refused (on the CPU: test_graph_capture_host.py)."""
    recipe = RECIPES["delayed"]()
    eager = _layer(kind)
    graphed = _graph_copy(eager, recipe, clone_param_grads_on_return=False)
    _steps_match(eager, graphed, recipe, 3)
    x, dy = _inputs(7)
    _step(graphed, x, dy, recipe)
    with pytest.raises(RuntimeError, match="still holds the previous backward's gradient"):
        _step(graphed, x, dy, recipe)


class _Stack(torch.nn.Module):
    """fp8dp layers, torch ops and a residual in one callable."""

    def __init__(self):
        super().__init__()
        kw = dict(params_dtype=torch.bfloat16, device="cuda")
        self.fc1 = fp8dp.LayerNormLinear(H, 2 * H, **kw)
        self.fc2 = fp8dp.Linear(2 * H, H, **kw)
        self.mlp = fp8dp.LayerNormMLP(H, 2 * H, **kw)

    def forward(self, x):
        h = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return h + self.mlp(h)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_stack_and_two_callables_match_eager(recipe_name):
    recipe = RECIPES[recipe_name]()
    torch.manual_seed(0)
    eager = torch.nn.Sequential(_Stack(), _Stack())
    graphed = copy.deepcopy(eager)
    x, dy = _inputs(1)
    for m in (eager, graphed):
        _step(m, x, dy, recipe)
        _clear(m)
    fp8dp.update_fp8_scales()
    a, b = graphed[0], graphed[1]
    xs = x.clone().requires_grad_(True)
    # b's sample: any tensor of its input's shape ([TOKENS, H], as a's output). Not a(xs): that
    # eager forward would leave its amaxes in row 0 of a's delayed-scaling histories, which the
    # capture keeps (it puts back the state it found), so a's next update would see them and the
    # eager copy's would not.
    hs = x.clone().requires_grad_(True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        fp8dp.make_graphed_callables((a, b), ((xs,), (hs,)))
    _steps_match(eager, graphed, recipe, 3)


def test_a_graph_alone_marks_its_amaxes_at_every_replay():
    """No eager model in the step: without the re-mark update_fp8_scales() would update nothing
    and the history would stay as it was."""
    recipe = RECIPES["delayed"]()
    m = _layer("LayerNormLinear")
    x, dy = _inputs(1)
    _step(m, x, dy, recipe)
    fp8dp.update_fp8_scales()
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        fp8dp.make_graphed_callables(m, (x.clone().requires_grad_(True),))
    assert not fp8dp._C.fp8_registry_signature()[1]
    for step in range(3):
        before = m._core.amax_history.clone()
        x, dy = _inputs(step + 2)
        xr = x.clone().requires_grad_(True)
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            y = m(xr)
        assert fp8dp._C.fp8_registry_signature()[1], "the forward replay marked observed"
        y.backward(dy * (step + 2))  # a gradient amax the history has not seen
        fp8dp.update_fp8_scales()
        after = m._core.amax_history
        # Rolled: row 0 cleared, this step's amaxes in row 1, the older rows moved down (the
        # replay's kernels alone would leave them in row 0, so "changed" would not be evidence).
        assert not after[0].any(), f"step {step}: the update rolled the history (row 0 cleared)"
        assert after[1].gt(0).all(), f"step {step}: the replays' amaxes reached the update"
        assert torch.equal(after[2:], before[1:-1]), f"step {step}: the older rows moved down"
        _clear(m)


def test_replay_refusals():
    recipe = RECIPES["delayed"]()
    m = _layer("Linear", "fused+delayed")
    _give_main_grads(m)
    x, dy = _inputs(1)
    _step(m, x, dy, recipe)
    fp8dp.update_fp8_scales()
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        fp8dp.make_graphed_callables(m, (x.clone().requires_grad_(True),))
    with pytest.raises(RuntimeError, match="captured under 'FP8 delayed"):
        with fp8dp.fp8_autocast(fp8_recipe=fp8dp.Float8CurrentScaling()):
            m(x)
    with pytest.raises(ValueError, match="input 0 must be"):
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            m(x[:16])
    with pytest.raises(ValueError, match="requires grad, but its sample at capture did not"):
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            other = _layer("Linear")
            _step(other, x, dy, recipe)
            fp8dp.make_graphed_callables(other, (x.clone(),))
            other(x.clone().requires_grad_(True))
    with pytest.raises(ValueError, match="takes only its captured inputs"):
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            m(x, scale=2.0)
    xr = x.clone().requires_grad_(True)
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        y = m(xr)
    y.backward(dy)  # queues the weight gradient
    with pytest.raises(RuntimeError, match="call backward_dw.. after each backward"):
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            m(xr)  # its operands are the graphs' static buffers
    m.backward_dw()
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        m(xr).backward(dy)  # now it may
    m.backward_dw()
    m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="main_grad was replaced"):
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            m(x)
    with torch.no_grad():  # evaluation (grad off) runs eagerly, under its own autocast state
        assert m(x[:16]).shape == (16, H)
    m.eval()  # the other training mode runs the eager forward, as in torch
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        assert m(x[:16]).shape == (16, H)


def test_capture_before_a_first_step_is_refused():
    m = _layer("Linear")
    x, _ = _inputs(1)
    with pytest.raises(ValueError, match="has not cast in FP8 before this capture"):
        with fp8dp.fp8_autocast(fp8_recipe=RECIPES["delayed"]()):
            fp8dp.make_graphed_callables(m, (x.clone().requires_grad_(True),))


def test_load_state_dict_after_capture_keeps_the_graph():
    """load_state_dict writes the FP8 state in place (same history length): the graph keeps
    reading it, and the graphed copy follows the eager one again."""
    recipe = RECIPES["delayed"]()
    eager = _layer("LayerNormMLP-gelu")
    graphed = _graph_copy(eager, recipe)
    for step in range(2):
        x, dy = _inputs(step + 2)
        _step(eager, x, dy, recipe)
        fp8dp.update_fp8_scales()
        _clear(eager)
    graphed.load_state_dict(eager.state_dict())  # weights (in place) and FP8 state
    x, dy = _inputs(7)
    ye, dxe = _step(eager, x, dy, recipe)
    yg, dxg = _step(graphed, x, dy, recipe)
    assert torch.equal(ye, yg) and torch.equal(dxe, dxg)
    fp8dp.update_fp8_scales()
    _assert_same_state(eager, graphed, "after load_state_dict")


@pytest.fixture(scope="module")
def nccl_group():
    yield from world_of_one("nccl")


@pytest.mark.parametrize("wgrad", list(WGRADS))
def test_ddp_bound_replays_match_eager(nccl_group, wgrad):
    """fp8dp.DistributedDataParallel (NCCL, one rank, ledger on, overlapped reduce): capture
    ddp.module, call ddp(x). Two micro-batches per step, finish_grad_sync, update_fp8_scales;
    main_grad after the finish equals the eager copy's bit for bit, every step."""
    recipe = RECIPES["delayed"]()
    cfg = fp8dp.DistributedDataParallelConfig(
        bucket_size=1 << 16, overlap_grad_reduce=True, grad_ledger=True
    )
    eager_m = torch.nn.Sequential(_layer("LayerNormLinear", wgrad), _layer("Linear", wgrad))
    graphed_m = copy.deepcopy(eager_m)
    # The graphed model's DDP is built on a side stream, as torch's DDP must be for CUDA graphs:
    # its gradient hooks create the parameters' AccumulateGrad nodes, which keep the stream they
    # were made on, and a captured backward cannot sync with the legacy default stream
    # (cudaErrorStreamCaptureImplicit, seen on the H100 2026-12-05).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphed_ddp = fp8dp.DistributedDataParallel(graphed_m, cfg, process_group=nccl_group)
    torch.cuda.current_stream().wait_stream(side)
    ddps = [fp8dp.DistributedDataParallel(eager_m, cfg, process_group=nccl_group), graphed_ddp]
    x, dy = _inputs(1)
    for d in ddps:  # one eager step each: the first scales
        d.zero_grad_buffer()
        _step(d, x, dy, recipe)
        d.finish_grad_sync()
    fp8dp.update_fp8_scales()
    with fp8dp.fp8_autocast(fp8_recipe=recipe):
        fp8dp.make_graphed_callables(graphed_m, (x.clone().requires_grad_(True),))
    for step in range(3):
        for d in ddps:
            d.zero_grad_buffer()
        for mb in range(2):
            x, dy = _inputs(10 * step + mb + 2)
            # The first micro-batch's backward must not launch the reduction (C8: no_sync).
            with contextlib.ExitStack() as stack:
                if mb == 0:
                    for d in ddps:
                        stack.enter_context(d.no_sync())
                ye, dxe = _step(ddps[0], x, dy, recipe)
                yg, dxg = _step(ddps[1], x, dy, recipe)
            assert torch.equal(ye, yg) and torch.equal(dxe, dxg), f"step {step} mb {mb}"
        for d in ddps:
            d.finish_grad_sync()
        fp8dp.update_fp8_scales()
        for (n, pe), pg in zip(eager_m.named_parameters(), graphed_m.parameters()):
            assert torch.equal(pe.main_grad, pg.main_grad), f"step {step}: {n}.main_grad"


class _Checkpointed(torch.nn.Module):
    """A LayerNormMLP under non-reentrant activation checkpointing: its recompute runs inside the
    captured backward."""

    def __init__(self, wgrad):
        super().__init__()
        self.mlp = _layer("LayerNormMLP-gelu", wgrad)

    def forward(self, x):
        # preserve_rng_state=False: the region draws no random numbers, and torch may not read the
        # CUDA generator while a graph is being captured.
        return torch.utils.checkpoint.checkpoint(
            self.mlp, x, use_reentrant=False, preserve_rng_state=False
        )


@pytest.mark.parametrize("wgrad", ["plain", "fused+delayed"])
def test_activation_checkpointing_replays_match_eager(wgrad):
    recipe = RECIPES["delayed"]()
    eager = _Checkpointed(wgrad)
    graphed = _graph_copy(eager, recipe)
    _steps_match(eager, graphed, recipe, 2)
