"""A small GPT whose every projection is an fp8dp module.

Per block: LayerNormLinear (norm + QKV), scaled_dot_product_attention, Linear (out projection),
LayerNormLinear (norm + MLP up), GELU, Linear (MLP down). The final norm and the vocabulary head
are one more LayerNormLinear. fp8.exclude keeps named projections out of FP8. Embeddings stay
plain torch parameters, so one model exercises both gradient routes of contract C2: autograd +
DDP hook (embeddings) and delayed/fused wgrad (the projections). Activations are sequence-first,
[seq, batch, hidden], as Megatron passes them.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial

import torch
import torch.nn.functional as F

import fp8dp

from .config import ModelConfig
from .data import VOCAB_SIZE


def _normal(std: float, w: torch.Tensor) -> None:
    torch.nn.init.normal_(w, mean=0.0, std=std)


def embed(tok: torch.nn.Embedding, pos: torch.nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [seq, batch] -> token + position embeddings [seq, batch, hidden] (GPT.forward and
    the pipeline's first block share it)."""
    s = tokens.shape[0]
    return tok(tokens) + pos(torch.arange(s, device=tokens.device))[:, None, :]


def split_qkv(qkv, n_head: int) -> tuple:
    """qkv [seq, batch, 3 * hidden], or the (q, k, v) that a LayerNormLinear with qkv_heads
    returns (each [seq, batch, head, head_dim]) -> q, k, v, each [batch, head, seq, head_dim], as
    views.

    The unbind is on the q/k/v axis of the [s, b, 3, h, hd] view, before the permute: its backward
    stacks the three gradients straight into qkv's layout. Unbinding after a permute to
    [3, b, h, s, hd] (the same views) stacked them in that order instead and needed one more full
    copy back to [s, b, 3 * hidden] in every backward (5.8 ms of the 342M step's 126 ms of
    kernels on an H100, 12-05). With qkv_heads the projection itself returns the three views, so
    no stack at all runs where its FP8 cast reads the three gradients in place."""
    if isinstance(qkv, tuple):
        parts = qkv
    else:
        s, b, three_d = qkv.shape
        d = three_d // 3
        parts = qkv.view(s, b, 3, n_head, d // n_head).unbind(2)
    return tuple(t.permute(1, 2, 0, 3) for t in parts)


def precision(name: str, exclude) -> contextlib.AbstractContextManager:
    """The context projection `name` runs in: as around it, or FP8 off when fp8.exclude names
    it."""
    return fp8dp.fp8_autocast(enabled=False) if name in exclude else contextlib.nullcontext()


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, proj: dict, exclude=()):
        super().__init__()
        self.exclude = tuple(exclude)
        self.fused_residual = cfg.fused_residual
        d, self.n_head = cfg.d_model, cfg.n_head
        std = 0.02
        out_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: residual projections scaled down
        ln = dict(normalization=cfg.normalization)
        # model.fused_residual: the norms' layers also return their input, the residual that
        # the next projection adds in its epilogue, so that its gradient joins x's in the norm's
        # backward (LayerNormLinear's return_layernorm_input).
        ln_in = dict(return_layernorm_input=cfg.fused_residual)
        self.qkv = fp8dp.LayerNormLinear(
            d,
            3 * d,
            init_method=partial(_normal, std),
            qkv_heads=cfg.n_head,
            **ln,
            **ln_in,
            **proj,
        )
        self.out = fp8dp.Linear(d, d, init_method=partial(_normal, out_std), **proj)
        if cfg.fused_mlp:  # the same two projections, built in the same order (same weights)
            self.mlp = fp8dp.LayerNormMLP(
                d,
                cfg.ffn_mult * d,
                activation="gelu",
                init_method=partial(_normal, std),
                output_layer_init_method=partial(_normal, out_std),
                **ln,
                **proj,
            )
        else:
            self.mlp = None
            # model.fused_activation: up applies the GELU (its FP8 backward casts the GELU's
            # derivative in one pass, LayerNormLinear(activation=)), or down to its input (its
            # FP8 forward casts the GELU of its input in one pass, Linear(input_activation=)).
            self.gelu_place = cfg.activation_place()
            act = dict(activation="gelu") if self.gelu_place == "up" else {}
            in_act = dict(input_activation="gelu") if self.gelu_place == "down" else {}
            self.up = fp8dp.LayerNormLinear(
                d,
                cfg.ffn_mult * d,
                init_method=partial(_normal, std),
                **ln,
                **ln_in,
                **act,
                **proj,
            )
            self.down = fp8dp.Linear(
                cfg.ffn_mult * d, d, init_method=partial(_normal, out_std), **in_act, **proj
            )

    def forward(self, x: torch.Tensor, is_first_microbatch) -> torch.Tensor:
        s, b, d = x.shape
        h = self.n_head
        first = is_first_microbatch
        # model.fused_residual: each residual add in the epilogue of the GEMM before it (no add
        # kernel of its own; the sum rounded once), and its gradient added to x's in the backward
        # of the norm that reads the same x (the residual comes from the norm's layer: its own
        # input, returned; LayerNormMLP does both itself when residual is its input).
        fused = self.fused_residual
        with precision("qkv", self.exclude):
            qkv = self.qkv(x, is_first_microbatch=first)
        if fused:
            *qkv, x = qkv
        q, k, v = split_qkv(tuple(qkv), h)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.permute(2, 0, 1, 3).reshape(s, b, d)
        with precision("out", self.exclude):
            if fused:
                x = self.out(a, is_first_microbatch=first, residual=x)
            else:
                x = x + self.out(a, is_first_microbatch=first)
        if self.mlp is not None:  # fp8.exclude names both of up / down or neither (config)
            with precision("up", self.exclude):
                if fused:
                    return self.mlp(x, is_first_microbatch=first, residual=x)
                return x + self.mlp(x, is_first_microbatch=first)
        with precision("up", self.exclude):
            u = self.up(x, is_first_microbatch=first)
        if fused:
            u, x = u
        if self.gelu_place == "torch":
            u = F.gelu(u)
        with precision("down", self.exclude):
            if fused:
                return self.down(u, is_first_microbatch=first, residual=x)
            return x + self.down(u, is_first_microbatch=first)


