"""fp8dp.make_graphed_callables: capture modules' forward and backward into CUDA graphs, with fp8dp
layers inside, under the fp8_autocast state open at the call (delayed scaling included).

It follows torch.cuda.make_graphed_callables (same arguments, same replacement of each module's
``forward``, same capture order: forwards in order, backwards in reverse, one memory pool) and adds
what fp8dp layers need:

- the warm-up runs on the capture stream (cuBLASLt keeps a workspace per stream, and a capture may
  not allocate one), with output gradients of ones (``empty_like`` can hold NaN, which a delayed
  amax would record), and everything it changes is put back: each FP8 scaling state, the
  registry's observed mark, ``main_grad`` of fused weights and their ``grad_added_to_main_grad``;
- delayed scaling: the captured casts write their amaxes into the states' histories, whose
  addresses stay fixed (update_fp8_scales and load_state_dict write in place); each replay marks
  them observed again (modules/graph_record.h), so ``update_fp8_scales()`` once per step works
  as it does eagerly and new scales take effect at the next replay;
- fused wgrad accumulation: the GEMM into ``main_grad`` is in the backward graph; each replay
  sets ``grad_added_to_main_grad`` again;
- delayed weight gradients (``delay_wgrad_compute=True``): each queued GEMM is captured in a graph
  of its own; each backward replay queues a task that replays it, so ``backward_dw()`` (and the
  hooks registered for it, and C4's bias backfill) work as eagerly. Call ``backward_dw()`` after
  each backward of a graphed callable: the next forward or backward replay overwrites the GEMM's
  operands, so both are refused while a task is still queued (eagerly, a pipeline schedule may
  run several forwards first);
- checks at every replay: the same fp8_autocast state as at capture, the parameters where they
  were, inputs of the captured shape, dtype and device (a copy into the static input would
  broadcast silently);
- the parameters' gradients are handed to autograd as the static tensors themselves, so that
  AccumulateGrad copies them into an empty ``.grad`` instead of taking the static buffer, which the
  next replay overwrites (two micro-batches would otherwise count the second one twice). With
  ``clone_param_grads_on_return=False`` they are handed over as torch's graphs do (``.grad`` is
  the static buffer, no copy), and a backward that finds a parameter's ``.grad`` still holding
  that buffer is refused before its replay;
- layers bound to fp8dp.DistributedDataParallel (capture its module, ``ddp.module``, and call
  ``ddp(x)`` as usual): the warm-up and the capture see a sink that records what would change
  DDP's state (modules/graph_sink.h); each replay re-issues it against DDP after its graph (the
  ledger's announcements, the acceptance checks before the backward graph, the fused deliveries
  and the delayed tasks' tokens after it), so buckets launch after the GEMMs into ``main_grad``.
  The parameter all-gather waits of ``overlap_param_gather`` (forward pre-hooks of the
  submodules, which a replay skips) run before each forward replay.

``is_first_microbatch`` is accepted and decides nothing: every replay casts the weight, which
within a step gives the bytes a reused cast would. Forwards that build no graph for a backward
(grad off, inference mode: evaluation) and the other training mode run the eager forward.
A graphed callable runs one call at a time: its outputs and saved state live in static buffers,
so a second call before the first one's backward is refused (torch does not check it); drop the
outputs of a call that will have no backward.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Sequence

import torch

from . import _C
from .ddp import _ParamGatherWait
from .modules import _FP8LinearBase

_CAPTURE_ERROR = "make_graphed_callables"


def _fp8_layers(module: torch.nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, _FP8LinearBase)]


def _check_arguments(modules: tuple, sample_args: tuple, num_warmup_iters, one: bool) -> None:
    """Argument errors, before any work (also on a machine without CUDA)."""
    if not modules:
        raise ValueError("modules: expected a torch.nn.Module or a non-empty tuple of them, got ()")
    for i, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise ValueError(
                f"modules[{i}]: expected a torch.nn.Module (fp8dp captures modules, whose "
                f"parameters are part of the graph), got {type(m).__name__}"
            )
    if not isinstance(num_warmup_iters, int) or isinstance(num_warmup_iters, bool):
        raise ValueError(f"num_warmup_iters: expected an int >= 1, got {num_warmup_iters!r}")
    if num_warmup_iters < 1:
        raise ValueError(f"num_warmup_iters: expected an int >= 1, got {num_warmup_iters}")
    if not isinstance(sample_args, tuple) or len(sample_args) != len(modules):
        got = f"a tuple of {len(sample_args)}" if isinstance(sample_args, tuple) else None
        raise ValueError(
            f"sample_args: expected one tuple of tensors per module ({len(modules)}), got "
            f"{got or type(sample_args).__name__}"
        )
    owner: dict = {}
    for i, (m, args) in enumerate(zip(modules, sample_args)):
        where = "sample_args" if one else f"sample_args[{i}]"
        if not isinstance(args, tuple) or not args:
            raise ValueError(
                f"{where}: expected a non-empty tuple of tensors, got {type(args).__name__}"
                + (" ()" if isinstance(args, tuple) else "")
            )
        for j, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise ValueError(f"{where}[{j}]: expected a torch.Tensor, got {type(a).__name__}")
        foreign_pre = [
            h for h in m._forward_pre_hooks.values() if not isinstance(h, _ParamGatherWait)
        ]
        if m._forward_hooks or foreign_pre or m._backward_hooks:
            raise ValueError(
                f"modules[{i}] ({type(m).__name__}): has forward or backward hooks; a replay "
                "would not run them (register hooks after make_graphed_callables, as with torch)"
            )
        for name, b in m.named_buffers():
            if b.requires_grad:
                raise ValueError(
                    f"modules[{i}] ({type(m).__name__}): buffer '{name}' requires grad; only "
                    "parameters may be trainable in a graphed module"
                )
        for layer in _fp8_layers(m):
            if id(layer) in owner:
                raise ValueError(
                    f"modules[{i}]: {layer._core.name} is also part of modules[{owner[id(layer)]}]; "
                    "each fp8dp layer may be captured once"
                )
            owner[id(layer)] = i
            if layer._core.queued_wgrads:
                raise ValueError(
                    f"modules[{i}]: {layer._core.name} has {layer._core.queued_wgrads} weight "
                    "gradient(s) queued; run backward_dw() for them before capturing"
                )


def _check_cuda(modules: tuple, sample_args: tuple) -> None:
    from . import cuda_available  # (fp8dp/__init__.py imports this module first)

    ok, why = cuda_available(return_reason=True)
    if not ok:
        raise RuntimeError(f"{_CAPTURE_ERROR}: CUDA graphs need a CUDA device: {why}")
    for i, (m, args) in enumerate(zip(modules, sample_args)):
        for j, a in enumerate(args):
            if not a.is_cuda:
                raise RuntimeError(f"{_CAPTURE_ERROR}: sample_args[{i}][{j}] is on {a.device}")
        for name, p in m.named_parameters():
            if not p.is_cuda:
                raise RuntimeError(
                    f"{_CAPTURE_ERROR}: modules[{i}] parameter '{name}' is on {p.device}"
                )


_NOT_READY = (
    "Run one training step (forward, backward, update_fp8_scales) inside the same fp8_autocast "
    "before capturing: a capture cannot choose a first scale"
)


def _check_fp8_ready(modules: tuple, state, wants_grad: list) -> None:
    """Delayed scaling: every state that has cast must be ready for capture. A layer that never
    cast in FP8 may be one that runs without it (fp8_autocast(enabled=False) inside the model, as
    fp8.exclude does): _check_warmed_up tells after the warm-up."""
    if not (state.enabled and state.recipe.kind == _C.RecipeKind.DELAYED):
        return
    for i, m in enumerate(modules):
        for layer in _fp8_layers(m):
            if layer._core.amax_history is None:
                continue
            why = layer._core.fp8_capture_refusal(state.recipe, wants_grad[i])
            if why:
                raise ValueError(
                    f"modules[{i}]: {layer._core.name}: its FP8 scaling state {why}. {_NOT_READY}"
                )


def _check_warmed_up(modules: tuple, saved) -> None:
    """After the warm-up, before its state is put back: a layer without FP8 state before it that
    has one now casts in FP8, and had no scale to capture with."""
    before = {id(layer): st is not None for layer, st in saved.states}
    for i, m in enumerate(modules):
        for layer in _fp8_layers(m):
            if not before[id(layer)] and layer._core.amax_history is not None:
                raise ValueError(
                    f"modules[{i}]: {layer._core.name}: its FP8 scaling state has not cast in FP8 "
                    f"before this capture. {_NOT_READY}"
                )


def _describe(state) -> str:
    if not state.enabled:
        return "FP8 off"
    r = state.recipe
    return f"FP8 {r.kind.name.lower()} {r.fwd_format.name}/{r.bwd_format.name}"


class _CudaGraphs:
    """The CUDA calls of the capture, in one place: the host tests
    (tests/python/test_graph_record_ddp.py) run the whole procedure with graphs that record nothing
    and replay nothing, to check fp8dp's host work (DDP's accounting above all) on the CPU."""

    pool = staticmethod(lambda: torch.cuda.graph_pool_handle())
    stream = staticmethod(lambda: torch.cuda.Stream())
    on_stream = staticmethod(lambda s: torch.cuda.stream(s))
    synchronize = staticmethod(lambda: torch.cuda.synchronize())
    new_graph = staticmethod(lambda: torch.cuda.CUDAGraph())

    @staticmethod
    @contextlib.contextmanager
    def capture(g, pool, s):
        # thread_local (docs/cuda_graphs_design.md B13): fp8dp's NCCL watchdog thread polls the
        # events of collectives launched before the capture (cudaEventQuery); under the default
        # "global" mode that call, from another thread, invalidates the capture.
        # No garbage collection inside a capture (make_graphed_callables collects just before):
        # a collected cycle of an earlier graphed module or DistributedDataParallel would destroy
        # its CUDA graphs or NCCL communicator there, CUDA calls a capture may refuse.
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(g, pool=pool, stream=s, capture_error_mode="thread_local"):
                yield
        finally:
            if gc_enabled:
                gc.enable()

    # The backward graph's static grad_output: filled by each replay (a CPU capture runs, so the
    # host tests give it the values their replays will bring).
    grad_output = staticmethod(lambda o: torch.empty_like(o))


class _Saved:
    """What the warm-up changes that a training loop would see: put back before capture."""

    def __init__(self, layers: list, backend):
        self.backend = backend
        self.states = [(layer, layer._core.get_extra_state()) for layer in layers]
        self.main_grads = []
        self.flags = []
        for layer in layers:
            w = layer.weight
            self.flags.append((w, getattr(w, "grad_added_to_main_grad", False)))
            mg = getattr(w, "main_grad", None)
            if layer.fuse_wgrad_accumulation and isinstance(mg, torch.Tensor):
                self.main_grads.append((mg, mg.clone()))

    def restore_flags(self) -> None:
        for w, flag in self.flags:
            w.grad_added_to_main_grad = flag

    def restore(self) -> None:
        self.backend.synchronize()
        for layer, state in self.states:
            layer._core.set_extra_state(state)  # in place: the addresses the capture will use
        for mg, copy in self.main_grads:
            mg.copy_(copy)
        self.restore_flags()
        self.backend.synchronize()


def _delivered_by_layers(module) -> set:
    """ids of the parameters whose gradient an fp8dp layer computes outside autograd, so that the
    captured backward gives them none: a delayed weight, bound to DDP or not (backward_dw(); the
    bias too: FP8 off computes it there), and the fused weight of a DDP-bound layer (an unbound
    one hands autograd a stand-in)."""
    out = set()
    for layer in _fp8_layers(module):
        if layer.delay_wgrad_compute or (
            layer._core.grad_sink_bound and layer.fuse_wgrad_accumulation
        ):
            out.add(id(layer.weight))
            if layer.delay_wgrad_compute and layer.bias is not None:
                out.add(id(layer.bias))
    return out


def _check_unused(i: int, module, surface: tuple, grads, allow_unused: bool) -> None:
    """torch's allow_unused_input rule, except for the gradients bound layers deliver themselves."""
    if allow_unused or grads is None:
        return
    own = _delivered_by_layers(module)
    names = {id(p): n for n, p in module.named_parameters()}
    for t, g in zip(_grad_surface(surface), grads):
        if g is None and id(t) not in own:
            what = f"parameter '{names[id(t)]}'" if id(t) in names else "an input"
            raise ValueError(
                f"modules[{i}]: {what} requires grad but the captured backward gives it no "
                "gradient (pass allow_unused_input=True if that is meant)"
            )


