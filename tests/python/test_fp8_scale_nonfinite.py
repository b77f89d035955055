"""A non-finite or zero amax is no observation for delayed scaling (C7 — FP8 numerics).

Before the fix, one Inf or NaN in the first delayed-scaling cast of a role (input or grad_output)
pinned its scale at 1 for amax_history_len steps: the first cast marked the role as having a
scale (1, from an amax that says nothing), and the NaN / Inf then won the history's max, which
keeps the scale, until it left the window. An all-zero first gradient did the same for one step.
The Linear's error went from 0.04-0.06 to 0.36-0.61. Now (scaling_state.cpp, scaling.h):
- a first cast whose amax is 0, NaN or Inf is cast with scale 1 but leaves the role without a
  scale, so its next cast chooses it (the first-scale rule);
- the update's max skips non-finite history entries and the roll stores them as 0, so they never
  stay in the history (CPU and CUDA share the element rule, finite_max / finite_or_zero).

Tests: the scale each step casts with equals a reference written from the rules above, computed
from the finite observations only (bit for bit: the same FP32 division); after a poisoned first
step the Linear's outputs and gradients are bit-identical to a clean run's from step 1 on, and
within the FP8 quantisation bound of _linear_cases.product_bound (elementwise worst case from the
formats' unit roundoff, E4M3 2^-4 / E5M2 2^-3, and half their subnormal spacing over the scale,
plus the GEMM's accumulation error) computed with the clean run's scales; with DDP, the bucket's
NaN check (check_for_nan_in_grad) still reports the non-finite gradient.

Mutations tried (2026-12-03, CPU, then restored):
1. prepare_scale: `initialized_[r] = true` again (a zero / NaN / Inf first cast sets the scale):
   22 of the 34 CPU tests fail: test_scale_follows_finite_observations for all 12 first-step
   poisons (e.g. [max-grad-nan-step0] "step 1 grad_output: scale 1.0, reference 31250.49"),
   test_error_matches_clean_run for all 6 ([grad-zero] "step 1 input grad (poisoned run,
   grad-zero): error exceeds the clean run's FP8 bound by 3.65e-06 (scales [458752.0,
   2534.67, 1.0])"), and the 4 DDP tests.
2. The history rule of the old code in update_scaling_cpu (the max lets NaN or a larger value
   win, and the roll copies entries as they are): test_scale_follows_finite_observations fails
   for the 8 [max-*-nan/inf-step0/step3] cases (the scale stays where it was while the NaN / Inf
   is in the window) and the 3 non-finite DDP tests; test_scaling.cpp's
   OneNonFiniteStepDoesNotPinTheScale, NonFiniteAmaxIsNoObservation and EachSlotAsAlone too.
   Each half alone is caught by test_scaling.cpp only (the other half still keeps a new NaN out
   of the scale): the old max alone fails MatchesReferenceOverSteps (max, L > 1: NaN / Inf in
   older rows), EachSlotAsAlone and NonFiniteAmaxIsNoObservation; the plain roll alone fails
   MatchesReferenceOverSteps, EachSlotAsAlone and NonFiniteAmaxIsNoObservation (the rolled
   history still holds the NaN).
"""

import math

import pytest
import torch
from _linear_cases import FP8, IN, OUT, product_bound

import fp8dp

L = 4  # amax_history_len: a poison that stayed in the window would last 4 steps
STEPS = 9
# Per-step magnitudes, so that the window's max moves (a pinned scale then differs from it).
X_MAG = [1.0, 2.0, 0.5, 3.0, 1.0, 0.25, 4.0, 1.0, 0.5]
G_MAG = [1.0, 0.5, 2.0, 0.25, 3.0, 1.0, 0.5, 4.0, 1.0]
POISONS = ["grad-nan", "grad-inf", "grad-zero", "input-nan", "input-inf", "input-zero"]
ROLES = ["input", "weight", "grad_output"]


def _data(step, poison, poison_step, device, x_amax=None, g_amax=None):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(32, IN, generator=g)
    dy = torch.randn(32, OUT, generator=g)
    if x_amax is None:
        x, dy = x * X_MAG[step], dy * G_MAG[step]
    else:  # a fixed amax every step: the delayed scale then equals the current one
        x, dy = x * (x_amax / x.abs().max()), dy * (g_amax / dy.abs().max())
    if step == poison_step and poison is not None:
        where, kind = poison.split("-")
        t = x if where == "input" else dy
        if kind == "zero":
            t.zero_()
        else:
            t[3, 5] = float(kind)
    return x.to(device), dy.to(device)


def _run(module, recipe, data, zero_grad=True):
    """Forward + backward per step, then update_fp8_scales(). Returns, per step, the scales the
    casts used, the amaxes they saw (input, weight, grad_output) and the outputs and gradients."""
    out = []
    for x, dy in data:
        xa = x.clone().requires_grad_(True)
        if zero_grad:
            module.weight.grad = module.bias.grad = None
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            y = module(xa)
        y.backward(dy)
        amax = [
            float(x.abs().max()),
            float(module.weight.detach().abs().max()),
            float(dy.abs().max()),
        ]
        used = [float(s) for s in module._core.scale]
        out.append((used, amax, y.detach(), xa.grad, module.weight.grad.clone()))
        fp8dp.update_fp8_scales()
    return out


def _f32_div(a, b):
    return float(torch.tensor(a, dtype=torch.float32) / torch.tensor(b, dtype=torch.float32))


