"""model.fused_residual: each block's residual adds in the epilogue of the GEMM before them
(``out(a, residual=x)``, ``down(u, residual=x)`` or LayerNormMLP's ``mlp(x, residual=x)``).

- The same parameters (names and initial values) as without it.
- The blocks pass residual=x to both layers (a spy on their forward counts the calls; every test
  below checks the count, so a Block that ignored the flag fails them all).
- The same model: logits and every parameter's gradient against model.fused_residual=false,
  separate MLP modules and the fused MLP.
- A short training run of the demo loop (delayed weight gradients, fused main_grad
  accumulation, DDP, ZeRO-1; FP8 delayed and FP32 parameters as configs/ci_convergence.yaml)
  gives the unfused run's losses.
- Config errors name model.fused_residual.

Tolerances. FP32 parameters (FP8 off or on): bit-identical. The CPU GEMM computes
(a·bᵀ + bias) + residual in FP32 and an FP32 output is not rounded again, which is exactly the
unfused fl(x + fl(a·bᵀ + bias)); the FP8 casts then see the same values. BF16 parameters, FP8
off: the fused add rounds x + P once where the unfused one rounds P first, so each of the 4 adds
differs by at most one bfloat16 rounding of P and of the sum, 2 · 2^-8 of the stream normwise
(P is smaller than the stream); if every add's difference reached the logits unamplified (the
head's norm rescales the stream, the projections are initialised small), 4 · 2 · 2^-8 = 3.1e-2
normwise; gradients, one more GEMM deep, 3× that. And they must differ (> 0): equal bytes would
mean the unfused adds ran. (Measured 2026-12-06: 5.3e-3 logits, 8.8e-3 worst gradient.)

Mutations (2026-12-06, restored): Block ignoring model.fused_residual (the unfused adds always):
every test but test_same_parameters and test_config_errors failed (no residual calls, bf16
difference 0). gemm_cpu without the residual: every model comparison failed (logits off by the
whole residual stream).
"""

import json
from pathlib import Path

import pytest
import torch

import fp8dp
from fp8dp.train import loop
from fp8dp.train.config import ModelConfig, load_config
from fp8dp.train.model import GPT

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "ci_convergence.yaml")


def _model(fused_residual: bool, fused_mlp: bool = False, seed: int = 5, dtype="float32") -> GPT:
    cfg = ModelConfig(
        n_layer=2,
        d_model=64,
        n_head=4,
        seq_len=32,
        fused_mlp=fused_mlp,
        fused_residual=fused_residual,
        params_dtype=dtype,
    )
    torch.manual_seed(seed)
    return GPT(cfg, False, False, torch.device("cpu"))


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_same_parameters():
    a, b = _model(False), _model(True)
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k, v in sa.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert torch.equal(sb[k], v), k


@pytest.fixture
def residual_calls(monkeypatch):
    """How many Linear / LayerNormMLP forwards got a residual (a list, appended per call)."""
    seen = []
    for cls in (fp8dp.Linear, fp8dp.LayerNormMLP):
        orig = cls.forward

        def spy(self, x, is_first_microbatch=None, residual=None, orig=orig):
            if residual is not None:
                seen.append(type(self).__name__)
            return orig(self, x, is_first_microbatch, residual)

        monkeypatch.setattr(cls, "forward", spy)
    return seen


@pytest.mark.parametrize("fused_mlp", [False, True], ids=["separate", "fused_mlp"])
def test_blocks_take_the_residual(residual_calls, fused_mlp):
    """Each block's out projection and down projection (or LayerNormMLP) get residual=x."""
    _model(True, fused_mlp)(torch.randint(0, 256, (32, 2)))
    mlp = "LayerNormMLP" if fused_mlp else "Linear"
    assert residual_calls == ["Linear", mlp] * 2
    residual_calls.clear()
    _model(False, fused_mlp)(torch.randint(0, 256, (32, 2)))
    assert residual_calls == []


def _compare(fp8, fused_mlp, dtype, residual_calls):
    tokens = torch.randint(0, 256, (32, 4), generator=torch.Generator().manual_seed(1))
    recipe = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID)
    outs = []
    for fused in (False, True):
        m = _model(fused, fused_mlp, dtype=dtype)
        with fp8dp.fp8_autocast(enabled=bool(fp8), fp8_recipe=recipe):
            y = m(tokens)
        y.float().square().mean().backward()
        outs.append((y.detach(), {k: p.grad for k, p in m.named_parameters()}))
    assert len(residual_calls) == 4  # the fused model's, none of the unfused one's
    return outs


@pytest.mark.parametrize("fp8", [False, "delayed"])
@pytest.mark.parametrize("fused_mlp", [False, True], ids=["separate", "fused_mlp"])
def test_fp32_model_is_bit_identical(fp8, fused_mlp, residual_calls):
    (y0, g0), (y1, g1) = _compare(fp8, fused_mlp, "float32", residual_calls)
    assert torch.equal(y1, y0)
    for k, g in g0.items():
        assert g1[k] is not None and torch.equal(g1[k], g), k


@pytest.mark.parametrize("fused_mlp", [False, True], ids=["separate", "fused_mlp"])
def test_bf16_model_within_rounding(fused_mlp, residual_calls):
    (y0, g0), (y1, g1) = _compare(False, fused_mlp, "bfloat16", residual_calls)
    tol = 4 * 2 * 2.0**-8
    assert 0 < _rel(y1, y0) <= tol
    for k, g in g0.items():
        assert g1[k] is not None and _rel(g1[k], g) <= 3 * tol, k


def _train(tmp_path, name: str, fused: bool) -> list:
    sets = [
        "train.steps=4",
        "train.eval_every=4",
        f"model.fused_residual={str(fused).lower()}",
        f"out.dir={tmp_path / name}",
        f"data.cache_dir={tmp_path / 'corpus'}",
        "run.device=cpu",
    ]
    cfg = load_config(CONFIG, sets)
    assert cfg.model.fused_residual is fused
    run_dir = tmp_path / name / ("fp8" if cfg.fp8.enabled else "nofp8")
    loop.train(cfg, str(run_dir), rank=0, world_size=1, device=torch.device("cpu"), progress=False)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_training_run_gives_the_unfused_losses(group, tmp_path, residual_calls):
    base = _train(tmp_path, "base", False)
    assert residual_calls == []
    fused = _train(tmp_path, "fused", True)
    assert residual_calls  # every forward of the fused run (4 per model forward)
    assert [r["step"] for r in fused] == [r["step"] for r in base]
    checked = 0
    for a, b in zip(fused, base):
        for k in ("train_loss", "val_loss"):
            if k in b:
                assert a[k] == b[k], (a["step"], k)  # FP32 parameters: bit-identical
                checked += 1
    assert checked >= 4


@pytest.mark.parametrize(
    "sets,match",
    [
        (["model.fused_residual=1"], r"model\.fused_residual"),
        (
            ["model.fused_residual=true", "fp8.enabled=true", "train.fp8_stats_every=10"],
            r"model\.fused_residual: expected false with train\.fp8_stats_every",
        ),
    ],
)
def test_config_errors(sets, match):
    with pytest.raises(ValueError, match=match):
        load_config(CONFIG, sets)
