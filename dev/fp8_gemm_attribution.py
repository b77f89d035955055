"""Which of the three GEMMs of an FP8 linear layer costs the loss? An experiment, not a reference
benchmark: the plain-torch GPT of fp8dp.train.torch_ref (same config, initial weights, batches,
schedule and evaluation as fp8dp.train) with every projection's GEMMs emulated in FP8 or not, one
GEMM at a time.

    torchrun --nproc_per_node=1 dev/fp8_gemm_attribution.py --config configs/fp8_gap_cpu.yaml \
        --gemms fprop,dgrad,wgrad --out runs/attr/all [--grad-format E4M3] [--no-head]

--gemms: the GEMMs that run in FP8 (a comma list of fprop, dgrad, wgrad; "none" for FP32;
fprop_x / fprop_w quantize only the forward GEMM's input / weight).
Emulation: current scaling per tensor (scale = fp8_max / amax, the tensor's own amax, as
Float8CurrentScaling with margin 0); x and w in E4M3, dy in E5M2 (HYBRID) unless --grad-format
E4M3; round to nearest even, saturating; products and sums in FP32 (what fp8dp's CPU path
computes). A GEMM left out of --gemms multiplies the unquantized FP32 operands. The cast of an
operand is the same in every GEMM that uses it (x in fprop and wgrad, dy in dgrad and wgrad).
Writes <out>/torch/metrics.jsonl as fp8dp.train does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp8dp.train import torch_ref
from fp8dp.train.config import load_config
from fp8dp.train.fp8_stats import FORMATS, fake_cast
from fp8dp.train.loop import setup_distributed

# fprop_x / fprop_w: the forward GEMM with only its input / only its weight quantized.
GEMMS = ("fprop", "dgrad", "wgrad", "fprop_x", "fprop_w")


def cast(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """dequant(quant(v)) under current scaling (scale = fp8_max / amax of v)."""
    amax = v.abs().max()
    if not torch.isfinite(amax) or amax == 0:
        return v
    return fake_cast(v, FORMATS[fmt][1] / amax.float(), fmt)


class EmulatedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, fp8: frozenset, grad_fmt: str):
        ctx.save_for_backward(x, w)
        ctx.fp8, ctx.grad_fmt, ctx.has_bias = fp8, grad_fmt, b is not None
        x2 = x.reshape(-1, x.shape[-1])
        qx = cast(x2, "E4M3") if fp8 & {"fprop", "fprop_x"} else x2
        qw = cast(w, "E4M3") if fp8 & {"fprop", "fprop_w"} else w
        y = qx @ qw.t()
        if b is not None:
            y = y + b
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        fp8 = ctx.fp8
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        qdy = cast(dy2, ctx.grad_fmt) if fp8 & {"dgrad", "wgrad"} else dy2
        dx = (qdy if "dgrad" in fp8 else dy2) @ (cast(w, "E4M3") if "dgrad" in fp8 else w)
        if "wgrad" in fp8:
            dw = qdy.t() @ cast(x2, "E4M3")
        else:
            dw = dy2.t() @ x2
        db = dy2.sum(0) if ctx.has_bias else None
        return dx.reshape(x.shape), dw, db, None, None


# Cleared while the unquantized evaluation of --eval-both runs.
_EMULATE = [True]


def evaluate_both(path: str):
    """torch_ref's evaluation as trained (FP8 emulated), and once more with every GEMM
    unquantized, written to `path` (one JSON line per evaluation): the share of the FP8 run's
    loss gap that its evaluation's own FP8 forward adds to what the trained weights lose."""
    evaluate = torch_ref.evaluate
    out = open(path, "w")

    def both(model, *args, **kw):
        as_trained = evaluate(model, *args, **kw)
        _EMULATE[0] = False
        try:
            plain = evaluate(model, *args, **kw)
        finally:
            _EMULATE[0] = True
        out.write(json.dumps({"val_loss": as_trained, "val_loss_unquantized": plain}) + "\n")
        out.flush()
        return as_trained

    torch_ref.evaluate = both


def install(fp8: frozenset, grad_fmt: str, head: bool) -> None:
    """Route torch_ref's projections through EmulatedLinear."""

    def norm_linear(self, x):
        if self.rms:
            h = F.rms_norm(x, x.shape[-1:], self.layer_norm_weight, eps=1e-5)
        else:
            h = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, 1e-5)
        use = fp8 if (head or not getattr(self, "is_head", False)) else frozenset()
        use = use if _EMULATE[0] else frozenset()
        return EmulatedLinear.apply(h, self.weight, self.bias, use, grad_fmt)

    def plain_linear(self, x):
        use = fp8 if _EMULATE[0] else frozenset()
        return EmulatedLinear.apply(x, self.weight, self.bias, use, grad_fmt)

    torch_ref.NormLinear.forward = norm_linear
    torch_ref.PlainLinear.forward = plain_linear
    build = torch_ref.build_like_fp8dp

    def build_marking_head(cfg, device):
        model = build(cfg, device)
        model.head.is_head = True
        return model

    torch_ref.build_like_fp8dp = build_marking_head


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument(
        "--gemms",
        required=True,
        help="comma list of fprop, dgrad, wgrad, fprop_x, fprop_w; or none",
    )
    p.add_argument("--grad-format", choices=("E5M2", "E4M3"), default="E5M2")
    p.add_argument("--no-head", action="store_true", help="the head's GEMMs stay FP32")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int)
    p.add_argument(
        "--eval-both",
        action="store_true",
        help="also evaluate without FP8 at each evaluation (<out>/eval_both.jsonl)",
    )
    args = p.parse_args(argv)
    fp8 = frozenset() if args.gemms == "none" else frozenset(args.gemms.split(","))
    if not fp8 <= set(GEMMS):
        p.error(f"--gemms: expected a comma list of {', '.join(GEMMS)} or none, got {args.gemms}")
    cfg = load_config(args.config, args.set + ["run.device=cpu"])
    rank, world, device, _ = setup_distributed(cfg.run)
    install(fp8, args.grad_format, head=not args.no_head)
    if args.eval_both and rank == 0:
        os.makedirs(args.out, exist_ok=True)
        evaluate_both(os.path.join(args.out, "eval_both.jsonl"))
    try:
        s = torch_ref.train_torch(
            cfg,
            os.path.join(args.out, "torch"),
            rank=rank,
            world_size=world,
            device=device,
            steps=args.steps,
        )
        if rank == 0:
            print(f"[attribution] gemms {sorted(fp8)}: val loss {s['last_val_loss']:.5f}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
