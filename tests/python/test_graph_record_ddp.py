"""fp8dp.make_graphed_callables with fp8dp.DistributedDataParallel, on the CPU: the whole capture
procedure of python/fp8dp/graph.py with graphs that record and replay nothing (HostGraphs below),
so that what is left is fp8dp's host work, against a real DDP (gloo, one rank, grad_ledger on).

What a CPU "capture" does differently from a CUDA one: it runs. Its forward and backward compute
with the sample input and the grad_output HostGraphs hands in, and its fused GEMMs write main_grad
there and then; a "replay" then computes nothing. So each test captures right before the one
micro-batch it replays, with that micro-batch's input and grad_output: main_grad then holds what
one replay on a GPU writes, and every gradient reaches DDP only through what the replay re-issues
(the RecordingSink kept DDP out of the capture: graph_sink.h). Against the same iteration run
eagerly on a copy: main_grad after finish_grad_sync equal within FP32 roundings (rtol 1e-5,
atol 2^-17, as tests/python/test_ddp_phases.py: the same operations in the same order, so in
practice bit for bit), the ledger complete (finish_grad_sync checks it), the phases alike.

The GPU half (replays that compute, several micro-batches) is tests/python/test_graphed_cuda.py.

Mutation evidence (2026-12-05, each built and run, then restored): replay_backward without the
fused deliveries fails the [fused] accounting case (the ledger misses the weights); ReplayUse never
withdrawing fails both dropped-forward cases; before_backward without the acceptance checks fails
the refusal test (the backward graph replayed before the refusal); LinearCore::grad_sink without
the RecordingSink fails six tests (the capture's calls reach DDP: tokens expected twice, the
dropped forward's report differs); the graphed forward without overlap_param_gather's waits
fails the all-gather test (its graph replayed with the gather in flight).
"""

import pytest
import torch
from _host_graphs import HostGraphs

import fp8dp
from fp8dp import graph

IN, H, OUT, TOKENS = 16, 32, 16, 16
TOL = dict(rtol=1e-5, atol=2.0**-17)
WGRADS = {
    "plain": {},
    "fused": dict(fuse_wgrad_accumulation=True),
    "delayed": dict(delay_wgrad_compute=True),
    "fused+delayed": dict(fuse_wgrad_accumulation=True, delay_wgrad_compute=True),
}


def model(wgrad, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        fp8dp.Linear(IN, H, **WGRADS[wgrad]),
        torch.nn.Tanh(),
        fp8dp.LayerNormLinear(H, OUT, **WGRADS[wgrad]),
    )


def wrap(m, group):
    cfg = fp8dp.DistributedDataParallelConfig(
        bucket_size=200, overlap_grad_reduce=True, grad_ledger=True
    )
    return fp8dp.DistributedDataParallel(m, cfg, process_group=group)


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, IN, generator=g), torch.randn(TOKENS, OUT, generator=g)


def backward_dw(m):
    for layer in m.modules():
        if isinstance(layer, (fp8dp.Linear, fp8dp.LayerNormLinear)) and layer.need_backward_dw():
            layer.backward_dw()


def eager_iteration(ddp, x, dy):
    ddp.zero_grad_buffer()
    ddp(x.clone().requires_grad_(True)).backward(dy)
    backward_dw(ddp.module)
    ddp.finish_grad_sync()


def capture(ddp, x, dy):
    graph._capture(
        (ddp.module,),
        ((x.clone().requires_grad_(True),),),
        2,
        False,
        None,
        HostGraphs(dy),
    )


@pytest.mark.parametrize("wgrad", list(WGRADS))
def test_replay_hands_every_gradient_to_ddp_once(group, wgrad):
    eager = wrap(model(wgrad), group)
    graphed = wrap(model(wgrad), group)
    for step in range(2):  # the second step: after finish, zero_grad_buffer, as a loop
        x, dy = data(step)
        eager_iteration(eager, x, dy)
        graphed.zero_grad_buffer()
        capture(graphed, x, dy)
        assert graphed.phase == "accumulating", "the capture left DDP alone"
        graphed(x.clone().requires_grad_(True)).backward(dy)
        backward_dw(graphed.module)
        graphed.finish_grad_sync()  # raises if the ledger or the readiness misses a gradient
        assert graphed.phase == eager.phase
        for (n, pe), pg in zip(eager.module.named_parameters(), graphed.module.parameters()):
            torch.testing.assert_close(pg.main_grad, pe.main_grad, **TOL, msg=f"{step}: {n}")
        # Rebind the graphed module's forward for the next capture (make_graphed_callables
        # replaces it; a new capture wraps the module's own forward again).
        for m in graphed.module.modules():
            m.__dict__.pop("forward", None)


