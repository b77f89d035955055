"""fp8dp.LayerNormMLP: the fused module against the unfused composition of fp8dp
modules (bytes), against a float64 reference (derived bounds), the C2-C4 routes of both weights
(immediate / fused / delayed, DDP), and its errors.

1. Unfused composition, exact: ``m.fc2(fp8dp.activation(m.fc1(x), act))`` on a deep copy runs the
   same casts on the same values: fc1 is the same LayerNormLinear, fp8dp.activation stores a in
   the parameters' dtype with the math of the fused kernel (src/fp8/activation_math.h), and fc2's
   cast of a (and fc1's cast of dh in backward) is the quantize that the fused kernel runs over
   the same rounded values. So y, every gradient, main_grad and both children's FP8 states (amax
   histories, scales) must be bit-identical, FP8 on (delayed and current scaling) or off, fused
   or not, delayed or not.
2. float64 reference: FP8 off, float32 parameters: every output within FP32 bounds (k 2^-24
   sum|a||b| per GEMM plus the activation's own error, see `fp32_tol`); FP8 on: y within the
   first-order elementwise propagation of the E4M3 quantization bounds through fc1, the
   activation (Lipschitz bounds of GELU / SwiGLU) and fc2 (`fp8_forward_bound`); the backward of
   FP8 is covered by 1. (bit-identical to the separate modules, whose FP8 gradient bounds
   test_linear_fp8_numerics.py checks) and by the normwise check here (E5M2: 2^-3).
3. Activation math: fp8dp.activation against float64 torch within 1e-6 relative + 2e-7 absolute
   (erf's A&S 7.1.26 error 1.5e-7, exp within 2 ulp, a few float32 roundings).

4. Routes: backward_dw() runs both queues once; C4 for both biases with an unconditional external
   consumer; under fp8dp.DistributedDataParallel (1-rank gloo, grad ledger on) main_grad equals an
   unwrapped twin's FP32 sum of two micro-batches, bit for bit, immediate / delayed x fused or not.

Mutations tried (2026-12-03, CPU build, each reverted after it failed as shown):
- M1 fused act+cast records no amax (cast_activation without amax_slot): the 16 delayed-scaling
  byte tests fail: "fc1 amax_history: differ, max |diff| 4.21875" (fc1's grad_output role empty).
- M3 fused route without mark_grad_added_to_main_grad (route_wgrad): the 16 fused byte tests
  whose scaling is off/current fail on `assert p.grad_added_to_main_grad`.
- M2 SwiGLU derivative wrong (silu'(g) := sigmoid(g) in activation_math.h; shared by the fused
  kernel and fp8dp.activation, so the byte tests still pass - the float64 ones are what catch
  it): test_fp32_matches_float64_reference[swiglu-*] "fc1.weight.grad: relative error 0.217",
  test_activation_math_vs_float64[swiglu] "backward: 9.58 over the bound".
- M4 eager FP8 fc1 bias gradient dropped (db1 not set from the dact cast's dbias): 32 FP8 byte
  tests "fc1.bias: one side has no gradient", test_fp8_backward_normwise[*],
  test_c4_backfill_fp8_bias_not_doubled and the FP8 DDP cases fail (NoneType .grad).
- M5 fused immediate route does not deliver to the DDP sink: the new immediate-fused DDP cases
  fail in finish_grad_sync: "gradient ledger: each micro-batch's gradient must enter main_grad
  exactly once per use (contracts C2, C8) ...". (Dropping only the forward's announce() was not
  caught: a delivery without an announcement is not something the ledger reports.)
- M6 token multiple-of-16 check removed (LayerNormMLPCore::forward):
  test_bad_shapes_and_dtypes_refused_before_any_state_changes fails (no ValueError).
- P1 LayerNormMLP.backward_dw() runs only fc1's queue: test_backward_dw_runs_both_queues_once,
  test_c4_backfill_fp8_bias_not_doubled and the delayed byte tests fail ("fc2.weight: one side has
  no gradient").
"""

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from _linear_cases import FP8_MODES
from _linear_cases import mode_autocast as autocast

import fp8dp
from fp8dp import _C

HID, FFN, TOKENS = 32, 48, 32
ACTS = ["gelu", "swiglu"]
NORMS = ["LayerNorm", "RMSNorm"]


def make_mlp(act, norm, dtype=torch.bfloat16, seed=0, hid=HID, ffn=FFN, **kw):
    torch.manual_seed(seed)
    m = fp8dp.LayerNormMLP(hid, ffn, activation=act, normalization=norm, params_dtype=dtype, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 2 else 0.5))
        m.fc1.layer_norm_weight.add_(1.0)
    return m


def attach_main_grad(m):
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)


def data(dtype, seed=1, n=2):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(2, TOKENS // 2, HID, generator=g).to(dtype),
            torch.randn(2, TOKENS // 2, HID, generator=g).to(dtype),
        )
        for _ in range(n)
    ]


def grads(m):
    """Every parameter's gradient where its route put it: main_grad for the fused weights (their
    .grad holds the uninitialised stand-in of C2 b), else .grad."""
    fused = {"fc1.weight", "fc2.weight"} if m.fuse_wgrad_accumulation else set()
    out = {}
    for name, p in m.named_parameters():
        g = p.main_grad if name in fused else p.grad
        out[name] = None if g is None else g.clone()
    return out


def fp8_state(m):
    return {
        k: (c._core.amax_history.clone(), c._core.scale.clone())
        for k, c in (("fc1", m.fc1), ("fc2", m.fc2))
        if c._core.amax_history is not None and c._core.amax_history.numel() > 0
    }


def step(m, x, dy, mode, fused_path, delayed):
    """Forward + backward (+ backward_dw) of one micro-batch; returns (y, dx)."""
    xa = x.clone().requires_grad_(True)
    with autocast(mode):
        if fused_path:
            y = m(xa, is_first_microbatch=None)
        else:
            y = m.fc2(fp8dp.activation(m.fc1(xa), m.activation))
    y.backward(dy)
    if delayed:
        if fused_path:
            m.backward_dw()
        else:
            m.fc2.backward_dw()
            m.fc1.backward_dw()
    return y.detach(), xa.grad


