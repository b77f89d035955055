"""Exactly-once gradient accounting under fp8dp.DistributedDataParallel (contracts C2, C3, C8): the
named reproducers of the defects that the randomized property test (tests/distributed/) also
hunts. One process, a gloo group of one rank: with one rank main_grad is the plain sum over
micro-batches, which a float64 autograd reference gives directly.

Each test says which mutation of its fix it was checked against and how it failed."""

import contextlib
import copy

import pytest
import torch

import fp8dp

D, V, TOKENS = 32, 48, 16


def ddp_config(delay, **kw):
    # The ledger is on: it must count every route of every use without a false alarm.
    return fp8dp.DistributedDataParallelConfig(
        delay_wgrad_compute=delay,
        overlap_grad_reduce=True,
        bucket_size=1000,
        grad_ledger=True,
        **kw,
    )


def run_microbatches(ddp, layers, batches, forward, delay):
    """The README's loop: all but the last micro-batch under no_sync, is_first_microbatch on the
    first, backward_dw() after each backward."""
    ddp.zero_grad_buffer()
    for k, batch in enumerate(batches):
        last = k == len(batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            forward(batch, k == 0).backward()
            if delay:
                for m in reversed(layers):
                    m.backward_dw()
    ddp.finish_grad_sync()


# FP8 off, FP32 everywhere: each main_grad element is a sum of TOKENS * micro-batches <= 64
# products of O(1) values, accumulated in FP32 in another order than the float64 reference;
# 64 * 2^-24 relative per term bounds it.
TOL = dict(rtol=64 * 2.0**-24, atol=64 * 2.0**-24 * 8)


class TiedGPTHead(torch.nn.Module):
    """A GPT's embedding tied to its output head: the embedding lookup is plain torch, the head is
    an fp8dp.Linear whose weight IS the embedding matrix."""

    def __init__(self, fuse, delay):
        super().__init__()
        self.embedding = torch.nn.Parameter(torch.randn(V, D) / D**0.5)
        self.head = fp8dp.Linear(
            D, V, bias=False, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay
        )
        self.head.weight = self.embedding

    def forward(self, idx, first):
        h = torch.tanh(self.embedding[idx])
        return torch.log_softmax(self.head(h, is_first_microbatch=first), -1).mean()


@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_weight_tied_to_plain_torch_use(group, fuse, delay):
    """Defect 1a: the plain use's gradient (the embedding lookup) was dropped in every micro-batch
    when the head fused its wgrad: the head's stand-in gradient and the lookup's were summed in
    p.grad, and the DDP hook skipped p.grad because grad_added_to_main_grad was set. Checked by
    making the bound fused route return the dummy again (linear_autograd.cpp): main_grad lacks
    the lookup's rows (max error ~0.3 against the reference)."""
    torch.manual_seed(0)
    model = TiedGPTHead(fuse, delay)
    ref_w = model.embedding.detach().double().clone().requires_grad_()
    ddp = fp8dp.DistributedDataParallel(model, ddp_config(delay), process_group=group)
    batches = [torch.randint(0, V, (TOKENS,)) for _ in range(3)]
    for _ in range(2):  # the first iteration learns readiness counts, the second launches by them
        run_microbatches(ddp, [model.head], batches, lambda b, first: ddp(b, first), delay)
        ref_w.grad = None
        for b in batches:
            h = torch.tanh(ref_w[b])
            torch.log_softmax(h @ ref_w.t(), -1).mean().backward()
        torch.testing.assert_close(model.embedding.main_grad.double(), ref_w.grad, **TOL)
        assert model.embedding.grad is None


class SharedWeightPair(torch.nn.Module):
    """Two fp8dp layers that share one weight (e.g. an encoder and a decoder tied together)."""

    def __init__(self, fuse, delay):
        super().__init__()
        kw = dict(bias=False, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay)
        self.a = fp8dp.Linear(D, D, **kw)
        self.b = fp8dp.Linear(D, D, **kw)
        self.b.weight = self.a.weight

    def forward(self, x, first):
        return self.b(torch.tanh(self.a(x, is_first_microbatch=first)), is_first_microbatch=first)


@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_two_fused_layers_share_one_weight(group, fp8, delay):
    """Defect 1b: with is_first_microbatch=True the fused GEMM overwrote main_grad, so the second
    use to run its wgrad erased the first (and every micro-batch before). Checked by making
    run_wgrad overwrite again when the task came from is_first_microbatch=True: main_grad held
    one use of the first micro-batch only."""
    torch.manual_seed(1)
    model = SharedWeightPair(True, delay)
    w = model.a.weight
    ref_w = w.detach().double().clone().requires_grad_()
    ddp = fp8dp.DistributedDataParallel(model, ddp_config(delay), process_group=group)
    batches = [torch.randn(TOKENS, D) for _ in range(3)]
    recipe = fp8dp.Float8CurrentScaling()

    def forward(x, first):
        with fp8dp.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            return ddp(x, first).square().mean()

    run_microbatches(ddp, [model.a, model.b], batches, forward, delay)
    ref_w.grad = None
    for x in batches:
        (torch.tanh(x.double() @ ref_w.t()) @ ref_w.t()).square().mean().backward()
    if not fp8:
        torch.testing.assert_close(w.main_grad.double(), ref_w.grad, **TOL)
    else:
        # FP8 casts (E4M3 forward, E5M2 gradients) change each product by up to ~2^-2 relative
        # (E5M2: 2 mantissa bits): accounting is what this compares, so the bound only has to
        # tell one use's sum from two (a lost use changes main_grad by ~50% of its norm).
        err = (w.main_grad.double() - ref_w.grad).norm() / ref_w.grad.norm()
        assert err < 0.1, err


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_forgotten_backward_dw_is_an_error_naming_the_module(group, fuse):
    """Defect 2: backward ran, backward_dw() did not; under the default config the queue stayed one
    deep and every later step reduced a stale micro-batch. Now finish_grad_sync() names the module
    and, as no collective was launched, keeps the queue (C11, H1b: the caller may still run the
    missing backward_dw()); zero_grad_buffer() drops it, naming it again, so the next iteration is
    exact. Checked by disabling the undelivered check in GradSync::local_errors: no error, and the
    next iteration's main_grad held the stale micro-batch too."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        fp8dp.Linear(D, D, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=True),
        torch.nn.Tanh(),
        fp8dp.Linear(D, D, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=True),
    )
    ddp = fp8dp.DistributedDataParallel(
        model, fp8dp.DistributedDataParallelConfig(delay_wgrad_compute=True), process_group=group
    )
    x = torch.randn(TOKENS, D)
    ddp.zero_grad_buffer()
    ddp(x).square().mean().backward()
    model[2].backward_dw()  # model[0].backward_dw() forgotten
    with pytest.raises(
        RuntimeError,
        match=r"never computed by backward_dw\(\).*'0\.weight' \(1 queued, by module '0'\)",
    ):
        ddp.finish_grad_sync()
    assert model[0].need_backward_dw(), "a refusal before any launch keeps the queue"
    with pytest.raises(RuntimeError, match=r"zero_grad_buffer: weight gradients queued"):
        ddp.zero_grad_buffer()
    assert not model[0].need_backward_dw(), "the abandoned iteration's wgrad must be dropped"
    # The next iteration is exact: nothing of the abandoned one arrives.
    ref = [p.detach().double().clone().requires_grad_() for p in model.parameters()]
    run_microbatches(ddp, [model[2], model[0]], [x], lambda b, first: ddp(b).square().mean(), True)
    h = torch.tanh(x.double() @ ref[0].t() + ref[1])
    (h @ ref[2].t() + ref[3]).square().mean().backward()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.main_grad.double(), r.grad, **TOL)


def test_forgotten_backward_dw_before_zero_grad_buffer(group):
    """zero_grad_buffer() with a weight gradient still queued from the last iteration raises (and
    drops it) instead of letting it land in the new iteration."""
    lin = fp8dp.Linear(D, D, delay_wgrad_compute=True)
    ddp = fp8dp.DistributedDataParallel(
        lin, fp8dp.DistributedDataParallelConfig(delay_wgrad_compute=True), process_group=group
    )
    ddp(torch.randn(TOKENS, D)).sum().backward()
    with pytest.raises(RuntimeError, match="zero_grad_buffer: weight gradients queued"):
        ddp.zero_grad_buffer()
    assert not lin.need_backward_dw()
    ddp.zero_grad_buffer()  # recovered


@pytest.mark.parametrize(
    "convert",
    ["to_bf16", "half", "inner_to_bf16", "data_assignment"],
)
def test_conversion_after_wrapping_is_refused(group, convert):
    """Defect 4: model.to(torch.bfloat16) after wrapping moved the parameters out of the buffers:
    the model silently never trained. ddp.to()/.half() now refuse before changing anything; a
    conversion of the inner module (which DDP cannot intercept) fails at the next forward. Checked
    by removing GradSync::check_params_in_buffers from begin_microbatch: the inner conversion's
    forward ran and the optimizer never changed the parameters."""
    model = torch.nn.Sequential(fp8dp.Linear(D, D), torch.nn.Linear(D, D))
    ddp = fp8dp.DistributedDataParallel(model, process_group=group)
    x = torch.randn(TOKENS, D)
    if convert in ("to_bf16", "half"):
        with pytest.raises(ValueError, match=r"parameter '0.weight'.*convert the model"):
            ddp.to(torch.bfloat16) if convert == "to_bf16" else ddp.half()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        ddp(x)  # untouched, still usable
        return
    if convert == "inner_to_bf16":
        model.to(torch.bfloat16)
        x = x.bfloat16()
    else:
        model[1].weight.data = model[1].weight.data.clone()
    with pytest.raises(ValueError, match="no longer lives in DistributedDataParallel's buffer"):
        ddp(x)


def test_wrapping_twice_is_refused(group):
    """Item 10: a model wrapped twice had its parameters moved into the second buffer while the
    first wrapper's hooks stayed: the second main_grad stayed 0. Checked by removing the
    _fp8dp_ddp check in DistributedDataParallel.__init__: no error."""
    model = fp8dp.Linear(D, D)
    first = fp8dp.DistributedDataParallel(model, process_group=group)
    with pytest.raises(ValueError, match="already managed by another"):
        fp8dp.DistributedDataParallel(model, process_group=group)
    del first
    fp8dp.DistributedDataParallel(model, process_group=group)  # the first one is gone: fine
    # A deep copy of a wrapped model carries the marker but has parameters of its own: it may be
    # wrapped too (fp8dp modules do not deep-copy; a plain model does).
    plain = torch.nn.Linear(D, D)
    keep = fp8dp.DistributedDataParallel(plain, process_group=group)
    fp8dp.DistributedDataParallel(copy.deepcopy(plain), process_group=group)
    del keep


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_double_backward_is_refused(fp8):
    """Defect 7: a gradient penalty through an fp8dp layer (create_graph=True) silently got a zero
    second-order weight gradient. Checked by removing the GradMode check in the backward: the
    penalty's backward ran and weight.grad stayed None."""
    lin = fp8dp.Linear(D, D)
    x = torch.randn(TOKENS, D, requires_grad=True)
    with fp8dp.fp8_autocast(enabled=fp8, fp8_recipe=fp8dp.Float8CurrentScaling()):
        y = lin(x)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


class _ContainerUser(torch.nn.Module):
    """Parameters read by the parent's forward: an nn.ParameterList (no forward of its own) and a
    weight tied between an fp8dp.Linear that registers it first but never runs and an
    nn.Linear that does run."""

    def __init__(self):
        super().__init__()
        self.plain = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(D, D))])
        self.unused = fp8dp.Linear(D, D, bias=False)
        self.used = torch.nn.Linear(D, D, bias=False)
        self.used.weight = self.unused.weight

    def forward(self, x):
        return self.used(x @ self.plain[0])


