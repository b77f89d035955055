"""LayerNormLinear(qkv_heads=h): a fused QKV projection that returns q, k and v.

Checked against the same module without qkv_heads (same parameters), split the way the GPT
model split it before (a [s, b, 3, h, hd] view, unbind on the q/k/v axis): outputs, input and
parameter gradients, main_grad and the FP8 scaling state agree exactly (rtol=0, atol=0). The
q, k, v views are the output's own bytes, and backward's grad_output is the same matrix: under
delayed scaling its FP8 cast reads the three gradients where they lie (quantize_parts), under
the other recipes and without FP8 they are joined as autograd's unbind backward stacked them.
Nothing is computed differently, so nothing may differ, on the CPU and on CUDA.

The gradients come in the layout attention leaves them in (a contiguous [b, h, s, hd] buffer
seen as [s, b, h, hd]), contiguous, or with one of the three missing (undefined: zeros).

On CUDA one more test: the backward of the qkv_heads module under delayed scaling launches no
stacking copy, where the reference's does (the point of the feature; it fails if the projection
stacked the gradients itself or autograd did).
"""

import pytest
import torch
from _linear_cases import attach_main_grad, autocast, make_recipe, randomize_

import fp8dp

S, B, IN, HEADS, HD = 8, 4, 32, 2, 16
OUT = 3 * HEADS * HD
LAYOUTS = ["attention", "contiguous", "no_v"]


def modules(device, **kw):
    ref = fp8dp.LayerNormLinear(IN, OUT, device=device, **kw)
    randomize_(ref, seed=3)
    qkv = fp8dp.LayerNormLinear(IN, OUT, device=device, qkv_heads=HEADS, **kw)
    qkv.load_state_dict(ref.state_dict())
    return ref, qkv