def test_capture_sends_nothing_to_ddp(group):
    """The warm-up and the capture change no DDP state: no announcement (the ledger would miss it
    at finish), no delivery (readiness would launch a bucket), no expected token."""
    ddp = wrap(model("fused+delayed"), group)
    x, dy = data(0)
    capture(ddp, x, dy)
    assert all(not m._core.queued_wgrads for m in ddp.module.modules() if hasattr(m, "_core"))
    for p in ddp.module.parameters():  # the capture's own fused writes (a GPU capture makes none)
        p.main_grad.zero_()
    ddp.finish_grad_sync()  # nothing announced, nothing owed: a clean (empty) iteration
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in ddp.module.parameters())


@pytest.mark.parametrize("wgrad", ["fused", "fused+delayed"])
def test_a_dropped_forward_is_reported_as_eagerly(group, wgrad):
    """A forward whose output is dropped without a backward: the layers take back what they
    announced (as ~SinkUse does eagerly: a replay's ReplayUse), DDP's own announcements of the
    autograd-hook contributions stay, so finish_grad_sync reports exactly what it reports for the
    same forward run eagerly (a graphed use not taken back would show "0 of 2")."""
    reports = []
    for graphed in (False, True):
        ddp = wrap(model(wgrad), group)
        x, dy = data(0)
        if graphed:
            capture(ddp, x, dy)
            for p in ddp.module.parameters():
                p.main_grad.zero_()
        out = ddp(x.clone().requires_grad_(True))
        del out
        with pytest.raises(RuntimeError, match="gradient ledger") as e:
            ddp.finish_grad_sync()
        reports.append(str(e.value))
        ddp.zero_grad_buffer()
    assert reports[0] == reports[1]
    assert "0 of 1 (missing 1)" in reports[1] and "of 2" not in reports[1]


def test_a_refused_backward_changes_nothing(group):
    """C11: the acceptance checks are re-issued before the backward graph runs: a backward after
    the iteration's sync started is refused, and main_grad and the queue stay as they were."""
    ddp = wrap(model("fused+delayed"), group)
    x, dy = data(0)
    capture(ddp, x, dy)
    before = [p.main_grad.clone() for p in ddp.module.parameters()]
    out = ddp(x.clone().requires_grad_(True))
    ddp.start_grad_sync()
    HostGraphs.Graph.replays.clear()
    with pytest.raises(RuntimeError, match="sync_started|already|launched"):
        out.backward(dy)
    assert not HostGraphs.Graph.replays, "refused before the backward graph replays"
    assert all(torch.equal(b, p.main_grad) for b, p in zip(before, ddp.module.parameters()))
    assert all(not m._core.queued_wgrads for m in ddp.module.modules() if hasattr(m, "_core"))
    del out


def test_parameter_all_gathers_are_waited_for_before_a_replay(group):
    """overlap_param_gather: the all-gather of the step's parameters is waited for by the forward
    pre-hooks of the modules that read them, which a replay skips; the graphed forward runs those
    waits itself before its graph reads the weights."""
    cfg = fp8dp.DistributedDataParallelConfig(
        bucket_size=200, use_distributed_optimizer=True, overlap_param_gather=True
    )
    ddp = fp8dp.DistributedDataParallel(model("fused"), cfg, process_group=group)
    opt = fp8dp.DistributedOptimizer(torch.optim.SGD, ddp, lr=0.1)
    x, dy = data(0)
    capture(ddp, x, dy)  # the modules carry the waits as forward pre-hooks: accepted
    ddp(x.clone().requires_grad_(True)).backward(dy)
    opt.step()
    assert ddp._sync.param_sync_pending
    ddp.zero_grad_buffer()
    pending_at_replay = []
    HostGraphs.Graph.on_replay = lambda: pending_at_replay.append(ddp._sync.param_sync_pending)
    try:
        ddp(x.clone().requires_grad_(True))
    finally:
        HostGraphs.Graph.on_replay = None
    assert pending_at_replay == [False], "the forward graph replayed after the all-gathers"


class Checkpointed(torch.nn.Module):
    """The model of the tests above with its second layer under activation checkpointing
    (non-reentrant), whose recompute runs inside the captured backward."""

    def __init__(self, wgrad):
        super().__init__()
        self.m = model(wgrad)

    def forward(self, x):
        h = self.m[1](self.m[0](x))
        return torch.utils.checkpoint.checkpoint(
            self.m[2], h, use_reentrant=False, preserve_rng_state=False
        )


@pytest.mark.parametrize("wgrad", ["fused", "fused+delayed"])
def test_activation_checkpointing_inside_the_graph(group, wgrad):
    eager = wrap(Checkpointed(wgrad), group)
    graphed = wrap(Checkpointed(wgrad), group)
    x, dy = data(0)
    eager_iteration(eager, x, dy)
    graphed.zero_grad_buffer()
    capture(graphed, x, dy)
    graphed(x.clone().requires_grad_(True)).backward(dy)
    backward_dw(graphed.module)
    graphed.finish_grad_sync()
    for (n, pe), pg in zip(eager.module.named_parameters(), graphed.module.parameters()):
        torch.testing.assert_close(pg.main_grad, pe.main_grad, **TOL, msg=n)