def run_both(a, b, batches, mode, delayed):
    """Iterations of a (fused) and b (unfused), interleaved: with delayed scaling
    update_fp8_scales() runs between iterations (it updates every state of the process, so both
    modules see the same updates), and the second iteration casts with scales from the history."""
    out = []
    for x, dy in batches:
        out.append((step(a, x, dy, mode, True, delayed), step(b, x, dy, mode, False, delayed)))
        if mode == "delayed":
            fp8dp.update_fp8_scales()
    return out


def assert_same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side has no gradient"
        return
    assert torch.equal(a, b), f"{what}: differ, max |diff| {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("fused", [False, True], ids=["unfused-wgrad", "fused-wgrad"])
@pytest.mark.parametrize("delayed", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("mode", FP8_MODES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("act", ACTS)
def test_matches_unfused_composition_bytes(act, norm, mode, delayed, fused):
    """Fused LayerNormMLP == LayerNormLinear -> fp8dp.activation -> Linear, bit for bit."""
    kw = dict(delay_wgrad_compute=delayed, fuse_wgrad_accumulation=fused)
    a = make_mlp(act, norm, **kw)
    b = copy.deepcopy(a)
    if fused:
        attach_main_grad(a)
        attach_main_grad(b)
    batches = data(torch.bfloat16)
    for i, ((ya, dxa), (yb, dxb)) in enumerate(run_both(a, b, batches, mode, delayed)):
        assert_same(ya, yb, f"y[{i}]")
        assert_same(dxa, dxb, f"dx[{i}]")
    ga, gb = grads(a), grads(b)
    for k in ga:
        assert_same(ga[k], gb[k], k)
    if mode == "delayed":  # current scaling keeps no state
        sa, sb = fp8_state(a), fp8_state(b)
        assert sa.keys() == sb.keys() == {"fc1", "fc2"}
        for k in sa:
            assert_same(sa[k][0], sb[k][0], f"{k} amax_history")
            assert_same(sa[k][1], sb[k][1], f"{k} scale")
    if fused:
        for p in (a.fc1.weight, a.fc2.weight):
            assert p.grad_added_to_main_grad


# ---------------------------------------------------------------------------------------------
# float64 reference


def ref_forward(m, x):
    """float64 forward of m on x [tokens, HID]; returns (y, z, h, a)."""
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    x = x.double()
    fc1, fc2 = m.fc1, m.fc2
    if m.normalization == "LayerNorm":
        z = F.layer_norm(x, (HID,), d(fc1.layer_norm_weight), d(fc1.layer_norm_bias), fc1.eps)
    else:
        z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + fc1.eps) * d(fc1.layer_norm_weight)
    h = z @ d(fc1.weight).t()
    if fc1.bias is not None:
        h = h + d(fc1.bias)
    if m.activation == "gelu":
        a = F.gelu(h)
    else:
        g, u = h.chunk(2, -1)
        a = F.silu(g) * u
    y = a @ d(fc2.weight).t()
    if fc2.bias is not None:
        y = y + d(fc2.bias)
    return y, z, h, a


U32 = 2.0**-24  # float32 unit roundoff
E4M3 = (2.0**-4, 2.0**-10, 448.0)  # unit roundoff, subnormal spacing / 2 (half a step), max
ACT_ABS = 2e-7  # the activation math's absolute error (erf 1.5e-7 + roundings), see module doc


def fp32_tol(ref, A, B, k):
    """Elementwise FP32 bound of a k-term GEMM: 2 k u32 sum|a||b| (Higham's gamma_k, doubled to
    cover the inputs' own float32 rounding) + 4 u32 |ref|."""
    return 2 * k * U32 * (A @ B.t()) + 4 * U32 * ref.abs()


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("act", ACTS)
def test_fp32_matches_float64_reference(act, norm):
    """FP8 off, float32 parameters: y and every gradient against float64 autograd."""
    m = make_mlp(act, norm, dtype=torch.float32)
    ((x, dy),) = data(torch.float32, n=1)
    x2, dy2 = x.reshape(-1, HID), dy.reshape(-1, HID)
    xa = x2.clone().requires_grad_(True)
    y = m(xa)
    y.backward(dy2)
    # float64 reference with autograd on copies of the parameters
    ref = copy.deepcopy(m).double()
    xr = x2.double().requires_grad_(True)
    yr, z, h, a = ref_forward(ref, xr)
    # ref_forward detaches the parameters: rebuild it with autograd for the gradients.
    params = {n: p.detach().double().requires_grad_(True) for n, p in m.named_parameters()}
    fc1w, fc2w = params["fc1.weight"], params["fc2.weight"]
    if norm == "LayerNorm":
        zr = F.layer_norm(
            xr, (HID,), params["fc1.layer_norm_weight"], params["fc1.layer_norm_bias"], 1e-5
        )
    else:
        zr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5)
        zr = zr * params["fc1.layer_norm_weight"]
    hr = zr @ fc1w.t() + params["fc1.bias"]
    if act == "gelu":
        ar = F.gelu(hr)
    else:
        g, u = hr.chunk(2, -1)
        ar = F.silu(g) * u
    yr2 = ar @ fc2w.t() + params["fc2.bias"]
    yr2.backward(dy2.double())
    # y: fc2's GEMM bound plus the activation error carried through |W2|, plus fc1's bound
    # carried through the activation (|act'| <= 1.13 for GELU; SwiGLU: 1.1 |up| + |silu(gate)|).
    W1, W2 = fc1w.detach().abs(), fc2w.detach().abs()
    e_h = fp32_tol(h, z.abs(), W1, HID) + 8 * U32 * z.abs() @ W1.t()
    if act == "gelu":
        e_a = 1.13 * e_h + ACT_ABS + 4 * U32 * a.abs()
    else:
        g, u = h.detach().chunk(2, -1)
        eg, eu = e_h.chunk(2, -1)
        e_a = 1.1 * eg * (u.abs() + eu) + (F.silu(g).abs() + 1.1 * eg) * eu
        e_a = e_a + ACT_ABS * (1 + u.abs()) + 4 * U32 * a.abs()
    e_y = fp32_tol(yr, a.abs(), W2, FFN) + e_a @ W2.t()
    err = (y.detach().double() - yr).abs()
    assert (err <= e_y).all(), f"y: error exceeds the FP32 bound by {(err - e_y).max()}"
    # Gradients: normwise, relative 1e-4 (FP32 GEMMs of k <= 96 terms and the activation
    # derivative's 1e-6 relative error stay far below; a wrong formula is O(1)).
    for name, p in m.named_parameters():
        r = params[name].grad
        rel = float((p.grad.double() - r).norm() / r.norm())
        assert rel < 1e-4, f"{name}.grad: relative error {rel}"
    rel = float((xa.grad.double() - xr.grad).norm() / xr.grad.norm())
    assert rel < 1e-4, f"x.grad: relative error {rel}"


