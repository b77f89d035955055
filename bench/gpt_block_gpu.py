"""End to end on one GPU: a stack of GPT blocks, forward + backward, in torch BF16 (the baseline),
fp8dp (FP8 delayed, FP8 current, FP8 off) and TransformerEngine (FP8 delayed, FP8 off) when
`import transformer_engine.pytorch` works. All variants are built and timed interleaved in one
process on identical inputs.

Three architectures (--arch), each against its own torch BF16 stack:
- gpt: LayerNormLinear(QKV) -> causal SDPA -> Linear(proj) -> residual, LayerNormLinear(fc1, 4x)
  -> GELU -> Linear(fc2) -> residual: a stack of separate modules;
- gpt_fused: the same model from each library's best modules: LayerNormLinear(QKV), Linear(proj),
  LayerNormMLP (GELU) for the MLP;
- llama: RMSNorm, SwiGLU (ffn = 8/3 hidden rounded up to 256), no bias; LayerNormLinear(QKV),
  Linear(proj), LayerNormMLP(swiglu) in fp8dp and TE.
fp8dp's blocks add their residuals as fp8dp does best (since 2026-12-06, RESIDUALS): in the
epilogue of the projection before them, the gradients joined with x's in the norm's backward
(`--compare-residual` also times FP8 delayed with torch adds on the same model);
`--compare-activation` also times the gpt stack with fp8dp's fc1 applying the GELU itself
(`activation="gelu"`) and with fc2 applying it to its input (`input_activation="gelu"`),
GELU_PLACES.
Activations [seq, batch, hidden], BF16 parameters, head dim 128; q, k and v are taken from the QKV output with `split_qkv` (`--compare-qkv unbind`
or `index` also times the baseline and FP8 delayed with an earlier split; QKV_SPLITS). fp8dp's QKV
projection returns q, k and v itself (`qkv_heads`, since 2026-12-06), so its FP8 backward casts
their gradients where SDPA left them; the split then applies to the torch and TE blocks. One step = forward, backward with a fixed grad_output, gradients dropped, and for
delayed scaling the per-step scale update (fp8dp.update_fp8_scales(); TE updates at the end of
its autocast). Reported per variant: ms per step (median of CUDA-event samples), tokens/s, the
ratio over torch BF16, peak memory of one step, and host enqueue time per step (CPU time from the
step's first call to its return, without a synchronisation). With --graphs the graphed variants
also get speedup_vs_bf16_graphed; a capture that fails is printed with its traceback, recorded in
the shape's graph_errors (exit status 1) and left out, and the eager variants are still timed.
Their peak memory leaves out the graphs' pool (activations live there). Both libraries' graphed
steps hand the parameters' static gradient buffers over to `.grad` without a copy (fp8dp with
clone_param_grads_on_return=False, since 2026-12-07; before, fp8dp's copied them out). --graphs
also times fp8dp on a model whose weights add their gradients into FP32 main_grad in the wgrad
GEMM (MG_GRAPHED, and its eager twin fp8dp_delayed_mg), as a Megatron-style loop does.

Then each variant runs alone for a sustained block (~1.5 s after 0.5 s of warm-up): its ms per step
at its own clock, and from the GPU's energy counter (NVML) its joules per step and mean power.
Where the GPU runs at its power limit (the H200 does at every width here), the step time follows
the energy per step, so the ratio of joules per step (BF16 over the variant) bounds the speed-up.

    python3 bench/gpt_block_gpu.py [--shapes 2048x8,4096x4,8192x2] [--arch gpt,gpt_fused,llama]
        [--graphs] [--json out.json]

Targets (ratios over torch BF16): gpt 2048x8 >= 1.40, 4096x4 >= 1.55, 8192x2 >= 1.62;
llama 4096x4 >= 1.50; gpt_fused >= 1.05x TE's gpt_fused where TE imports; FP8 off >= 0.98 at
every width.
"""

import argparse
import gc
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import (  # noqa: E402
    ALONE_HEADER,
    EnergyCounter,
    GpuSampler,
    alone_cells,
    alone_vs,
    device_info,
    host_ms,
    peak_step_mib,
    print_table,
    time_interleaved,
    time_sustained,
    write_json,
)

