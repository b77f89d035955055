"""C4 — backfill: the guarded bias-gradient backfill with an unconditional external consumer.

DelayedScaling FP8, delay_wgrad_compute, bias. Every parameter has a post-accumulate hook that
moves .grad into main_grad and clears .grad, with no regard for flags (an unconditional external
consumer); the same consumer runs from register_wgrad_accumulation_and_reduce_hooks, as DDP's hook
does. In FP8 mode the bias gradient reaches autograd eagerly in backward and is moved at once, so
bias.grad is None when backward_dw() runs; the deferred GEMM makes no bias gradient, and
backward_dw() must neither crash nor add the bias gradient a second time.

Evidence that this test catches a broken guard (both runs on 2026-11-30, then reverted):

1. Guard removed: in LinearCore::backward_dw the line
       if (r.dbias.defined() && task.bias.defined()) accumulate_into_grad(task.bias, r.dbias);
   replaced by the unconditional backfill of the known failure (`.to()` on the bias gradient the
   deferred GEMM did not produce):
       if (task.bias.defined())
         accumulate_into_grad(task.bias, r.dbias.to(task.bias.scalar_type()));
   All 6 parametrizations fail inside backward_dw():
       E   RuntimeError: Expected a proper Tensor but got None (or an undefined Tensor in C++)
           for argument #0 'self'
       FAILED tests/python/test_linear_c4_backfill.py::test_c4_external_consumer[1mb-Linear]
       ... (1mb/3mb x Linear/LayerNorm/RMSNorm)
       6 failed in 6.99s
2. Deferred GEMM recomputing the FP8 bias gradient (`task.dy = dy` added in the FP8 branch of
   the backward in linear_autograd.cpp), so backward_dw backfills a second copy into the empty
   bias.grad and the consumer moves it too. All 6 fail on the bias main_grad:
       E   Mismatched elements: 48 / 48 (100.0%)
       E   Greatest relative difference: 1.0000065565109253 at index (43,) (up to 1e-05 allowed)
   i.e. the bias gradient counted twice.

The test runs on every device (conftest.py `device`): on CUDA the same contract holds with the
CUDA casts and cuBLASLt GEMMs, and the FP8 bounds add the GPU's accumulation error.
"""

import pytest
import torch
from _linear_cases import (
    IN,
    OUT,
    batches,
    cpu64,
    input_grad_bound,
    make_module,
    norm_stats,
    product_bound,
    randomize_,
)

import fp8dp


def consume(p):
    """Unconditional external consumer: move .grad into main_grad, clear .grad."""
    if p.grad is not None:
        p.main_grad += p.grad.float()
        p.grad = None


@pytest.mark.parametrize("kind", ["Linear", "LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("microbatches", [1, 3], ids=["1mb", "3mb"])
def test_c4_external_consumer(kind, microbatches, device):
    recipe = fp8dp.DelayedScaling(amax_history_len=4, margin=1)
    m = make_module(kind, bias=True, delay_wgrad_compute=True, device=device)
    randomize_(m, seed=3)
    ref = make_module(kind, bias=True)  # the FP32 CPU reference: same parameters, no FP8
    ref.load_state_dict(m.state_dict())
    params = list(m.parameters())
    for p in params:
        p.main_grad = torch.zeros(p.shape, device=device)
        p.register_post_accumulate_grad_hook(consume)
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: [consume(p) for p in params])

    data = batches(microbatches, torch.float32, seed=5)
    expected_bias = torch.zeros(OUT)
    dx_fp8, dx_ref = [], []
    for i, (x, dy) in enumerate(data):
        xa = x.to(device, copy=True).requires_grad_(True)
        with fp8dp.fp8_autocast(fp8_recipe=recipe):
            y = m(xa, is_first_microbatch=i == 0)
        y.backward(dy.to(device))
        assert m.bias.grad is None, "the consumer already took the eager bias gradient"
        m.backward_dw()  # must not crash on the missing bias gradient
        xr = x.clone().requires_grad_(True)
        ref(xr).backward(dy)
        dx_fp8.append(xa.grad.cpu())
        dx_ref.append(xr.grad)
        expected_bias += dy.reshape(-1, OUT).sum(0)

    # Once: not zero, not twice. The FP8 bias gradient is the FP32 column sum of the unquantized
    # grad_output, so only the summation order differs from the reference.
    bias_main_grad = m.bias.main_grad.cpu()
    torch.testing.assert_close(bias_main_grad, expected_bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias_main_grad, ref.bias.grad, rtol=1e-5, atol=1e-5)
    for p in params:
        assert p.grad is None, "every gradient went to main_grad"
        assert torch.isfinite(p.main_grad).all()

    # Weight and input gradients against the FP32 reference within the FP8 error bound derived
    # in _linear_cases.product_bound, with the scales this step actually used (delayed scaling
    # keeps them fixed within a step; margin=1 leaves room so later micro-batches do not saturate),
    # and the accumulation error of the device's GEMMs (dgrad and wgrad: split accumulator).
    s_in, s_w, s_go = (float(v) for v in m._core.scale)
    bound = torch.zeros(OUT, IN)
    for (x, dy), a, b in zip(data, dx_fp8, dx_ref):
        x2d, dy2d = x.reshape(-1, IN), dy.reshape(-1, OUT)
        x_in = x2d if kind == "Linear" else norm_stats(ref, x2d)[0]
        bound += product_bound(dy2d.t(), x_in.t(), "E5M2", s_go, "E4M3", s_in, device)
        e_dgrad = product_bound(dy2d, ref.weight.detach().t(), "E5M2", s_go, "E4M3", s_w, device)
        dx_bound = input_grad_bound(ref, x2d, e_dgrad) + 1e-5
        assert torch.isfinite(a).all()
        assert ((a - b).abs().reshape(-1, IN) <= dx_bound).all()
    err = (cpu64(m.weight.main_grad) - ref.weight.grad.double()).abs().float()
    assert (err <= bound + 1e-5).all(), f"max excess {(err - bound).max()}"
    assert err.max() > 0  # FP8 really ran
