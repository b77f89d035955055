"""fp8dp.DistributedDataParallel: owns the wrapped module and routes its gradient hooks into the C++
GradSync (src/grad_buffer), which holds the buffers, readiness, collectives, ledger and NaN check.
"""

import atexit
import contextlib
import gc
import sys
import weakref

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from . import _C, agreement
from .ddp_config import DistributedDataParallelConfig
from .modules import _FP8LinearBase
from .scaling import set_fp8_identities

# Every DDP alive, for the exit drain below (weakly: the set keeps nothing alive).
_LIVE: "weakref.WeakSet" = weakref.WeakSet()

# How many parameters and submodules any module of this process has registered (torch's global
# registration hooks): a DistributedDataParallel walks its module for parameters added after it
# was built only when this moved since its last walk. The walk at every forward and
# zero_grad_buffer() took about a millisecond of host time per call with 150 parameters, at the
# start of each step, where the GPU waits for the host.
_registrations = [0]


def _count_registration(*_args) -> None:
    _registrations[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


def _drain_at_exit() -> None:
    """Run once at exit, while the interpreter is still whole.

    1. Waits for the parameter all-gathers that the last DistributedOptimizer.step() left in
       flight (overlap_param_gather): every rank launched them in that step, so the wait ends.
       A collective still running on a gloo thread when the interpreter finalises frees its
       tensors on that thread, which then takes the GIL of a dying interpreter and is unwound
       through a noexcept frame: "terminate called without an active exception", SIGABRT (a plain
       torch async all_reduce left in flight at exit aborted 2 of 8 two-rank runs here,
       2026-12-04). Gradient buckets are not waited for: a backward cut short may have launched
       a bucket that other ranks never will, and a hang at exit is worse than an abort.
    2. One collection. A DDP, its optimizer and their model often end in reference cycles (a
       frame of torch's optimizer __init__ keeps our DistributedOptimizer.__init__ frame alive,
       and with it the DDP), which only the cycle collector frees; left to interpreter teardown,
       after destroy_process_group, their gloo state was torn down out of order and aborted the
       same way in 4 of 24 four-rank demo runs on a loaded 2-core machine; with it, 0 of 32.
    Registered after torch's own exit handlers, so it runs before them."""
    _finish_param_syncs()
    gc.collect()


def _finish_param_syncs() -> None:
    """(Its own frame, so that no local keeps a DDP alive through the collection after it.)"""
    for ddp in list(_LIVE):
        if ddp._sync.param_sync_pending:
            try:
                ddp._sync.finish_param_sync()
            except Exception as e:  # noqa: BLE001 (a peer gone: say so, and go on exiting)
                print(f"fp8dp: at exit, an all-gather in flight failed: {e}", file=sys.stderr)


atexit.register(_drain_at_exit)


class _GradHook:
    """The hook a parameter (or its module's delayed-wgrad path) calls when its gradient is ready.
    It holds the DDP weakly, so that a dropped DDP (its buffers, its NCCL communicator) is freed
    at once by reference counting, not at some later run of the cycle collector: the model holds
    this hook (a module's wgrad hooks, a parameter's autograd hook) and the DDP holds the model."""

    def __init__(self, ddp, i: int):
        self._ddp = weakref.ref(ddp)
        self._i = i

    def __call__(self, *_param) -> None:
        ddp = self._ddp()
        if ddp is not None:
            ddp._on_grad(self._i)


class _BackwardBegins:
    """Hook on a forward's outputs (grad_ledger only): when their gradient arrives, that
    micro-batch's backward has begun, and the ledger counts the autograd-hook contributions that
    follow against it, not against the latest forward (pipelined forwards run ahead: ledger.h).
    Holds the DDP weakly, like _GradHook."""

    def __init__(self, ddp, microbatch: int, nodes: list, announce: bool = False):
        self._ddp = weakref.ref(ddp)
        self._mb = microbatch
        self._nodes = nodes  # (index, AccumulateGrad node) the forward announced
        # A recompute's outputs (a forward inside a backward: DDP itself under a checkpoint) are
        # announced here, when a backward through them begins, not by the forward: a reentrant
        # checkpoint runs a nested backward through its recompute, a non-reentrant one never does
        # (it only takes the recomputed saved tensors).
        self._announce = announce
        self._task = None

    def __call__(self, _grad) -> None:
        ddp = self._ddp()
        if ddp is None:
            return
        ddp._sync.set_backward_microbatch(self._mb)
        task = torch._C._current_graph_task_id()
        if task == self._task:  # one output of several: the backward's first call did it
            return
        self._task = task
        if self._announce:
            ddp._sync.announce_hooks([i for i, _ in self._nodes], self._mb)
        # torch.autograd.grad(loss, inputs) captures the gradients of its inputs and runs no
        # AccumulateGrad node: the hooks the forward announced for them will not fire, so the
        # announcements are taken back (C14; exact for torch layers and fp8dp's alike).
        for i, node in self._nodes:
            if not _will_accumulate(node):
                ddp._sync.withdraw(i, self._mb)


def _will_accumulate(node) -> bool:
    """Whether the running backward executes this AccumulateGrad node. torch answers for
    backward(inputs=...) and plain backward(); for a leaf's node during autograd.grad() it raises
    instead: autograd.grad accumulates into no leaf at all, so the answer there is no."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return False


class _ReentrantRegion:
    """Ledger (grad_ledger): announces the autograd-hook contributions of a reentrant checkpoint's
    region for micro-batch `microbatch`. Called with the region's backward node found by the
    forward's graph walk, it wraps the node's recompute (ctx.run_function, which the node's
    backward calls to rebuild the region's graph): the recompute's outputs are walked like a
    forward's, so each parameter the nested backward reaches is announced once per recompute,
    nested regions included. Holds the DDP weakly, like _GradHook."""

    def __init__(self, ddp, microbatch: int):
        self._ddp = weakref.ref(ddp)
        self._mb = microbatch

    def __call__(self, node) -> None:
        run = node.run_function
        if isinstance(run, _Recompute):  # walked twice (outputs sharing the region)
            return
        node.run_function = _Recompute(run, self)

    def announce(self, out) -> None:
        ddp = self._ddp()
        if ddp is not None:
            ddp._sync.announce_hooks(_hooked_params(out, ddp._index, self), self._mb)


class _Recompute:
    """A reentrant checkpoint's region function that announces what its output's graph reaches."""

    def __init__(self, run, region: _ReentrantRegion):
        self._run = run
        self._region = region

    def __call__(self, *args):
        out = self._run(*args)
        self._region.announce(out)
        return out


class _ParamGatherWait:
    """The forward / state_dict / load_state_dict pre-hook of a module that owns parameters
    (overlap_param_gather): waits for the bucket groups holding them. Holds the DDP weakly, like
    _GradHook, so that the model keeping its hooks does not keep a dropped DDP alive."""

    def __init__(self, ddp, groups: tuple):
        self._ddp = weakref.ref(ddp)
        self._groups = groups

    def __call__(self, *_hook_args) -> None:
        ddp = self._ddp()
        if ddp is not None and ddp._sync.param_sync_pending:
            for g in self._groups:
                ddp._sync.finish_param_sync(g)


# The backward node of torch.utils.checkpoint's reentrant mode (None if torch renames it).
_REENTRANT_NODE = getattr(torch.utils.checkpoint.CheckpointFunction, "_backward_cls", None)


def _hooked_params(out, index: dict, on_reentrant=None, nodes=None) -> list:
    """Indices (in `index`: id(parameter) -> index) of the parameters whose autograd hook a backward
    through `out` runs: the AccumulateGrad nodes of its graph, one each (autograd sums every use of
    a parameter into one call of its hook per backward). For the ledger, which announces them per
    micro-batch; costs a walk of the graph, so only with grad_ledger.

    A reentrant checkpoint's node hides its region: the region ran without a graph, and its
    backward recomputes it and runs a nested backward whose hooks this walk cannot see. Each such
    node is passed to `on_reentrant`, which announces the region when it is recomputed. `nodes`,
    when given, receives (index, AccumulateGrad node) of each parameter found."""
    found, seen = [], set()
    stack = [
        t.grad_fn
        for t in torch.utils._pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad holds its parameter
        if var is not None:
            if id(var) in index:
                found.append(index[id(var)])
                if nodes is not None:
                    nodes.append((index[id(var)], fn))
            continue
        if on_reentrant is not None and _REENTRANT_NODE is not None and type(fn) is _REENTRANT_NODE:
            on_reentrant(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


def _owners(module: torch.nn.Module) -> dict:
    """id(parameter) -> the module that registers it directly."""
    out = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                out.setdefault(id(p), m)
    return out


def _defined_in_torch(m: torch.nn.Module) -> bool:
    """Whether m's class comes from torch (nn.Linear, nn.Embedding, ...): such modules never mark a
    gradient as already added to main_grad (Megatron's protocol for modules that fuse it)."""
    return type(m).__module__.split(".", 1)[0] == "torch"


def _checked_args(config, process_group) -> tuple:
    """(config, process_group) with their defaults filled in; TypeError / RuntimeError before the
    DDP changes anything."""
    config = DistributedDataParallelConfig() if config is None else config
    if not isinstance(config, DistributedDataParallelConfig):
        raise TypeError(
            f"config: expected a DistributedDataParallelConfig, got {type(config).__name__}"
        )
    if process_group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "process_group: None needs torch.distributed.init_process_group() first "
                "(or pass a process group)"
            )
        process_group = dist.group.WORLD
    return config, process_group


def _check_not_wrapped_twice(named: list) -> None:
    for name, p in named:
        # (a deep copy of a wrapped model carries the attribute but not the parameter identity)
        other = getattr(p, "_fp8dp_ddp", lambda: None)()
        if other is not None and id(p) in other._index:
            raise ValueError(
                f"module: parameter '{name}' is already managed by another "
                "fp8dp.DistributedDataParallel (the same model wrapped twice?); its gradients "
                "would go to that wrapper's buffer and this one's main_grad would stay 0: wrap "
                "each model once"
            )


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module` for data-parallel training with one contiguous main_grad buffer per
    (param dtype, grad dtype) (contract C1), exactly-once gradient accumulation (C2) and bucketed
    collectives launched by readiness counts (C5, C6). See DistributedDataParallelConfig."""

    def __init__(self, module: torch.nn.Module, config=None, process_group=None):
        super().__init__()
        config, process_group = _checked_args(config, process_group)
        self.module = module
        self.config = config
        # C9: each FP8 scaling state is known by its module's name in this model (and shape), so
        # every rank reduces the same states in the same order whatever order they were built in.
        set_fp8_identities(module)
        self.process_group = process_group
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._check_ranks_agree(named)
        _check_not_wrapped_twice(named)
        fp8_modules, foreign, delayed = self._gradient_routes(named)
        self._build_grad_sync(named)
        self._bind_fp8_modules(fp8_modules)
        self._install_grad_hooks(delayed, foreign)
        self.overlap_param_gather = config.overlap_param_gather
        if self.overlap_param_gather:
            self._install_param_gather_waits()

    # -- construction steps, in the order __init__ runs them -------------------------------------
    def _check_ranks_agree(self, named: list) -> None:
        # C12: the ranks must build this DDP alike. Compared here, before anything that could
        # fail on one rank only (the checks below read config fields) and before any collective
        # (the communicator's kind is one of the fields); a difference raises on every rank.
        module, config, process_group = self.module, self.config, self.process_group
        agreement.check_ranks_agree(
            process_group,
            "DistributedDataParallel",
            lambda: agreement.ddp_fields(module, config, process_group, named),
        )

    def _gradient_routes(self, named: list) -> tuple:
        """How each parameter's gradient reaches GradSync: (the fp8dp modules -> their first name
        in the model, ids of parameters registered by modules outside fp8dp and torch, id of each
        delayed parameter of a foreign module -> that module). Raises ValueError for a parameter
        marked skip_backward_post_hook whose gradient could never arrive."""
        module, config = self.module, self.config
        owners = _owners(module)
        # fp8dp modules hand their gradients to GradSync directly (bind_grad_sink below); every
        # parameter of theirs takes the autograd hook for what autograd does produce (plain-torch
        # uses of a tied weight, the unfused immediate wgrad, the eager FP8 bias gradient).
        fp8_modules = {}  # module -> its (first) name in the model
        for mname, m in module.named_modules():
            if isinstance(m, _FP8LinearBase):
                fp8_modules.setdefault(m, mname)
        bound = {id(p) for m in fp8_modules for p in m.parameters(recurse=False)}
        foreign = {
            id(p)
            for m in module.modules()
            if not isinstance(m, _FP8LinearBase) and not _defined_in_torch(m)
            for p in m._parameters.values()
            if p is not None
        }
        delayed = {}
        for name, p in named:
            if id(p) in bound or not getattr(p, "skip_backward_post_hook", False):
                continue
            owner = owners[id(p)]
            if not config.delay_wgrad_compute:
                raise ValueError(
                    f"parameter '{name}' has skip_backward_post_hook=True (its module computes the "
                    "weight gradient in backward_dw()), but config.delay_wgrad_compute is False: "
                    "its gradient would never reach main_grad; set delay_wgrad_compute=True"
                )
            if not callable(getattr(owner, "register_wgrad_accumulation_and_reduce_hooks", None)):
                raise ValueError(
                    f"parameter '{name}' has skip_backward_post_hook=True but its module "
                    f"{type(owner).__name__} has no register_wgrad_accumulation_and_reduce_hooks()"
                )
            delayed[id(p)] = owner
        return fp8_modules, foreign, delayed

    def _build_grad_sync(self, named: list) -> None:
        """The communicator and the C++ GradSync that owns the buffers of the parameters `named`."""
        config = self.config
        opts = _C.GradSyncOptions()
        opts.grad_reduce_in_fp32 = config.grad_reduce_in_fp32
        opts.overlap_grad_reduce = config.overlap_grad_reduce
        opts.use_distributed_optimizer = config.use_distributed_optimizer
        opts.bucket_size = config.resolved_bucket_size(self.process_group.size())
        opts.average_in_collective = config.average_in_collective
        opts.check_for_nan_in_grad = config.check_for_nan_in_grad
        opts.defer_nan_check = config.defer_nan_check
        opts.pad_buckets_for_high_nccl_busbw = config.pad_buckets_for_high_nccl_busbw
        opts.grad_ledger = config.grad_ledger
        opts.grad_reduce_wire = config.grad_reduce_wire
        opts.overlap_param_gather = config.overlap_param_gather
        is_cuda = bool(named) and named[0][1].is_cuda
        comm = _C.make_communicator(
            config.comm_backend, self.process_group, is_cuda, config.nccl_high_priority_stream
        )
        comm.blocking_wait = config.nccl_blocking_wait
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        self._sync = _C.GradSync(self._params, self._names, comm, opts)
        self._known = {id(p) for p in self.module.parameters()}
        self._walked_at = _registrations[0]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._ledger = config.grad_ledger
        _LIVE.add(self)

    def _bind_fp8_modules(self, fp8_modules: dict) -> None:
        """Each fp8dp module delivers its fused and delayed weight gradients to GradSync itself."""
        index = self._index
        for m, mname in fp8_modules.items():
            bias = index.get(id(m.bias), -1) if m.bias is not None else -1
            m._core.bind_grad_sink(self._sync, index.get(id(m.weight), -1), bias, mname or "(root)")

    def _install_grad_hooks(self, delayed: dict, foreign: set) -> None:
        """main_grad on every parameter, and the hook that hands its gradient to GradSync: the
        delayed-wgrad hook of a foreign module, a Python autograd hook, or the C++ one."""
        self._hook_handles = []
        me = weakref.ref(self)
        native = []  # parameters whose autograd hook runs in C++
        for i, p in enumerate(self._params):
            p.main_grad = self._sync.main_grad(i)
            p.grad_added_to_main_grad = False
            p._fp8dp_ddp = me
            if id(p) in delayed:
                delayed[id(p)].register_wgrad_accumulation_and_reduce_hooks(_GradHook(self, i))
            elif id(p) in foreign:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(_GradHook(self, i)))
            else:
                native.append(i)
        # The C++ hook (ParamHooks) hands p.grad to GradSync without entering Python; the Python one
        # above is kept for parameters a module outside fp8dp and torch registers, which may mark
        # p.grad as a stand-in (grad_added_to_main_grad, zero_out_wgrad) that only Python can read.
        self._param_hooks = _C.ParamHooks(self._sync, native, [self._params[i] for i in native])

    def _install_param_gather_waits(self) -> None:
        # DistributedOptimizer.step() only launches the all-gathers. Each module that
        # registers parameters waits for the bucket groups holding them just before anything
        # reads or writes them through it: its forward (so the gather overlaps the forward
        # of the modules before it), its state_dict() and its load_state_dict() (a checkpoint
        # taken through the bare module, or loaded into it, right after a step).
        # Every module that registers a parameter waits (a tied weight has several, and the
        # first may never run). A container without a forward of its own (nn.ParameterList,
        # nn.ParameterDict) never runs one: its parent's forward, which reads its parameters,
        # waits instead. A parameter read directly by code outside its modules' forwards
        # needs ddp.finish_param_sync() first (README). Nor does a child whose parent's forward
        # reads the child's parameters itself (fp8dp.LayerNormMLP calls no forward of its fc1
        # and fc2): a parent that says so (_reads_child_parameters) waits for them too.
        module, index = self.module, self._index
        parents = {}
        for m in module.modules():
            for c in m.children():
                reads = getattr(m, "_reads_child_parameters", False)
                if reads or type(c).forward is torch.nn.Module.forward:
                    parents.setdefault(id(c), []).append(m)
        groups_of = {}
        for m in module.modules():
            mine = {
                self._sync.group_of_param(index[id(p)])
                for p in m._parameters.values()
                if p is not None and id(p) in index
            }
            if not mine:
                continue
            for waiter in [m] + parents.get(id(m), []):
                groups_of.setdefault(id(waiter), (waiter, set()))[1].update(mine)
        for owner, groups in groups_of.values():
            wait = _ParamGatherWait(self, tuple(sorted(groups)))
            self._hook_handles += [
                owner.register_forward_pre_hook(wait),
                owner.register_state_dict_pre_hook(wait),
                owner.register_load_state_dict_pre_hook(wait),
            ]

    # -- hooks: C2 (a)/(b); the accumulate / count / launch logic is GradSync.param_ready --------
    def _on_grad(self, i: int) -> None:
        p = self._params[i]
        # Megatron's rule for a module outside fp8dp that fused into main_grad itself: its
        # stand-in in p.grad is not added, unless zero_out_wgrad made it zeros (then p.grad may
        # also hold other uses' gradients, which must be added). fp8dp's own modules never put a
        # stand-in into p.grad once bound (see bind_grad_sink).
        fused = bool(getattr(p, "grad_added_to_main_grad", False))
        self._sync.param_ready(i, p.grad, fused and not getattr(p, "zero_out_wgrad", False))
        p.grad = None

    def _check_parameters(self) -> None:
        """Refuses a parameter added to the module after construction (its gradient would have
        no place in the buffers and go unreduced). Walks the module only when some module of the
        process registered a parameter or submodule since the last walk (_registrations); a
        write into a module's _parameters dict itself is not seen."""
        if _registrations[0] == self._walked_at:
            return
        for name, p in self.module.named_parameters():
            if id(p) not in self._known:
                raise ValueError(
                    f"parameter '{name}' was added after DistributedDataParallel was constructed: "
                    "its gradient has no place in the buffers; build the model first, then wrap it"
                )
        self._walked_at = _registrations[0]

    def _apply(self, fn, recurse=True):
        # model.to(dtype) / .half() / .cuda() would move the parameters out of the buffers that
        # main_grad, the collectives and the optimizer use: refuse before anything changes.
        for name, p in zip(self._names, self._params):
            probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            if probe.dtype != p.dtype or probe.device != p.device:
                raise ValueError(
                    f"parameter '{name}': DistributedDataParallel keeps it as {p.dtype} on "
                    f"{p.device} in its buffers, and this conversion would make it {probe.dtype} "
                    f"on {probe.device}: convert the model (model.to(...)) before wrapping it"
                )
        return super()._apply(fn, recurse)

    def forward(self, *args, **kwargs):
        self._check_parameters()
        # A forward inside a backward is the recompute of activation checkpointing around this
        # module (torch.utils.checkpoint(ddp, ...)): it repeats a micro-batch that already began,
        # so it starts no new one (nor is refused by the phase it lands in: the sync of the
        # iteration may have started during this backward) and announces to the ledger only when
        # a backward runs through it (_BackwardBegins).
        recompute = torch._C._current_graph_task_id() != -1
        if not recompute:
            # C11: a forward that builds a graph is refused once the iteration's sync has started
            # (or finished, or the optimizer stepped); without overlap_param_gather this also
            # waits for the parameter all-gathers in flight before the module reads its weights.
            self._sync.begin_microbatch(torch.is_grad_enabled())
        out = self.module(*args, **kwargs)
        if self._ledger:
            mb, nodes = self._sync.ledger_microbatch(), []
            region = _ReentrantRegion(self, mb)
            params = _hooked_params(out, self._index, region, nodes)
            if not recompute:
                self._sync.announce_hooks(params)
            hook = _BackwardBegins(self, mb, nodes, announce=recompute)
            for t in torch.utils._pytree.tree_leaves(out):
                # (not on a leaf, e.g. a parameter returned as is: its hooks would pile up)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.register_hook(hook)
        if self._sync.param_sync_pending:
            # Parameters whose module did not run (unused in this forward) are complete afterwards.
            self._sync.finish_param_sync()
        return out

    # -- ZeRO-1 (use_distributed_optimizer): what DistributedOptimizer works with -----------------
    @property
    def rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return self._sync.rank

    @property
    def world_size(self) -> int:
        """The data-parallel group's size."""
        return self._sync.world_size

    def owned_shards(self) -> list:
        """The parameter shards this rank owns (chunk `rank` of every bucket): OwnedShard records
        (param index, param_offset, numel, buffer, buffer_offset), in buffer order."""
        return self._sync.owned_shards()

    def grad_shard(self, shard) -> torch.Tensor:
        """The reduce-scattered gradient of `shard` (a view into the grad buffer)."""
        return self._sync.grad_shard(shard)

    def param_shard(self, shard) -> torch.Tensor:
        """The elements of the parameters that `shard` covers (a view into the param buffer)."""
        return self._sync.param_shard(shard)

    def copy_shards(self, masters) -> None:
        """Copy each updated master (one per owned shard, any float dtype) into its param_shard,
        after any parameter all-gather still in flight."""
        self._sync.copy_shards(list(masters))

    def start_param_sync(self) -> None:
        """Launch the all-gather of every bucket's updated parameters (asynchronously, in forward
        order); finish_param_sync() or the next forward waits for them."""
        self._sync.start_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers that DistributedOptimizer.step() left in flight
        (overlap_param_gather): every parameter holds its full updated value afterwards
        (stream-ordered on CUDA). A no-op when none is in flight."""
        self._sync.finish_param_sync()

    @property
    def phase(self) -> str:
        """Where the iteration stands (contract C11): "accumulating", "sync_started" (a bucket
        group launched its collective), "finished" (finish_grad_sync()), "stepped" (the
        distributed optimizer stepped) or "failed" (a finish failed; zero_grad_buffer() next)."""
        return self._sync.phase

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside only accumulate into main_grad: no readiness, no collectives.
        Only the last micro-batch runs outside no_sync(): once its backward launched bucket groups
        a forward with grad is refused (inside no_sync() too), while an earlier micro-batch's
        deferred backward_dw() may still run in here; refused (RuntimeError) once the iteration is
        finished or stepped."""
        previous = self._sync.enter_no_sync()
        try:
            yield
        finally:
            self._sync.sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Launch every bucket group not launched yet (asynchronously), after the last
        micro-batch's backward (and backward_dw()); a no-op once finished."""
        self._sync.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Launch what is left, wait for all collectives; idempotent until zero_grad_buffer()."""
        self._sync.finish_grad_sync()

    def check_deferred(self) -> None:
        """defer_nan_check: raise now (naming the rank and the parameters) if the last finished
        iteration's gradients held NaN or Inf, instead of at the next finish_grad_sync(); waits for
        that iteration's flags (not for the work queued after them). Call it after the last step and before saving a checkpoint. A no-op
        when nothing is pending (or without defer_nan_check)."""
        self._sync.check_deferred()

    def zero_grad_buffer(self) -> None:
        """Zero every main_grad, clear every parameter's .grad and reset grad_added_to_main_grad:
        the start of an iteration (phase "accumulating")."""
        self._check_parameters()
        self._sync.zero_grad_buffer()
        for p in self._params:
            p.grad_added_to_main_grad = False

    def scale_gradients(self, scaling_factor: float) -> None:
        """main_grad *= scaling_factor for every parameter; waits first for collectives in flight
        (which would lose the factor). Refused after the optimizer step."""
        self._sync.scale_gradients(float(scaling_factor))

    def broadcast_params(self, src: int = 0) -> None:
        """Copy the parameters of group rank `src` to every rank (one collective per buffer)."""
        self._sync.broadcast_params(int(src))

    # With overlap_param_gather the owners' state_dict / load_state_dict pre-hooks wait for the
    # all-gathers still in flight (a half-gathered save, or a load a late gather overwrites).
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
