"""fp8dp.Linear and fp8dp.LayerNormLinear: nn.Module owners of the parameters.

Forward, backward, the FP8 casts, the weight cache, the delayed weight-gradient queue and
backward_dw live in C++ (``_C.LinearCore``, src/modules/). These classes own the nn.Parameters,
validate the constructor's arguments and pass the parameter attributes that C++ reads and writes
(``main_grad``, ``zero_out_wgrad``, ``grad_added_to_main_grad``).

Torch's autograd features (C14): the activations backward needs are saved through autograd's
saved-tensor mechanism, so ``torch.utils.checkpoint`` (non-reentrant and reentrant) frees and
recomputes them as for ``nn.Linear`` and ``torch.autograd.graph.save_on_cpu`` offloads them. The
recompute repeats the forward's ``fp8_autocast`` state (that of the layer's latest forward outside
backward), so backward may run outside the context. ``torch.autograd.grad(loss, weight)`` returns
the weight gradient as ``nn.Linear`` does, also with ``fuse_wgrad_accumulation`` or
``delay_wgrad_compute`` (then nothing goes to ``main_grad`` or the backward_dw queue); a tensor hook
on such a weight (``weight.register_hook``) with a backward that accumulates is refused, since that
gradient never passes through autograd.
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import Callable, Optional

import torch

from . import _C

_EXTRA_STATE_KEY = "_extra_state"


def _check_features(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected an integer > 0, got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def _check_residual(residual) -> None:
    # Shape, dtype and device are checked in C++ (LinearCore / LayerNormMLPCore::forward), which
    # knows the output's; here only what pybind11 would otherwise turn into a TypeError.
    if residual is not None and not isinstance(residual, torch.Tensor):
        raise ValueError(
            f"residual: expected None or a torch.Tensor, got {type(residual).__name__}"
        )


ACTIVATIONS = ("gelu", "swiglu")


def _check_activation(activation, optional: bool = False, arg: str = "activation") -> None:
    """A name of ACTIVATIONS (or None where optional), as the ValueError a user should see; C++
    (parse_activation) refuses the same names for its own callers."""
    if activation in ACTIVATIONS or (optional and activation is None):
        return
    allowed = ("None, " if optional else "") + "'gelu' or 'swiglu'"
    raise ValueError(f"{arg}: expected {allowed}, got {activation!r}")


class _FP8LinearBase(torch.nn.Module):
    """What Linear and LayerNormLinear share: weight/bias, the C++ core and the C3 API."""

    input_activation: Optional[str] = None  # Linear's argument; LayerNormLinear has none

    def __init__(
        self,
        in_features,
        out_features,
        bias,
        params_dtype,
        device,
        fuse_wgrad_accumulation,
        delay_wgrad_compute,
        init_method,
    ):
        super().__init__()
        _check_features("in_features", in_features)
        _check_features("out_features", out_features)
        for name, value in (
            ("bias", bias),
            ("fuse_wgrad_accumulation", fuse_wgrad_accumulation),
            ("delay_wgrad_compute", delay_wgrad_compute),
        ):
            _check_bool(name, value)
        dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                "params_dtype: expected torch.float32, torch.bfloat16 or torch.float16, "
                f"got {dtype!r}"
            )
        if init_method is not None and not callable(init_method):
            raise ValueError(
                f"init_method: expected a callable(weight) or None, got {init_method!r}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.delay_wgrad_compute = delay_wgrad_compute
        factory = {"dtype": dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        with torch.no_grad():
            if init_method is not None:
                init_method(self.weight)
            else:  # torch.nn.Linear's default
                torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            if self.bias is not None:
                self.bias.zero_()
        self._init_param_attrs()

    def _make_core(self, **norm) -> None:
        self._core_args = norm  # for __deepcopy__
        name = (
            f"{type(self).__name__}(in_features={self.in_features}, "
            f"out_features={self.out_features})"
        )
        self._core = _C.LinearCore(
            name=name,
            in_features=self.in_features,
            out_features=self.out_features,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            delay_wgrad_compute=self.delay_wgrad_compute,
            **norm,
        )
        # The callables reach the module through a weak reference: a strong one would make a
        # module -> C++ core -> module cycle that Python's GC cannot see through. They look up
        # self.weight on each call, so a weight re-assigned after construction (tying) is used.
        module = weakref.ref(self)

        def mark_added():
            module().weight.grad_added_to_main_grad = True

        self._core.set_weight_attrs(
            main_grad=lambda: getattr(module().weight, "main_grad", None),
            zero_out_wgrad=lambda: bool(getattr(module().weight, "zero_out_wgrad", False)),
            mark_grad_added_to_main_grad=mark_added,
        )
        # The wgrad hooks live here, where the GC sees them, for the same reason: a hook that
        # reaches the module (DistributedDataParallel's, a user's closure over the model) held by
        # the core kept the module, its FP8 state and its graph alive for the life of the process.
        # The core gets one caller through the weak reference, on the first registration.
        self._wgrad_hooks = []

    def __deepcopy__(self, memo):
        """A copy with its own parameters and its own C++ core, the FP8 scaling state copied over
        (through the extra state); not bound to any DistributedDataParallel, like a new module.
        (The C++ core itself cannot be copied, so the default deep copy failed.)"""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in ("_core", "_wgrad_hooks"):  # a copy is bound to no hook, like a new module
                new.__dict__[k] = copy.deepcopy(v, memo)
        new._make_core(**self._core_args)
        new._init_param_attrs()  # Parameter's deep copy keeps no attributes
        new._core.set_extra_state(self._core.get_extra_state())
        return new

    def _init_param_attrs(self) -> None:
        for p in (self.weight, self.bias):
            if p is None:
                continue
            # C3: DDP routes these parameters' gradients through backward_dw's hooks instead.
            p.skip_backward_post_hook = self.delay_wgrad_compute
        self.weight.grad_added_to_main_grad = False
        self.weight.zero_out_wgrad = False

    # ---- the C3 API -------------------------------------------------------------------------
    def backward_dw(self) -> None:
        """Run the oldest queued weight-gradient GEMM (delay_wgrad_compute=True): writes
        ``weight.grad`` (or ``weight.main_grad`` when fused; accumulates into an existing one),
        backfills the bias gradient only where the deferred GEMM made one (C4), then calls every
        hook registered with register_wgrad_accumulation_and_reduce_hooks."""
        self._core.backward_dw()

    def need_backward_dw(self) -> bool:
        """True when delay_wgrad_compute is on and at least one weight gradient is queued."""
        return self._core.need_backward_dw()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` (no arguments) at the end of every backward_dw()."""
        if not callable(hook):
            raise ValueError(f"hook: expected a callable taking no arguments, got {hook!r}")
        if not self._wgrad_hooks:
            module = weakref.ref(self)

            def run_wgrad_hooks():
                m = module()
                for h in list(m._wgrad_hooks) if m is not None else ():
                    h()

            self._core.register_wgrad_hook(run_wgrad_hooks)
        self._wgrad_hooks.append(hook)

    # ---- FP8 state in the state dict --------------------------------------------------------
    def get_extra_state(self):
        """The delayed-scaling state (amax history, scales; CPU tensors), or None before the
        first FP8 forward."""
        return self._core.get_extra_state()

    def set_extra_state(self, state) -> None:
        """Restore what get_extra_state returned. A malformed state (not a dict, a missing or
        unknown key, a wrong type, a non-positive or non-finite scale, ...) raises ValueError
        naming the state-dict key and what was expected; the module's state is then unchanged."""
        where = getattr(self, "_extra_state_key_loading", _EXTRA_STATE_KEY)
        self._core.set_extra_state(state, where)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # set_extra_state names the full key ("layers.0.fc1._extra_state") in its errors.
        self._extra_state_key_loading = prefix + _EXTRA_STATE_KEY
        try:
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        finally:
            del self._extra_state_key_loading
        key = prefix + _EXTRA_STATE_KEY
        if key not in state_dict:
            # A state dict without FP8 state (e.g. from torch.nn.Linear) loads; the FP8 state
            # starts afresh, as in a new module.
            if key in missing_keys:
                missing_keys.remove(key)
            self._core.set_extra_state(None)

    def _forward(self, x, is_first_microbatch, ln_weight=None, ln_bias=None, residual=None):
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise ValueError(
                f"is_first_microbatch: expected None, True or False, got {is_first_microbatch!r}"
            )
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"input: expected a torch.Tensor, got {type(x).__name__}")
        _check_residual(residual)
        return self._core.forward(
            x, self.weight, self.bias, ln_weight, ln_bias, is_first_microbatch, residual
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, "
            f"delay_wgrad_compute={self.delay_wgrad_compute}"
            + (f", activation={self.activation!r}" if self.activation else "")
            + (f", input_activation={self.input_activation!r}" if self.input_activation else "")
        )