def quant_bound(A, B, sa, sb, k):
    """Elementwise bound on |deq(q(a)) deq(q(b))ᵀ - a bᵀ| for E4M3 a, b with scales sa, sb
    (|a|, |b| given): relative u and absolute half-spacing d/s per cast, plus the FP32 sum."""
    u, h, _ = E4M3
    da, db = h / sa, h / sb
    qa, qb = (1 + u) * A + da, (1 + u) * B + db
    return (u * A + da) @ qb.t() + A @ (u * B + db).t() + k * U32 * (qa @ qb.t())


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("act", ACTS)
def test_fp8_forward_within_derived_bound(act, norm):
    """FP8 (delayed scaling, first step: the scales of the first casts), float32 parameters: y
    within the first-order propagation of the E4M3 bounds (quant_bound) through fc1, the
    activation's Lipschitz bound and fc2; and y's normwise error is not zero (FP8 ran)."""
    m = make_mlp(act, norm, dtype=torch.float32)
    ((x, _),) = data(torch.float32, n=1)
    x2 = x.reshape(-1, HID)
    with autocast("delayed"):
        y = m(x2)
    yr, z, h, a = ref_forward(m, x2)
    s_in1, s_w1 = (float(v) for v in m.fc1._core.scale[:2])
    s_in2, s_w2 = (float(v) for v in m.fc2._core.scale[:2])
    W1, W2 = m.fc1.weight.detach().double().abs(), m.fc2.weight.detach().double().abs()
    # z from the float32 kernel: 1e-5 relative slack on its input to the cast.
    Z = z.abs() * (1 + 1e-5)
    e_h = quant_bound(Z, W1, s_in1, s_w1, HID) + 1e-5 * z.abs() @ W1.t()
    if act == "gelu":
        e_a = 1.13 * e_h + ACT_ABS + 2 * U32 * a.abs()
    else:
        g, u = h.chunk(2, -1)
        eg, eu = e_h.chunk(2, -1)
        e_a = 1.1 * eg * (u.abs() + eu) + (F.silu(g).abs() + 1.1 * eg) * eu + ACT_ABS
    # fc2 quantizes the computed a, which is within e_a of the reference a.
    e_y = quant_bound(a.abs() + e_a, W2, s_in2, s_w2, FFN) + e_a @ W2.t()
    err = (y.detach().double() - yr).abs()
    assert (err <= e_y).all(), f"y: error exceeds the FP8 bound by {(err - e_y).max()}"
    assert err.max() > 0, "no quantization error: FP8 did not run"


@pytest.mark.parametrize("act", ACTS)
def test_fp8_backward_normwise(act):
    """FP8 HYBRID backward vs float64: each gradient within 4 (2^-3 + 2^-4) normwise relative
    (one E5M2 and one E4M3 cast per GEMM operand pair, amplified at most 4x through two GEMMs and
    the activation on these well-conditioned inputs); a missing dequantisation or a wrong
    activation derivative is O(1)."""
    m = make_mlp(act, "LayerNorm", dtype=torch.float32)
    ((x, dy),) = data(torch.float32, n=1)
    x2, dy2 = x.reshape(-1, HID), dy.reshape(-1, HID)
    with autocast("delayed"):
        y = m(x2.clone().requires_grad_(True))
    y.backward(dy2)
    ref = fp8dp.LayerNormMLP(HID, FFN, activation=act, params_dtype=torch.float32)
    ref.load_state_dict(m.state_dict())
    ref64 = {n: p.detach().double().requires_grad_(True) for n, p in m.named_parameters()}
    z = F.layer_norm(
        x2.double(), (HID,), ref64["fc1.layer_norm_weight"], ref64["fc1.layer_norm_bias"], 1e-5
    )
    h = z @ ref64["fc1.weight"].t() + ref64["fc1.bias"]
    if act == "gelu":
        a = F.gelu(h)
    else:
        g, u = h.chunk(2, -1)
        a = F.silu(g) * u
    (a @ ref64["fc2.weight"].t() + ref64["fc2.bias"]).backward(dy2.double())
    tol = 4 * (2.0**-3 + 2.0**-4)
    for name, p in m.named_parameters():
        r = ref64[name].grad
        rel = float((p.grad.double() - r).norm() / r.norm())
        assert rel < tol, f"{name}.grad: relative error {rel} > {tol}"
        assert rel > 0


# ---------------------------------------------------------------------------------------------
# activation math


