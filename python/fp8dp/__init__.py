"""fp8dp: FP8 layers and data-parallel gradient buffers for PyTorch training loops."""

import torch  # noqa: F401  (loads libtorch before the extension that links against it)

from . import _extension  # noqa: F401  (first: imports _C, or says why it cannot)

# isort: split
from . import _C, pipeline, recipe
from .autocast import fp8_autocast, is_fp8_enabled
from .ddp import DistributedDataParallel
from .ddp_config import DistributedDataParallelConfig
from .graph import make_graphed_callables
from .mlp import LayerNormMLP, activation
from .modules import LayerNormLinear, Linear
from .optimizer import DistributedOptimizer
from .recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format
from .scaling import update_fp8_scales

__version__ = "0.1.0"


def build_info() -> dict:
    """What this build was compiled with: fp8dp and torch versions, CUDA on/off and, when built with
    CUDA, the CUDA runtime, cuBLASLt and NCCL versions loaded at run time."""
    return dict(_C.build_info())


def cuda_available(return_reason: bool = False):
    """True when this build has CUDA and torch sees a GPU; with return_reason, (ok, reason)."""
    if not _C.build_info()["cuda"]:
        ok, reason = False, "fp8dp was built without CUDA"
    elif not torch.cuda.is_available():
        ok, reason = False, "torch sees no CUDA device"
    else:
        ok, reason = True, ""
    return (ok, reason) if return_reason else ok


__all__ = [
    "DelayedScaling",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "DistributedOptimizer",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "activation",
    "build_info",
    "cuda_available",
    "fp8_autocast",
    "is_fp8_enabled",
    "make_graphed_callables",
    "pipeline",
    "recipe",
    "update_fp8_scales",
]
