"""The demo GPT written with plain torch (F.layer_norm / F.rms_norm, F.linear, nn.Embedding),
trained with torch.nn.parallel.DistributedDataParallel and torch.optim.AdamW: the baseline that
fp8dp with FP8 off must follow. Same config, same initial weights (copied from an
fp8dp.train GPT built with the same seed), same batches, schedule, clipping and evaluation.

    python -m fp8dp.train.torch_ref --config CONFIG [--set k=v] [--steps N]   (under torchrun)

writes <out.dir>/torch/metrics.jsonl like the demo. --steps N stops after N steps of the
schedule of train.steps, so a short run compares with the first N steps of a long one.

Parameters are FP32 (torch's master weights); with model.params_dtype bfloat16 the forward and
backward run under torch.autocast(bfloat16), so the GEMMs see BF16-rounded weights and
activations as fp8dp's BF16 parameters do, while the optimizer steps FP32 weights with FP32
gradients as fp8dp's FP32 masters and main_grad do. The residual stream and the norms stay FP32
under autocast (fp8dp's are BF16), so with BF16 the two follow each other within BF16 rounding,
not bit for bit; with FP32 parameters they differ only in summation order.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import ModelConfig, TrainConfig, load_config
from .data import VOCAB_SIZE, load_corpus, to_device
from .loop import _all_mean, evaluate, lr_at, peak_memory_gib, setup_distributed
from .metrics import MetricsWriter
from .model import split_qkv


class NormLinear(torch.nn.Module):
    """norm(x) @ weight.T + bias, with fp8dp.LayerNormLinear's parameter names."""

    def __init__(self, cfg: ModelConfig, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.rms = cfg.normalization == "RMSNorm"
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(n_in))
        self.layer_norm_bias = None if self.rms else torch.nn.Parameter(torch.zeros(n_in))
        self.weight = torch.nn.Parameter(torch.empty(n_out, n_in))
        self.bias = torch.nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x):
        if self.rms:
            h = F.rms_norm(x, x.shape[-1:], self.layer_norm_weight, eps=1e-5)
        else:
            h = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, 1e-5)
        return F.linear(h, self.weight, self.bias)


class PlainLinear(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n_out, n_in))
        self.bias = torch.nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class TorchBlock(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f, b = cfg.d_model, cfg.ffn_mult * cfg.d_model, cfg.bias
        self.n_head = cfg.n_head
        self.qkv, self.out = NormLinear(cfg, d, 3 * d, b), PlainLinear(d, d, b)
        self.up, self.down = NormLinear(cfg, d, f, b), PlainLinear(f, d, b)

    def forward(self, x):  # model.Block.forward, step for step
        s, b, d = x.shape
        h = self.n_head
        q, k, v = split_qkv(self.qkv(x), h)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.permute(2, 0, 1, 3).reshape(s, b, d))
        return x + self.down(F.gelu(self.up(x)))


