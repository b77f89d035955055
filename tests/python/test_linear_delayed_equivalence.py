"""C2 — exactly once, C3 — delayed wgrad: delayed weight gradients give bit-identical results to
immediate ones.

Both modules run the same micro-batches with the same parameters; the delayed one calls
backward_dw() after each backward. The deferred GEMM is the same function on the same operands
(src/modules/wgrad_store.cpp run_wgrad), so outputs, input gradients, parameter gradients,
main_grad and the FP8 scaling state must agree exactly (rtol=0, atol=0), on every device (on CUDA
both modules hit the same cached cuBLASLt plan, so the GEMMs are bit-identical there too)."""

import pytest
import torch
from _linear_cases import (
    KINDS,
    RECIPES,
    attach_main_grad,
    batches,
    make_recipe,
    run_microbatches,
    twin,
)

import fp8dp


def assert_same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a} vs {b}"
        return
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.slow  # the family takes ~15-30 s on 2 cores (pyproject's markers)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_delayed_matches_immediate(kind, recipe_name, bias, fuse, dtype, device):
    recipe = make_recipe(recipe_name)
    imm, dly = twin(
        kind, bias=bias, params_dtype=dtype, fuse_wgrad_accumulation=fuse, device=device
    )
    if fuse:
        for m in (imm, dly):
            attach_main_grad(m)
            m.weight.zero_out_wgrad = True  # the dummy gradient is zeros, so it can be compared
    for step in range(2):  # two steps of two micro-batches: accumulation, scale update, cache
        data = batches(2, dtype, seed=10 + step, device=device)
        ys_i, dxs_i = run_microbatches(imm, data, recipe)
        ys_d, dxs_d = run_microbatches(dly, data, recipe)
        if recipe_name == "delayed":
            fp8dp.update_fp8_scales()
        for i, (a, b) in enumerate(zip(ys_i, ys_d)):
            assert_same(a, b, f"step {step} micro-batch {i} output")
        for i, (a, b) in enumerate(zip(dxs_i, dxs_d)):
            assert_same(a, b, f"step {step} micro-batch {i} input grad")
    for (name, p_i), (_, p_d) in zip(imm.named_parameters(), dly.named_parameters()):
        assert_same(p_i.grad, p_d.grad, f"{name}.grad")
    if fuse:
        assert_same(imm.weight.main_grad, dly.weight.main_grad, "weight.main_grad")
        assert imm.weight.grad_added_to_main_grad and dly.weight.grad_added_to_main_grad
        assert torch.count_nonzero(dly.weight.main_grad) > 0
    else:
        assert torch.count_nonzero(dly.weight.grad) > 0
    if recipe_name == "delayed":
        assert_same(imm._core.amax_history, dly._core.amax_history, "amax_history")
        assert_same(imm._core.scale, dly._core.scale, "scale")
    assert not dly.need_backward_dw()