def _waited_groups(module) -> set:
    """The bucket groups whose parameter all-gather `module`'s forward waits for."""
    from fp8dp.ddp import _ParamGatherWait

    return {
        g
        for h in module._forward_pre_hooks.values()
        if isinstance(h, _ParamGatherWait)
        for g in h._groups
    }


def test_param_gather_waits_where_the_parameters_are_read(group):
    """overlap_param_gather: the forward that reads a parameter waits for its all-gather first.
    The race is timing-dependent (the property test saw it only under load), so this checks the
    waits themselves: the parent of a parameter container waits for the container's parameters,
    and every module registering a tied weight waits for it, not only the first. Checked by
    registering waits on the first registering module only (the former rule): the first assert
    fails (the parent waits for nothing); with the parent rule kept and only the first-owner rule
    restored, the second fails (the nn.Linear that runs waits for nothing)."""
    model = _ContainerUser()
    cfg = fp8dp.DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_param_gather=True,
        overlap_grad_reduce=True,
        bucket_size=D * D,  # one parameter per bucket group
    )
    ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
    sync = ddp._sync
    group_of = {id(p): sync.group_of_param(i) for i, p in enumerate(ddp._params)}

    waited = _waited_groups
    assert group_of[id(model.plain[0])] in waited(model), "the container's parent must wait"
    assert group_of[id(model.used.weight)] in waited(model.used), "the running owner must wait"


