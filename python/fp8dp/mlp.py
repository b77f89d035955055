"""fp8dp.LayerNormMLP: norm -> fc1 -> activation -> fc2 in one autograd function.

The module owns two child modules, ``fc1`` (an ``fp8dp.LayerNormLinear``: the norm's parameters
``fc1.layer_norm_weight`` / ``fc1.layer_norm_bias``, ``fc1.weight``, ``fc1.bias``) and ``fc2`` (an
``fp8dp.Linear``). Its forward does not call them: it runs one C++ autograd function
(``_C.LayerNormMLPCore``, src/modules/layernorm_mlp*.cpp) over their parameters and their C++
cores, which fuses the activation with the FP8 cast of fc2's input and, in backward, the
activation's derivative with the FP8 cast of fc1's grad_output. Because the GEMMs stay the
children's, everything that holds for a Linear / LayerNormLinear holds for each of them as is:
its own FP8 scaling state, weight cache, delayed-wgrad queue, fused ``main_grad`` accumulation,
the guarded bias backfill (C4), DistributedDataParallel's binding and ledger, pipeline W steps
(which call ``fc1.backward_dw()`` / ``fc2.backward_dw()``), agreement and the state dict.

Calling ``mlp.fc2(act(mlp.fc1(x)))`` with ``fp8dp.activation`` gives the same bytes (the unfused
composition; see tests/python/test_layernorm_mlp.py).
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch

from . import _C
from .modules import (
    LayerNormLinear,
    Linear,
    _check_activation,
    _check_bool,
    _check_features,
    _check_residual,
)


class _Activation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, activation):
        ctx.activation = activation
        ctx.save_for_backward(h)
        return _C.activation_forward(h, activation)

    @staticmethod
    def backward(ctx, da):
        (h,) = ctx.saved_tensors
        return _C.activation_backward(da.contiguous(), h, ctx.activation), None


def activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """LayerNormMLP's activation on its own, differentiable: ``gelu`` (the exact, erf form, as
    ``torch.nn.functional.gelu``) maps [..., n] to [..., n]; ``swiglu`` maps [..., 2 n] =
    [gate | up] to ``silu(gate) * up`` [..., n]. Computed in FP32 and rounded once to h's dtype,
    with the math that LayerNormMLP's fused kernels use (src/fp8/activation_math.h)."""
    _check_activation(activation)
    if not isinstance(h, torch.Tensor):
        raise ValueError(f"h: expected a torch.Tensor, got {type(h).__name__}")
    if h.dim() < 1:
        raise ValueError(f"h: expected at least 1 dimension, got shape {tuple(h.shape)}")
    h2 = h.reshape(-1, h.shape[-1])
    out = _Activation.apply(h2, activation)
    return out.view(*h.shape[:-1], out.shape[-1])


