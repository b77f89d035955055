"""One MLP block on one GPU, forward + backward: fp8dp.LayerNormMLP (fused) against the separate
fp8dp modules (LayerNormLinear -> activation -> Linear), torch BF16 (nn.LayerNorm / RMSNorm +
nn.Linear + F.gelu / silu*up) and TransformerEngine's LayerNormMLP when
`import transformer_engine.pytorch` works. All variants are built and timed interleaved in one
process on identical inputs (bench/cuda_timing.py).

Per width: GELU (LayerNorm, bias, ffn = 4 h) and SwiGLU (RMSNorm, no bias, ffn = 8/3 h rounded to a
multiple of 256: the Llama shape); 4096 tokens ([seq 2048, batch 2, hidden]); BF16 parameters; FP8
delayed scaling (HYBRID, history 1024, scale update each step) and FP8 off. One step = forward,
backward with a fixed grad_output, gradients dropped. Reported: ms per step (median), the ratio over
torch BF16, peak MiB of one step. `fp8dp_mlp_fp8_computed` is the fused module with its activation
computed per element rather than looked up in the bf16 tables (the same bits).

    python3 bench/layernorm_mlp_gpu.py [--widths 2048,4096,8192] [--tokens 4096] [--json out.json]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import (
    device_info,
    peak_step_mib,
    print_table,
    time_interleaved,
    write_json,
)  # noqa: E402

import fp8dp  # noqa: E402

try:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    TE_REASON = None
except Exception as e:  # noqa: BLE001  (any import failure means: no TE variants)
    te = None
    TE_REASON = f"{type(e).__name__}: {e}"


def ffn_of(h, act):
    return 4 * h if act == "gelu" else ((8 * h // 3 + 255) // 256) * 256


class TorchMLP(torch.nn.Module):
    def __init__(self, h, ffn, act):
        super().__init__()
        self.act = act
        bias = act == "gelu"
        self.norm = torch.nn.LayerNorm(h) if act == "gelu" else torch.nn.RMSNorm(h)
        self.fc1 = torch.nn.Linear(h, ffn * (2 if act == "swiglu" else 1), bias=bias)
        self.fc2 = torch.nn.Linear(ffn, h, bias=bias)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        if self.act == "gelu":
            a = F.gelu(h)
        else:
            g, u = h.chunk(2, -1)
            a = F.silu(g) * u
        return self.fc2(a)


class SeparateMLP(torch.nn.Module):
    """The unfused stack of fp8dp modules (what gpt_block_gpu.py's blocks use today)."""

    def __init__(self, h, ffn, act):
        super().__init__()
        self.act = act
        bias = act == "gelu"
        norm = "LayerNorm" if act == "gelu" else "RMSNorm"
        fc1_out = ffn * (2 if act == "swiglu" else 1)
        kw = dict(params_dtype=torch.bfloat16, device="cuda", bias=bias)
        self.fc1 = fp8dp.LayerNormLinear(h, fc1_out, normalization=norm, **kw)
        self.fc2 = fp8dp.Linear(ffn, h, **kw)

    def forward(self, x):
        h = self.fc1(x)
        if self.act == "gelu":
            a = F.gelu(h)
        else:
            g, u = h.chunk(2, -1)
            a = F.silu(g) * u
        return self.fc2(a)


def computed_activation(step):
    """`step` with fp8dp's activation tables off for its forward and backward (a process-wide
    switch, read at each kernel launch, so autograd's device thread sees it too)."""

    def run():
        before = fp8dp._C._set_activation_lut(False)
        try:
            step()
        finally:
            fp8dp._C._set_activation_lut(before)

    return run


def make_step(model, x, dy, ctx, after=None):
    def step():
        with ctx():
            y = model(x)
        y.backward(dy)
        if after is not None:
            after()
        for p in model.parameters():
            p.grad = None

    return step


def variants_for(h, act, tokens):
    ffn = ffn_of(h, act)
    x = torch.randn(tokens // 2, 2, h, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    r = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID, amax_history_len=1024)
    on = lambda: fp8dp.fp8_autocast(enabled=True, fp8_recipe=r)  # noqa: E731
    off = lambda: fp8dp.fp8_autocast(enabled=False)  # noqa: E731
    v = {}
    base = TorchMLP(h, ffn, act).to("cuda", torch.bfloat16)
    v["torch_bf16"] = make_step(base, x, dy, torch.enable_grad)
    norm = "LayerNorm" if act == "gelu" else "RMSNorm"
    fused = fp8dp.LayerNormMLP(
        h,
        ffn,
        bias=act == "gelu",
        activation=act,
        normalization=norm,
        params_dtype=torch.bfloat16,
        device="cuda",
    )
    sep = SeparateMLP(h, ffn, act)
    v["fp8dp_mlp_fp8"] = make_step(fused, x, dy, on, fp8dp.update_fp8_scales)
    # The same module with its activation computed for every element instead of looked up in
    # the bf16 tables (src/fp8/activation_lut.h; the same bits): what the tables gain.
    v["fp8dp_mlp_fp8_computed"] = computed_activation(
        make_step(fused, x, dy, on, fp8dp.update_fp8_scales)
    )
    v["fp8dp_separate_fp8"] = make_step(sep, x, dy, on, fp8dp.update_fp8_scales)
    v["fp8dp_mlp_off"] = make_step(fused, x, dy, off)
    v["fp8dp_separate_off"] = make_step(sep, x, dy, off)
    if te is not None:
        tr = te_recipe.DelayedScaling(
            fp8_format=te_recipe.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max"
        )
        tm = te.LayerNormMLP(
            h,
            ffn,
            bias=act == "gelu",
            normalization=norm,
            activation="gelu" if act == "gelu" else "swiglu",
            params_dtype=torch.bfloat16,
        ).cuda()
        ton = lambda: te.fp8_autocast(enabled=True, fp8_recipe=tr)  # noqa: E731
        toff = lambda: te.fp8_autocast(enabled=False)  # noqa: E731
        v["te_mlp_fp8"] = make_step(tm, x, dy, ton)
        v["te_mlp_off"] = make_step(tm, x, dy, toff)
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="2048,4096,8192")
    ap.add_argument("--acts", default="gelu,swiglu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    results = []
    for act in a.acts.split(","):
        for h in (int(w) for w in a.widths.split(",")):
            v = variants_for(h, act, a.tokens)
            ms = time_interleaved(v, warmup=5, rounds=a.rounds)
            base = ms["torch_bf16"]
            rows = []
            for name, t in ms.items():
                mib = peak_step_mib(v[name])
                rows.append([name, f"{t:.3f}", f"{base / t:.2f}x", f"{mib:.0f}"])
                results.append(
                    {
                        "activation": act,
                        "hidden": h,
                        "ffn": ffn_of(h, act),
                        "tokens": a.tokens,
                        "variant": name,
                        "ms": t,
                        "speedup_vs_torch_bf16": base / t,
                        "peak_step_mib": mib,
                    }
                )
            print_table(
                f"{act} hidden={h} ffn={ffn_of(h, act)} tokens={a.tokens}",
                ["variant", "ms", "vs bf16", "peak MiB"],
                rows,
            )
            del v
            torch.cuda.empty_cache()
    write_json(a.json, {"device": device_info(), "te": TE_REASON or "imported", "results": results})


if __name__ == "__main__":
    main()