@pytest.mark.parametrize("act", ACTS)
def test_activation_math_vs_float64(act):
    g = torch.Generator().manual_seed(3)
    h = torch.cat([torch.randn(64, 96, generator=g) * 4, torch.linspace(-20, 20, 96)[None]])
    h[0, :6] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -110.0])
    da = torch.randn(h.shape[0], 96 if act == "gelu" else 48, generator=g)
    hd = h.double().requires_grad_(True)
    if act == "gelu":
        ref = F.gelu(hd)
    else:
        gate, up = hd.chunk(2, -1)
        ref = F.silu(gate) * up
    ref.backward(da.double())
    out = fp8dp.activation(h, act)
    dh = _C.activation_backward(da, h, act)
    scale_in = 1 + h.double().abs() if act == "gelu" else 1 + h.double().abs().max()
    bound_f = 1e-6 * ref.detach().abs() + ACT_ABS * (
        1 + (hd.detach().abs() if act == "gelu" else hd.detach().chunk(2, -1)[1].abs())
    )
    err = (out.double() - ref.detach()).abs()
    assert (err <= bound_f).all(), f"forward: {(err - bound_f).max()} over the bound"
    bound_b = 1e-6 * hd.grad.abs() + 4 * ACT_ABS * (da.double().abs().max()) * scale_in
    errb = (dh.double() - hd.grad).abs()
    assert (errb <= bound_b).all(), f"backward: {(errb - bound_b).max()} over the bound"


def test_activation_special_values_match_torch():
    """Infinities, NaN, signed zeros and arguments past the range of erf's polynomial (|x| >= 6 sqrt 2)
    and of the exponential (e^-x overflowing in the sigmoid): the branch-free selects of
    activation_math.h give torch's float64 results rounded to float32: bit for bit for GELU (NaN
    where torch has NaN, the sign of every zero), its derivative within 1e-14 (past |x| = 6 sqrt 2
    the density is taken as 0: dgelu(-8.5) is 0 here, -6.9e-16 in float64), SwiGLU within 1e-36
    (where e^-x overflows float32 the sigmoid is 0: 2 silu(-89) is -0 here, -4.0e-37 in float64). Mutation (2026-12-05): erf
    without its |x| >= 6 select gives gelu(100) = 50; the exponential without its overflow select
    gives silu(-100) = -50."""
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 100.0, -100.0, 89.0, -89.0])
    x = torch.cat([x, torch.tensor([-104.0, 0.0, -0.0, 8.5, -8.5, 9.0, -9.0])])
    xd = x.double().requires_grad_(True)
    F.gelu(xd).backward(torch.ones_like(xd))
    ours, ref = fp8dp.activation(x[None], "gelu")[0], F.gelu(x.double()).float()
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)
    num = ~torch.isnan(ref)  # a NaN's sign is not a value (stored as +NaN: the test below)
    assert torch.equal(torch.signbit(ours[num]), torch.signbit(ref[num])), (ours, ref)
    ours = _C.activation_backward(torch.ones(1, x.numel()), x[None], "gelu")[0]
    torch.testing.assert_close(ours, xd.grad.float(), rtol=0, atol=1e-14, equal_nan=True)
    h = torch.cat([x, torch.full_like(x, 2.0)])[None]
    ref = (F.silu(x.double()) * 2).float()
    torch.testing.assert_close(
        fp8dp.activation(h, "swiglu")[0], ref, rtol=1e-6, atol=1e-36, equal_nan=True
    )


def test_activation_bf16_close_to_torch_gelu():
    """bf16 GELU next to torch's, in float32 both: 0.5 x (1 + erf(x / sqrt 2)). Two erf
    implementations may differ by one float32 ulp of erf (2^-24 where |erf| >= 1/2), and in the
    left tail 1 + erf cancels exactly, so that ulp becomes the whole result: 0.5 |x| 2^-24 each,
    |x| 2^-24 between them (torch 2.11's vectorised CPU erf gives 0 at x = -8 where the exact
    value is -5e-15). Anywhere else a value next to a bf16 rounding boundary may round the other
    way: one bf16 ulp."""
    h = torch.linspace(-8, 8, 20001).to(torch.bfloat16)
    ours, theirs = fp8dp.activation(h, "gelu"), F.gelu(h)
    diff = (ours.float() - theirs.float()).abs()
    ulp = 2.0**-7 * theirs.float().abs().clamp_min(2.0**-126)
    tol = ulp + h.float().abs() * 2.0**-24
    assert (diff <= tol).all(), (h[diff > tol], ours[diff > tol], theirs[diff > tol])


# ---------------------------------------------------------------------------------------------
# delayed wgrad / fused main_grad / DDP


def test_backward_dw_runs_both_queues_once():
    m = make_mlp("swiglu", "RMSNorm", bias=False, delay_wgrad_compute=True)
    ((x, dy),) = data(torch.bfloat16, n=1)
    with autocast("delayed"):
        y = m(x)
    y.backward(dy)
    assert m.fc1.weight.grad is None and m.fc2.weight.grad is None
    assert m.need_backward_dw()
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    m.backward_dw()
    assert m.fc1.weight.grad is not None and m.fc2.weight.grad is not None
    assert calls == [1]
    assert not m.need_backward_dw()
    with pytest.raises(RuntimeError, match="no weight-gradient computation is queued"):
        m.backward_dw()


def test_c4_backfill_fp8_bias_not_doubled():
    """C4 for both biases: an external consumer moves the eager FP8 bias gradients into main_grad
    and clears .grad before backward_dw(); backward_dw() adds nothing to them."""
    m = make_mlp("gelu", "LayerNorm", delay_wgrad_compute=True)
    ref = copy.deepcopy(m)
    ((x, dy),) = data(torch.bfloat16, n=1)
    for p in list(m.parameters()) + list(ref.parameters()):
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)

    def consume(p):
        if p.grad is not None:
            p.main_grad += p.grad.float()
            p.grad = None

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(consume)
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: [consume(p) for p in m.parameters()])
    with autocast("delayed"):
        y = m(x)
    y.backward(dy)
    assert m.fc1.bias.grad is None and m.fc2.bias.grad is None
    m.backward_dw()
    # reference: the same step without the consumer
    with autocast("delayed"):
        yr = ref(x)
    yr.backward(dy)
    ref.backward_dw()
    for (name, p), (_, r) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.main_grad, r.grad.float()), name
        assert p.grad is None, name


