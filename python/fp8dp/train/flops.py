"""The demo GPT's size and cost from its config alone (no model is allocated): parameter counts
and model FLOPs per token, for the start-of-run print, the MFU in the metrics, and the test that
configs/gpt350m.yaml is as large as its name says.

FLOPs are counted as PaLM does (Chowdhery et al. 2022, appendix B), the model's FLOPs, not the
hardware's: 6 per GEMM weight per token (2 forward, 4 backward: input and weight gradients) plus
12 * n_layer * d_model * seq_len per token for the attention scores and their weighted sum
(QK^T and AV, 2 * seq_len * d_model each forward, x3 with backward), not halved for the causal
mask. Norms, GELU, softmax, biases and the embeddings are left out (they are < 1% at
d_model >= 1536). MFU = FLOPs per token * tokens/s / (devices * peak FLOP/s); the peak is the
device's dense BF16 peak (train.peak_tflops) for every run, FP8 included, so MFUs of runs compare
as throughputs do.
"""

from __future__ import annotations

from .config import ModelConfig
from .data import VOCAB_SIZE


def param_counts(m: ModelConfig) -> dict:
    """{"total", "gemm", "embedding", "other"}: elements of the parameters model.GPT allocates.
    gemm: the projections' weights (what the FP8 GEMMs multiply); other: biases and norm
    parameters."""
    d, f = m.d_model, m.ffn_mult * m.d_model
    norm = 2 * d if m.normalization == "LayerNorm" else d  # LayerNorm has a bias, RMSNorm none
    bias = (lambda n: n) if m.bias else (lambda n: 0)
    gemm_block = d * 3 * d + d * d + d * f + f * d
    other_block = 2 * norm + bias(3 * d) + bias(d) + bias(f) + bias(d)
    gemm = m.n_layer * gemm_block + d * VOCAB_SIZE
    other = m.n_layer * other_block + norm + bias(VOCAB_SIZE)
    embedding = VOCAB_SIZE * d + m.seq_len * d
    return {
        "total": gemm + other + embedding,
        "gemm": gemm,
        "embedding": embedding,
        "other": other,
    }


def flops_per_token(m: ModelConfig) -> int:
    """Model FLOPs of one training token (forward + backward), as the module docstring counts."""
    return 6 * param_counts(m)["gemm"] + 12 * m.n_layer * m.d_model * m.seq_len


def mfu(m: ModelConfig, tokens_per_s: float, devices: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation of `devices` devices of peak_tflops each."""
    return flops_per_token(m) * tokens_per_s / (devices * peak_tflops * 1e12)


def main(argv=None) -> int:
    """python -m fp8dp.train.flops CONFIG [--set k=v ...]: the counts, without building a model."""
    import argparse

    from .config import load_config

    p = argparse.ArgumentParser(prog="python -m fp8dp.train.flops", description=main.__doc__)
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    m = load_config(args.config, args.set).model
    n = param_counts(m)
    print(
        f"{args.config}: {n['total']:,} parameters ({n['gemm']:,} in GEMM weights, "
        f"{n['embedding']:,} in embeddings, {n['other']:,} biases and norms); "
        f"{flops_per_token(m) / 1e9:.4g} GFLOP per training token"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
