"""FP8 recipes: which formats to use and how to choose the scaling factors (contract C7)."""

from __future__ import annotations

import enum
import math
from dataclasses import KW_ONLY, dataclass

from . import _C


class Format(enum.Enum):
    """FP8 formats of a recipe.

    E4M3: every tensor in E4M3 (max 448). HYBRID: forward tensors (input, weight) in E4M3 and
    gradients in E5M2 (max 57344), whose wider range suits gradients' dynamic range.
    """

    E4M3 = "E4M3"
    HYBRID = "HYBRID"

    @property
    def fwd(self) -> _C.Format:
        return _C.Format.E4M3

    @property
    def bwd(self) -> _C.Format:
        return _C.Format.E4M3 if self is Format.E4M3 else _C.Format.E5M2


_ALGOS = {"max": _C.AmaxAlgo.MAX, "most_recent": _C.AmaxAlgo.MOST_RECENT}


def _check_format(value) -> None:
    if not isinstance(value, Format):
        raise ValueError(f"fp8_format: expected fp8dp.recipe.Format, got {value!r}")


MAX_MARGIN = math.log2(448.0) + 6  # = log2(448 / 2**-6) = 14.807...
"""The largest margin a recipe takes. With scale = fp8_max / amax / 2**margin, a tensor's largest
value (its amax) is cast to fp8_max / 2**margin, and forward tensors are E4M3 (max 448) in every
recipe: above this margin even the largest value falls below E4M3's smallest normal 2**-6 and
loses mantissa bits; above log2(448 / 2**-10) = 18.8 it rounds to zero, so every forward cast is
all zeros; from 128 on 2**margin overflows float32 (the scale is computed in float32) and every
scale becomes 0. (For E5M2, max 57344 and smallest normal 2**-14, the same rule gives 29.8; the
bound is the smaller of the two.)"""


def _check_margin(value) -> None:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 <= value <= MAX_MARGIN
    ):
        raise ValueError(
            f"margin: expected a finite number >= 0 and <= {MAX_MARGIN:.3f} (log2(448 / 2**-6): "
            f"a larger margin casts even a tensor's amax below E4M3's smallest normal), "
            f"got {value!r}"
        )


@dataclass(frozen=True)
class _GemmAccumulation:
    """How the FP8 GEMMs accumulate on CUDA (keyword-only fields of both recipes).

    Split accumulation promotes the tensor cores' partial sums to FP32 at intervals (exact
    FP32 accumulation); fast accumulation keeps the tensor cores' own, coarser accumulator over the
    whole reduction and runs faster. The defaults are TransformerEngine's: fast in the forward GEMM,
    split in dgrad and wgrad, whose reductions run over many tokens or a wide layer. The CPU GEMM
    always accumulates in FP32, so these change nothing there."""

    _: KW_ONLY
    split_accumulator_fprop: bool = False
    """Forward GEMM (y = x Wᵀ). Default False (fast)."""
    split_accumulator_dgrad: bool = True
    """Input-gradient GEMM (dx = dy W). Default True (split)."""
    split_accumulator_wgrad: bool = True
    """Weight-gradient GEMM (dW = dyᵀ x). Default True (split)."""

    def _check_accumulation(self):
        for name in (
            "split_accumulator_fprop",
            "split_accumulator_dgrad",
            "split_accumulator_wgrad",
        ):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name}: expected True or False, got {v!r}")

    def _accumulation_to_cpp(self, r: _C.Recipe) -> _C.Recipe:
        r.split_accumulator_fprop = self.split_accumulator_fprop
        r.split_accumulator_dgrad = self.split_accumulator_dgrad
        r.split_accumulator_wgrad = self.split_accumulator_wgrad
        return r


@dataclass(frozen=True)
class DelayedScaling(_GemmAccumulation):
    """Per-tensor delayed scaling: each tensor's scale comes from the amaxes of earlier steps.

    scale = fp8_max / amax / 2**margin, with amax taken from a history of the last
    ``amax_history_len`` steps; an amax of 0 or non-finite keeps the previous scale.
    """

    fp8_format: Format = Format.HYBRID
    """Formats of forward tensors and gradients. Default HYBRID: E5M2's range suits gradients."""
    amax_history_len: int = 1024
    """Steps of amax history. Default 1024: a long window keeps one outlier step from shrinking the
    range for long, at the price of reacting slowly when values grow."""
    amax_compute_algo: str = "max"
    """"max" (largest amax in the history, the safe choice against overflow; default) or
    "most_recent" (last step's amax, tracks changes fastest)."""
    margin: float = 0
    """Extra headroom in powers of two: the scale is divided by 2**margin. Default 0. At most
    MAX_MARGIN = log2(448 / 2**-6) = 14.807: a larger margin casts even the amax below E4M3's
    smallest normal (and from 18.8 on to zero)."""

    def __post_init__(self):
        _check_format(self.fp8_format)
        h = self.amax_history_len
        if not isinstance(h, int) or isinstance(h, bool) or h < 1:
            raise ValueError(f"amax_history_len: expected an integer >= 1, got {h!r}")
        if not isinstance(self.amax_compute_algo, str) or self.amax_compute_algo not in _ALGOS:
            raise ValueError(
                f"amax_compute_algo: expected one of {sorted(_ALGOS)}, got {self.amax_compute_algo!r}"
            )
        _check_margin(self.margin)
        self._check_accumulation()

    def to_cpp(self) -> _C.Recipe:
        r = _C.Recipe()
        r.kind = _C.RecipeKind.DELAYED
        r.fwd_format, r.bwd_format = self.fp8_format.fwd, self.fp8_format.bwd
        r.amax_history_len = self.amax_history_len
        r.amax_compute_algo = _ALGOS[self.amax_compute_algo]
        r.margin = float(self.margin)
        return self._accumulation_to_cpp(r)


@dataclass(frozen=True)
class Float8CurrentScaling(_GemmAccumulation):
    """Per-tensor current scaling: each cast first takes the amax of the tensor being cast."""

    fp8_format: Format = Format.HYBRID
    """Formats of forward tensors and gradients. Default HYBRID."""
    margin: float = 0
    """Extra headroom in powers of two. Default 0: the amax is exact, so none is needed. At most
    MAX_MARGIN = log2(448 / 2**-6) = 14.807, as for DelayedScaling."""

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_margin(self.margin)
        self._check_accumulation()

    def to_cpp(self) -> _C.Recipe:
        r = _C.Recipe()
        r.kind = _C.RecipeKind.CURRENT
        r.fwd_format, r.bwd_format = self.fp8_format.fwd, self.fp8_format.bwd
        r.amax_history_len = 1
        r.margin = float(self.margin)
        return self._accumulation_to_cpp(r)