def reference_scales(amaxes, fmax, algo):
    """The scale each step's cast uses, from the rules of C7 and the first-scale rule, with only
    the finite, positive amaxes as observations."""
    scale = None  # the role has no scale yet
    window = []  # observations of the last L steps, newest first (0: none that step)
    used = []
    for a in amaxes:
        ok = math.isfinite(a) and a > 0
        if scale is None:  # first-scale rule: its own amax, or 1 without marking a scale
            used.append(_f32_div(fmax, a) if ok else 1.0)
            if ok:
                scale = used[-1]
        else:
            used.append(scale)
        window = ([a if ok else 0.0] + window)[:L]
        m = max(window) if algo == "max" else window[0]
        if m > 0:
            scale = _f32_div(fmax, m)
    return used


@pytest.mark.parametrize("poison_step", [0, 3], ids=["step0", "step3"])
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_scale_follows_finite_observations(algo, poison, poison_step, device):
    torch.manual_seed(0)
    m = fp8dp.Linear(IN, OUT, device=device)
    recipe = fp8dp.DelayedScaling(
        fp8_format=fp8dp.Format.HYBRID, amax_history_len=L, amax_compute_algo=algo
    )
    data = [_data(k, poison, poison_step, device) for k in range(STEPS)]
    got = _run(m, recipe, data)
    fmax = [FP8["E4M3"][2], FP8["E4M3"][2], FP8["E5M2"][2]]
    for r, role in enumerate(ROLES):
        want = reference_scales([step[1][r] for step in got], fmax[r], algo)
        for k, (step, w) in enumerate(zip(got, want)):
            assert step[0][r] == w, f"step {k} {role}: scale {step[0][r]}, reference {w}"


@pytest.mark.parametrize("poison", POISONS)
def test_error_matches_clean_run(poison, device):
    """Small magnitudes (input amax 2^-10, grad_output amax 2^-17: below E4M3's and E5M2's normal
    range at scale 1), the same every step. After a poisoned step 0 every later step casts with
    the clean run's scales, so its outputs and gradients are the clean run's bit for bit, within
    the FP8 bound; with scale 1 they lose most of their bits."""
    recipe = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID, amax_history_len=L)
    runs = {}
    for name, p in (("clean", None), ("poisoned", poison)):
        torch.manual_seed(0)
        m = fp8dp.Linear(IN, OUT, device=device)
        data = [_data(k, p, 0, device, x_amax=2.0**-10, g_amax=2.0**-17) for k in range(5)]
        runs[name] = (m, data, _run(m, recipe, data))
    m, data, clean = runs["clean"]
    _, _, poisoned = runs["poisoned"]
    W = m.weight.detach().cpu().double()
    for k in range(1, 5):
        x, dy = (t.cpu().double() for t in data[k])
        s_in, s_w, s_go = clean[k][0]
        refs = {
            "output": (x @ W.t() + m.bias.detach().cpu().double(), x, W, "E4M3", s_in, s_w),
            "input grad": (dy @ W, dy, W.t(), "E5M2", s_go, s_w),
            "weight grad": (dy.t() @ x, dy.t(), x.t(), "E5M2", s_go, s_in),
        }
        for i, (what, (ref, a, b, fmt_a, sa, sb)) in enumerate(refs.items()):
            # plus one FP32 rounding of the result (the bias add, the output's own rounding)
            bound = product_bound(a, b, fmt_a, sa, "E4M3", sb, device).double()
            bound = bound + 2.0**-23 * ref.abs()
            for name, run in (("clean", clean), ("poisoned", poisoned)):
                err = (run[k][2 + i].cpu().double() - ref).abs()
                assert (err <= bound).all(), (
                    f"step {k} {what} ({name} run, {poison}): error exceeds the clean run's FP8 "
                    f"bound by {(err - bound).max().item():.3g} (scales {run[k][0]})"
                )
            assert torch.equal(poisoned[k][2 + i], clean[k][2 + i]), f"step {k} {what} differs"


@pytest.mark.parametrize("poison", ["grad-inf", "grad-nan", "input-nan", "grad-zero"])
def test_ddp_nan_check_still_reports(group, poison, fp8_states_released):
    """With DDP and check_for_nan_in_grad, the poisoned step still fails in finish_grad_sync,
    naming the parameter (an all-zero gradient is no error); a loop that skips that step and
    goes on gets the scales of the finite observations."""
    torch.manual_seed(0)
    m = fp8dp.Linear(IN, OUT)
    cfg = fp8dp.DistributedDataParallelConfig(check_for_nan_in_grad=True, overlap_grad_reduce=False)
    ddp = fp8dp.DistributedDataParallel(m, cfg, process_group=group)
    recipe = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID, amax_history_len=L)
    scales, amaxes = [], []
    for k in range(6):
        x, dy = _data(k, poison, 0, "cpu")
        ddp.zero_grad_buffer()
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            y = ddp(x)
        y.backward(dy)
        scales.append([float(s) for s in m._core.scale])
        amaxes.append(
            [float(x.abs().max()), float(m.weight.detach().abs().max()), float(dy.abs().max())]
        )
        if k == 0 and not poison.endswith("zero"):
            with pytest.raises(
                RuntimeError, match=r"has NaN or Inf in the local gradients of .*'(weight|bias)'"
            ):
                ddp.finish_grad_sync()
        else:
            ddp.finish_grad_sync()
        fp8dp.update_fp8_scales()
    fmax = [FP8["E4M3"][2], FP8["E4M3"][2], FP8["E5M2"][2]]
    for r, role in enumerate(ROLES):
        want = reference_scales([a[r] for a in amaxes], fmax[r], "max")
        got = [s[r] for s in scales]
        assert got == want, f"{role}: scales {got}, reference {want}"
