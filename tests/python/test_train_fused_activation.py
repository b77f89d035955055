"""model.fused_activation: the separate MLP's GELU applied by its up projection
(``LayerNormLinear(activation="gelu")``, true or "up") or by its down projection to its input
(``Linear(input_activation="gelu")``, "down") instead of torch's GELU between them.

- The same parameters (names and initial values) as without it; up or down carries the activation
  exactly where the setting puts it (so a Block that ignored the setting fails
  test_projection_applies_the_gelu, and the model comparison below would compare a model with
  itself).
- The same model, FP8 off, FP32 parameters: logits and every gradient against the unfused model.
  The two differ only in the GELU's arithmetic: fp8dp's (activation_math.h: erf within 2e-7
  absolute, so gelu(u) within 1e-7 |u|, plus a few FP32 roundings) against torch's (its libm erf,
  within an ulp or two), so each GELU output differs by at most about 1e-7 |u| + 4 2^-24 |gelu(u)|,
  under 1e-6 relative to the MLP's activations; the tolerance, 1e-5 normwise, allows ten times
  that for the layers after it (norms and residual stream carry a perturbation through at about
  unit gain). The layer-level bits (FP8 included) are test_linear_activation.py's.
- The FP8 forward and backward of the fused model run (delayed scaling; every gradient finite and
  of the unfused model's magnitude within the FP8 casts' error, 2^-3 normwise: a GELU output that
  differs in its last bits may round to the neighbouring E4M3 value).
  Measured 2026-12-06 ("up"): FP8 off 2.2e-7 (logits), 4.5e-7 (worst gradient); FP8 delayed 0
  and 1.9e-7.
- Config errors name model.fused_activation.

Mutations (restored): Block ignoring model.fused_activation (up without activation, and F.gelu
after it; 2026-12-06): test_up_applies_the_gelu failed; Block treating "down" as "torch" (F.gelu
and a plain down; 2026-12-07): test_projection_applies_the_gelu["down"] fails.
"""

from pathlib import Path

import pytest
import torch

import fp8dp
from fp8dp.train.config import ModelConfig, load_config
from fp8dp.train.model import GPT

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "ci_convergence.yaml")


PLACES = [True, "up", "down"]  # model.fused_activation's settings other than false


def _model(fused_activation, seed: int = 5) -> GPT:
    cfg = ModelConfig(
        n_layer=2, d_model=64, n_head=4, seq_len=32, fused_activation=fused_activation
    )
    torch.manual_seed(seed)
    return GPT(cfg, False, False, torch.device("cpu"))


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("place", PLACES)
def test_same_parameters(place):
    sa, sb = _model(False).state_dict(), _model(place).state_dict()
    assert sorted(sa) == sorted(sb)
    for k, v in sa.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert torch.equal(sb[k], v), k


@pytest.mark.parametrize("place", [False] + PLACES)
def test_projection_applies_the_gelu(place):
    up = place in (True, "up")
    for blk in _model(place).blocks:
        assert blk.up.activation == ("gelu" if up else None)
        assert blk.down.input_activation == ("gelu" if place == "down" else None)


def _run(fused, fp8: bool):
    tokens = torch.randint(0, 256, (32, 4), generator=torch.Generator().manual_seed(1))
    m = _model(fused)
    recipe = fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID)
    with fp8dp.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
        y = m(tokens)
    y.float().square().mean().backward()
    return y.detach(), {k: p.grad for k, p in m.named_parameters()}


@pytest.mark.parametrize("place", PLACES)
def test_same_model_without_fp8(place):
    (y0, g0), (y1, g1) = _run(False, False), _run(place, False)
    assert _rel(y1, y0) <= 1e-5
    for k, g in g0.items():
        assert g1[k] is not None and _rel(g1[k], g) <= 1e-5, k


@pytest.mark.parametrize("place", PLACES)
def test_fp8_step(place):
    (y0, g0), (y1, g1) = _run(False, True), _run(place, True)
    assert _rel(y1, y0) <= 2.0**-3
    for k, g in g0.items():
        assert g1[k] is not None and bool(torch.isfinite(g1[k]).all()), k
        assert _rel(g1[k], g) <= 2.0**-3, k


@pytest.mark.parametrize(
    "sets,match",
    [
        (["model.fused_activation=1"], r"model\.fused_activation"),
        (
            ["model.fused_activation=sideways"],
            r"model\.fused_activation: expected false, true, 'up' or 'down', got 'sideways'",
        ),
        (
            ["model.fused_activation=down", "model.fused_mlp=true"],
            r"model\.fused_activation: expected false with model\.fused_mlp .* got 'down'",
        ),
        (
            ["model.fused_activation=down", "fp8.enabled=true", "train.fp8_stats_every=10"],
            r"model\.fused_activation: expected false with train\.fp8_stats_every",
        ),
        (
            ["model.fused_activation=true", "model.fused_mlp=true"],
            r"model\.fused_activation: expected false with model\.fused_mlp",
        ),
        (
            ["model.fused_activation=true", "fp8.enabled=true", "train.fp8_stats_every=10"],
            r"model\.fused_activation: expected false with train\.fp8_stats_every",
        ),
    ],
)
def test_config_errors(sets, match):
    with pytest.raises(ValueError, match=match):
        load_config(CONFIG, sets)
