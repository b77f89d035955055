"""model.fused_mlp: each block's MLP as one fp8dp.LayerNormMLP instead of LayerNormLinear, torch's
GELU and Linear (the 342M model with the library's fused module, for the step's GELU time).

- The same initial weights, bit for bit, under the new names (blocks.N.mlp.fc1 / .fc2).
- The same model: logits and every parameter's gradient against the separate model's, FP8 off
  and under FP8 delayed scaling (CPU emulation), within the tolerances derived below.
- A short training run (delayed weight gradients, fused main_grad accumulation, DDP, ZeRO-1:
  the demo loop) follows the separate model's run.
- Config errors name model.fused_mlp: with the FP8 probe, and with fp8.exclude naming one of
  up / down.

Mutations (2026-12-05, restored): Block ignoring model.fused_mlp (separate modules always):
test_same_initial_weights failed (no LayerNormMLP); fc2's init from `std` instead of `out_std`:
test_same_initial_weights, the two model comparisons and the training run failed.
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


def _model(fused: bool, seed: int = 5) -> GPT:
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=4, seq_len=32, fused_mlp=fused)
    torch.manual_seed(seed)
    return GPT(cfg, False, False, torch.device("cpu"))


def _renamed(name: str) -> str:
    return name.replace(".mlp.fc1.", ".up.").replace(".mlp.fc2.", ".down.")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_same_initial_weights():
    sep, fused = _model(False), _model(True)
    assert all(isinstance(b.mlp, fp8dp.LayerNormMLP) for b in fused.blocks)
    want = dict(sep.state_dict())
    got = {_renamed(k): v for k, v in fused.state_dict().items()}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert torch.equal(got[k], v), k


@pytest.mark.parametrize("fp8", [False, "delayed", "block"])
def test_fused_model_computes_the_separate_model(fp8):
    """Tolerances. FP8 off (FP32): the two GELUs (torch's and fp8dp's activation_math.h, which
    builds erf from IEEE-rounded operations) differ by a few FP32 ulps, carried through two
    layers: relative 1e-5. FP8 delayed (first step: scales from the current amax): a GELU output
    one ulp apart can round to the neighbouring E4M3 value (a step of up to 2^-3 of it); a few of
    the 32,768 MLP activations do, which moves the norm-wise result by far less than 1e-3. Block
    scaling the same (its tiles' scales come from their own amax, which one ulp rarely moves)."""
    sep, fused = _model(False), _model(True)
    tokens = torch.randint(0, 256, (32, 4), generator=torch.Generator().manual_seed(1))
    recipe = (
        fp8dp.Float8BlockScaling()
        if fp8 == "block"
        else fp8dp.DelayedScaling(fp8_format=fp8dp.Format.HYBRID)
    )
    outs = []
    for m in (sep, fused):
        with fp8dp.fp8_autocast(enabled=bool(fp8), fp8_recipe=recipe):
            y = m(tokens)
        y.float().square().mean().backward()
        outs.append((y.detach(), {_renamed(k): p.grad for k, p in m.named_parameters()}))
    tol = 1e-3 if fp8 else 1e-5
    assert _rel(outs[1][0], outs[0][0]) <= tol
    for k, g in outs[0][1].items():
        assert outs[1][1][k] is not None, k
        assert _rel(outs[1][1][k], g) <= tol * 10, k  # gradients: one more GEMM deep


def _train(tmp_path, name: str, fused: bool) -> list:
    sets = [
        "train.steps=4",
        "train.eval_every=4",
        f"model.fused_mlp={str(fused).lower()}",
        f"out.dir={tmp_path / name}",
        f"data.cache_dir={tmp_path / 'corpus'}",
        "run.device=cpu",
    ]
    cfg = load_config(CONFIG, sets)
    run_dir = tmp_path / name / ("fp8" if cfg.fp8.enabled else "nofp8")
    loop.train(cfg, str(run_dir), rank=0, world_size=1, device=torch.device("cpu"), progress=False)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_training_run_follows_the_separate_model(group, tmp_path):
    """The demo loop (delayed weight gradients through fp8_modules(), which now finds the fused
    module's fc1 and fc2; DDP; ZeRO-1) over four steps: losses within 1e-3 relative, as the FP8
    forward above (the steps' updates are small against the weights, so the gap grows little)."""
    sep, fused = _train(tmp_path, "sep", False), _train(tmp_path, "fused", True)
    assert [r["step"] for r in fused] == [r["step"] for r in sep]
    for a, b in zip(fused, sep):
        for k in ("train_loss", "val_loss"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-3), (a["step"], k)


def test_the_torch_baseline_starts_from_the_fused_models_weights():
    """fp8dp.train.torch_ref (the plain-torch DDP run that FP8 off must follow) copies its weights
    from an fp8dp GPT of the same seed; with model.fused_mlp, the config's default for the 342M
    run, those carry the fused module's names. The copy holds the fused model's weights exactly.
    Mutation: building the copy from cfg.model as given fails the strict load (unexpected keys
    blocks.N.mlp.fc1.*)."""
    from fp8dp.train.torch_ref import build_like_fp8dp

    cfg = load_config(CONFIG, ["model.fused_mlp=true", "model.params_dtype=bfloat16"])
    torch.manual_seed(cfg.train.seed)
    fused = GPT(cfg.model, False, False, torch.device("cpu"))
    want = {
        _renamed(k): v.float()
        for k, v in fused.state_dict().items()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    }
    got = build_like_fp8dp(cfg, torch.device("cpu")).state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize(
    "sets, match",
    [
        (["train.fp8_stats_every=10"], r"model\.fused_mlp: expected false with train\.fp8_stats"),
        (["fp8.exclude=[up]"], r"model\.fused_mlp: expected fp8\.exclude to name both"),
    ],
)
def test_config_errors_name_the_key(sets, match):
    with pytest.raises(ValueError, match=match):
        load_config(CONFIG, ["model.fused_mlp=true", "fp8.enabled=true"] + sets)