import fp8dp  # noqa: E402
from fp8dp.train.model import split_qkv  # noqa: E402

try:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    TE_REASON = None
except Exception as e:  # noqa: BLE001  (any import failure means: no TE on this machine)
    te, te_recipe, TE_REASON = None, None, f"{type(e).__name__}: {e}"

SEQ, BATCH, HEAD_DIM = 2048, 2, 128
# q, k, v from the QKV output: "split_qkv" (fp8dp.train.model.split_qkv: unbind on the q/k/v axis
# before the permute, so the backward's stack writes the QKV gradient in its own layout; the
# default since 2026-12-05), "unbind" (permute first, then unbind: the stack writes [3, b, h, s, hd]
# and a second full copy brings it back; 2026-12-02 to 12-05) or "index" (qkv[0], qkv[1], qkv[2]:
# each backward writes a zero-filled full-size gradient and autograd adds the three; before
# 2026-12-02; docs/changelog.md). Every variant of a run uses the same split.
QKV_SPLITS = ("split_qkv", "unbind", "index")
# fp8dp's residual adds: "fused" (in the GEMM epilogue, their gradients in the norm's backward;
# the default since 2026-12-06) or "add" (torch adds, autograd adding the gradients; before).
# `--compare-residual` also times FP8 delayed with "add" (variant fp8dp_delayed_addres).
RESIDUALS = ("fused", "add")
# Where fp8dp's gpt stack applies its GELU: "torch" (F.gelu between fc1 and fc2, the default) or
# "fc1" (LayerNormLinear(activation="gelu"), whose FP8 backward applies the derivative inside the
# cast of fc1's output gradient). `--compare-activation` also times FP8 delayed with "fc1" on a
# second fp8dp model with the same weights (variant fp8dp_delayed_fc1gelu). One H100, 2026-12-06
# 19:00: 2048 x 8 1.30 (fc1) against 1.32x (torch), 4096 x 4 1.51 / 1.51x, 8192 x 2 1.66 / 1.63x.
# "fc2" (Linear(input_activation="gelu"): the GELU inside the FP8 cast of fc2's input, the forward's
# half of the fusion; the backward is F.gelu's) is timed by the same flag as fp8dp_delayed_fc2gelu.
GELU_PLACES = ("torch", "fc1", "fc2")
TARGETS = {
    ("gpt", 2048, 8): 1.40,
    ("gpt", 4096, 4): 1.55,
    ("gpt", 8192, 2): 1.62,
    ("llama", 4096, 4): 1.50,
}
ARCHS = ("gpt", "gpt_fused", "llama")
# With --graphs, fp8dp FP8 delayed is also timed on models whose weights' gradients go into an FP32
# main_grad inside the wgrad GEMM (fuse_wgrad_accumulation, as a Megatron-style loop and fp8dp's
# DDP use them), eager ("fp8dp_delayed_mg") and graphed (MG_GRAPHED). One H100, 2026-12-07, 2048 x 8
# (fc2's GELU): main_grad costs 1.03 ms per step eagerly (the wgrad GEMMs' FP32 read-modify-write).
MG_GRAPHED = "fp8dp_delayed_mg_graphed"
DEVICE = "cuda"  # tests/python/test_bench_gpt_block.py builds the blocks on the CPU


