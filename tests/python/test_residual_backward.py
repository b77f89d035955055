"""The residual's gradient joined with x's inside the norm's backward (norm_backward's dx_add):
LayerNormLinear(return_layernorm_input=True) hands its input on as the block's residual, and
LayerNormMLP does it itself when residual is its input. A pre-norm block sends x two gradients
(the norm's and the residual's); autograd adds them in a kernel of its own after rounding the
norm's to x's dtype, the fold adds them in FP32 inside the norm's backward and rounds once.

Tolerances:
- float32: the norm's dx is an FP32 value either way, and rounding an FP32 sum to float32 is what
  autograd's float32 add does, so the fold gives the same bits (asserted exactly, under every
  precision mode: the FP8 GEMMs are the same calls on both sides).
- bfloat16 (unit roundoff u = 2^-8): the fold rounds once, autograd's route twice, so the two
  differ by at most 2u (|d| + |r|) per element for the norm's part d and the residual's r; with
  d and r independent, ||d|| + ||r|| <= 2 ||d + r|| here, hence 4u = 2^-6 normwise. A gradient
  dropped or counted twice moves it by ||r|| / ||d + r||, about 0.7. Measured (CPU, 2026-12-06):
  2.7e-3 (LayerNormLinear, FP8 off), 2.6e-3 (delayed), 2.6e-3 (LayerNormMLP).

Mutations (2026-12-06, restored): the MLP returning the residual's gradient as well as folding it
(counted twice), and LayerNormLinear dropping the returned input's gradient: 21 of these tests
failed, and tests/distributed/test_grad_property.py's res_in cases with them.
"""

import pytest
import torch
import torch.nn.functional as F
from _linear_cases import FP8_MODES, mode_autocast
from torch.utils.checkpoint import checkpoint

import fp8dp
from fp8dp import _C

HIDDEN, FFN, TOKENS = 64, 128, 32
BF16_NORMWISE = 2.0**-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _randomize(mods, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in mods:
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class AttnLikeBlock(torch.nn.Module):
    """x -> LayerNormLinear -> gelu -> Linear(residual=x): the attention half of a pre-norm block
    with the attention itself replaced by a pointwise function. fold=True takes the residual from
    the norm's layer (return_layernorm_input), fold=False passes x itself: the same forward
    (the same GEMM with the same residual), the gradients joined by autograd."""

    def __init__(self, fold: bool, normalization: str, dtype, device):
        super().__init__()
        kw = dict(params_dtype=dtype, device=device)
        self.fold = fold
        self.ln = fp8dp.LayerNormLinear(
            HIDDEN, FFN, normalization=normalization, return_layernorm_input=fold, **kw
        )
        self.proj = fp8dp.Linear(FFN, HIDDEN, **kw)

    def forward(self, x):
        if self.fold:
            h, r = self.ln(x)
        else:
            h, r = self.ln(x), x
        return self.proj(F.gelu(h), residual=r)


def _grads(block, x, dy, mode: str, use_checkpoint: bool = False):
    xa = x.detach().requires_grad_(True)
    with mode_autocast(mode):
        y = checkpoint(block, xa, use_reentrant=False) if use_checkpoint else block(xa)
    y.backward(dy)
    out = {"y": y.detach(), "x": xa.grad}
    out.update({n: p.grad for n, p in block.named_parameters()})
    for p in block.parameters():
        p.grad = None
    return out


def _inputs(dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS // 4, 4, HIDDEN, generator=g).to(dtype=dtype, device=device)
    dy = torch.randn(x.shape, generator=g).to(dtype=dtype, device=device)
    return x, dy


def _pair(normalization, dtype, device):
    a = AttnLikeBlock(True, normalization, dtype, device)
    b = AttnLikeBlock(False, normalization, dtype, device)
    _randomize([a], 4)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("mode", FP8_MODES)
def test_return_layernorm_input_folds_exactly_in_float32(mode, normalization, device):
    fold, plain = _pair(normalization, torch.float32, device)
    x, dy = _inputs(torch.float32, device)
    got, want = _grads(fold, x, dy, mode), _grads(plain, x, dy, mode)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, _rel(got[k], want[k]))


@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["eager", "checkpoint"])
@pytest.mark.parametrize("mode", ["off", "delayed"])
def test_return_layernorm_input_in_bfloat16(mode, use_checkpoint, device):
    fold, plain = _pair("LayerNorm", torch.bfloat16, device)
    x, dy = _inputs(torch.bfloat16, device)
    got = _grads(fold, x, dy, mode, use_checkpoint)
    want = _grads(plain, x, dy, mode)
    assert torch.equal(got["y"], want["y"])
    assert _rel(got["x"], want["x"]) <= BF16_NORMWISE, _rel(got["x"], want["x"])
    # The parameters' gradients do not pass through the fold: the same bits.
    for k in want:
        if k not in ("x", "y"):
            assert torch.equal(got[k], want[k]), k


def test_returned_input_is_a_read_only_view_of_x(device):
    m = fp8dp.LayerNormLinear(HIDDEN, FFN, return_layernorm_input=True, device=device)
    x = torch.randn(TOKENS, HIDDEN, device=device, requires_grad=True)
    y, r = m(x)
    assert r.shape == x.shape and r.data_ptr() == x.data_ptr() and torch.equal(r, x)
    with pytest.raises(RuntimeError):
        r.add_(1.0)  # a view made inside a custom function: autograd forbids writing it
    # With qkv_heads and return_layernorm_output the input comes last.
    m = fp8dp.LayerNormLinear(
        HIDDEN,
        3 * HIDDEN,
        qkv_heads=4,
        return_layernorm_output=True,
        return_layernorm_input=True,
        device=device,
    )
    out = m(x)
    assert len(out) == 5 and out[3].shape == x.shape and out[4].data_ptr() == x.data_ptr()