@pytest.mark.parametrize("fp8", FP8_MODES)
@pytest.mark.parametrize("delayed", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused-wgrad", "fused-wgrad"])
def test_ddp_delivers_each_weight_once(group, fp8, delayed, fused):
    """Under fp8dp.DistributedDataParallel (1-rank gloo, ledger on): two micro-batches, each
    weight's gradient reaches main_grad exactly once per micro-batch: main_grad equals the sum of
    the two micro-batches' gradients of an unwrapped twin, bit for bit."""
    m = make_mlp("gelu", "LayerNorm", delay_wgrad_compute=delayed, fuse_wgrad_accumulation=fused)
    twin = copy.deepcopy(m)
    cfg = fp8dp.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        delay_wgrad_compute=True,
        grad_ledger=True,
    )
    ddp = fp8dp.DistributedDataParallel(m, cfg, process_group=group)
    batches = data(torch.bfloat16, n=2)
    ddp.zero_grad_buffer()
    for i, (x, dy) in enumerate(batches):
        ctx = ddp.no_sync() if i == 0 else contextlib_null()
        with ctx:
            with autocast(fp8):
                y = ddp(x)
            y.backward(dy)
            if delayed:
                m.backward_dw()
    ddp.finish_grad_sync()
    # twin, no DDP: main_grad set by hand for the fused weights; every other gradient is moved
    # into an FP32 sum after each micro-batch, as DDP's hooks add it to main_grad.
    attach_main_grad(twin)
    fused_w = {"fc1.weight", "fc2.weight"} if fused else set()
    for x, dy in batches:
        with autocast(fp8):
            y = twin(x)
        y.backward(dy)
        if delayed:
            twin.backward_dw()
        for name, p in twin.named_parameters():
            if name not in fused_w:
                p.main_grad += p.grad.float()
                p.grad = None
    for (name, p), (_, t) in zip(m.named_parameters(), twin.named_parameters()):
        assert torch.equal(p.main_grad, t.main_grad), f"{name}: main_grad != the twin's sum"


def contextlib_null():
    import contextlib

    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# errors


def test_bad_activation_name():
    with pytest.raises(ValueError, match="activation: expected 'gelu' or 'swiglu', got 'relu'"):
        fp8dp.LayerNormMLP(HID, FFN, activation="relu")
    with pytest.raises(ValueError, match="activation must be 'gelu' or 'swiglu', got 'silu'"):
        _C.activation_forward(torch.zeros(2, 4), "silu")


def test_swiglu_odd_fc1_width_refused():
    with pytest.raises(ValueError, match="swiglu needs an even number of input columns"):
        fp8dp.activation(torch.zeros(4, 5), "swiglu")
    fc1 = fp8dp.LayerNormLinear(HID, 2 * FFN + 1)
    fc2 = fp8dp.Linear(FFN, HID)
    with pytest.raises(ValueError, match=r"fc1 must have out_features=96 \(swiglu"):
        _C.LayerNormMLPCore("mlp", "swiglu", FFN, fc1._core, fc2._core)