def ffn_size(hidden: int, arch: str) -> int:
    """The MLP's width: 4 hidden (GPT), or Llama's 8/3 hidden rounded up to a multiple of 256."""
    return 4 * hidden if arch != "llama" else (8 * hidden // 3 + 255) // 256 * 256


TARGET_FP8_OFF = 0.98


class Block(torch.nn.Module):
    """One block of `arch` (ARCHS) built from `lib`'s layers: 'torch' (nn.LayerNorm / nn.RMSNorm +
    nn.Linear, the activation in between), 'fp8dp' or 'te' (LayerNormLinear + Linear, and for
    gpt_fused and llama LayerNormMLP)."""

    def __init__(
        self,
        hidden: int,
        lib: str,
        arch: str = "gpt",
        gelu: str = GELU_PLACES[0],
        main_grad: bool = False,
    ):
        super().__init__()
        self.heads = hidden // HEAD_DIM
        self.llama = arch == "llama"
        self.fp8dp = lib == "fp8dp"
        bias = not self.llama
        ffn = ffn_size(hidden, arch)
        fc1_out = 2 * ffn if self.llama else ffn
        if lib == "torch":
            tkw = dict(dtype=torch.bfloat16, device=DEVICE)

            def norm():
                if self.llama:
                    return torch.nn.RMSNorm(hidden, eps=1e-5, **tkw)
                return torch.nn.LayerNorm(hidden, **tkw)

            self.qkv = torch.nn.Sequential(
                norm(), torch.nn.Linear(hidden, 3 * hidden, bias=bias, **tkw)
            )
            self.proj = torch.nn.Linear(hidden, hidden, bias=bias, **tkw)
            self.fc1 = torch.nn.Sequential(
                norm(), torch.nn.Linear(hidden, fc1_out, bias=bias, **tkw)
            )
            self.fc2 = torch.nn.Linear(ffn, hidden, bias=bias, **tkw)
            self.mlp = None
            return
        mod = fp8dp if lib == "fp8dp" else te
        kw = dict(params_dtype=torch.bfloat16, device=DEVICE, bias=bias)
        if main_grad:  # make_model gives each weight its main_grad
            if lib != "fp8dp":
                raise ValueError(f"main_grad: fp8dp blocks only, got lib={lib!r}")
            kw["fuse_wgrad_accumulation"] = True
        if self.llama:
            kw["normalization"] = "RMSNorm"
        # fp8dp's QKV projection returns q, k, v itself (qkv_heads), so that its FP8 backward
        # casts their gradients in place instead of autograd stacking them (the split setting
        # below then applies to the torch and TE blocks).
        qkv_kw = {"qkv_heads": self.heads} if lib == "fp8dp" else {}
        # fp8dp's residual adds: in the epilogue of the projection before them, their gradients
        # joined with x's in the norm's backward (the norm's layer returns its input, the
        # residual: return_layernorm_input; LayerNormMLP does both itself with residual=x).
        # self.residual = "add" (per step, as split) uses torch adds instead on the same model.
        ln_in = {"return_layernorm_input": True} if lib == "fp8dp" else {}
        self.qkv = mod.LayerNormLinear(hidden, 3 * hidden, **kw, **qkv_kw, **ln_in)
        kw.pop("normalization", None)
        self.proj = mod.Linear(hidden, hidden, **kw)
        self.mlp = None
        if arch == "gpt":
            # fp8dp's fc1 applies the GELU itself with gelu="fc1", fc2 to its input with
            # gelu="fc2" (GELU_PLACES).
            self.gelu_in_fc1 = lib == "fp8dp" and gelu == "fc1"
            self.gelu_in_fc2 = lib == "fp8dp" and gelu == "fc2"
            act = {"activation": "gelu"} if self.gelu_in_fc1 else {}
            in_act = {"input_activation": "gelu"} if self.gelu_in_fc2 else {}
            self.fc1 = mod.LayerNormLinear(hidden, ffn, **kw, **ln_in, **act)
            self.fc2 = mod.Linear(ffn, hidden, **kw, **in_act)
        else:
            self.mlp = mod.LayerNormMLP(
                hidden,
                ffn,
                activation="swiglu" if self.llama else "gelu",
                **({"normalization": "RMSNorm"} if self.llama else {}),
                **kw,
            )

    gelu_in_fc1 = False  # fp8dp's gpt fc1 with activation="gelu" (GELU_PLACES)
    gelu_in_fc2 = False  # fp8dp's gpt fc2 with input_activation="gelu" (GELU_PLACES)
    split = QKV_SPLITS[0]  # how q, k, v come out of the QKV output (QKV_SPLITS); set per step
    residual = RESIDUALS[0]  # fp8dp's residual adds (RESIDUALS); set per step

    def forward(self, x):
        s, b, h = x.shape
        fused = self.fp8dp and self.residual == "fused"
        out = self.qkv(x)
        if self.fp8dp:  # q, k, v, then the input (return_layernorm_input)
            *out, x_in = out
            out = tuple(out)
        if self.split == "split_qkv" or isinstance(out, tuple):  # tuple: fp8dp's q, k, v
            q, k, v = split_qkv(out, self.heads)
        else:
            qkv = out.view(s, b, 3, self.heads, HEAD_DIM).permute(2, 1, 3, 0, 4)
            q, k, v = qkv.unbind(0) if self.split == "unbind" else (qkv[0], qkv[1], qkv[2])
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.permute(2, 0, 1, 3).reshape(s, b, h)
        x = self.proj(a, residual=x_in) if fused else x + self.proj(a)
        if self.mlp is not None:
            return self.mlp(x, residual=x) if fused else x + self.mlp(x)
        u = self.fc1(x)
        if self.fp8dp:
            u, x_in = u
        if self.llama:  # [gate | up], as fp8dp.LayerNormMLP's swiglu
            gate, up = u.chunk(2, dim=-1)
            u = F.silu(gate) * up
        elif not (self.gelu_in_fc1 or self.gelu_in_fc2):
            u = F.gelu(u)
        return self.fc2(u, residual=x_in) if fused else x + self.fc2(u)


def _baseline(mode: str) -> str:
    """The torch BF16 variant a mode is compared with: the one with the same QKV split."""
    return "bf16@" + mode.partition("@")[2] if "@" in mode else "bf16"


def _mlp_params(m):
    """(norm weight, norm bias, fc1 weight, fc1 bias, fc2 weight, fc2 bias) of a LayerNormMLP,
    fp8dp's (children fc1, fc2) or TE's (flat names); None where there is none."""
    if isinstance(m, fp8dp.LayerNormMLP):
        return (
            m.fc1.layer_norm_weight,
            getattr(m.fc1, "layer_norm_bias", None),
            m.fc1.weight,
            m.fc1.bias,
            m.fc2.weight,
            m.fc2.bias,
        )
    return tuple(
        getattr(m, n, None)
        for n in ("layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight")
    ) + (
        getattr(m, "fc2_bias", None),
    )


def _copy(dst, src) -> None:
    """dst <- src where both exist (a module without bias has None or an empty tensor)."""
    if dst is not None and src is not None and dst.numel() > 0:
        dst.copy_(src)


def copy_weights(blk: Block, rblk: Block) -> None:
    """The torch block's weights into an fp8dp / TE block of the same arch."""
    ln, lin = rblk.qkv
    _copy(blk.qkv.layer_norm_weight, ln.weight)
    _copy(getattr(blk.qkv, "layer_norm_bias", None), getattr(ln, "bias", None))
    _copy(blk.qkv.weight, lin.weight)
    _copy(blk.qkv.bias, lin.bias)
    _copy(blk.proj.weight, rblk.proj.weight)
    _copy(blk.proj.bias, rblk.proj.bias)
    ln, lin = rblk.fc1
    src = (ln.weight, getattr(ln, "bias", None), lin.weight, lin.bias)
    src += (rblk.fc2.weight, rblk.fc2.bias)
    if blk.mlp is not None:
        dst = _mlp_params(blk.mlp)
    else:
        dst = (
            blk.fc1.layer_norm_weight,
            getattr(blk.fc1, "layer_norm_bias", None),
            blk.fc1.weight,
            blk.fc1.bias,
            blk.fc2.weight,
            blk.fc2.bias,
        )
    for d, r in zip(dst, src):
        _copy(d, r)


def make_model(
    hidden: int,
    layers: int,
    lib: str,
    ref=None,
    arch: str = "gpt",
    gelu: str = GELU_PLACES[0],
    main_grad: bool = False,
):
    """main_grad (fp8dp only): every layer built with fuse_wgrad_accumulation=True, its weight
    given an FP32 `main_grad` that the wgrad GEMM adds into (beta = 1), as in a Megatron-style
    loop; `.grad` then holds the fused route's stand-in, none when graphed (variants `*_mg`,
    MG_GRAPHED)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(hidden, lib, arch, gelu, main_grad) for _ in range(layers)])
    if ref is not None:  # the baseline's weights, so that the losses compare
        with torch.no_grad():
            for blk, rblk in zip(model, ref):
                copy_weights(blk, rblk)
    if main_grad:  # the GEMM weights: the blocks' only 2-D parameters
        for w in model.parameters():
            if w.dim() == 2:
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    return model


def _recipe_mode(mode: str) -> str:
    """A mode without its model-variant suffixes (residual adds, GELU place, main_grad): the name
    _context knows."""
    for suffix in ("_mg", "_addres", "_fc1gelu", "_fc2gelu"):
        mode = mode.removesuffix(suffix)
    return mode


def _context(mode: str):
    """The autocast context of a mode (see make_step) and whether its step updates FP8 scales."""
    if mode in ("fp8dp_delayed", "fp8dp_delayed_fastbwd"):
        fast = mode == "fp8dp_delayed_fastbwd"
        recipe = fp8dp.DelayedScaling(
            fp8_format=fp8dp.Format.HYBRID,
            amax_history_len=16,
            amax_compute_algo="max",
            split_accumulator_dgrad=not fast,
            split_accumulator_wgrad=not fast,
        )
        ctx = lambda: fp8dp.fp8_autocast(fp8_recipe=recipe)  # noqa: E731
    elif mode == "fp8dp_current":
        recipe = fp8dp.Float8CurrentScaling(fp8_format=fp8dp.Format.HYBRID)
        ctx = lambda: fp8dp.fp8_autocast(fp8_recipe=recipe)  # noqa: E731
    elif mode == "fp8dp_block":
        recipe = fp8dp.Float8BlockScaling()
        ctx = lambda: fp8dp.fp8_autocast(fp8_recipe=recipe)  # noqa: E731
    elif mode == "te_block":
        recipe = te_recipe.Float8BlockScaling()
        ctx = lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)  # noqa: E731
    elif mode == "fp8dp_off":
        ctx = lambda: fp8dp.fp8_autocast(enabled=False)  # noqa: E731
    elif mode == "te_delayed":
        recipe = te_recipe.DelayedScaling(
            fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"
        )
        ctx = lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)  # noqa: E731
    elif mode == "te_off":
        ctx = lambda: te.fp8_autocast(enabled=False)  # noqa: E731
    else:
        ctx = _nullcontext
    return ctx, mode.startswith("fp8dp_delayed")


def make_step(model, x, dy, mode: str):
    """mode: 'bf16' (plain torch), 'fp8dp_delayed', 'fp8dp_delayed_fastbwd' (fast accumulation in
    the dgrad and wgrad GEMMs too: other numerics than TransformerEngine's recipe), 'fp8dp_current',
    'fp8dp_block', 'fp8dp_off', 'te_delayed', 'te_block', 'te_off', 'fp8dp_delayed_addres'
    (fp8dp's residual adds as torch adds, RESIDUALS), 'fp8dp_delayed_fc1gelu' /
    'fp8dp_delayed_fc2gelu' (a model built with gelu="fc1" / "fc2", GELU_PLACES),
    'fp8dp_delayed_mg' (a model built with main_grad=True: the weights' gradients added into FP32
    main_grad by the wgrad GEMM), each optionally suffixed '@unbind' or '@index' (the QKV split,
    QKV_SPLITS; default split_qkv); 'bf16_graphed', 'fp8dp_delayed_graphed' and
    'fp8dp_delayed_mg_graphed' capture the whole stack as one callable (make_graphed_step).
    Returns (step, loss) closures."""
    if mode.endswith("_graphed"):
        return make_graphed_step(model, x, dy, mode)
    mode, _, split = mode.partition("@")
    split = split or QKV_SPLITS[0]
    residual = "add" if mode.endswith("_addres") else RESIDUALS[0]
    ctx, update = _context(_recipe_mode(mode))

    def use_split():
        for blk in model:
            blk.split = split
            blk.residual = residual

    def step():
        use_split()
        xa = x.detach().requires_grad_(True)
        with ctx():
            y = model(xa)
        y.backward(dy)
        for p in model.parameters():
            p.grad = None
        if update:
            fp8dp.update_fp8_scales()

    def loss():
        use_split()
        with torch.no_grad(), ctx():
            return float(model(x).float().square().mean())

    return step, loss


def make_graphed_step(model, x, dy, mode: str):
    """The stack as one graphed callable (2 replays per step): torch.cuda.make_graphed_callables
    for 'bf16_graphed', fp8dp.make_graphed_callables for 'fp8dp_delayed_graphed' (its scale update
    stays once per step, outside the graphs). One eager step first: delayed scaling needs scales
    before capture."""
    base = mode[: -len("_graphed")]
    eager_step, _ = make_step(model, x, dy, base)
    eager_step()
    ctx, update = _context(_recipe_mode(base))
    params = list(model.parameters())
    xs = x.detach().clone().requires_grad_(True)
    with ctx():
        if base == "bf16":
            torch.cuda.make_graphed_callables(model, (xs,))
        else:
            # The step clears .grad after each backward, so the static gradients can be handed
            # over as torch's graphs do (no copy out of the graph).
            fp8dp.make_graphed_callables(model, (xs,), clone_param_grads_on_return=False)

    def step():
        with ctx():
            y = model(xs)
        y.backward(dy)
        xs.grad = None  # as the eager step's fresh input (else each step adds into it)
        for p in params:
            p.grad = None
        if update:
            fp8dp.update_fp8_scales()

    def loss():
        with torch.no_grad(), ctx():
            return float(model(x).float().square().mean())

    return step, loss


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def bench_shape(
    hidden,
    layers,
    rounds,
    skip_te,
    energy,
    compare_split,
    fast_backward,
    block,
    arch,
    graphs=False,
    compare_residual=False,
    compare_activation=False,
    gelu=GELU_PLACES[0],
):
    modes = ["bf16", "fp8dp_delayed", "fp8dp_current", "fp8dp_off"]
    if compare_residual:
        modes.append("fp8dp_delayed_addres")
    if compare_activation and arch == "gpt":
        modes += ["fp8dp_delayed_fc1gelu", "fp8dp_delayed_fc2gelu"]
    if graphs:  # each on its own copy of the model: capture replaces its forward
        modes += ["bf16_graphed", "fp8dp_delayed_graphed", "fp8dp_delayed_mg", MG_GRAPHED]
    if fast_backward:
        modes.append("fp8dp_delayed_fastbwd")
    if block:
        modes.append("fp8dp_block")
    if te is not None and not skip_te:
        modes += ["te_delayed", "te_off"]
        if block and getattr(te_recipe, "Float8BlockScaling", None):
            modes.append("te_block")
    if compare_split:  # the same stack with an earlier QKV split, for the baseline and FP8 delayed
        modes += [f"bf16@{compare_split}", f"fp8dp_delayed@{compare_split}"]
    torch.manual_seed(1)
    x = torch.randn(SEQ, BATCH, hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(SEQ, BATCH, hidden, device="cuda", dtype=torch.bfloat16) * 1e-2
    ref = make_model(hidden, layers, "torch", arch=arch)
    models = {"bf16": ref}
    for lib in ("fp8dp", "te"):
        if any(m.startswith(lib) and not m.endswith("_graphed") for m in modes):
            model = make_model(hidden, layers, lib, ref, arch=arch, gelu=gelu)
            for m in modes:
                if m.startswith(lib) and not m.endswith("_graphed"):
                    models[m] = model
    for place in GELU_PLACES[1:]:  # a model of its own: fc1 or fc2 is built with the GELU
        if f"fp8dp_delayed_{place}gelu" in modes:
            models[f"fp8dp_delayed_{place}gelu"] = make_model(
                hidden, layers, "fp8dp", ref, arch=arch, gelu=place
            )
    if graphs:
        models["bf16_graphed"] = make_model(hidden, layers, "torch", arch=arch)
        models["fp8dp_delayed_graphed"] = make_model(
            hidden, layers, "fp8dp", ref, arch=arch, gelu=gelu
        )
        for m in ("fp8dp_delayed_mg", MG_GRAPHED):
            models[m] = make_model(
                hidden, layers, "fp8dp", ref, arch=arch, gelu=gelu, main_grad=True
            )
    steps, losses, graph_errors = {}, {}, {}
    for m in list(modes):
        try:
            steps[m], losses[m] = make_step(models[m.partition("@")[0]], x, dy, m)
        except Exception as e:  # noqa: BLE001  a failed capture leaves the eager variants' numbers
            if not m.endswith("_graphed"):
                raise
            print(f"[gpt_block] {arch} {hidden} x {layers} {m}: capture FAILED", flush=True)
            traceback.print_exc()
            torch.cuda.synchronize()
            graph_errors[m] = f"{type(e).__name__}: {e}"
            modes.remove(m)
            del models[m]
    with GpuSampler() as gpu:
        ms = time_interleaved(steps, warmup=5, rounds=rounds)
    tokens = SEQ * BATCH
    out = {"arch": arch, "hidden": hidden, "layers": layers, "tokens": tokens, "variants": {}}
    for m in modes:
        vs = ms[_baseline(m)]
        out["variants"][m] = {
            "ms": ms[m],
            "tokens_per_s": tokens / ms[m] * 1e3,
            "speedup": vs / ms[m],
            "peak_step_mib": peak_step_mib(steps[m]),
            "host_ms": host_ms(steps[m]),
            "loss": losses[m](),
        }
        if m.endswith("_graphed") and "bf16_graphed" in ms:
            out["variants"][m]["speedup_vs_bf16_graphed"] = ms["bf16_graphed"] / ms[m]
    if graph_errors:
        out["graph_errors"] = graph_errors
    out["target"] = TARGETS.get((arch, hidden, layers))
    out["gpu_during_timing"] = gpu.summary()  # clocks and power of the interleaved timing
    if energy is not None:
        alone = {m: time_sustained(steps[m], energy) for m in modes}
        for m in modes:
            out["variants"][m].update(alone_vs(alone, m, _baseline(m)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--shapes", default="2048x8,4096x4,8192x2", help="hidden x layers, comma-separated"
    )
    ap.add_argument(
        "--arch",
        default="gpt",
        help=f"block architectures, comma-separated, of {', '.join(ARCHS)} (default gpt)",
    )
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--no-te", action="store_true", help="leave TransformerEngine out")
    ap.add_argument(
        "--no-alone", action="store_true", help="skip the sustained per-variant energy blocks"
    )
    ap.add_argument(
        "--compare-qkv",
        choices=QKV_SPLITS[1:],
        default=None,
        help="also time torch BF16 and fp8dp FP8 delayed with this earlier QKV split (QKV_SPLITS)",
    )
    ap.add_argument(
        "--fast-backward",
        action="store_true",
        help="also time fp8dp FP8 delayed with fast accumulation in dgrad and wgrad (other numerics)",
    )
    ap.add_argument(
        "--block",
        action="store_true",
        help="also time Float8BlockScaling (fp8dp, and TE's when it has the recipe)",
    )
    ap.add_argument(
        "--compare-residual",
        action="store_true",
        help="also time fp8dp FP8 delayed with its residual adds as torch adds (RESIDUALS)",
    )
    ap.add_argument(
        "--compare-activation",
        action="store_true",
        help="also time fp8dp FP8 delayed (gpt) with fc1 applying the GELU "
        '(LayerNormLinear(activation="gelu")) and with fc2 applying it to its input '
        '(Linear(input_activation="gelu")), GELU_PLACES',
    )
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="also time the stack captured in CUDA graphs: torch BF16 (torch.cuda."
        "make_graphed_callables) and fp8dp FP8 delayed (fp8dp.make_graphed_callables)",
    )
    ap.add_argument(
        "--gelu",
        default=GELU_PLACES[0],
        choices=GELU_PLACES,
        help="where the fp8dp gpt models apply the GELU (GELU_PLACES), the graphed one included",
    )
    ap.add_argument("--json", default="bench/results/gpt_block_gpu.json")
    args = ap.parse_args()
    if te is None:
        print(
            f"TransformerEngine: not importable here ({TE_REASON}); its variants are left out",
            flush=True,
        )
    energy = None if args.no_alone else EnergyCounter()
    if energy is not None and energy.why:
        print(f"energy counter: not readable here ({energy.why}); joules are left out", flush=True)
    archs = args.arch.split(",")
    for a in archs:
        if a not in ARCHS:
            ap.error(f"--arch: expected names from {', '.join(ARCHS)}, got {a!r}")
    results = []
    for arch, shape in [(a, s) for a in archs for s in args.shapes.split(",")]:
        hidden, layers = (int(v) for v in shape.split("x"))
        print(f"[gpt_block] {arch} {hidden} x {layers} ...", flush=True)
        try:
            results.append(
                bench_shape(
                    hidden,
                    layers,
                    args.rounds,
                    args.no_te,
                    energy,
                    args.compare_qkv,
                    args.fast_backward,
                    args.block,
                    arch,
                    args.graphs,
                    args.compare_residual,
                    args.compare_activation,
                    args.gelu,
                )
            )
        except Exception as e:  # one shape failing must not hide the others
            print(f"{arch} {shape}: FAILED {type(e).__name__}: {e}", flush=True)
            results.append(
                {
                    "arch": arch,
                    "hidden": hidden,
                    "layers": layers,
                    "error": f"{type(e).__name__}: {e}",
                }
            )
        # The graphed models hold reference cycles (forward -> closure -> module): collect them here,
        # not during the next shape's torch capture (which runs without gc.collect in torch 2.11).
        gc.collect()
        torch.cuda.empty_cache()
    rows = []
    for r in results:
        if "error" in r:
            continue
        for m, v in r["variants"].items():
            rows.append(
                [
                    f"{r['arch']} {r['hidden']}x{r['layers']}",
                    m,
                    f"{v['ms']:.2f}",
                    f"{v['tokens_per_s'] / 1e3:.0f}k",
                    f"{v['speedup']:.2f}x",
                    f"{v['host_ms']:.2f}",
                    f"{v['peak_step_mib']:.0f}",
                    f"{v['loss']:.5f}",
                ]
            )
    print_table(
        f"GPT block stack, seq {SEQ} x batch {BATCH}, forward+backward, ratio over torch BF16",
        [
            "arch width x layers",
            "variant",
            "ms",
            "tokens/s",
            "vs bf16",
            "host ms",
            "peak MiB",
            "loss",
        ],
        rows,
    )
    alone_rows = [
        [f"{r['arch']} {r['hidden']}x{r['layers']}", m] + alone_cells(v)
        for r in results
        for m, v in r.get("variants", {}).items()
        if "alone" in v
    ]
    if alone_rows:
        print_table(
            "Each variant alone, sustained (~1.5 s): time, energy per step, mean power, SM clock;"
            " base = torch BF16",
            ["arch width x layers", "variant"] + ALONE_HEADER,
            alone_rows,
        )
    for r in results:
        g = r.get("gpu_during_timing")
        if g:
            c, w = g["sm_clock_mhz"], g["power_w"]
            print(
                f"{r['arch']} {r['hidden']}x{r['layers']}: SM clock {c['median']:.0f} MHz median "
                f"({c['min']:.0f}-{c['max']:.0f}), power {w['median']:.0f} W median "
                f"({w['max']:.0f} max) while timing, {g['samples']} samples"
            )
    write_json(
        args.json,
        {
            "benchmark": "gpt_block_gpu",
            **device_info(),
            "te": None if te is None else getattr(te, "__version__", "?"),
            "te_reason": TE_REASON,
            "seq": SEQ,
            "batch": BATCH,
            "targets": {f"{a} {h}x{n}": t for (a, h, n), t in TARGETS.items()},
            "target_fp8_off": TARGET_FP8_OFF,
            "command": " ".join(["python3"] + sys.argv),
            "qkv_split": QKV_SPLITS[0],
            "fp8dp_residual": RESIDUALS[0],
            "fp8dp_gelu": args.gelu,
            "results": results,
        },
    )
    ok = all("error" not in r and "graph_errors" not in r for r in results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