def test_returned_input_without_input_gradient(device):
    """x without requires_grad: the returned input still carries the weights' graph (the
    function's output), its gradient reaches backward and is dropped there with x's."""
    fold, plain = _pair("RMSNorm", torch.float32, device)
    x, dy = _inputs(torch.float32, device)
    got_y = fold(x)
    got_y.backward(dy)
    plain(x).backward(dy)
    for (n, p), q in zip(fold.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("mode", FP8_MODES)
def test_layernorm_mlp_residual_is_x_folds_exactly_in_float32(mode, activation, device):
    mlp = fp8dp.LayerNormMLP(HIDDEN, FFN, activation=activation, device=device)
    _randomize([mlp], 5)
    x, dy = _inputs(torch.float32, device)
    res = {}
    # residual=x folds; residual=x.view_as(x) is another tensor object: autograd adds.
    for name, same in (("fold", True), ("plain", False)):
        xa = x.detach().requires_grad_(True)
        with mode_autocast(mode):
            y = mlp(xa, residual=xa if same else xa.view_as(xa))
        y.backward(dy)
        res[name] = [y.detach(), xa.grad] + [p.grad for p in mlp.parameters()]
        for p in mlp.parameters():
            p.grad = None
    for i, (a, b) in enumerate(zip(res["fold"], res["plain"])):
        assert torch.equal(a, b), (i, _rel(a, b))


def test_layernorm_mlp_residual_is_x_in_bfloat16(device):
    mlp = fp8dp.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.bfloat16, device=device)
    _randomize([mlp], 6)
    x, dy = _inputs(torch.bfloat16, device)
    grads = []
    for same in (True, False):
        xa = x.detach().requires_grad_(True)
        mlp(xa, residual=xa if same else xa.view_as(xa)).backward(dy)
        grads.append(xa.grad)
    assert _rel(grads[0], grads[1]) <= BF16_NORMWISE, _rel(grads[0], grads[1])


@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cols", [64, 136, 13000])  # vectorised, ragged, past the registers
def test_norm_backward_dx_add(cols, dtype, rms, device):
    """The kernel level: dx_add enters before dx's one rounding. Reference: the same backward in
    float64 from the same (rounded) inputs, plus dx_add, rounded once; the difference is the
    FP32 arithmetic's (row sums of `cols` terms: <= 2 cols 2^-24 relative to the terms) plus at
    most one ulp where the reference lies near a rounding boundary."""
    g = torch.Generator().manual_seed(cols)
    rows = 37
    x = torch.randn(rows, cols, generator=g).to(dtype)
    gamma = (1 + 0.3 * torch.randn(cols, generator=g)).to(dtype)
    dz = torch.randn(rows, cols, generator=g).to(dtype)
    add = (4 * torch.randn(rows, cols, generator=g)).to(dtype)
    xd = x.double()
    mu = torch.zeros(rows, dtype=torch.float64) if rms else xd.mean(1)
    var = (xd - mu[:, None]).square().mean(1)
    rs = (var + 1e-5).rsqrt()
    xhat = (xd - mu[:, None]) * rs[:, None]
    dxhat = dz.double() * gamma.double()
    inner = dxhat - xhat * (dxhat * xhat).mean(1, keepdim=True)
    if not rms:
        inner = inner - dxhat.mean(1, keepdim=True)
    want = inner * rs[:, None] + add.double()
    args = [t.to(device) for t in (dz, x, mu.float(), rs.float(), gamma)]
    dx, dgamma, _ = _C.norm_backward(*args, has_beta=not rms, rms=rms, dx_add=add.to(device))
    dx_plain, dgamma_plain, _ = _C.norm_backward(*args, has_beta=not rms, rms=rms)
    assert torch.equal(dgamma, dgamma_plain)  # the column sums do not see dx_add
    ulp = torch.finfo(dtype).eps  # one ulp at 1 relative (2u)
    terms = (dxhat.abs() + xhat.abs() * dxhat.abs()).max(1, keepdim=True).values * rs[:, None]
    bound = ulp * want.abs() + 4 * cols * 2.0**-24 * terms
    err = (dx.cpu().double() - want).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # Without dx_add the result misses it by |add|: the check can fail.
    assert not bool(((dx_plain.cpu().double() - want).abs() <= bound).all())


def test_norm_backward_dx_add_errors(device):
    x = torch.randn(4, 8, device=device)
    args = (x, x, torch.zeros(4, device=device), torch.ones(4, device=device))
    gamma = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="dx_add must have x's shape"):
        _C.norm_backward(*args, gamma, has_beta=True, dx_add=x[:2])
    with pytest.raises(ValueError, match="dx_add must have x's dtype"):
        _C.norm_backward(*args, gamma, has_beta=True, dx_add=x.double())


def test_return_layernorm_input_needs_a_bool():
    with pytest.raises(ValueError, match="return_layernorm_input"):
        fp8dp.LayerNormLinear(HIDDEN, FFN, return_layernorm_input="yes")