class Linear(_FP8LinearBase):
    """y = x · weightᵀ + bias, in FP8 inside ``fp8dp.fp8_autocast`` (E4M3 input and weight, E5M2
    grad_output with HYBRID), else in params_dtype with FP32 accumulation.

    in_features, out_features: sizes; FP8 needs both (and the token count) multiples of 16.
    bias: add a bias (initialised to zero).
    params_dtype: dtype of the parameters and of the input (default: torch's default dtype).
    device: where the parameters live.
    fuse_wgrad_accumulation: accumulate the weight gradient into ``weight.main_grad`` (C2 b),
        always (beta = 1); only ``zero_grad_buffer()`` (or the owner of main_grad) zeroes it.
    delay_wgrad_compute: queue the weight gradient for ``backward_dw()`` (C3).
    init_method: callable(weight) that initialises the weight; default torch.nn.Linear's.
    activation: None, "gelu" (exact, erf form: torch.nn.functional.gelu's default) or "swiglu"
        (silu(gate) * up of the output's halves [gate | up]; the output has out_features / 2
        columns). Forward returns act(x · weightᵀ + bias), the fc1 of an MLP built from separate
        modules. Under FP8 the backward applies the activation's derivative inside the cast of
        the output gradient, where a separate activation would write that gradient in high
        precision for the cast to read again. Not with ``residual``.
    input_activation: None, "gelu" or "swiglu" (the same functions): forward returns
        act(x) · weightᵀ + bias, the fc2 of an MLP built from separate modules; the input then
        has in_features columns (2 * in_features for "swiglu": [gate | up]). Under FP8 the
        activation is applied inside the FP8 cast of the GEMM's input, where a separate activation
        would write act(x) in high precision for the cast to read again; backward returns
        dgrad · act'(x). Bytes equal to ``Linear()(fp8dp.activation(x, act))``. Not together with
        ``activation`` (fc1 applying it instead saves in the backward, this in the forward).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        init_method: Optional[Callable[[torch.Tensor], None]] = None,
        activation: Optional[str] = None,
        input_activation: Optional[str] = None,
    ):
        super().__init__(
            in_features,
            out_features,
            bias,
            params_dtype,
            device,
            fuse_wgrad_accumulation,
            delay_wgrad_compute,
            init_method,
        )
        _check_activation(activation, optional=True)
        _check_activation(input_activation, optional=True, arg="input_activation")
        if activation is not None and input_activation is not None:
            raise ValueError(
                f"input_activation: not supported together with activation={activation!r}, "
                f"got input_activation={input_activation!r}"
            )
        self.activation = activation
        self.input_activation = input_activation
        self._make_core(
            layernorm=False,
            rms=False,
            eps=1e-5,
            zero_centered_gamma=False,
            return_layernorm_output=False,
            activation=activation,
            input_activation=input_activation,
        )

    def forward(
        self,
        x: torch.Tensor,
        is_first_microbatch: Optional[bool] = None,
        residual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x: [..., in_features]. is_first_microbatch: None or True refresh the FP8 weight cache,
        False reuses it while the weight is unchanged (a weight written in place since, e.g. by an
        optimizer step, is re-quantized; writes through ``weight.data`` are not seen). It never
        touches gradients: a fused wgrad always accumulates into main_grad.
        residual: None, or a tensor of the output's shape, dtype and device; returns
        ``x · weightᵀ + bias + residual``, the add done in the GEMM's epilogue (FP32, rounded once
        into the output) instead of a separate kernel. Its gradient is the output's gradient."""
        return self._forward(x, is_first_microbatch, residual=residual)[0]


