"""fp8_autocast: the context in which fp8dp modules run their GEMMs in FP8."""

from __future__ import annotations

import contextlib

from . import _C
from .recipe import DelayedScaling, Float8CurrentScaling

_groups: list = []  # fp8_group of each open context, innermost last (the C++ stack holds the rest)


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe=None, fp8_group=None):
    """Run fp8dp modules in FP8 inside the block. Contexts nest; the innermost one wins.

    enabled: FP8 on or off for the block (an inner ``enabled=False`` turns it off).
    fp8_recipe: a DelayedScaling or Float8CurrentScaling; default DelayedScaling().
    fp8_group: process group across which delayed-scaling amaxes are reduced (MAX) once per step;
        None means the default group when torch.distributed is initialised.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool, got {enabled!r}")
    if fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    if not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling)):
        raise ValueError(
            f"fp8_recipe: expected DelayedScaling or Float8CurrentScaling, got {fp8_recipe!r}"
        )
    _C.autocast_enter(enabled, fp8_recipe.to_cpp())
    _groups.append(fp8_group)
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
