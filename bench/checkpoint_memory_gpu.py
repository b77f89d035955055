"""Activation checkpointing on one GPU: what torch.utils.checkpoint saves on a stack of GPT blocks
(bench/gpt_block_gpu.py's Block) in torch BF16 and in fp8dp (FP8 delayed scaling, FP8 off), each
with and without checkpointing every block (non-reentrant and reentrant).

Per variant: the memory the forward leaves allocated for the backward (activations saved, MiB), the
peak of one forward + backward above what was allocated before it (MiB), ms per step (median of
CUDA-event samples, interleaved), and the largest difference of any parameter gradient from the
same library's run without checkpointing (the recompute runs the same kernels on the same inputs,
so 0 is expected; the FP8 scales do not move inside one step).

    python3 bench/checkpoint_memory_gpu.py [--hidden 4096] [--layers 4] [--json out.json]

Contract C14: checkpointing must free fp8dp's activations as it frees nn.Linear's.
"""

import argparse
import os
import sys

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import device_info, print_table, time_interleaved, write_json  # noqa: E402
from gpt_block_gpu import BATCH, SEQ, make_model  # noqa: E402

import fp8dp  # noqa: E402

MODES = {  # name -> (library, fp8 autocast kwargs or None for plain torch)
    "torch_bf16": ("torch", None),
    "fp8dp_delayed": ("fp8dp", dict(enabled=True)),
    "fp8dp_off": ("fp8dp", dict(enabled=False)),
}
CHECKPOINTING = ("none", "non_reentrant", "reentrant")


class Checkpointed(torch.nn.Module):
    """The blocks of `model`, each run under torch.utils.checkpoint (`how`) or plainly."""

    def __init__(self, model, how: str):
        super().__init__()
        self.blocks, self.how = model, how

    def forward(self, x):
        for blk in self.blocks:
            if self.how == "none":
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.how == "reentrant")
        return x


def make_variant(model, x, dy, fp8_kwargs, how):
    wrapped = Checkpointed(model, how)
    recipe = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID, amax_history_len=16)

    def ctx():
        if fp8_kwargs is None:
            return torch.autocast("cuda", enabled=False)
        return fp8dp.fp8_autocast(fp8_recipe=recipe, **fp8_kwargs)

    def forward():
        xa = x.detach().requires_grad_(True)
        with ctx():
            return wrapped(xa)

    def step():
        forward().backward(dy)
        for p in model.parameters():
            p.grad = None

    def measure():
        """(MiB held between forward and backward, MiB peak of the step, the gradients)."""
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = forward()
        torch.cuda.synchronize()
        held = (torch.cuda.memory_allocated() - base - y.numel() * y.element_size()) / 2**20
        y.backward(dy)
        del y
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        grads = [p.grad.detach().float().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        return held, peak, grads

    return step, measure


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    ok, why = fp8dp.cuda_available(return_reason=True)
    if not ok:
        print(f"checkpoint_memory_gpu: skipped, no GPU ({why})")
        return
    torch.manual_seed(0)
    x = torch.randn(SEQ, BATCH, args.hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    rows, results, steps = [], [], {}
    for mode, (lib, fp8_kwargs) in MODES.items():
        ref = make_model(args.hidden, args.layers, "torch") if lib != "torch" else None
        model = make_model(args.hidden, args.layers, lib, ref=ref)
        del ref
        base_grads = None
        for how in CHECKPOINTING:
            step, measure = make_variant(model, x, dy, fp8_kwargs, how)
            step()  # warm-up: FP8 scales, cuBLASLt plans, allocator
            held, peak, grads = measure()
            if base_grads is None:
                base_grads, diff = grads, 0.0
            else:
                diff = max(float((a - b).abs().max()) for a, b in zip(grads, base_grads))
            name = f"{mode}/{how}"
            steps[name] = step
            results.append(dict(variant=name, held_mib=held, peak_mib=peak, grad_max_diff=diff))
            print(
                f"{name}: held {held:.0f} MiB, peak {peak:.0f} MiB, grad diff {diff:.3g}",
                flush=True,
            )
        del model
    ms = time_interleaved(steps, rounds=args.rounds)
    for r in results:
        r["ms"] = ms[r["variant"]]
        none = next(q for q in results if q["variant"] == r["variant"].split("/")[0] + "/none")
        r["held_vs_none"] = r["held_mib"] / none["held_mib"]
        rows.append(
            [
                r["variant"],
                f"{r['held_mib']:.0f}",
                f"{r['held_vs_none']:.2f}",
                f"{r['peak_mib']:.0f}",
                f"{r['ms']:.2f}",
                f"{r['grad_max_diff']:.3g}",
            ]
        )
    print_table(
        f"activation checkpointing, {args.layers} GPT blocks of width {args.hidden}, "
        f"{SEQ}x{BATCH} tokens",
        ["variant", "held MiB", "held / none", "peak MiB", "ms", "grad max diff"],
        rows,
    )
    if args.json:
        write_json(
            args.json,
            dict(device=device_info(), hidden=args.hidden, layers=args.layers, results=results),
        )


if __name__ == "__main__":
    main()