class LayerNormLinear(_FP8LinearBase):
    """Linear(norm(x)) with the norm and the FP8 cast of its output in one pass per row.

    normalization: "LayerNorm" (parameters layer_norm_weight and layer_norm_bias) or "RMSNorm"
        (layer_norm_weight only).
    eps: added to the variance. Default 1e-5.
    zero_centered_gamma: the norm multiplies by 1 + layer_norm_weight (initialised to 0), so weight
        decay pulls the scale towards 1.
    return_layernorm_output: forward returns (y, normalized input).
    return_layernorm_input: forward also returns x itself, last: pass it on as the block's
        residual (``proj(attn, residual=x)``). The gradient it gets back is added to this
        layer's input gradient inside the norm's backward (one pass, rounded once) instead of in
        autograd's separate add. It is a view of x; do not modify it in place.
    qkv_heads: a fused QKV projection with this many heads: out_features = 3 x qkv_heads x
        head_dim, laid out [q | k | v], and forward returns q, k, v, each [..., qkv_heads,
        head_dim] (views of one output; then the normalized input with return_layernorm_output).
        Their gradients reach backward as attention left them: under delayed scaling the FP8
        cast of grad_output reads them in place, where an unbind after the call would have
        stacked them into one tensor first. Do not modify them in place.
    Other arguments (activation among them: not with qkv_heads) as in fp8dp.Linear.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        init_method: Optional[Callable[[torch.Tensor], None]] = None,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        qkv_heads: Optional[int] = None,
        return_layernorm_input: bool = False,
        activation: Optional[str] = None,
    ):
        super().__init__(
            in_features,
            out_features,
            bias,
            params_dtype,
            device,
            fuse_wgrad_accumulation,
            delay_wgrad_compute,
            init_method,
        )
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"normalization: expected 'LayerNorm' or 'RMSNorm', got {normalization!r}"
            )
        if (
            not isinstance(eps, (int, float))
            or isinstance(eps, bool)
            or not eps > 0
            or not math.isfinite(eps)
        ):
            raise ValueError(f"eps: expected a finite number > 0, got {eps!r}")
        _check_bool("zero_centered_gamma", zero_centered_gamma)
        _check_bool("return_layernorm_output", return_layernorm_output)
        _check_bool("return_layernorm_input", return_layernorm_input)
        if qkv_heads is not None and (
            not isinstance(qkv_heads, int)
            or isinstance(qkv_heads, bool)
            or qkv_heads <= 0
            or out_features % (3 * qkv_heads) != 0
        ):
            raise ValueError(
                f"qkv_heads: expected None or an int > 0 with out_features ({out_features}) "
                f"divisible by 3 * qkv_heads, got {qkv_heads!r}"
            )
        _check_activation(activation, optional=True)
        self.activation = activation
        self.qkv_heads = qkv_heads
        self.normalization = normalization
        self.eps = float(eps)
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_input = return_layernorm_input
        factory = {"dtype": self.weight.dtype, "device": self.weight.device}
        gamma = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(gamma(in_features, **factory))
        self.layer_norm_bias = (
            torch.nn.Parameter(torch.zeros(in_features, **factory))
            if normalization == "LayerNorm"
            else None
        )
        self._make_core(
            layernorm=True,
            rms=normalization == "RMSNorm",
            eps=self.eps,
            zero_centered_gamma=zero_centered_gamma,
            return_layernorm_output=return_layernorm_output,
            qkv_heads=qkv_heads or 0,
            return_layernorm_input=return_layernorm_input,
            activation=activation,
        )

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """x: [..., in_features]; returns y, or a tuple: y (q, k, v with qkv_heads), then ln_out
        with return_layernorm_output, then x with return_layernorm_input."""
        out = self._forward(x, is_first_microbatch, self.layer_norm_weight, self.layer_norm_bias)
        return tuple(out) if len(out) > 1 else out[0]