class GPT(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        delay_wgrad_compute: bool,
        fuse_wgrad_accumulation: bool,
        device: torch.device,
        exclude=(),
    ):
        """exclude: the projections (config.PROJECTIONS) that run in params_dtype under any
        fp8_autocast (config fp8.exclude)."""
        super().__init__()
        self.exclude = tuple(exclude)
        dtype = getattr(torch, cfg.params_dtype)
        proj = dict(
            bias=cfg.bias,
            params_dtype=dtype,
            device=device,
            delay_wgrad_compute=delay_wgrad_compute,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        )
        self.tok = torch.nn.Embedding(VOCAB_SIZE, cfg.d_model, dtype=dtype, device=device)
        self.pos = torch.nn.Embedding(cfg.seq_len, cfg.d_model, dtype=dtype, device=device)
        torch.nn.init.normal_(self.tok.weight, std=0.02)
        torch.nn.init.normal_(self.pos.weight, std=0.01)
        self.blocks = torch.nn.ModuleList(Block(cfg, proj, exclude) for _ in range(cfg.n_layer))
        self.head = fp8dp.LayerNormLinear(
            cfg.d_model,
            VOCAB_SIZE,
            normalization=cfg.normalization,
            init_method=partial(_normal, 0.02),
            **proj,
        )
        if cfg.tie_embeddings:
            # The head is still built above, so the random stream (and every other initial
            # weight) is that of the untied model; its own weight is dropped for the embedding.
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, is_first_microbatch=None) -> torch.Tensor:
        """tokens [seq, batch] (int64) -> logits [seq, batch, 256]."""
        x = embed(self.tok, self.pos, tokens)
        for block in self.blocks:
            x = block(x, is_first_microbatch)
        with precision("head", self.exclude):
            return self.head(x, is_first_microbatch=is_first_microbatch)

    def fp8_modules(self) -> list:
        """The fp8dp projections in forward order (backward_dw runs them in reverse)."""
        return [m for m in self.modules() if isinstance(m, (fp8dp.Linear, fp8dp.LayerNormLinear))]
