"""Recipes (validated dataclasses) and fp8_autocast (a nestable context whose state C++ reads)."""

import dataclasses
import math
import re

import pytest
import torch
import torch.distributed as dist

import fp8dp
from fp8dp import _C, recipe
from fp8dp.autocast import current_fp8_group, take_step_fp8_groups


@pytest.fixture(autouse=True)
def no_open_autocast():
    """Every test starts and ends outside any fp8_autocast (the stack is process-wide)."""
    assert _C.autocast_depth() == 0
    yield
    assert _C.autocast_depth() == 0
    take_step_fp8_groups()  # no fp8_group recorded here reaches another test's update


# ---- recipes ----


def test_delayed_scaling_defaults_and_cpp_form():
    r = recipe.DelayedScaling()
    assert (r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.margin) == (
        recipe.Format.HYBRID,
        1024,
        "max",
        0,
    )
    c = r.to_cpp()
    assert c.kind == _C.RecipeKind.DELAYED
    assert (c.fwd_format, c.bwd_format) == (_C.Format.E4M3, _C.Format.E5M2)
    assert c.amax_history_len == 1024 and c.amax_compute_algo == _C.AmaxAlgo.MAX


def test_formats_map_forward_and_backward():
    assert (recipe.Format.E4M3.fwd, recipe.Format.E4M3.bwd) == (_C.Format.E4M3, _C.Format.E4M3)
    assert (recipe.Format.HYBRID.fwd, recipe.Format.HYBRID.bwd) == (_C.Format.E4M3, _C.Format.E5M2)


def test_current_scaling_cpp_form():
    c = recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3, margin=1.5).to_cpp()
    assert c.kind == _C.RecipeKind.CURRENT
    assert (c.fwd_format, c.bwd_format, c.margin) == (_C.Format.E4M3, _C.Format.E4M3, 1.5)


def test_most_recent_algo_maps():
    r = recipe.DelayedScaling(amax_compute_algo="most_recent", amax_history_len=1)
    assert r.to_cpp().amax_compute_algo == _C.AmaxAlgo.MOST_RECENT


def test_recipes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.DelayedScaling().margin = 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"amax_history_len": -3}, "amax_history_len"),
        ({"amax_history_len": 2.5}, "amax_history_len"),
        ({"amax_history_len": True}, "amax_history_len"),
        ({"amax_history_len": "16"}, "amax_history_len"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
        ({"amax_compute_algo": None}, "amax_compute_algo"),
        ({"amax_compute_algo": ["max"]}, "amax_compute_algo"),
        ({"margin": -1}, "margin"),
        ({"margin": math.nan}, "margin"),
        ({"margin": math.inf}, "margin"),
        ({"margin": "1"}, "margin"),
        ({"fp8_format": "HYBRID"}, "fp8_format"),
        ({"fp8_format": None}, "fp8_format"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) else v,
)
def test_delayed_scaling_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        recipe.DelayedScaling(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"margin": -0.5}, "margin"), ({"fp8_format": "E5M2"}, "fp8_format")],
    ids=["negative-margin", "unknown-format"],
)
def test_current_scaling_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        recipe.Float8CurrentScaling(**kwargs)


ACCUMULATION = ("split_accumulator_fprop", "split_accumulator_dgrad", "split_accumulator_wgrad")


@pytest.mark.parametrize("cls", [recipe.DelayedScaling, recipe.Float8CurrentScaling])
def test_gemm_accumulation_defaults_and_cpp_form(cls):
    """TransformerEngine's defaults (fast fprop, split dgrad / wgrad), and each flag reaches the C++
    recipe on its own (a swapped or dropped field shows as a wrong tuple)."""
    assert tuple(getattr(cls(), f) for f in ACCUMULATION) == (False, True, True)
    assert tuple(getattr(cls().to_cpp(), f) for f in ACCUMULATION) == (False, True, True)
    for i, field in enumerate(ACCUMULATION):
        flipped = [False, True, True]
        flipped[i] = not flipped[i]
        c = cls(**{field: flipped[i]}).to_cpp()
        assert tuple(getattr(c, f) for f in ACCUMULATION) == tuple(flipped), field
    with fp8dp.fp8_autocast(fp8_recipe=cls(split_accumulator_wgrad=False)):
        assert _C.autocast_current().recipe.split_accumulator_wgrad is False


@pytest.mark.parametrize("cls", [recipe.DelayedScaling, recipe.Float8CurrentScaling])
@pytest.mark.parametrize("field", ACCUMULATION)
@pytest.mark.parametrize("value", [1, 0, "True", None])
def test_gemm_accumulation_validation_names_the_field(cls, field, value):
    with pytest.raises(ValueError, match=f"^{field}: expected True or False, got {value!r}$"):
        cls(**{field: value})


def test_gemm_accumulation_is_keyword_only():
    """The flags come after the existing fields for keyword use only: positional arguments keep
    their meaning (fp8_format, amax_history_len, ...)."""
    r = recipe.DelayedScaling(recipe.Format.E4M3, 16, "most_recent", 1)
    assert (r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.margin) == (
        recipe.Format.E4M3,
        16,
        "most_recent",
        1,
    )
    assert recipe.Float8CurrentScaling(recipe.Format.E4M3, 2).margin == 2
    with pytest.raises(TypeError):
        recipe.DelayedScaling(recipe.Format.E4M3, 16, "max", 0, True)