class TorchGPT(torch.nn.Module):
    """model.GPT's architecture and state-dict keys (without the FP8 _extra_state)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.pos = torch.nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = torch.nn.ModuleList(TorchBlock(cfg) for _ in range(cfg.n_layer))
        self.head = NormLinear(cfg, cfg.d_model, VOCAB_SIZE, cfg.bias)

    def forward(self, tokens, is_first_microbatch=None):
        s = tokens.shape[0]
        x = self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))[:, None, :]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_like_fp8dp(cfg: TrainConfig, device) -> TorchGPT:
    """A TorchGPT (FP32) holding exactly the initial weights fp8dp.train's GPT gets from
    train.seed (built here the same way, then copied; BF16 values are exact in FP32). With
    model.fused_mlp the fp8dp model draws the same weights under other names (blocks.N.mlp.fc1 /
    .fc2), so the copy is taken from the separate-module build, whose names TorchGPT shares."""
    from .model import GPT

    torch.manual_seed(cfg.train.seed)
    ref = GPT(dataclasses.replace(cfg.model, fused_mlp=False), False, False, device)
    state = {k: v.float() for k, v in ref.state_dict().items() if not k.endswith("_extra_state")}
    del ref
    model = TorchGPT(cfg.model).to(device)
    model.load_state_dict(state, strict=True)
    return model


def train_torch(cfg: TrainConfig, run_dir: str, *, rank, world_size, device, steps=None) -> dict:
    """The torch DDP run; writes <run_dir>/metrics.jsonl and summary.json on rank 0."""
    steps = cfg.train.steps if steps is None else min(steps, cfg.train.steps)
    n_micro = cfg.check_world_size(world_size)
    corpus = load_corpus(cfg.data, cfg.model.seq_len, rank=rank, barrier=dist.barrier)
    model = build_like_fp8dp(cfg, device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), **t.adamw_kwargs(device))
    bf16 = cfg.model.params_dtype == "bfloat16"

    def autocast():
        if not bf16:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def val():
        with autocast():
            return evaluate(model, corpus, cfg, rank, device)

    writer = MetricsWriter(os.path.join(run_dir, "metrics.jsonl")) if rank == 0 else None
    first = last = val()
    if writer:
        writer.write({"step": 0, "val_loss": first})
    tokens_per_step = t.global_batch_size * cfg.model.seq_len
    t_start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i in range(n_micro):
            x, y = corpus.batch("train", t.seed, step, rank, i, t.micro_batch_size)
            x, y = to_device(x, device), to_device(y, device)
            sync = ddp.no_sync() if i < n_micro - 1 else contextlib.nullcontext()
            with sync:
                with autocast():
                    logits = ddp(x)
                loss = F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), y.view(-1))
                (loss / n_micro).backward()
            loss_sum += loss.item()
        rec = {"step": step + 1, "lr": lr}
        if t.clip_grad > 0:
            rec["grad_norm"] = torch.nn.utils.clip_grad_norm_(
                model.parameters(), t.clip_grad
            ).item()
        opt.step()
        rec["train_loss"] = _all_mean(loss_sum / n_micro, device)
        dt = time.perf_counter() - t0
        rec.update(tokens_per_s=tokens_per_step / dt, step_time_s=dt)
        rec["peak_mem_gib"] = peak_memory_gib(device)
        done = step + 1
        if done % t.eval_every == 0 or done == steps:
            rec["val_loss"] = last = val()
        if writer:
            writer.write(rec)
    summary = {
        "first_val_loss": first,
        "last_val_loss": last,
        "start_step": 0,
        "steps": steps,
        "schedule_steps": t.steps,
        "world_size": world_size,
        "fp8": False,
        "recipe": None,
        "train_time_s": time.perf_counter() - t_start,
        "complete": True,
        "stopped_at": steps,
        "baseline": "torch.nn + torch DDP",
    }
    if writer:
        writer.close()
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8dp.train.torch_ref", description=__doc__)
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--steps", type=int, help="stop after this many steps (default train.steps)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    args = p.parse_args(argv)
    try:
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps: expected a step count >= 1, got {args.steps}")
        flags = [f"run.device={args.device}"] if args.device else []
        cfg = load_config(args.config, args.set + flags)
        rank, world, device, _ = setup_distributed(cfg.run)
    except (ValueError, OSError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"fp8dp.train.torch_ref: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    try:
        run_dir = os.path.join(cfg.out.dir, "torch")
        s = train_torch(cfg, run_dir, rank=rank, world_size=world, device=device, steps=args.steps)
        if rank == 0:
            last = s["last_val_loss"]
            print(
                f"[fp8dp.train.torch_ref] {s['steps']} steps: val loss {s['first_val_loss']:.4f} "
                f"-> {last:.4f}{'' if math.isfinite(last) else ' (not finite)'}; metrics "
                f"{run_dir}/metrics.jsonl",
                flush=True,
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