def test_bad_shapes_and_dtypes_refused_before_any_state_changes():
    m = make_mlp("gelu", "LayerNorm")
    with pytest.raises(ValueError, match="input must have hidden_size=32 as its last dimension"):
        m(torch.zeros(4, HID + 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="input has dtype .* but the parameters have dtype"):
        m(torch.zeros(4, HID))
    with pytest.raises(ValueError, match="ffn_hidden_size: expected an integer > 0"):
        fp8dp.LayerNormMLP(HID, 0)
    odd = make_mlp("gelu", "LayerNorm")
    odd_x = torch.zeros(3, HID, dtype=torch.bfloat16)
    with autocast("delayed"):
        with pytest.raises(ValueError, match="number of tokens .* multiple of 16, got 3"):
            odd(odd_x)
    assert odd.fc1._core.amax_history is None or odd.fc1._core.amax_history.numel() == 0
    with pytest.raises(ValueError, match="da' must have shape \\[4, 3\\]"):
        _C.activation_backward(torch.zeros(4, 6), torch.zeros(4, 6), "swiglu")


def test_backward_dw_without_delay_refused():
    m = make_mlp("gelu", "LayerNorm")
    with pytest.raises(RuntimeError, match="delay_wgrad_compute=False"):
        m.backward_dw()


def test_fp8_ffn_not_multiple_of_16_refused():
    m = fp8dp.LayerNormMLP(HID, 40, params_dtype=torch.bfloat16)
    with autocast("delayed"):
        with pytest.raises(ValueError, match="FP8 needs ffn_hidden_size to be a multiple of 16"):
            m(torch.zeros(16, HID, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# CUDA bytes == CPU bytes


def _cuda_reason():
    ok, reason = fp8dp.cuda_available(return_reason=True)
    return ok, reason


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", ACTS)
# 257 x 96: partial tiles in both directions and byte-wise transposed stores; 512 x 160: 16-byte
# transposed stores, a partial column tile; 3 x 5: less than one vector per row.
@pytest.mark.parametrize("rows,cols", [(257, 96), (512, 160), (3, 5)])
def test_cuda_activation_cast_bytes_match_cpu(act, dtype, rows, cols):
    ok, reason = _cuda_reason()
    if not ok:
        pytest.skip(reason)
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(rows, 2 * cols if act == "swiglu" else cols, generator=g) * 3).to(dtype)
    da = torch.randn(rows, cols, generator=g).to(dtype)
    h[0, :4] = torch.tensor([0.0, 1e-30, 30.0, -30.0]).to(dtype)
    # (data, transpose): both (the tiled pass), the row-major bytes alone (the flat pass), the
    # transposed bytes alone (tiled, no row-major store).
    for back, (data, trans) in itertools.product(
        (False, True), ((True, True), (True, False), (False, True))
    ):
        d = da if back else None
        fmt = _C.Format.E5M2 if back else _C.Format.E4M3
        scale = torch.tensor([2.0])
        cpu = _C.activation_cast(d, h, act, scale, fmt, data, trans, back, None, dtype)
        gpu = _C.activation_cast(
            None if d is None else d.cuda(),
            h.cuda(),
            act,
            scale.cuda(),
            fmt,
            data,
            trans,
            back,
            None,
            dtype,
        )
        if data:
            assert torch.equal(cpu.data.view(torch.uint8), gpu.data.cpu().view(torch.uint8))
        if trans:
            assert torch.equal(cpu.data_t.view(torch.uint8), gpu.data_t.cpu().view(torch.uint8))
        assert torch.equal(cpu.amax, gpu.amax.cpu())
        assert torch.equal(cpu.scale_inv, gpu.scale_inv.cpu())
        if back:
            assert torch.equal(cpu.dbias, gpu.dbias.cpu())
        hp_cpu = _C.activation_backward(da, h, act) if back else _C.activation_forward(h, act)
        hp_gpu = (
            _C.activation_backward(da.cuda(), h.cuda(), act)
            if back
            else _C.activation_forward(h.cuda(), act)
        )
        assert torch.equal(hp_cpu, hp_gpu.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dbias_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_activation_dbias_over_many_chunks_matches_cpu(act, dbias_dtype):
    """dbias adds its 64-row chunk sums in chunk order, as the CPU does, also where the chunks
    outnumber one round of the summing kernel (128 chunks; 8,293 rows are 130 chunks, the last
    one partial) and the columns end in a partial group of 32 (136). The inputs span 2^-8 .. 2^8,
    so that adding the chunks in any other order would change some column's bits."""
    ok, reason = _cuda_reason()
    if not ok:
        pytest.skip(reason)
    rows, cols = 8293, 136
    g = torch.Generator().manual_seed(12)
    h = (torch.randn(rows, 2 * cols if act == "swiglu" else cols, generator=g) * 2).bfloat16()
    mag = torch.exp2(torch.randint(-8, 9, (rows, cols), generator=g).float())
    da = (torch.randn(rows, cols, generator=g) * mag).bfloat16()
    scale = torch.tensor([1.0])
    args = (act, scale, _C.Format.E5M2, True, True, True, None, dbias_dtype)
    cpu = _C.activation_cast(da, h, *args)
    gpu = _C.activation_cast(da.cuda(), h.cuda(), act, scale.cuda(), *args[2:])
    assert cpu.dbias.dtype == dbias_dtype and not torch.isnan(cpu.dbias).any()
    assert torch.equal(cpu.dbias, gpu.dbias.cpu())
    # The test can fail: the chunks added in reverse order give other bits in some column.
    chunks = torch.stack([t.sum(0) for t in _C.activation_backward(da, h, act).float().split(64)])
    assert not torch.equal(chunks.sum(0), chunks.flip(0).sum(0))


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("back", [False, True], ids=["forward", "backward"])
def test_cuda_activation_cast_misaligned_rows_match_cpu(act, back):
    """h and da starting 2 bytes past a 16-byte boundary: the kernels must take their element-wise
    loads (16-byte loads there would fault with a misaligned address), with the CPU's bytes."""
    ok, reason = _cuda_reason()
    if not ok:
        pytest.skip(reason)
    rows, cols = 64, 96
    g = torch.Generator().manual_seed(6)
    h = (torch.randn(rows, 2 * cols if act == "swiglu" else cols, generator=g) * 3).bfloat16()
    da = torch.randn(rows, cols, generator=g).bfloat16() if back else None

    def misaligned(t):  # the same values on the GPU, one bf16 element past an aligned start
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        buf[1:].copy_(t.reshape(-1))
        view = buf[1:].view(t.shape)
        assert view.data_ptr() % 16 == 2
        return view

    fmt = _C.Format.E5M2 if back else _C.Format.E4M3
    scale = torch.tensor([2.0])
    cpu = _C.activation_cast(da, h, act, scale, fmt, True, True, back, None, torch.bfloat16)
    gpu = _C.activation_cast(
        None if da is None else misaligned(da),
        misaligned(h),
        act,
        scale.cuda(),
        fmt,
        True,
        True,
        back,
        None,
        torch.bfloat16,
    )
    assert torch.equal(cpu.data.view(torch.uint8), gpu.data.cpu().view(torch.uint8))
    assert torch.equal(cpu.data_t.view(torch.uint8), gpu.data_t.cpu().view(torch.uint8))
    assert torch.equal(cpu.amax, gpu.amax.cpu())
    if back:
        assert torch.equal(cpu.dbias, gpu.dbias.cpu())
    hp_cpu = _C.activation_backward(da, h, act) if back else _C.activation_forward(h, act)
    hp_gpu = (
        _C.activation_backward(misaligned(da), misaligned(h), act)
        if back
        else _C.activation_forward(misaligned(h), act)
    )
    assert torch.equal(hp_cpu, hp_gpu.cpu())


def _every_bf16_below(limit, rows, cols):
    """[rows, cols] bf16 that holds every bf16 bit pattern of magnitude below `limit` (the others,
    Inf and NaN among them, set to 0), each rows * cols / 65536 times, in a fixed shuffled order.
    The limit keeps products and dbias sums finite: an Inf - Inf NaN's bits differ between CPU and
    GPU, and NaN never equals itself."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).clone()
    x[~(x.float().abs() < limit)] = 0
    x = x.repeat(rows * cols // 65536)
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(8))
    return x[perm].view(rows, cols)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("back", [False, True], ids=["forward", "backward"])
def test_cuda_activation_tables_give_the_cpu_bytes_for_every_bf16(act, back):
    """The CUDA kernels look bf16 inputs up in tables (src/fp8/activation_lut.h) and compute only
    those outside them; the CPU computes every element. Over every bf16 value of h below 2^20 in
    magnitude (the tables hold 2^-12 <= |x| < 16; the GELU input or SwiGLU's gate; the up half
    and da random), the FP8 bytes of both orientations,
    amax, dbias and the high-precision results must equal the CPU's, with the tables and without
    (fp8dp._C._set_activation_lut). A slot of the wrong value, SwiGLU's two tables swapped or a
    table entry not rounded as the kernel rounds changes bytes here. The shape gives more tiles
    (256 to 512) and 8-element groups than an H100 / H200 (132 SMs) gets blocks on the table path,
    so blocks loop over several tiles (the tiled pass: data + data_t, dbias) and the flat pass
    (data alone, the high-precision result) strides more than once."""
    ok, reason = _cuda_reason()
    if not ok:
        pytest.skip(reason)
    rows, cols = 2048, 512  # 16 copies of each value; vec_in (cols % 8 == 0): the table path
    g = torch.Generator().manual_seed(9)
    h = _every_bf16_below(2.0**20, rows, cols)
    if act == "swiglu":
        h = torch.cat([h, torch.randn(rows, cols, generator=g).bfloat16()], dim=1)
    da = torch.randn(rows, cols, generator=g).bfloat16() if back else None
    fmt = _C.Format.E5M2 if back else _C.Format.E4M3
    scale = torch.tensor([2.0])

    def run(dev):
        d = None if da is None else da.to(dev)
        q = _C.activation_cast(
            d, h.to(dev), act, scale.to(dev), fmt, True, True, back, None, torch.bfloat16
        )
        hp = (
            _C.activation_backward(d, h.to(dev), act)
            if back
            else _C.activation_forward(h.to(dev), act)
        )
        flat = _C.activation_cast(
            d, h.to(dev), act, scale.to(dev), fmt, True, False, False, None, torch.bfloat16
        )
        out = [q.data.view(torch.uint8), q.data_t.view(torch.uint8), q.amax, hp.view(torch.int16)]
        out += [flat.data.view(torch.uint8), flat.amax]
        return [t.cpu() for t in out + ([q.dbias] if back else [])]

    cpu = run("cpu")
    before = _C._set_activation_lut(True)
    try:
        tables = run("cuda")
        _C._set_activation_lut(False)
        computed = run("cuda")
    finally:
        _C._set_activation_lut(before)
    names = ["data", "data_t", "amax", "high precision", "flat data", "flat amax", "dbias"]
    assert len(cpu) == len(tables) == len(computed) == (7 if back else 6)
    for name, c, t, m in zip(names, cpu, tables, computed):
        assert torch.equal(c, t), f"{name}: tables differ from the CPU"
        assert torch.equal(c, m), f"{name}: computed differs from the CPU"


_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _special_inputs(dtype, rows=16, cols=64):
    """[rows, cols] of random values with -Inf, +Inf, NaN and -NaN in every row."""
    g = torch.Generator().manual_seed(11)
    h = torch.randn(rows, cols, generator=g) * 3
    specials = torch.tensor([-math.inf, math.inf, math.nan, -math.nan])
    h[:, :4] = specials
    h[:, 9:13] = specials.flip(0)
    return h.to(dtype)


def _nan_bits(t):
    return t.view(_INT_OF[t.dtype]).long() & (0xFFFFFFFF if t.dtype == torch.float32 else 0xFFFF)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
def test_activation_nans_are_the_positive_quiet_nan(act, dtype):
    """Every NaN the activation makes or passes on is stored as the positive quiet NaN (c10's bits:
    0x7FC00000, bf16 0x7FC0, half 0x7E00) and casts to FP8 0x7F: x86 makes gelu(-Inf) = -Inf * 0
    a negative NaN where the GPU's is positive, so without this the two devices' bytes differed
    (0xFF against 0x7F; found by a desk review, 2026-12-05). Mutation: activation_cpu.cpp's
    round without the NaN replacement -> gelu(-Inf) is 0xFFC00000 here."""
    h = _special_inputs(dtype)
    if act == "swiglu":
        h = torch.cat([h, h.flip(1)], dim=1)
    rows, cols = h.shape[0], h.shape[1] // (2 if act == "swiglu" else 1)
    da = torch.ones(rows, cols, dtype=dtype)
    for out in (_C.activation_forward(h, act), _C.activation_backward(da, h, act)):
        nan = torch.isnan(out.float())
        assert nan.any(), "the specials make NaNs"
        assert (_nan_bits(out)[nan] == _NAN_BITS[dtype]).all(), _nan_bits(out)[nan].unique()
    for back in (False, True):
        q = _C.activation_cast(
            da if back else None, h, act, torch.tensor([1.0]), _C.Format.E4M3, True, False
        )
        hp = _C.activation_backward(da, h, act) if back else _C.activation_forward(h, act)
        nan = torch.isnan(hp.float())
        assert (q.data.view(torch.uint8)[nan] == 0x7F).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("back", [False, True], ids=["forward", "backward"])
def test_cuda_activation_of_infinities_and_nans_matches_cpu(act, dtype, back):
    """-Inf, +Inf, NaN and -NaN among random inputs: the CUDA bytes (high precision, FP8 in both
    orientations, amax) equal the CPU's, NaNs included; dbias agrees as a NaN where it is one."""
    ok, reason = _cuda_reason()
    if not ok:
        pytest.skip(reason)
    h = _special_inputs(dtype)
    if act == "swiglu":
        h = torch.cat([h, h.flip(1)], dim=1)
    rows, cols = h.shape[0], h.shape[1] // (2 if act == "swiglu" else 1)
    da = torch.randn(rows, cols, generator=torch.Generator().manual_seed(12)).to(dtype)
    d = da if back else None
    fmt = _C.Format.E5M2 if back else _C.Format.E4M3
    scale = torch.tensor([2.0])

    def run(dev):
        dd = None if d is None else d.to(dev)
        q = _C.activation_cast(
            dd, h.to(dev), act, scale.to(dev), fmt, True, True, back, None, dtype
        )
        hp = (
            _C.activation_backward(dd, h.to(dev), act)
            if back
            else _C.activation_forward(h.to(dev), act)
        )
        return q, hp.cpu()

    (qc, hc), (qg, hg) = run("cpu"), run("cuda")
    assert torch.equal(_nan_bits(hc), _nan_bits(hg)), "high-precision bits"
    assert torch.equal(qc.data.view(torch.uint8), qg.data.cpu().view(torch.uint8))
    assert torch.equal(qc.data_t.view(torch.uint8), qg.data_t.cpu().view(torch.uint8))
    assert torch.equal(qc.amax.view(torch.int32), qg.amax.cpu().view(torch.int32))
    if back:
        torch.testing.assert_close(qg.dbias.cpu(), qc.dbias, rtol=0, atol=0, equal_nan=True)


def test_activation_table_switch_returns_the_previous_setting():
    """The benchmark's switch (bench/layernorm_mlp_gpu.py): on by default, set and restored."""
    assert _C._set_activation_lut(False) is True
    try:
        assert _C._set_activation_lut(False) is False
    finally:
        assert _C._set_activation_lut(True) is False


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["delayed", "block"])
@pytest.mark.parametrize("act", ACTS)
def test_cuda_module_matches_cpu(act, mode):
    """The whole module on CUDA against the CPU: the activation bytes are identical (above); the
    GEMMs differ (cuBLASLt vs FP32 CPU sums), so y agrees to the FP8 accumulation tolerance.
    Block scaling: the activation in bf16, then the block casts (identical bytes on both), at
    widths of whole 128-element tiles (cuBLASLt's block modes)."""
    ok, reason = _cuda_reason()
    if not ok:
        pytest.skip(reason)
    hid, ffn = (128, 256) if mode == "block" else (HID, FFN)
    m = make_mlp(act, "RMSNorm", hid=hid, ffn=ffn)
    mc = copy.deepcopy(m).cuda()
    x = torch.randn(128, hid, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with autocast(mode):
        y = m(x)
        yc = mc(x.cuda())
    rel = float((yc.cpu().float() - y.float()).norm() / y.float().norm())
    assert rel < 2.0**-6, rel
    assert math.isfinite(rel)


@pytest.mark.parametrize("through", ["ddp", "module"])
@pytest.mark.parametrize("target", ["fc2.weight", "x"])
@pytest.mark.parametrize("wgrad", ["fused", "delayed"])
def test_ddp_autograd_grad_keeps_the_ledger_exact(group, wgrad, target, through):
    """C14 under the ledger, as for Linear (test_linear_autograd_grad.py): autograd.grad(loss,
    fc2.weight) captures fc2's gradient and does not want fc1's; autograd.grad(loss, x) wants
    neither. What the forward announced for those uses is withdrawn in the backward, so
    finish_grad_sync() finds nothing missing and main_grad stays zero. Mutation (2026-12-03): the
    MLP backward's withdraw / check_accepting loop skipped: all 8 cases fail at finish_grad_sync()
    with "'fc1.weight': micro-batch 1: 0 of 1 (missing 1)" and the same for fc2.weight."""
    kw = {"fuse_wgrad_accumulation": True} if wgrad == "fused" else {"delay_wgrad_compute": True}
    m = make_mlp("gelu", "LayerNorm", **kw)
    cfg = fp8dp.DistributedDataParallelConfig(
        delay_wgrad_compute=wgrad == "delayed", bucket_size=10000, grad_ledger=True
    )
    ddp = fp8dp.DistributedDataParallel(m, cfg, process_group=group)
    ((x, dy),) = data(torch.bfloat16, n=1)
    x = x.clone().requires_grad_(target == "x")
    ddp.zero_grad_buffer()
    with autocast("delayed"):
        y = (ddp if through == "ddp" else m)(x)
    loss = (y.float() * dy.float()).sum()
    got = torch.autograd.grad(loss, x if target == "x" else m.fc2.weight)[0]
    assert got is not None and torch.isfinite(got).all()
    ddp.finish_grad_sync()
    for name, p in m.named_parameters():
        assert torch.count_nonzero(p.main_grad) == 0, name
    assert not m.need_backward_dw()


@pytest.mark.parametrize("fp8", ["off", "delayed"])
def test_fused_gemm_into_a_launched_bucket_is_refused_before_it_writes(group, fp8):
    """C11, as for Linear (test_ddp_phases.py): micro-batch 0's forward under no_sync(), then
    micro-batch 1 outside it launches every bucket; micro-batch 0's backward, run late in its
    no_sync() context, would have fc2's fused GEMM accumulate into a bucket being reduced. The
    MLP asks the sink before any cast or GEMM (GradSink::check_accepting), so the refusal leaves
    main_grad and the phase as they were, and finish_grad_sync() still reduces micro-batch 1's
    gradients (micro-batch 0's is lost, as the error says; with grad_ledger on, finish_grad_sync
    would report it missing). Mutation (2026-12-03, the check skipped): both cases fail, the GEMM
    writes first and deliver() refuses after ("assert 'failed' == 'sync_started'")."""
    m = make_mlp("gelu", "LayerNorm", fuse_wgrad_accumulation=True)
    cfg = fp8dp.DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=64)
    ddp = fp8dp.DistributedDataParallel(m, cfg, process_group=group)
    (x0, dy0), (x1, dy1) = data(torch.bfloat16, n=2)

    # The first iteration in order: readiness learns its counts.
    ddp.zero_grad_buffer()
    for i, (x, dy) in enumerate(((x0, dy0), (x1, dy1))):
        with ddp.no_sync() if i == 0 else contextlib_null(), autocast(fp8):
            y = ddp(x)
        with ddp.no_sync() if i == 0 else contextlib_null():
            y.backward(dy)
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    with ddp.no_sync(), autocast(fp8):
        y0 = ddp(x0)
    with autocast(fp8):
        y1 = ddp(x1)
    y1.backward(dy1)
    assert ddp.phase == "sync_started"
    before = {n: p.main_grad.clone() for n, p in m.named_parameters()}
    with ddp.no_sync(), pytest.raises(RuntimeError, match=r"arrived in phase 'sync_started'"):
        y0.backward(dy0)
    assert ddp.phase == "sync_started"
    for n, p in m.named_parameters():
        assert torch.equal(p.main_grad, before[n]), n
    ddp.finish_grad_sync()  # one rank: the reduced main_grad is micro-batch 1's, bit for bit
    for n, p in m.named_parameters():
        assert torch.equal(p.main_grad, before[n]), n
