"""fp8_autocast: the context in which fp8dp modules run their GEMMs in FP8."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed

from . import _C
from .recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

_ProcessGroup = getattr(torch.distributed, "ProcessGroup", ())  # () where torch lacks distributed
_groups: list = []  # fp8_group of each open context, innermost last (the C++ stack holds the rest)
# The fp8_group of every enabled context entered since the last update_fp8_scales (distinct objects,
# None left out): the group that call reduces the step's amaxes across when it is given none.
_step_groups: list = []


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe=None, fp8_group=None):
    """Run fp8dp modules in FP8 inside the block. Contexts nest; the innermost one wins.

    enabled: FP8 on or off for the block (an inner ``enabled=False`` turns it off).
    fp8_recipe: a DelayedScaling, Float8CurrentScaling or Float8BlockScaling; default
        DelayedScaling().
    fp8_group: the process group across which the next ``update_fp8_scales()`` reduces (MAX) the
        delayed-scaling amaxes of the step, when it is called without a group (as
        TransformerEngine reduces across fp8_group). None: no preference (the group given to
        update_fp8_scales, else the default group). Every enabled context of one step that names
        a group must name the same ranks, since all amaxes are reduced in one collective.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool, got {enabled!r}")
    if fp8_group is not None and not isinstance(fp8_group, _ProcessGroup):
        raise ValueError(
            f"fp8_group: expected a torch.distributed.ProcessGroup or None, got {fp8_group!r}"
        )
    if fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    if not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)):
        raise ValueError(
            "fp8_recipe: expected DelayedScaling, Float8CurrentScaling or Float8BlockScaling, "
            f"got {fp8_recipe!r}"
        )
    _C.autocast_enter(enabled, fp8_recipe.to_cpp())
    _groups.append(fp8_group)
    if enabled and fp8_group is not None and not any(g is fp8_group for g in _step_groups):
        _step_groups.append(fp8_group)
    try:
        yield
    finally:
        _groups.pop()
        _C.autocast_exit()


def is_fp8_enabled() -> bool:
    """True inside an enabled fp8_autocast (the innermost context decides)."""
    return bool(_C.autocast_current().enabled)


def current_fp8_group():
    """fp8_group of the innermost open fp8_autocast, or None."""
    return _groups[-1] if _groups else None


def take_step_fp8_groups() -> list:
    """The distinct fp8_group of the enabled contexts entered since the last call (update_fp8_scales
    calls it once per step), and forget them."""
    groups = list(_step_groups)
    _step_groups.clear()
    return groups
