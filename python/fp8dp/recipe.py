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
    override_linear_precision: tuple = (False, False, False)
    """(fprop, dgrad, wgrad): which GEMMs of each Linear / LayerNormLinear run in the parameters'
    precision on the unquantized operands instead of FP8 (TransformerEngine's field; it takes
    only (False, False, True), fp8dp any combination: for finding which GEMM costs accuracy).
    Default (False, False, False): all three in FP8. Each one in high precision runs at the
    parameters' GEMM speed; a high-precision wgrad keeps the input in its own precision for
    backward instead of FP8 (twice the bytes for BF16), a high-precision dgrad the weight. The
    casts still run and record their amaxes. fp8dp.LayerNormMLP refuses any override."""

    def _check_accumulation(self):
        for name in (
            "split_accumulator_fprop",
            "split_accumulator_dgrad",
            "split_accumulator_wgrad",
        ):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name}: expected True or False, got {v!r}")
        v = self.override_linear_precision
        if not (isinstance(v, tuple) and len(v) == 3 and all(isinstance(b, bool) for b in v)):
            raise ValueError(
                "override_linear_precision: expected a tuple of three bools (fprop, dgrad, "
                f"wgrad: True runs that GEMM in high precision), got {v!r}"
            )

    def _accumulation_to_cpp(self, r: _C.Recipe) -> _C.Recipe:
        r.split_accumulator_fprop = self.split_accumulator_fprop
        r.split_accumulator_dgrad = self.split_accumulator_dgrad
        r.split_accumulator_wgrad = self.split_accumulator_wgrad
        fprop, dgrad, wgrad = self.override_linear_precision
        r.fprop_high_precision, r.dgrad_high_precision = fprop, dgrad
        r.wgrad_high_precision = wgrad
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


@dataclass(frozen=True)
class QParams:
    """How a Float8BlockScaling cast turns a tile's amax into its scale (TransformerEngine's
    QParams): scale = fp8_max / max(amax, amax_epsilon), rounded down to a power of two when
    ``power_2_scale``; a tile whose amax (after the epsilon) is 0 or not finite gets scale 1."""

    power_2_scale: bool = True
    """Round each scale down to a power of two (TransformerEngine's default). Default True: then
    scaling and unscaling are exact (only the FP8 rounding remains), at the price of up to one bit
    of the FP8 range left unused."""
    amax_epsilon: float = 0.0
    """Floor for a tile's amax before the scale is computed. Default 0.0 (none): a tiny but
    non-zero tile is scaled up to the full FP8 range; a floor caps that scale at
    fp8_max / amax_epsilon."""

    def __post_init__(self):
        if not isinstance(self.power_2_scale, bool):
            raise ValueError(f"power_2_scale: expected True or False, got {self.power_2_scale!r}")
        e = self.amax_epsilon
        if (
            not isinstance(e, (int, float))
            or isinstance(e, bool)
            or not math.isfinite(e)
            or e < 0
            or e > 3.4028234663852886e38
        ):
            raise ValueError(
                f"amax_epsilon: expected a finite number >= 0 (that fits in float32), got {e!r}"
            )

    def _to_cpp(self) -> _C.BlockQParams:
        q = _C.BlockQParams()
        q.power_2_scale = self.power_2_scale
        q.amax_epsilon = float(self.amax_epsilon)
        return q


_BLOCK_DIMS = {"x_block_scaling_dim": 1, "w_block_scaling_dim": 2, "grad_block_scaling_dim": 1}


@dataclass(frozen=True)
class Float8BlockScaling:
    """DeepSeek-V3-style block scaling (TransformerEngine's Float8BlockScaling): one FP32 scale per
    1x128 tile of activations and output gradients (along the GEMM's reduction dimension) and per
    128x128 block of weights, each from that tile's own amax at the cast. One outlier then costs
    the precision of its own tile only, not of the whole tensor. No amax history, no scaling
    state, nothing for update_fp8_scales to do.

    The wgrad GEMM reduces over the tokens, so the transposes of the input and of grad_output are
    re-cast from the high-precision tensors in 1x128 tiles along the tokens (a 1x128 tile of x is
    not one of xᵀ); a weight's 128x128 blocks serve both orientations. Shapes: a last tile shorter
    than 128 is scaled from its own elements (what a zero-padded tile would get), so any shape the
    per-tensor recipes take (multiples of 16) is taken here too.
    """

    fp8_format: Format = Format.E4M3
    """Formats. Default E4M3 for every tensor (TransformerEngine's default for this recipe): with a
    scale per tile, gradients need E5M2's range less than its extra mantissa bit. HYBRID keeps
    E5M2 for grad_output."""
    fp8_quant_fwd_inp: QParams = QParams()
    """Scale rule of the input's tiles. Default QParams(): power-of-two scales, no epsilon."""
    fp8_quant_fwd_weight: QParams = QParams()
    """Scale rule of the weight's blocks. Default QParams()."""
    fp8_quant_bwd_grad: QParams = QParams()
    """Scale rule of grad_output's tiles. Default QParams()."""
    x_block_scaling_dim: int = 1
    """1: the input in 1x128 tiles (the only layout supported: cuBLASLt's VEC128 mode)."""
    w_block_scaling_dim: int = 2
    """2: the weight in 128x128 blocks (the only layout supported: cuBLASLt's BLK128x128 mode)."""
    grad_block_scaling_dim: int = 1
    """1: grad_output in 1x128 tiles (the only layout supported)."""

    def __post_init__(self):
        _check_format(self.fp8_format)
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            v = getattr(self, name)
            if not isinstance(v, QParams):
                raise ValueError(f"{name}: expected fp8dp.recipe.QParams, got {v!r}")
        for name, want in _BLOCK_DIMS.items():
            v = getattr(self, name)
            if v != want or isinstance(v, bool):
                layout = "1x128 tiles" if want == 1 else "128x128 blocks"
                raise ValueError(
                    f"{name}: only {want} is supported ({layout}, the layout cuBLASLt's "
                    f"block-scaled GEMMs take for this tensor), got {v!r}"
                )

    def to_cpp(self) -> _C.Recipe:
        r = _C.Recipe()
        r.kind = _C.RecipeKind.BLOCK
        r.fwd_format, r.bwd_format = self.fp8_format.fwd, self.fp8_format.bwd
        r.amax_history_len = 1
        r.margin = 0.0
        # The block-scaled GEMMs scale every 128-wide K chunk's partial sum in FP32 anyway; TE's
        # Float8BlockScaling splits the accumulator in all three GEMMs, and so does this.
        r.split_accumulator_fprop = r.split_accumulator_dgrad = r.split_accumulator_wgrad = True
        r.block_inp = self.fp8_quant_fwd_inp._to_cpp()
        r.block_weight = self.fp8_quant_fwd_weight._to_cpp()
        r.block_grad = self.fp8_quant_bwd_grad._to_cpp()
        return r