class LayerNormMLP(torch.nn.Module):
    """fc2(act(fc1(norm(x)))) with FP8 GEMMs inside ``fp8dp.fp8_autocast``.

    hidden_size: input and output size; FP8 needs it (and ffn_hidden_size, and the token count) to
        be a multiple of 16.
    ffn_hidden_size: the activation's width. fc1 has ffn_hidden_size outputs for ``gelu`` and
        2 * ffn_hidden_size for ``swiglu`` (gate, then up: ``silu(gate) * up``).
    bias: biases on fc1 and fc2 (initialised to zero). Default True; a Llama-style SwiGLU block is
        ``activation="swiglu", normalization="RMSNorm", bias=False``. A SwiGLU fc1 bias has
        2 * ffn_hidden_size entries (gate and up), as in TransformerEngine.
    activation: "gelu" (exact erf form, torch.nn.functional.gelu's default) or "swiglu".
    normalization, eps, zero_centered_gamma: as in fp8dp.LayerNormLinear.
    params_dtype, device, fuse_wgrad_accumulation, delay_wgrad_compute: as in fp8dp.Linear, for
        both GEMMs; ``backward_dw()`` runs both queued weight gradients (fc2's, then fc1's).
    init_method: callable(weight) for fc1's weight; output_layer_init_method for fc2's (default
        init_method); None: torch.nn.Linear's default.
    """

    # forward reads fc1's and fc2's parameters without running their forwards, so
    # DistributedDataParallel's wait for their all-gather (overlap_param_gather) must run before
    # this module's forward too (ddp.py, _install_param_gather_waits).
    _reads_child_parameters = True

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        init_method: Optional[Callable[[torch.Tensor], None]] = None,
        output_layer_init_method: Optional[Callable[[torch.Tensor], None]] = None,
    ):
        super().__init__()
        _check_features("hidden_size", hidden_size)
        _check_features("ffn_hidden_size", ffn_hidden_size)
        _check_activation(activation)
        _check_bool("bias", bias)
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.normalization = normalization
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.delay_wgrad_compute = delay_wgrad_compute
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        common = dict(
            bias=bias,
            params_dtype=params_dtype,
            device=device,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
        )
        self.fc1 = LayerNormLinear(
            hidden_size,
            fc1_out,
            init_method=init_method,
            normalization=normalization,
            eps=eps,
            zero_centered_gamma=zero_centered_gamma,
            **common,
        )
        self.fc2 = Linear(
            ffn_hidden_size,
            hidden_size,
            init_method=output_layer_init_method or init_method,
            **common,
        )
        self._make_core()

    def _make_core(self) -> None:
        name = (
            f"LayerNormMLP(hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation})"
        )
        self._core = _C.LayerNormMLPCore(
            name=name,
            activation=self.activation,
            ffn_hidden_size=self.ffn_hidden_size,
            fc1=self.fc1._core,
            fc2=self.fc2._core,
        )

    def __deepcopy__(self, memo):
        """A copy whose core runs the copied children's cores (each copied with its FP8 state)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k != "_core":
                new.__dict__[k] = copy.deepcopy(v, memo)
        new._make_core()
        return new

    def forward(
        self,
        x: torch.Tensor,
        is_first_microbatch: Optional[bool] = None,
        residual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x: [..., hidden_size]; returns [..., hidden_size]. is_first_microbatch as in
        fp8dp.Linear, for both FP8 weight caches. residual: None, or a tensor of the output's
        shape, dtype and device (a transformer block's ``x``): returns ``mlp(x) + residual``, added
        in fc2's GEMM epilogue as in fp8dp.Linear. With ``residual=x`` (the very tensor, as a
        pre-norm block passes it) its gradient is added to x's inside the norm's backward, rounded
        once, instead of in autograd's separate add."""
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise ValueError(
                f"is_first_microbatch: expected None, True or False, got {is_first_microbatch!r}"
            )
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"input: expected a torch.Tensor, got {type(x).__name__}")
        _check_residual(residual)
        fc1, fc2 = self.fc1, self.fc2
        return self._core.forward(
            x,
            fc1.layer_norm_weight,
            fc1.layer_norm_bias,
            fc1.weight,
            fc1.bias,
            fc2.weight,
            fc2.bias,
            is_first_microbatch,
            residual,
        )

    # ---- the C3 API, over both GEMMs ------------------------------------------------------
    def backward_dw(self) -> None:
        """Run the oldest queued weight gradient of fc2, then of fc1 (delay_wgrad_compute=True);
        each writes its weight's gradient (or main_grad) and runs its hooks, as
        fp8dp.Linear.backward_dw does. A pipeline schedule may instead call fc1.backward_dw() and
        fc2.backward_dw() itself (each child keeps its own queue)."""
        if not self.delay_wgrad_compute:
            raise RuntimeError(
                f"{self._core.name}.backward_dw(): the module was built with "
                "delay_wgrad_compute=False, so its weight gradients are computed in backward and "
                "nothing is ever queued"
            )
        queued = [m for m in (self.fc2, self.fc1) if m.need_backward_dw()]
        if not queued:
            raise RuntimeError(
                f"{self._core.name}.backward_dw(): no weight-gradient computation is queued "
                "(call it once after each backward that reached this module)"
            )
        # A backward queues one entry per GEMM whose weight wants a gradient (a frozen weight
        # queues none), so the two queues stay in step.
        for m in queued:
            m.backward_dw()

    def need_backward_dw(self) -> bool:
        """True when delay_wgrad_compute is on and a weight gradient of fc1 or fc2 is queued."""
        return self.fc1.need_backward_dw() or self.fc2.need_backward_dw()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once at the end of every backward_dw() (registered on fc1, whose
        weight gradient backward_dw() computes last)."""
        self.fc1.register_wgrad_accumulation_and_reduce_hooks(hook)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation!r}, normalization={self.normalization!r}"
        )