@pytest.mark.parametrize("cls", [recipe.DelayedScaling, recipe.Float8CurrentScaling])
@pytest.mark.parametrize("margin", [2000, 128, 18.9, recipe.MAX_MARGIN + 1e-9])
def test_margin_above_the_bound_is_refused(cls, margin):
    """margin=2000 was accepted and failed only at the first cast (input checks before state):
    2**margin overflows float32, the scale becomes 0 and quantize refuses it.

    Evidence (2026-12-01, then restored): with `or not 0 <= value <= MAX_MARGIN` in
    recipe._check_margin put back to `or value < 0`, all 8 cases fail with
    `Failed: DID NOT RAISE <class 'ValueError'>`."""
    message = (
        r"^margin: expected a finite number >= 0 and <= 14\.807 "
        r"\(log2\(448 / 2\*\*-6\).*\), got " + re.escape(repr(margin)) + "$"
    )
    with pytest.raises(ValueError, match=message):
        cls(margin=margin)


@pytest.mark.parametrize("cls", [recipe.DelayedScaling, recipe.Float8CurrentScaling])
def test_margin_up_to_the_bound_is_taken(cls):
    for m in (0, 1, 14, recipe.MAX_MARGIN):
        assert cls(margin=m).to_cpp().margin == pytest.approx(m)


def _cast_at_margin(margin, amax=3.0):
    """Delayed scaling's update for one amax, then the E4M3 cast and back of [amax, amax / 3]."""
    history = torch.tensor([[amax]])
    scale, scale_inv = torch.ones(1), torch.ones(1)
    _C.update_scaling(history, scale, scale_inv, torch.tensor([448.0]), _C.AmaxAlgo.MAX, margin)
    q = _C.quantize(torch.tensor([amax, amax / 3]), scale, _C.Format.E4M3)
    return scale.item(), _C.dequantize(q.data, q.scale_inv, torch.float32)


def test_margin_bound_is_where_the_amax_leaves_e4m3s_normals():
    """The reason for MAX_MARGIN = log2(448 / 2**-6), checked on the kernels: at the bound the
    amax lands on E4M3's smallest normal and comes back exactly; past log2(448 / 2**-10) = 18.8
    it rounds to 0 (the whole tensor is zeros); from 128 on the scale itself is 0."""
    _, back = _cast_at_margin(recipe.MAX_MARGIN)
    assert back[0].item() == pytest.approx(3.0, rel=1e-6) and back[1].item() != 0.0
    _, back = _cast_at_margin(18.9)
    assert back.abs().max().item() == 0.0
    history, scale, scale_inv = torch.tensor([[3.0]]), torch.ones(1), torch.ones(1)
    _C.update_scaling(history, scale, scale_inv, torch.tensor([448.0]), _C.AmaxAlgo.MAX, 128.0)
    assert scale.item() == 0.0


# ---- fp8_autocast ----


def _current():
    s = _C.autocast_current()
    return s.enabled, s.recipe.amax_history_len


def test_outside_any_context_fp8_is_off():
    assert not fp8dp.is_fp8_enabled()
    assert current_fp8_group() is None


def test_default_recipe_is_delayed_scaling():
    with fp8dp.fp8_autocast():
        s = _C.autocast_current()
        assert s.enabled and s.recipe.kind == _C.RecipeKind.DELAYED
        assert s.recipe.amax_history_len == recipe.DelayedScaling().amax_history_len


@pytest.mark.parametrize("outer, inner", [(True, False), (False, True), (True, True)])
def test_nesting_inner_wins_and_exit_restores_outer(outer, inner):
    r_out, r_in = recipe.DelayedScaling(amax_history_len=8), recipe.DelayedScaling(
        amax_history_len=3
    )
    # Groups that no collective ever runs on: only their identity matters here.
    g_out, g_in = (dist.ProcessGroup(dist.HashStore(), 0, 1) for _ in range(2))
    with fp8dp.fp8_autocast(enabled=outer, fp8_recipe=r_out, fp8_group=g_out):
        assert _current() == (outer, 8)
        with fp8dp.fp8_autocast(enabled=inner, fp8_recipe=r_in, fp8_group=g_in):
            assert _current() == (inner, 3)
            assert fp8dp.is_fp8_enabled() is inner
            assert current_fp8_group() is g_in
            assert _C.autocast_depth() == 2
        assert _current() == (outer, 8)
        assert current_fp8_group() is g_out
    assert not fp8dp.is_fp8_enabled()
    # What the next update_fp8_scales() reduces across: the groups of the enabled contexts.
    assert take_step_fp8_groups() == [g for g, on in ((g_out, outer), (g_in, inner)) if on]
    assert take_step_fp8_groups() == []


def test_fp8_group_must_be_a_process_group():
    with pytest.raises(ValueError, match="fp8_group: expected a torch.distributed.ProcessGroup"):
        with fp8dp.fp8_autocast(fp8_group="world"):
            pass
    assert _C.autocast_depth() == 0


def test_exception_inside_restores_the_outer_state():
    with fp8dp.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(amax_history_len=5)):
        with pytest.raises(RuntimeError, match="boom"):
            with fp8dp.fp8_autocast(enabled=False):
                assert not fp8dp.is_fp8_enabled()
                raise RuntimeError("boom")
        assert _current() == (True, 5)
        assert _C.autocast_depth() == 1
    assert _C.autocast_depth() == 0


def test_current_scaling_recipe_in_autocast():
    with fp8dp.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        assert _C.autocast_current().recipe.kind == _C.RecipeKind.CURRENT


@pytest.mark.parametrize(
    "kwargs, field",
    [({"enabled": "yes"}, "enabled"), ({"fp8_recipe": object()}, "fp8_recipe")],
    ids=["enabled-not-bool", "recipe-wrong-type"],
)
def test_autocast_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        with fp8dp.fp8_autocast(**kwargs):
            pass