def grads(layout, seed, device, dtype):
    """The gradients of q, k, v, each [s, b, h, hd] (None: that output gets none)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(3):
        if layout == "attention":  # what SDPA's backward hands back: [b, h, s, hd] in memory
            t = torch.randn(B, HEADS, S, HD, generator=g).to(device, dtype).permute(2, 0, 1, 3)
            assert not t.is_contiguous()
        else:
            t = torch.randn(S, B, HEADS, HD, generator=g).to(device, dtype)
        out.append(None if layout == "no_v" and i == 2 else t)
    return out


def step(module, x, gs, recipe, split):
    x = x.clone().requires_grad_(True)
    with autocast(recipe):
        y = module(x, is_first_microbatch=True)
    parts = split(y)
    outs = [p for p, g in zip(parts, gs) if g is not None]
    torch.autograd.backward(outs, [g for g in gs if g is not None])
    if module.delay_wgrad_compute:
        module.backward_dw()
    return [p.detach().clone() for p in parts], x.grad


def unbind_split(y):
    return y.view(S, B, 3, HEADS, HD).unbind(2)


def assert_same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a} vs {b}"
        return
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed_wgrad"])
@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qkv_heads_matches_unbind(dtype, recipe_name, layout, fuse, delay, device):
    recipe = make_recipe(recipe_name)
    ref, qkv = modules(
        device, params_dtype=dtype, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay
    )
    if fuse:
        for m in (ref, qkv):
            attach_main_grad(m)
            m.weight.zero_out_wgrad = True  # the dummy gradient is zeros, so it can be compared
    for s in range(2):  # two steps: the second casts with the scales the first recorded
        g = torch.Generator().manual_seed(20 + s)
        x = torch.randn(S, B, IN, generator=g).to(device, dtype)
        gs = grads(layout, 30 + s, device, dtype)
        parts_r, dx_r = step(ref, x, gs, recipe, unbind_split)
        parts_q, dx_q = step(qkv, x, gs, recipe, lambda y: y)
        for name, a, b in zip("qkv", parts_r, parts_q):
            assert b.shape == (S, B, HEADS, HD)
            assert_same(a, b, f"step {s} {name}")
        assert_same(dx_r, dx_q, f"step {s} input grad")
        if recipe_name == "delayed":
            fp8dp.update_fp8_scales()
    for (name, p_r), (_, p_q) in zip(ref.named_parameters(), qkv.named_parameters()):
        assert_same(p_r.grad, p_q.grad, f"{name}.grad")
        if fuse and name == "weight":
            assert_same(p_r.main_grad, p_q.main_grad, "weight.main_grad")
            assert torch.count_nonzero(p_q.main_grad) > 0
    if recipe_name == "delayed":
        assert_same(ref._core.amax_history, qkv._core.amax_history, "amax_history")
        assert_same(ref._core.scale, qkv._core.scale, "scale")
        assert torch.count_nonzero(qkv._core.amax_history[:, 2]) > 0  # grad_output was recorded


def test_qkv_heads_with_layernorm_output(device):
    ref = fp8dp.LayerNormLinear(IN, OUT, device=device, return_layernorm_output=True)
    randomize_(ref, seed=4)
    qkv = fp8dp.LayerNormLinear(
        IN, OUT, device=device, return_layernorm_output=True, qkv_heads=HEADS
    )
    qkv.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(S, B, IN, generator=g).to(device)
    gs = grads("attention", 6, device, torch.float32)
    g_ln = torch.randn(S, B, IN, generator=g).to(device)
    recipe = make_recipe("delayed")
    results = []
    for m, split in ((ref, unbind_split), (qkv, None)):
        xi = x.clone().requires_grad_(True)
        with autocast(recipe):
            out = m(xi)
        parts, ln = (split(out[0]), out[1]) if split else (out[:3], out[3])
        assert len(out) == (2 if split else 4)
        torch.autograd.backward([*parts, ln], [*gs, g_ln])
        results.append((ln.detach(), xi.grad, m.layer_norm_weight.grad, m.weight.grad))
    for what, a, b in zip(("ln_out", "dx", "dln_w", "dw"), *results):
        assert_same(a, b, what)


@pytest.mark.parametrize("bad", [0, -3, True, 5, 2.0, "2"])
def test_qkv_heads_refused(bad):
    with pytest.raises(ValueError, match=r"qkv_heads: expected None or an int > 0 .*got"):
        fp8dp.LayerNormLinear(IN, OUT, qkv_heads=bad)


def test_qkv_heads_views_refuse_in_place():
    m = fp8dp.LayerNormLinear(IN, OUT, qkv_heads=HEADS)
    q, k, v = m(torch.randn(S, B, IN, requires_grad=True))
    assert q.shape == k.shape == v.shape == (S, B, HEADS, HD)
    assert q.data_ptr() + HEADS * HD * q.element_size() == k.data_ptr()  # views of one output
    with pytest.raises(RuntimeError):
        q.mul_(2.0)  # autograd refuses in-place on a custom function's output views


def test_layernorm_mlp_refuses_a_qkv_core():
    # LayerNormMLP builds its own cores; the C++ check guards the binding's other callers.
    fc1 = fp8dp.LayerNormLinear(IN, OUT, qkv_heads=HEADS)
    fc2 = fp8dp.Linear(OUT, IN)
    with pytest.raises(ValueError, match="fc1 must be a LayerNormLinear core without"):
        fp8dp._C.LayerNormMLPCore(
            name="mlp", activation="gelu", ffn_hidden_size=OUT, fc1=fc1._core, fc2=fc2._core
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: kernel names of CUDA")
def test_no_stack_in_backward_cuda():
    ref, qkv = modules("cuda", params_dtype=torch.bfloat16)
    x = torch.randn(S * 16, B * 4, IN, device="cuda", dtype=torch.bfloat16)
    recipe = make_recipe("delayed")

    def copies(m, split):
        xi = x.clone().requires_grad_(True)
        with autocast(recipe):
            parts = split(m(xi))
        # [b, h, s, hd] buffers seen as [s, b, h, hd], as SDPA's backward returns them
        gs = [
            torch.randn(x.shape[1], HEADS, x.shape[0], HD, device="cuda", dtype=x.dtype).permute(
                2, 0, 1, 3
            )
            for _ in range(3)
        ]
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.autograd.backward(list(parts), gs)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return [n for n in names if "Cat" in n or "stack" in n.lower() or "copy" in n.lower()]

    split = lambda y: y.view(y.shape[0], y.shape[1], 3, HEADS, HD).unbind(2)  # noqa: E731
    assert copies(ref, split), "the reference backward should stack the three gradients"
    assert copies(qkv, lambda t: t) == []


@pytest.mark.parametrize("recipe_name", ["none", "delayed"])
def test_qkv_heads_under_activation_checkpointing(recipe_name, device):
    """C14: the views are recomputed by a non-reentrant checkpoint like any output; the
    gradients equal those of the same module run plainly."""
    recipe = make_recipe(recipe_name)
    plain, ckpt = modules(device)[1], modules(device)[1]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(S, B, IN, generator=g).to(device)
    gs = grads("attention", 8, device, torch.float32)
    for m, checkpointed in ((plain, False), (ckpt, True)):
        xi = x.clone().requires_grad_(True)
        with autocast(recipe):
            if checkpointed:
                parts = torch.utils.checkpoint.checkpoint(m, xi, use_reentrant=False)
            else:
                parts = m(xi)
        torch.autograd.backward(list(parts), gs)
        m.dx = xi.grad
    assert_same(plain.dx, ckpt.dx, "input grad")
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert_same(a.grad, b.grad, f"{name}.grad")
