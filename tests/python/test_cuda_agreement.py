"""CPU (emulated FP8, FP32 GEMMs) against CUDA (CUDA kernels, cuBLASLt) for the same module, weights
and inputs: two steps of two micro-batches, forward and backward, every output, input gradient and
parameter gradient, and the delayed-scaling state. GPU only; skips with the reason otherwise.

Where the two devices may differ, and by how much (every bound elementwise, computed in float64 on
the CPU from the actual operands):
- FP8 casts are bit-exact across devices (C7) for the same input and scale, so the weight and the
  grad_output operands are identical. The GEMM input is identical for Linear; for LayerNormLinear it
  is the norm's output, computed by different code on each device, so a few of its FP8 values (and
  the input scale) may differ; the test re-casts both devices' norm outputs with their own scales
  and carries the exact difference D of the dequantized operands through the GEMM (D·|W|ᵀ, |dy|ᵀ·D).
- Each GEMM errs by its accumulation error (_linear_cases.accumulation_error: k 2^-24 on the CPU;
  plus c 2^-14 for Hopper's FP8 tensor cores, c = k in fprop, which uses fast accumulation, and
  min(k, 128) with the split accumulator of dgrad and wgrad) times sum |q(a)||q(b)|, with
  |q(v)| <= 1.25 |v| + 2^-18 max|v| (one E4M3 / E5M2 rounding and the subnormal spacing over the
  scale); the two devices differ by at most the sum of their errors.
- Every rounding of a result into its dtype adds u |value| per device: u = 2^-24 in FP32, 2^-8 in
  BF16 (outputs, input gradients, weight gradients and their accumulation over micro-batches).
- Norm statistics and the norm backward are FP32 on both devices in different orders: (IN + 16)
  2^-24 relative to the magnitude of the formula's terms.
A missing bias, a wrong scale or format, or a dropped micro-batch on either device exceeds these
bounds by orders of magnitude.
"""

import gc

import pytest
import torch
from _linear_cases import (
    IN,
    OUT,
    accumulation_error,
    attach_main_grad,
    autocast,
    batches,
    cpu64,
    input_grad_bound,
    make_module,
    make_recipe,
    norm_stats,
    randomize_,
)

import fp8dp

OK, REASON = fp8dp.cuda_available(return_reason=True)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not OK, reason=REASON),
    pytest.mark.usefixtures("fp8_states_released"),  # conftest.py: after a failure too
]

STEPS, MBS = 2, 2
ROUND = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
E4M3_MAX = 448.0


def run(device, kind, recipe_name, dtype, fuse, delay):
    """Two steps of MBS micro-batches on `device`; everything the test compares, on the CPU. The
    parameter gradients are those of the last step (zeroed, or overwritten with
    is_first_microbatch=True when fused, at the start of each step)."""
    recipe = make_recipe(recipe_name)
    kw = dict(bias=True, params_dtype=dtype, fuse_wgrad_accumulation=fuse, device=device)
    if kind != "Linear":
        kw["return_layernorm_output"] = True  # the GEMM input, to re-cast it in the bound
    m = make_module(kind, delay_wgrad_compute=delay, **kw)
    randomize_(m, seed=50)
    if fuse:
        attach_main_grad(m)
    rec = dict(y=[], dx=[], z=[], scale=[])
    for step in range(STEPS):
        for p in m.parameters():
            p.grad = None
        for i, (x, dy) in enumerate(batches(MBS, dtype, seed=60 + step)):
            xa = x.to(device, copy=True).requires_grad_(True)
            with autocast(recipe):
                out = m(xa, is_first_microbatch=i == 0)
            y, z = (out, xa) if kind == "Linear" else out
            y.backward(dy.to(device))
            if delay:
                m.backward_dw()
            rec["y"].append(y.detach().cpu())
            rec["dx"].append(xa.grad.cpu())
            rec["z"].append(z.detach().reshape(-1, IN).cpu())
        if recipe_name == "delayed":
            rec["scale"].append(m._core.scale.cpu().clone())  # the scales this step cast with
            fp8dp.update_fp8_scales()
    rec["grads"] = {
        name: (p.main_grad if fuse and name == "weight" else p.grad).detach().cpu()
        for name, p in m.named_parameters()
    }
    if recipe_name == "delayed":
        rec["amax_history"] = m._core.amax_history.cpu()
        rec["final_scale"] = m._core.scale.cpu()
    return rec