def _grad_surface(surface: tuple) -> tuple:
    return tuple(t for t in surface if t.requires_grad)


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool=None,
    clone_param_grads_on_return: bool = True,
):
    """Capture each module's forward and backward into CUDA graphs; return the module(s) with
    ``forward`` replaced, as torch.cuda.make_graphed_callables does.

    modules: a torch.nn.Module, or a tuple of them (captured in order and replayed in that order,
        backward in reverse, sharing one memory pool). fp8dp layers inside may use delayed,
        current or block scaling and fuse_wgrad_accumulation; see the module docstring for what
        is refused.
    sample_args: a tuple of tensors (one module) or a tuple of such tuples: the inputs whose
        shapes, dtypes and devices every later call must have.
    num_warmup_iters: eager forward + backward passes on the capture stream before capture.
    allow_unused_input, pool: as in torch.
    clone_param_grads_on_return: True (default): a parameter's gradient reaches ``.grad`` as a
        copy of the graph's static buffer, so micro-batches accumulate. False: ``.grad`` is the
        static buffer itself (torch's behaviour; no copy, which at the 2048 x 8 GPT stack is
        about 0.8 GB read and written per step); each backward then needs every such ``.grad``
        consumed and cleared (``zero_grad(set_to_none=True)``, or fp8dp's DDP, which does it)
        and refuses otherwise, since its replay would overwrite the gradient that ``.grad``
        holds and autograd would add the buffer to itself.

    Call it inside the fp8_autocast that training uses, after one eager training step of the
    modules (under delayed scaling their FP8 states need scales). Each later call must run under
    the same fp8_autocast state; ``update_fp8_scales()`` stays once per step, outside.
    """
    one = isinstance(modules, torch.nn.Module)
    mods = (modules,) if one else modules
    if one:
        args_all = (sample_args,)
    else:
        if not isinstance(mods, tuple):
            raise ValueError(
                "modules: expected a torch.nn.Module or a tuple of them, got "
                f"{type(modules).__name__}"
            )
        args_all = sample_args
    _check_arguments(mods, args_all, num_warmup_iters, one)
    if not isinstance(clone_param_grads_on_return, bool):
        raise ValueError(
            "clone_param_grads_on_return: expected True or False, got "
            f"{clone_param_grads_on_return!r}"
        )
    _check_cuda(mods, args_all)
    out = _capture(
        mods,
        args_all,
        num_warmup_iters,
        allow_unused_input,
        pool,
        _CudaGraphs,
        clone_param_grads_on_return,
    )
    return out[0] if one else out