def test_layernorm_mlp_waits_for_its_childrens_parameters(group):
    """fp8dp.LayerNormMLP's forward reads fc1's and fc2's parameters without running their
    forwards, so the waits on fc1 and fc2 never run: the MLP itself must wait for every group
    holding them. Found by the property test (case 1302649579, a LayerNormMLP with
    overlap_param_gather, under load in CI: a downstream bias gradient 0.85% off, the MLP having
    read weights whose all-gather was still in flight); the race is timing-dependent, so this
    checks the wait. Without LayerNormMLP._reads_child_parameters the MLP waits for nothing."""
    model = torch.nn.Sequential(fp8dp.LayerNormMLP(D, 2 * D))
    cfg = fp8dp.DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_param_gather=True,
        overlap_grad_reduce=True,
        bucket_size=D * D,  # about one parameter per bucket group
    )
    ddp = fp8dp.DistributedDataParallel(model, cfg, process_group=group)
    sync = ddp._sync
    mlp = model[0]
    groups = {sync.group_of_param(i) for i in range(len(ddp._params))}
    assert len(groups) > 1
    assert groups <= _waited_groups(mlp), (groups, _waited_groups(mlp))
    # and the waits work: after a step, the MLP's own forward (not DDP's, which waits for
    # everything after its module ran) leaves no all-gather in flight
    opt = fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.1)
    ddp(torch.randn(16, D)).square().sum().backward()
    ddp.finish_grad_sync()
    opt.step()
    assert sync.param_sync_pending
    mlp(torch.randn(16, D))
    assert not sync.param_sync_pending