def mag(v):
    """Upper bound on the dequantized FP8 values of v (float64, CPU)."""
    v = cpu64(v)
    return 1.25 * v.abs() + 2.0**-18 * v.abs().max()


def cast_input(z, recipe_name, rec, step):
    """The dequantized GEMM input a device multiplied: its own norm output, cast with its own
    input scale (delayed: the state's; current: E4M3 max over the amax, in FP32 like the cast),
    saturated and rounded to nearest even like fp8dp's cast (C7)."""
    if recipe_name == "none":
        return cpu64(z)
    zf = z.float()
    if recipe_name == "delayed":
        s = rec["scale"][step][0]
    else:
        s = torch.tensor(E4M3_MAX) / zf.abs().max()
    # Saturate like fp8dp's cast (a delayed scale from the previous step may put a value past the
    # format's max); torch's own cast would turn values from 480 up into NaN.
    q = (zf * s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.double() / s.double()


def assert_within(actual, expected, bound, what):
    err = (cpu64(actual) - cpu64(expected)).abs()
    excess = err - bound
    assert (excess <= 0).all(), f"{what}: CPU and CUDA differ by {excess.max():.3g} past the bound"


CASES = [(k, torch.float32) for k in ("Linear", "LayerNorm", "RMSNorm")] + [
    ("Linear", torch.bfloat16)
]


@pytest.mark.parametrize(
    "fuse,delay",
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["plain", "fused", "delayed", "fused-delayed"],
)
@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current"])
@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_cpu_and_cuda_agree(kind, dtype, recipe_name, fuse, delay):
    recs = {}
    for device in ("cpu", "cuda"):
        recs[device] = run(torch.device(device), kind, recipe_name, dtype, fuse, delay)
        gc.collect()  # the FP8 states of one device only, when update_fp8_scales runs next
    cpu, gpu = recs["cpu"], recs["cuda"]
    ref = make_module(kind, bias=True, params_dtype=dtype)  # the same parameters, for the bounds
    randomize_(ref, seed=50)
    W = mag(ref.weight)
    u = ROUND[dtype]
    u_w = 2.0**-24 if fuse else u  # a fused weight gradient goes into the FP32 main_grad
    noise = (IN + 16) * 2.0**-24
    cuda = torch.device("cuda")
    acc_fprop = accumulation_error(IN, cuda, fast_accum=True) + IN * 2.0**-24
    acc_dgrad = accumulation_error(OUT, cuda) + OUT * 2.0**-24
    tokens = cpu["z"][0].shape[0]
    acc_wgrad = accumulation_error(tokens, cuda) + MBS * tokens * 2.0**-24

    dw_bound = torch.zeros(OUT, IN, dtype=torch.float64)
    dw_mag = torch.zeros(OUT, IN, dtype=torch.float64)
    db_bound = torch.zeros(OUT, dtype=torch.float64)
    dg_bound = torch.zeros(IN, dtype=torch.float64)
    dbeta_bound = torch.zeros(IN, dtype=torch.float64)
    for j, (x, dy) in enumerate(
        [mb for step in range(STEPS) for mb in batches(MBS, dtype, seed=60 + step)]
    ):
        step, last_step = j // MBS, j // MBS == STEPS - 1
        x2d, dy2d = x.reshape(-1, IN), dy.reshape(-1, OUT)
        Z, DY = mag(cpu["z"][j]), mag(dy2d)
        # The GEMM inputs as each device cast them, and their exact difference.
        D = (
            cast_input(cpu["z"][j], recipe_name, cpu, step)
            - cast_input(gpu["z"][j], recipe_name, gpu, step)
        ).abs()
        if kind == "Linear":
            # The same input cast with the same scale (its amax is exact on both devices).
            assert not D.any(), f"mb {j}: the devices cast the same input differently"
        else:
            # FP32 noise of the norm's terms: relative to each value, and absolute up to the
            # row's largest (x - mu and the statistics err in units of the row's magnitudes).
            z_noise = noise * (Z + Z.amax(1, keepdim=True))
            assert_within(gpu["z"][j], cpu["z"][j], z_noise, f"mb {j} norm output")

        y_cpu = cpu["y"][j].reshape(-1, OUT)
        y_bound = (1 + 2 * u) * (acc_fprop * Z @ W.t() + D @ W.t()) + 2.03 * u * cpu64(y_cpu).abs()
        y_bound += 2.0**-22 * cpu64(y_cpu).abs()  # the bias add, an FP32 rounding per device
        assert_within(gpu["y"][j].reshape(-1, OUT), y_cpu, y_bound, f"mb {j} output")

        dz_mag = DY @ W
        e_dgrad = (1 + 2 * u) * acc_dgrad * dz_mag + 2.03 * u * dz_mag
        dx_cpu = cpu["dx"][j].reshape(-1, IN)
        if kind == "Linear":
            dx_bound = e_dgrad
        else:
            dx_bound = cpu64(input_grad_bound(ref, x2d, e_dgrad))
            dx_mag = cpu64(input_grad_bound(ref, x2d, dz_mag))  # the formula's terms, in |.|
            dx_bound += noise * (dx_mag + dx_mag.amax(1, keepdim=True))
        assert_within(gpu["dx"][j].reshape(-1, IN), dx_cpu, dx_bound, f"mb {j} input grad")

        if last_step:  # the parameter gradients hold the last step's micro-batches
            M = DY.t() @ Z
            dw_bound += acc_wgrad * M + DY.t() @ D
            dw_mag += M
            db_bound += (MBS * tokens * 2.0**-24) * cpu64(dy2d).abs().sum(0)
            if kind != "Linear":
                _, xhat, _ = norm_stats(ref, x2d)
                # xhat errs by FP32 noise relative to |xhat| + 1 (x - mu, rsigma; see z_noise).
                xh = xhat.abs()
                dg_bound += (e_dgrad * xh).sum(0) + noise * (dz_mag * (xh + 1)).sum(0)
                dbeta_bound += e_dgrad.sum(0) + noise * dz_mag.sum(0)

    # Per device: a rounding of each micro-batch's result and of each accumulation (MBS + 1).
    rounds = 2 * (MBS + 1)
    dw_bound += rounds * u_w * dw_mag * (1 + acc_wgrad)
    last = batches(MBS, dtype, seed=60 + STEPS - 1)
    db_bound += rounds * u * sum(cpu64(dy.reshape(-1, OUT)).abs().sum(0) for _, dy in last)
    g_cpu, g_gpu = cpu["grads"], gpu["grads"]
    assert set(g_cpu) == set(g_gpu)
    assert_within(g_gpu["weight"], g_cpu["weight"], dw_bound, "weight gradient")
    assert_within(g_gpu["bias"], g_cpu["bias"], db_bound, "bias gradient")
    if kind != "Linear":
        name = "layer_norm_weight"
        assert_within(g_gpu[name], g_cpu[name], dg_bound, name + " gradient")
        if kind == "LayerNorm":
            name = "layer_norm_bias"
            assert_within(g_gpu[name], g_cpu[name], dbeta_bound, name + " gradient")

    if recipe_name == "delayed":
        # Amaxes of identical tensors are identical, and the scale update is the same float
        # arithmetic on both devices (C7). The norm output's amax (input role of LayerNormLinear)
        # may differ by the norm's FP32 noise.
        roles = slice(0, 3) if kind == "Linear" else slice(1, 3)
        for key in ("amax_history", "final_scale"):
            assert torch.equal(gpu[key][..., roles], cpu[key][..., roles]), key
            torch.testing.assert_close(gpu[key], cpu[key], rtol=noise, atol=0)