def _capture(
    mods, args_all, num_warmup_iters, allow_unused_input, pool, backend, clone_param_grads=True
) -> tuple:
    """make_graphed_callables after its argument checks, with `backend`'s graphs."""
    state = _C.autocast_current()
    surfaces = [tuple(a) + tuple(m.parameters()) for m, a in zip(mods, args_all)]
    wants_grad = [any(t.requires_grad for t in s) for s in surfaces]
    _check_fp8_ready(mods, state, wants_grad)

    layers = [layer for m in mods for layer in _fp8_layers(m)]
    saved = _Saved(layers, backend)
    records = [_C.GraphRecord() for _ in mods]
    mempool = backend.pool() if pool is None else pool
    stream = backend.stream()

    backend.synchronize()
    warm = _C.GraphRecord()
    warm.begin(_C.GraphPhase.WARMUP)
    try:
        with backend.on_stream(stream):
            for m, a, surface in zip(mods, args_all, surfaces):
                for _ in range(num_warmup_iters):
                    outs = [o for o in torch.utils._pytree.tree_leaves(m(*a)) if o.requires_grad]
                    if outs and _grad_surface(surface):
                        torch.autograd.grad(
                            outs,
                            _grad_surface(surface),
                            grad_outputs=[torch.ones_like(o) for o in outs],
                            allow_unused=True,  # checked at capture
                        )
                    del outs
                    for layer in _fp8_layers(m):  # their GEMM plans, on this stream
                        layer._core.warm_queued_wgrads()
        _check_warmed_up(mods, saved)
    finally:
        warm.end()
        saved.restore()

    gc.collect()  # dead graphed modules and DDPs go now, not inside a capture (backend.capture)
    fwd_graphs = [backend.new_graph() for _ in mods]
    bwd_graphs = [backend.new_graph() for _ in mods]
    # One graph per delayed weight-gradient GEMM, replayed by backward_dw() in whatever order the
    # loop calls it: a pool of their own, so that this order cannot clash with the other graphs'.
    dw_graphs, dw_pool = [], backend.pool()
    static_outputs, specs = [], []
    try:
        for m, a, g, rec in zip(mods, args_all, fwd_graphs, records):
            rec.begin(_C.GraphPhase.FORWARD)
            try:
                with backend.capture(g, mempool, stream):
                    out = m(*a)
            finally:
                rec.end()
            flat, spec = torch.utils._pytree.tree_flatten(out)
            static_outputs.append(tuple(flat))
            specs.append(spec)

        static_grad_outputs = [None] * len(mods)
        static_grad_inputs = [None] * len(mods)
        for i in reversed(range(len(mods))):
            outs = static_outputs[i]
            grad_outs = tuple(
                backend.grad_output(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
                for o in outs
            )
            needs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
            grads = None
            if needs and _grad_surface(surfaces[i]):
                records[i].begin(_C.GraphPhase.BACKWARD)
                try:
                    with backend.capture(bwd_graphs[i], mempool, stream):
                        grads = torch.autograd.grad(
                            needs,
                            _grad_surface(surfaces[i]),
                            grad_outputs=[g for g in grad_outs if g is not None],
                            only_inputs=True,
                            allow_unused=True,
                        )
                finally:
                    records[i].end()
                _check_unused(i, mods[i], surfaces[i], grads, allow_unused_input)
                for k in range(records[i].wgrad_count):
                    g = backend.new_graph()
                    with backend.capture(g, dw_pool, stream):
                        records[i].capture_wgrad(k)
                    records[i].set_wgrad_replay(k, g.replay)
                    dw_graphs.append(g)
            it = iter(grads or ())
            static_grad_inputs[i] = tuple(
                next(it) if (t.requires_grad and grads is not None) else None for t in surfaces[i]
            )
            static_grad_outputs[i] = grad_outs
    finally:
        # The capture ran the layers' host code without their kernels.
        saved.restore_flags()
        for layer in layers:
            layer._core.drop_weight_cache()
    for m, rec in zip(mods, records):
        for layer in _fp8_layers(m):
            rec.watch_state(layer._core)
    backend.synchronize()

    out = []
    for i, m in enumerate(mods):
        fn = _graphed_function(
            m,
            len(args_all[i]),
            state,
            records[i],
            fwd_graphs[i],
            (
                bwd_graphs[i]
                if static_grad_outputs[i] and any(g is not None for g in static_grad_outputs[i])
                else None
            ),
            surfaces[i],
            static_outputs[i],
            specs[i],
            static_grad_outputs[i],
            static_grad_inputs[i],
            clone_param_grads,
        )
        out.append(_install(m, fn))
    return tuple(out)


def _graphed_function(
    module,
    n_user,
    state,
    record,
    fwd_graph,
    bwd_graph,
    surface: Sequence[torch.Tensor],
    static_outputs,
    spec,
    static_grad_outputs,
    static_grad_inputs,
    clone_param_grads=True,
):
    params = tuple(surface[n_user:])
    names = [n for n, _ in module.named_parameters()]
    # overlap_param_gather: the submodules' waits, which a replay would skip.
    waits = [
        h
        for sub in module.modules()
        for h in sub._forward_pre_hooks.values()
        if isinstance(h, _ParamGatherWait)
    ]
    ptrs = [p.data_ptr() for p in params]
    needs = [p.requires_grad for p in params]
    shapes = [(t.shape, t.dtype, t.device) for t in surface[:n_user]]
    what = type(module).__name__
    # The fused GEMMs accumulate into these main_grad tensors by address.
    fused = [
        (layer._core.name, layer.weight, layer.weight.main_grad.data_ptr())
        for layer in _fp8_layers(module)
        if layer.fuse_wgrad_accumulation
        and isinstance(getattr(layer.weight, "main_grad", None), torch.Tensor)
    ]

    # The autograd context of the latest replay, until its backward ran: the outputs and the saved
    # state of one call live in the graphs' static buffers, which a second call overwrites.
    in_flight = {"ctx": None}

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            prev = in_flight["ctx"]() if in_flight["ctx"] is not None else None
            if prev is not None and not prev.fp8dp_backward_done:
                raise RuntimeError(
                    f"graphed {what}: called again before the backward of its previous call; "
                    "that call's outputs and saved state live in the graphs' static buffers, "
                    "which this call would overwrite. Run its backward first, or drop its outputs"
                )
            now = _C.autocast_current()
            if not _C.same_autocast(now, state):
                raise RuntimeError(
                    f"graphed {what}: called under fp8_autocast state '{_describe(now)}', but "
                    f"it was captured under '{_describe(state)}' (with the same recipe fields); "
                    "call it under the capture's state or capture again"
                )
            for k, (p, ptr, need) in enumerate(zip(params, ptrs, needs)):
                if p.data_ptr() != ptr or p.requires_grad != need:
                    raise RuntimeError(
                        f"graphed {what}: parameter '{names[k]}' was moved, replaced or "
                        "(un)frozen since capture; the graph reads the old one. Capture again"
                    )
            for name, w, ptr in fused:
                mg = getattr(w, "main_grad", None)
                if not isinstance(mg, torch.Tensor) or mg.data_ptr() != ptr:
                    raise RuntimeError(
                        f"graphed {what}: {name}: weight.main_grad was replaced since capture; "
                        "the graph accumulates into the old tensor. Zero it in place, or capture "
                        "again"
                    )
            record.before_forward()
            for wait in waits:
                wait()
            for k in range(n_user):
                x, (shape, dtype, device) = inputs[k], shapes[k]
                if x.shape != shape or x.dtype != dtype or x.device != device:
                    raise ValueError(
                        f"graphed {what}: input {k} must be {tuple(shape)} {dtype} on {device} as "
                        f"at capture, got {tuple(x.shape)} {x.dtype} on {x.device}"
                    )
                if x.data_ptr() != surface[k].data_ptr():
                    surface[k].copy_(x)
            fwd_graph.replay()
            ctx.use = record.replay_forward()
            ctx.fp8dp_backward_done = False
            in_flight["ctx"] = weakref.ref(ctx)
            return tuple(o.detach() for o in static_outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            if bwd_graph is None:
                return tuple(None for _ in surface)
            if not clone_param_grads:  # before anything is overwritten
                for k, (p, g) in enumerate(zip(params, static_grad_inputs[n_user:])):
                    if g is not None and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                        raise RuntimeError(
                            f"graphed {what}: parameter '{names[k]}' still holds the previous "
                            "backward's gradient in .grad, which is this graph's static buffer "
                            "(clone_param_grads_on_return=False): this replay would overwrite "
                            "it and autograd would then add the buffer to itself. Consume and "
                            "clear the gradients before the next backward (zero_grad("
                            "set_to_none=True)), or capture with clone_param_grads_on_return="
                            "True to accumulate over micro-batches"
                        )
            record.before_backward(ctx.use)  # refuses before anything is overwritten
            for g, grad in zip(static_grad_outputs, grads):
                if g is not None and g.data_ptr() != grad.data_ptr():
                    g.copy_(grad)
            bwd_graph.replay()
            record.replay_backward(ctx.use)
            ctx.fp8dp_backward_done = True
            if clone_param_grads:
                # The static tensors themselves (not detached views): AccumulateGrad then copies
                # them into an empty .grad rather than taking the buffer the next replay
                # overwrites.
                return static_grad_inputs
            # Detached, the parameters' ones have no other reference: AccumulateGrad takes them
            # as .grad (the check at the top of this backward keeps a later backward from adding
            # into them).
            return static_grad_inputs[:n_user] + tuple(
                g.detach() if g is not None else None for g in static_grad_inputs[n_user:]
            )

    def run(*user_args):
        flat = torch.utils._pytree.arg_tree_leaves(*user_args)
        if len(flat) != n_user:
            raise ValueError(f"graphed {what}: expected {n_user} input tensor(s), got {len(flat)}")
        for k, x in enumerate(flat):
            if torch.is_grad_enabled() and x.requires_grad and not surface[k].requires_grad:
                raise ValueError(
                    f"graphed {what}: input {k} requires grad, but its sample at capture did not, "
                    "so the backward graph computes no gradient for it; capture with a sample "
                    "that requires grad"
                )
        outs = Graphed.apply(*(tuple(flat) + params))
        return torch.utils._pytree.tree_unflatten(list(outs), spec)

    return run


def _install(module, run):
    training = module.training
    eager = module.forward

    def forward(*args, is_first_microbatch=None, **kwargs):
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise ValueError(
                f"is_first_microbatch: expected None, True or False, got {is_first_microbatch!r}"
            )
        # Forwards that build no graph for a backward (evaluation: grad off or inference mode),
        # and the other training mode as in torch, run eagerly, with their own fp8_autocast.
        if module.training != training or not torch.is_grad_enabled():
            if is_first_microbatch is not None:
                kwargs["is_first_microbatch"] = is_first_microbatch
            return eager(*args, **kwargs)
        if kwargs:
            raise ValueError(
                f"graphed {type(module).__name__}: takes only its captured inputs, got keyword "
                f"argument(s) {sorted(kwargs)}"
            )
        # is_first_microbatch is accepted and has nothing to decide: every replay casts the
        # weight, which within a step gives the bytes a reused cast would (the weight and its
        # scale change only between steps).
        return run(*args)

    module.forward = forward
    return module
