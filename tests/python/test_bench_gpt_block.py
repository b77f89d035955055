"""bench/gpt_block_gpu.py's blocks, built on the CPU: every architecture's fp8dp block computes the
same function as its torch BF16 baseline once the baseline's weights are copied in, so the
benchmark's speed ratios compare equal models and its reported losses compare (the GPU run can
only print them). FP8 off on both sides: the two differ by BF16 roundings only.

Tolerance: one block rounds its intermediate results to BF16 (unit roundoff 2^-9) about a dozen
times on each side (norm, three GEMM outputs, attention, activation, two residual adds), and the
two sides round at different places, so their normwise relative difference is bounded by about
2 x 12 x 2^-9 ~ 0.05; measured 2026-12-04: 0 for gpt and gpt_fused (the same roundings as
torch), 0.002 for llama (torch's RMSNorm rounds differently). A weight left uncopied (or copied
into the wrong parameter) gives a difference of order 1.
"""

import os
import sys

import pytest
import torch

import fp8dp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpt_block_gpu as gb  # noqa: E402

TOL = 2 * 12 * 2.0**-9


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    monkeypatch.setattr(gb, "DEVICE", "cpu")


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _inputs(hidden, seq=32, batch=2):
    g = torch.Generator().manual_seed(3)
    return torch.randn(seq, batch, hidden, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize(
    "arch, gelu",
    [(a, gb.GELU_PLACES[0]) for a in gb.ARCHS] + [("gpt", p) for p in gb.GELU_PLACES[1:]],
)
def test_fp8dp_block_computes_the_baseline(arch, gelu):
    """gpt's fp8dp block with each GELU place (GELU_PLACES: F.gelu between, in fc1, in fc2)."""
    hidden, layers = 128, 2
    ref = gb.make_model(hidden, layers, "torch", arch=arch)
    mine = gb.make_model(hidden, layers, "fp8dp", ref, arch=arch, gelu=gelu)
    if arch != "gpt":
        assert all(isinstance(b.mlp, fp8dp.LayerNormMLP) for b in mine)
    else:
        assert all((b.fc1.activation == "gelu") == (gelu == "fc1") for b in mine)
        assert all((b.fc2.input_activation == "gelu") == (gelu == "fc2") for b in mine)
    x = _inputs(hidden)
    with torch.no_grad():
        want = ref(x)
        got = mine(x)
    assert _rel(got, want) <= TOL, (arch, _rel(got, want))
    # The check can fail: one MLP weight left at its own initialisation.
    with torch.no_grad():
        blk = mine[0]
        w = blk.fc2.weight if blk.mlp is None else blk.mlp.fc2.weight
        w.normal_(generator=torch.Generator().manual_seed(9))
        assert _rel(mine(x), want) > 10 * TOL


def test_llama_block_shape():
    """RMSNorm, no bias, SwiGLU at Llama's width (8/3 hidden, up to a multiple of 256)."""
    blk = gb.Block(4096 // 32, "fp8dp", "llama")
    assert gb.ffn_size(4096, "llama") == 11008
    assert blk.qkv.bias is None or blk.qkv.bias.numel() == 0
    assert blk.mlp.activation == "swiglu" and blk.mlp.normalization == "RMSNorm"
    assert blk.mlp.fc1.weight.shape == (2 * gb.ffn_size(128, "llama"), 128)


def test_fp8_step_runs_for_every_arch():
    """make_step's FP8 delayed step (forward, backward, scale update) on each architecture."""
    for arch in gb.ARCHS:
        ref = gb.make_model(128, 1, "torch", arch=arch)
        model = gb.make_model(128, 1, "fp8dp", ref, arch=arch)
        x = _inputs(128, seq=16)
        step, loss = gb.make_step(model, x, torch.ones_like(x) * 1e-2, "fp8dp_delayed")
        step()
        step()
        with torch.no_grad():
            want = float(ref(x).float().square().mean())
        # The output is the residual plus the block's contribution; E4M3 operands (2^-4 relative
        # each) perturb the contribution by a few percent and the mean square by far less
        # (measured 0.03-0.05%); 1% allows for that and fails on a broken FP8 path.
        assert abs(loss() - want) <= 0.01 * want, (arch, loss(), want)


def test_graphed_step_runs_for_every_arch(monkeypatch):
    """make_graphed_step's fp8dp variant (--graphs) on each architecture, with fp8dp's capture
    procedure on the host stand-in of tests/python/_host_graphs.py (a capture runs its work, a
    replay computes nothing): the capture accepts each stack (no parameter taken for an unused
    input: llama's layers have no bias), and every later step replays a forward and a backward
    graph with the scale update between steps. The numbers are the GPU run's to check."""
    from _host_graphs import HostGraphs

    from fp8dp import graph

    class SmallGradients(HostGraphs):
        def grad_output(self, o):
            return torch.full_like(o, 1e-2)

    def capture(model, sample_args, num_warmup_iters=3, **kw):
        graph._check_arguments((model,), (sample_args,), num_warmup_iters, True)
        (out,) = graph._capture(
            (model,),
            (sample_args,),
            num_warmup_iters,
            False,
            None,
            SmallGradients(None),
            kw.pop("clone_param_grads_on_return", True),
        )
        assert not kw, kw
        return out

    monkeypatch.setattr(fp8dp, "make_graphed_callables", capture)
    cases = [(arch, "fp8dp_delayed_graphed") for arch in gb.ARCHS] + [("gpt", gb.MG_GRAPHED)]
    for arch, mode in cases:
        ref = gb.make_model(128, 1, "torch", arch=arch)
        model = gb.make_model(128, 1, "fp8dp", ref, arch=arch, main_grad=mode == gb.MG_GRAPHED)
        x = _inputs(128, seq=16)
        HostGraphs.Graph.replays.clear()
        step, loss = gb.make_graphed_step(model, x, torch.ones_like(x) * 1e-2, mode)
        for _ in range(3):
            step()
        assert len(HostGraphs.Graph.replays) >= 2 * 3, (arch, len(HostGraphs.Graph.replays))
        assert torch.isfinite(torch.tensor(loss())), arch
        if mode == gb.MG_GRAPHED:  # the eager step and the capture's warm-up added into it
            assert all(
                torch.count_nonzero(w.main_grad) > 0 for w in model.parameters() if w.dim() == 2
            )


@pytest.mark.parametrize("split", gb.QKV_SPLITS[1:])
def test_every_qkv_split_computes_the_same(split):
    """The QKV splits (gb.QKV_SPLITS) only lay the same views out differently: the torch block's
    output and every gradient are bit for bit those of the default split, so a ratio measured
    with one split compares with one measured with another."""
    hidden = 128
    x = _inputs(hidden)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    runs = []
    for s in (gb.QKV_SPLITS[0], split):
        model = gb.make_model(hidden, 1, "torch", arch="gpt")
        for blk in model:
            blk.split = s
        xi = x.clone().requires_grad_()
        model(xi).backward(dy)
        runs.append([xi.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", gb.ARCHS)
def test_main_grad_model_delivers_the_same_gradients(arch):
    """make_model(main_grad=True) (the *_mg variants): the same forward as the plain fp8dp model,
    every weight's gradient in its FP32 main_grad (`.grad` holds the fused route's stand-in,
    grad_added_to_main_grad set), the other parameters' gradients in `.grad` as before. FP8 off on the CPU: the wgrad GEMM is the same FP32 product on
    both sides, rounded once to BF16 by the plain model, so main_grad rounded to BF16 equals it bit
    for bit (measured; a gradient sent nowhere leaves main_grad zero and fails)."""
    ref = gb.make_model(128, 2, "torch", arch=arch)
    plain = gb.make_model(128, 2, "fp8dp", ref, arch=arch)
    mg = gb.make_model(128, 2, "fp8dp", ref, arch=arch, main_grad=True)
    x = _inputs(128, seq=16)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    outs = []
    for model in (plain, mg):
        step, _ = gb.make_step(model, x, dy, "fp8dp_off")
        xi = x.clone().requires_grad_()
        with fp8dp.fp8_autocast(enabled=False):
            y = model(xi)
        y.backward(dy)
        outs.append(y.detach())
    assert torch.equal(outs[0], outs[1])
    weights = 0
    for (name, p), q in zip(plain.named_parameters(), mg.parameters()):
        if p.dim() == 2:
            weights += 1
            assert q.grad_added_to_main_grad, name
            assert q.main_grad.dtype == torch.float32, name
            assert torch.equal(q.main_grad.to(torch.bfloat16), p.grad), name
        else:
            assert not hasattr(q, "main_grad") and torch.equal(q.grad, p.grad), name
    assert weights == 2 * 4, weights  # qkv, proj, fc1, fc2 per block
